#!/usr/bin/env bash
# The GPU check: what the trainer does on one GPU, at most 7 minutes on an H100, every result kept
# the moment it is measured (docs/gpu-check.md).
#
#   gpucheck/gpu_check.sh OUT [--only a,b] [--skip a,b] [--budget S]   on a machine with a GPU
#   gpucheck/gpu_check.sh OUT --rehearse                              on this machine's CPU, tiny shapes
#
# From the repository root. On the GPU machine the image's python3 is used as it is (its torch, never
# installed here); what the image lacks is installed first from prebuilt wheels carried in .whl/
# (gpucheck/wheels.sh makes them: a pure-Python DeepSpeed and a few small packages; pip
# --no-index --no-deps, seconds). Then gpucheck/check.py runs the parts (its docstring lists them),
# each under `timeout -k`, inside one budget, and writes OUT: summary.md, versions.txt,
# results.jsonl, train.json, ops.json, costs.json, trace.json, logs.txt (at most 8 files, what a
# device run hands back).
set -uo pipefail
OUT=${1:?usage: gpucheck/gpu_check.sh OUT [--rehearse] [--only PARTS] [--skip PARTS] [--budget SECONDS]}
shift
cd "$(dirname "$0")/.."
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
case " $* " in
  *" --rehearse "*)
    PY=${PYTHON:-${DEEPNET_VENV:-.venv}/bin/python}  # run.sh's environment
    ;;
  *)
    PY=python3
    if [ -d .whl ] && ls .whl/*.whl > /dev/null 2>&1; then
      start=$SECONDS
      # into the image's environment, so that its bin/ gets the deepspeed launcher the ranks start from
      timeout -k 5 60 "$PY" -m pip install -q --no-index --no-deps --no-compile --disable-pip-version-check \
        --no-cache-dir .whl/*.whl > "$OUT/logs.txt" 2>&1 || echo "wheel install failed (exit $?)" >> "$OUT/logs.txt"
      echo "wheels installed in $((SECONDS - start)) s" >> "$OUT/logs.txt"
    fi
    ;;
esac
exec "$PY" -m gpucheck.check "$OUT" "$@" --spent "$SECONDS"  # the budget counts the install
