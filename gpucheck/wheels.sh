#!/usr/bin/env bash
# What the GPU machine's image lacks, as prebuilt wheels in .whl/ (ignored by git), for
# gpucheck/gpu_check.sh to install in seconds there (pip --no-index --no-deps; nothing is built
# or downloaded on the device). Run on a machine that reaches PyPI, from the repository root:
#
#   gpucheck/wheels.sh [PYTHON_VERSION]      (default 3.12, the GPU image's)
#
# What it builds and fetches is gpucheck/packages.txt's list: `built` ones (DeepSpeed
# 0.19.8, published as a source archive only) as pure-Python wheels, their CUDA ops left out
# (DS_BUILD_OPS=0: none is used; DeepSpeed would JIT-build one only if asked), by the repository's
# .venv (its setup.py imports torch); `wheel` ones fetched for CPython 3.12 on manylinux x86_64, at
# the pins of requirements.txt where it has them, else .venv's versions. The `image` ones are the
# image's own (KINDS.md lists the image) and never installed. The device run carries .whl
# (`carry: [".whl"]`, at most 64 MiB with the working tree); this script prints the sizes and fails
# above 48 MiB.
set -euo pipefail
PYV=${1:-3.12}
cd "$(dirname "$0")/.."
VENV=${DEEPNET_VENV:-.venv}
rm -rf .whl
mkdir -p .whl
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
PACKAGES=gpucheck/packages.txt
listed() { awk -v where="$1" '!/^#/ && NF == 3 && $3 == where {print $1}' "$PACKAGES"; }
pinned() {
  grep -m1 -iE "^$1==" requirements.txt \
    || "$VENV/bin/python" -c "from importlib import metadata; print('$1==' + metadata.version('$1'))"
}
start=$SECONDS

for dist in $(listed built); do
  DS_BUILD_OPS=0 "$VENV/bin/python" -m pip wheel -q --no-deps --no-build-isolation --no-cache-dir -w .whl \
    "$(pinned "$dist")"
done
for dist in $(listed built); do  # pure Python, or not at all
  ls .whl/"$(echo "$dist" | tr - _)"-*-py3-none-any.whl > /dev/null
done

PLATFORMS=()
for n in 17 24 27 28 31 34 35; do PLATFORMS+=(--platform "manylinux_2_${n}_x86_64"); done
PLATFORMS+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any)
for dist in $(listed wheel); do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYV" --implementation cp \
    "${PLATFORMS[@]}" -d .whl "$(pinned "$dist")" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
done
ls -l .whl | awk 'NR > 1 {printf "%8.1f MiB  %s\n", $5 / 1048576, $9}'
total=$(du -sm .whl | cut -f1)
echo "$(ls .whl | wc -l) wheels, ${total} MiB, in $((SECONDS - start)) s; carry .whl with the device run"
[ "$total" -le 48 ] || { echo "error: .whl is ${total} MiB: with the working tree it must stay under 64 MiB" >&2; exit 1; }
