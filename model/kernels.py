"""The project's CPU kernels (`model/csrc/`): the hashed dropout (model/dropout.py) and attention
for short sequences (model/attention.py), one C++ extension.

Compiled on first use (torch.utils.cpp_extension, g++ and the virtualenv's ninja, ~55 s on 2 cores, cached
per CPU model in torch's extension directory, `TORCH_EXTENSIONS_DIR`): a run's first step, or the
test suite's start. Where it cannot be built, torch's dropout and attention run instead and one
warning says why. Within `torch_ops()` the model uses torch's operators only (`./run.sh bench
model` compares the two).
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import platform
import shutil
import sys

log = logging.getLogger(__name__)
CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
SOURCES = [os.path.join(CSRC, name) for name in ("bindings.cpp", "dropout.cpp", "attention.cpp")]
_kernels: object | None = None
_failed: str | None = None
_torch_only = False


@contextlib.contextmanager
def torch_ops():
    """Within: torch's dropout and attention, the model's operators before these kernels."""
    global _torch_only
    saved, _torch_only = _torch_only, True
    try:
        yield
    finally:
        _torch_only = saved


def enabled() -> bool:
    """Whether the model may use the kernels now (not within `torch_ops()`, and they build)."""
    return not _torch_only and kernels() is not None


def _cpu_model() -> str:
    """The CPU model and its flags (the build uses -march=native: one build per kind of CPU)."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.startswith(("model name", "flags"))][:2]
    except OSError:
        lines = [platform.processor()]
    return hashlib.sha256((platform.machine() + "".join(lines)).encode()).hexdigest()[:10]


def kernels():
    """The compiled CPU kernels, or None (with one warning) where they cannot be built."""
    global _kernels, _failed
    if _kernels is None and _failed is None:
        try:
            from torch.utils.cpp_extension import load

            here = os.path.dirname(sys.executable)  # the virtualenv's ninja (a DeepSpeed requirement)
            if shutil.which("ninja") is None and shutil.which("ninja", path=here):
                os.environ["PATH"] = here + os.pathsep + os.environ.get("PATH", "")
            log.info("loading the CPU kernels (compiled once per CPU model, ~55 s on 2 cores): %s", CSRC)
            builder = logging.getLogger("torch.utils.cpp_extension")  # its compiler banner: ours says it
            level = builder.level
            builder.setLevel(logging.ERROR)
            try:
                _kernels = load(name=f"deepnet_cpu_{_cpu_model()}", sources=SOURCES,
                                extra_cflags=["-O3", "-march=native"], extra_include_paths=[CSRC], verbose=False)
            finally:
                builder.setLevel(level)
        except Exception as error:  # no compiler, no ninja, a read-only cache: torch's operators
            lines = str(error).strip().splitlines()
            _failed = f"{type(error).__name__}: {lines[-1] if lines else ''}"
            log.warning("fast CPU kernels unavailable: could not build %s with g++ and ninja (%s); using "
                        "torch's dropout and attention (same statistics and results, slower on CPUs)",
                        CSRC, _failed)
    return _kernels
