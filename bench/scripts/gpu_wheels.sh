#!/usr/bin/env bash
# The packages of requirements.txt that a GPU machine's image lacks, as wheels in .whl/ for
# bench/scripts/gpu_check.sh (a machine that cannot reach a package registry installs them from
# there). Run on a machine that can reach PyPI, from the repository root:
#
#   bench/scripts/gpu_wheels.sh [PYTHON_VERSION]      (default 3.12, the GPU image's)
#
# The images seen so far hold torch, numpy, sentencepiece, sacrebleu, tensorboard, transformers,
# safetensors, psutil, filelock, pyyaml, tqdm, ninja, msgpack and py-cpuinfo; what is fetched here
# is the rest. DeepSpeed 0.19.8 is published as a source archive only: gpu_check.sh builds it
# there with its CUDA ops left to compile on first use (none of them is used).
set -euo pipefail
PYV=${1:-3.12}
cd "$(dirname "$0")/../.."
mkdir -p .whl
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
pin() { grep -E "^$1==" requirements.txt | head -1; }
PLATFORMS=()
for n in 17 24 27 28 31 34 35; do PLATFORMS+=(--platform "manylinux_2_${n}_x86_64"); done
PLATFORMS+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any)
for pkg in "$(pin megatron-core)" "$(pin polib)" "$(pin Django)" "$(pin pycountry)" "$(pin ctranslate2)" \
           hjson pydantic pydantic-core annotated-types typing-inspection asgiref sqlparse; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYV" --implementation cp \
    "${PLATFORMS[@]}" -d .whl "$pkg"
done
python3 -m pip download -q --no-deps --no-binary=:all: -d .whl "$(pin deepspeed)"
ls -la .whl
echo "carry .whl with the device run (its 64 MiB limit holds these)"
