#!/usr/bin/env bash
# deepnet-trainer: the one command.
#   ./run.sh train [CONFIG]   prepare data and train (default: configs/default.yaml)
#   ./run.sh test [PYTEST ARGS]
# The first call creates .venv from requirements.txt; later calls update it when that file changes.
set -euo pipefail
cd "$(dirname "$0")"
ROOT=$(pwd)
VENV=${DEEPNET_VENV:-$ROOT/.venv}
PY=${PYTHON:-python3}

ensure_venv() {
  local stamp="$VENV/.requirements.sha256"
  local want
  want=$(sha256sum requirements.txt | cut -d' ' -f1)
  if [ ! -x "$VENV/bin/python" ]; then
    echo "creating virtualenv $VENV (one-time)" >&2
    "$PY" -m venv "$VENV"
  fi
  if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    echo "installing requirements into $VENV" >&2
    "$VENV/bin/pip" install --quiet --disable-pip-version-check -r requirements.txt 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
    echo "$want" > "$stamp"
  fi
}

ensure_venv
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
# No NVIDIA/AMD tooling: tell DeepSpeed it is on the CPU rather than have it warn while guessing.
if ! command -v nvidia-smi >/dev/null 2>&1 && ! command -v rocm-smi >/dev/null 2>&1; then
  export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}
fi

cmd=${1:-help}
[ $# -gt 0 ] && shift
case "$cmd" in
  test)
    if [ $# -eq 0 ]; then set -- tests; fi
    # A private temporary root: concurrent pytest sessions of the same user otherwise prune each
    # other's numbered folders (pytest keeps the newest three) while tests still use them.
    exec "$VENV/bin/python" -m pytest -q --basetemp "$(mktemp -d "${TMPDIR:-/tmp}/deepnet-tests.XXXXXX")" "$@"
    ;;
  help|-h|--help)
    sed -n '2,6p' "$0"
    exec "$VENV/bin/python" -m launcher.cli --help
    ;;
  *)
    exec "$VENV/bin/python" -m launcher.cli "$cmd" "$@"
    ;;
esac
