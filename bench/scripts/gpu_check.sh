#!/usr/bin/env bash
# How the files of this folder were made: on an offline machine with one H100 whose python
# (3.12, torch 2.11 CUDA 13) lacked deepspeed, megatron-core and the data packages, which were
# brought as wheels in ../.whl (deepspeed 0.19.8 is an sdist: built with its ops left to JIT).
# Usage: bench/scripts/gpu_check.sh OUT_DIR [PARTS]   (from the repository root)
# PARTS: any of ceiling,test,bench,profile (default: ceiling,test,bench)
set -uo pipefail
OUT=${1:?output folder}
PARTS=${2:-ceiling,test,bench}
want() { [[ ",$PARTS," == *",$1,"* ]]; }
export PYTHONUNBUFFERED=1
python3 -m pip list 2>/dev/null > "$OUT/pip-list.txt"
python3 -m pip install -q --no-index --find-links ../.whl megatron-core==0.16.1 hjson pydantic polib==1.2.0 Django==5.2.19 2>&1 | tail -3
DS_BUILD_OPS=0 python3 -m pip install -q --no-index --no-deps --no-build-isolation ../.whl/deepspeed-0.19.8.tar.gz 2>&1 | tail -3
export DEEPNET_VENV=$(python3 -c 'import sys; print(sys.prefix)') DEEPNET_NO_INSTALL=1
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee "$OUT/nvidia-smi.txt"
want ceiling && python3 - <<'PY' 2>&1 | tee "$OUT/ceiling.txt"
import torch
a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
for _ in range(3): a @ b
s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
s.record()
for _ in range(10): a @ b
e.record(); torch.cuda.synchronize()
print(f"bf16 8192^3 matmul: {10 * 2 * 8192**3 / (s.elapsed_time(e) / 1e3) / 1e12:.0f} TFLOP/s (torch {torch.__version__})")
PY
want test && timeout 230 ./run.sh test-gpu 2>&1 | tee "$OUT/test-gpu.log"
if want profile; then
  for shape in 6L-6L-d512 100L-100L-d64; do
    timeout 120 python3 bench/gpu.py --profile $shape --out "$OUT" 2>&1 | tail -5
  done
fi
if want bench; then
  timeout 250 ./run.sh bench train 2>&1 | tee "$OUT/bench.log"
  cp runs/bench-gpu/results.json runs/bench-gpu/report.md "$OUT/" 2>/dev/null
fi
