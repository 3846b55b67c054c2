#!/usr/bin/env bash
# The GPU check: what the trainer does on one GPU, in one run of at most 8 minutes on an H100.
#
#   bench/scripts/gpu_check.sh OUT            on a machine with a GPU (from the repository root)
#   bench/scripts/gpu_check.sh OUT --rehearse on this machine's CPU, tiny shapes (tests/test_gpu_check.py)
#
# Parts, each under its own time limit, in the order of what matters most if time runs out:
#   ops     ./run.sh bench ops: kernel operations per layer kind eager and compiled, engine
#           operations per step, host syncs, graph breaks and compilations (bench/ops.py)
#   train   the GPU training benchmark (bench/gpu.py): MFU, tokens/s, GPU busy fraction, kernels,
#           syncs, peak memory and compile time of a d=1024 stage's layers, the last stage at the
#           128k vocabulary and 6L-6L d=512; eager and compiled; 2k/4k/8k target tokens per micro-batch
#   costs   F, B and W seconds per layer kind at d=1024, eager and compiled (bench/schedules.py
#   replay  --measure-costs), and the pipeline bubbles of 1F1B and ZB-H1 replayed on them at pp = 2,
#           4, 8, 16 with the paper configs' micro-batch counts (--replay)
#   tests   ./run.sh test-gpu (tests/gpu)
# OUT gets at most 8 files (what a device run hands back): summary.md, versions.txt, ops.json,
# train.json, train.md, costs.json, replay.md, tests.log. The machine's python is used as it is
# (DEEPNET_NO_INSTALL): packages it lacks travel as wheels in .whl/ (bench/scripts/gpu_wheels.sh).
set -uo pipefail
OUT=${1:?usage: bench/scripts/gpu_check.sh OUT [--rehearse]}
MODE=${2:-gpu}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX")  # everything else: OUT holds only what comes back
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
SUMMARY="$OUT/summary.md"
echo "# GPU check ($(date -u '+%Y-%m-%d %H:%M UTC'), mode $MODE)" > "$SUMMARY"

if [ "$MODE" = --rehearse ]; then
  export DS_ACCELERATOR=cpu
  PY=${PYTHON:-${DEEPNET_VENV:-.venv}/bin/python}  # run.sh's environment
  OPS=(--set model.encoder_layers=2 --set model.decoder_layers=2 --set model.d_model=32 --set model.heads=4
       --set model.ffn_dim=64 --batch 4 --src 12 --tgt 10 --skip syncs,engine)
  TRAIN=(--device cpu --shapes tiny --tokens 256 --steps 1 --warmup 1)
  COSTS=(--d-model 32 --sequences 4 --seq-len 16 --timed 1 --repeats 1)
  LIMITS=(ops=300 train=300 costs=300 replay=60 tests=60)
else
  if [ -d .whl ]; then  # what the image lacks, carried (installed beside its packages)
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -2
    DS_BUILD_OPS=0 python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site \
      .whl/deepspeed-*.tar.gz 2>&1 | tail -2
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
  fi
  PY=python3
  export DEEPNET_VENV=$("$PY" -c 'import sys; print(sys.prefix)') DEEPNET_NO_INSTALL=1
  OPS=(--batch 16 --src 128 --tgt 128 --set model.d_model=1024 --set model.heads=16 --set model.ffn_dim=4096)
  TRAIN=(--steps 4 --warmup 3)
  COSTS=(--d-model 1024)
  LIMITS=(ops=90 train=240 costs=60 replay=20 tests=60)
fi
limit() { for kv in "${LIMITS[@]}"; do [ "${kv%%=*}" = "$1" ] && echo "${kv#*=}"; done; }
export PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}"

part() {  # part NAME COMMAND...: run under its limit, note the exit and the seconds in the summary
  local name=$1; shift
  local start=$SECONDS
  timeout "$(limit "$name")" "$@" > "$WORK/$name.log" 2>&1
  local rc=$?
  echo "- $name: exit $rc in $((SECONDS - start)) s: \`$*\`" >> "$SUMMARY"
  [ $rc -ne 0 ] && tail -20 "$WORK/$name.log" | sed 's/^/      /' >> "$SUMMARY"
  return 0
}

"$PY" - > "$OUT/versions.txt" 2>&1 <<'PY'
import platform, torch
print("python", platform.python_version(), "torch", torch.__version__)
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("gpu", p.name, f"{p.total_memory / 2**30:.0f} GiB", "cuda", torch.version.cuda)
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(10):
        a @ b
    e.record()
    torch.cuda.synchronize()
    print(f"bf16 8192^3 matmul: {10 * 2 * 8192**3 / (s.elapsed_time(e) / 1e3) / 1e12:.0f} TFLOP/s")
PY

part ops "$PY" -m launcher.cli bench ops "${OPS[@]}" --out "$WORK/ops"
cp "$WORK/ops/bench.json" "$OUT/ops.json" 2>/dev/null
part train "$PY" -m bench.gpu "${TRAIN[@]}" --out "$WORK/train"
cp "$WORK/train/results.json" "$OUT/train.json" 2>/dev/null
cp "$WORK/train/report.md" "$OUT/train.md" 2>/dev/null
part costs "$PY" -m bench.schedules --measure-costs "${COSTS[@]}" --out "$WORK/costs"
part replay "$PY" -m bench.schedules --replay "$WORK/costs/zb-costs.json" --pp 2,4,8,16 --out "$WORK/replay"
cp "$WORK/costs/zb-costs.json" "$OUT/costs.json" 2>/dev/null
cp "$WORK/replay/zb-replay.md" "$OUT/replay.md" 2>/dev/null
if [ "$MODE" != --rehearse ]; then
  part tests ./run.sh test-gpu
  cp "$WORK/tests.log" "$OUT/tests.log" 2>/dev/null
fi
rm -rf "$WORK"
cat "$SUMMARY"
