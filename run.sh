#!/usr/bin/env bash
# deepnet-trainer: the one command.
#   ./run.sh train [CONFIG] [--set KEY=VALUE]   prepare data and train (default: configs/default.yaml)
#   ./run.sh test [PYTEST ARGS]
#   ./run.sh test-gpu [PYTEST ARGS]   the CUDA suite (tests/gpu; skipped with one line without a GPU)
# The first call creates .venv from requirements.txt; later calls update it when that file changes.
# DEEPNET_VENV=DIR uses another environment; DEEPNET_NO_INSTALL=1 uses it as it is (no pip: offline
# GPU machines whose python already has the packages, e.g. DEEPNET_VENV=$(python3 -c 'import sys;print(sys.prefix)')).
# Commands run from the repository root; relative paths inside a config are from the config's folder,
# paths on the command line (and given with --set) from the caller's: DEEPNET_CALLER_CWD tells the
# commands where it was called from (docs/configuration.md#paths).
set -euo pipefail
CALLER_CWD=$(pwd)
cd "$(dirname "$0")"
ROOT=$(pwd)
VENV=${DEEPNET_VENV:-$ROOT/.venv}
PY=${PYTHON:-python3}

ensure_venv() {
  if [ "${DEEPNET_NO_INSTALL:-0}" = 1 ]; then
    [ -x "$VENV/bin/python" ] || { echo "error: DEEPNET_NO_INSTALL=1 but $VENV/bin/python does not exist; set DEEPNET_VENV" >&2; exit 2; }
    return
  fi
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
    # Test files and node ids given from another folder are the caller's.
    args=()
    for arg in "$@"; do
      if [[ "$arg" != -* && "$arg" != /* && -e "$CALLER_CWD/${arg%%::*}" && ! -e "$ROOT/${arg%%::*}" ]]; then
        arg="$CALLER_CWD/$arg"
      fi
      args+=("$arg")
    done
    set -- "${args[@]}"
    # A private temporary root: concurrent pytest sessions of the same user otherwise prune each
    # other's numbered folders (pytest keeps the newest three) while tests still use them.
    exec "$VENV/bin/python" -m pytest -q --basetemp "$(mktemp -d "${TMPDIR:-/tmp}/deepnet-tests.XXXXXX")" "$@"
    ;;
  test-gpu)
    # The GPU suite: the accelerator is left to DeepSpeed (it picks the GPU when one is visible).
    if [ $# -eq 0 ]; then set -- tests/gpu; fi
    unset DS_ACCELERATOR
    DEEPNET_TEST_GPU=1 exec "$VENV/bin/python" -m pytest -q -rs -m gpu \
      --basetemp "$(mktemp -d "${TMPDIR:-/tmp}/deepnet-tests.XXXXXX")" "$@"
    ;;
  help|-h|--help)
    # The header comment (every line after the shebang up to the first that is not a comment).
    awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"
    echo
    exec "$VENV/bin/python" -m launcher.cli --help
    ;;
  *)
    DEEPNET_CALLER_CWD=$CALLER_CWD exec "$VENV/bin/python" -m launcher.cli "$cmd" "$@"
    ;;
esac
