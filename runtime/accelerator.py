"""The one place that asks which accelerator this process runs on.

Every other module names devices, backends and memory counters through these functions, so no
source file outside this one spells a device type or a communication backend (tests/test_sources.py
greps for them). The choice follows DeepSpeed's (`DS_ACCELERATOR`, else a visible CUDA device):
run.sh sets `DS_ACCELERATOR=cpu` on machines without GPU tooling, the CPU test suite sets it too,
and `./run.sh test-gpu` leaves it unset so the GPU is used.

`HOST` is the processor memory that data loaders fill and checkpoints are mapped to before they
move to the accelerator; on a CPU-only run it is also the accelerator. torch is imported inside
the functions, so that importing the constants costs nothing (the CLI imports every command).
"""
from __future__ import annotations

import os
import typing

if typing.TYPE_CHECKING:
    import torch

HOST = "cpu"
"""The host device: data loaders, checkpoint loading (`map_location`), CPU-side RNG state."""
GPU = "cuda"
"""The GPU device type this trainer supports (NVIDIA, through torch.cuda and NCCL)."""
_BACKENDS = {HOST: "gloo", GPU: "nccl"}


def gpu_available() -> bool:
    """A CUDA device is visible and the CPU accelerator was not chosen (DS_ACCELERATOR=cpu)."""
    import torch

    return os.environ.get("DS_ACCELERATOR", "") != HOST and torch.cuda.is_available()


def why_no_gpu() -> str:
    """One line saying why no GPU is used here ('' when one is)."""
    import torch

    if os.environ.get("DS_ACCELERATOR", "") == HOST:
        return "DS_ACCELERATOR=cpu (the CPU suite forces it; ./run.sh test-gpu runs on the GPU)"
    if not torch.cuda.is_available():
        return f"no CUDA device (torch {torch.__version__}, torch.cuda.is_available() is False)"
    return ""


def device_type() -> str:
    """'cuda' on a GPU, else 'cpu' (the device type of tensors the engine trains on)."""
    return GPU if gpu_available() else HOST


def on_host() -> bool:
    return device_type() == HOST


HOST_MEMORY_KEPT = 1 << 30
"""Bytes of freed host memory a training process keeps for reuse (`keep_freed_host_memory`)."""

_GLIBC_VARIABLES = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_")


def keep_freed_host_memory(kept: int = HOST_MEMORY_KEPT) -> bool:
    """Make glibc's malloc keep up to `kept` freed bytes for reuse instead of handing them back.

    With tensors in host memory (training on CPUs) every step allocates and frees its
    activations, hundreds of MB. glibc gives free memory at the top of its heap back to the
    operating system beyond a trim threshold (and serves blocks above its mmap threshold by
    mmap, freed by munmap), so the next step faults those pages in again and the kernel zeroes
    them, thousands of page faults a step (measured in docs/bench/host-malloc.md). Fixing
    M_TRIM_THRESHOLD and M_MMAP_THRESHOLD at `kept` (glibc's own tunables, through mallopt)
    leaves almost none. The peak RSS (the high-water mark) does not change; between steps RSS
    stays near it.

    Nothing changes under another C library, or when the user tunes glibc's malloc through its
    own variables (MALLOC_TRIM_THRESHOLD_, MALLOC_MMAP_THRESHOLD_, MALLOC_TOP_PAD_, or a
    glibc.malloc tunable in GLIBC_TUNABLES): theirs wins. For glibc's defaults as they are, set a
    tunable to its default value, e.g. GLIBC_TUNABLES=glibc.malloc.mxfast=128.
    Returns whether the setting was applied.
    """
    import ctypes
    import platform

    if platform.libc_ver()[0] != "glibc" or any(name in os.environ for name in _GLIBC_VARIABLES) \
            or "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # <malloc.h>
    trimmed = libc.mallopt(m_trim_threshold, ctypes.c_int(kept)) == 1
    return libc.mallopt(m_mmap_threshold, ctypes.c_int(kept)) == 1 and trimmed


def collective_fault_env(device: str | None = None) -> dict[str, str]:
    """Environment under which a collective fails, instead of hanging, once a rank is lost, on
    `device` (default: this process's); set before the process group exists (runtime/distributed.py
    setup_distributed, and the SLURM job script). The timeout itself is the process group's
    (train.collective_timeout_seconds: init_process_group and every new_group, also DeepSpeed's).

    GPUs (NCCL): TORCH_NCCL_ASYNC_ERROR_HANDLING=1: NCCL's watchdog thread checks every collective
    against the group's timeout and, on a timeout or an NCCL error (a peer gone), aborts the
    communicators and ends the process, instead of leaving it in a kernel that never completes.
    The rank then ends by SIGABRT without a Python line of its own: the job script names the lost
    rank from the heartbeats (launcher/faults.py). TORCH_NCCL_BLOCKING_WAIT stays off: it would
    raise in Python instead, but makes every wait a host synchronisation, losing the overlap of
    communication and compute. TORCH_NCCL_DUMP_ON_TIMEOUT=0: no flight-recorder dump on every
    rank of a large job at each timeout.
    CPUs (gloo): nothing to set: its collectives and send/recv wait at most the group's timeout and
    fail at once on a closed connection."""
    if (device or device_type()) == GPU:
        return {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0"}
    return {}


def backend_error_words() -> tuple[str, ...]:
    """How every backend names itself in its error messages (NCCL's in capitals)."""
    return tuple(word for b in _BACKENDS.values() for word in (b, b.upper()))


def device(index: int | None = None) -> torch.device:
    """This process's device: the current (or `index`-th) GPU, or the host."""
    import torch

    if on_host():
        return torch.device(HOST)
    return torch.device(GPU, torch.cuda.current_device() if index is None else index)


def gpu_count() -> int:
    """GPUs this process may use (0 when the CPU accelerator was chosen)."""
    import torch

    return torch.cuda.device_count() if gpu_available() else 0


def gpu_name(index: int = 0) -> str:
    import torch

    return torch.cuda.get_device_name(index)


def gpu_memory_bytes(index: int = 0) -> int:
    import torch

    return torch.cuda.get_device_properties(index).total_memory


def set_device(index: int) -> None:
    import torch

    if not on_host():
        torch.cuda.set_device(index)


def synchronize() -> None:
    """Wait for queued device work (a no-op on the host, where work is synchronous)."""
    import torch

    if not on_host():
        torch.cuda.synchronize()


def warn_on_sync(enabled: bool) -> bool:
    """Make every operation that waits for the device warn (the GPU's sync debug mode: reads of
    values, copies to pageable host memory). False where nothing syncs: on the host."""
    import torch

    if on_host():
        return False
    torch.cuda.set_sync_debug_mode("warn" if enabled else "default")
    return True


def reset_peak_memory() -> int:
    """Restart the allocator's high-water mark; returns the bytes allocated now (GPU only)."""
    import torch

    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


def peak_memory() -> int:
    """The allocator's high-water mark since the last reset, in bytes (GPU only)."""
    import torch

    return torch.cuda.max_memory_allocated()


def supports(dtype) -> bool:
    """Whether the accelerator trains in `dtype` (a torch dtype: parallel/precision.py's
    `Precision.dtype`); DeepSpeed's own answer."""
    from deepspeed.accelerator import get_accelerator

    return dtype in get_accelerator().supported_dtypes()


def versions() -> dict[str, str]:
    """Versions that numbers measured on this machine depend on (the packages' metadata: importing
    megatron.core alone costs seconds)."""
    import platform
    from importlib import metadata

    import torch

    out = {"python": platform.python_version(), "torch": torch.__version__}
    for key, package in (("deepspeed", "deepspeed"), ("megatron.core", "megatron-core")):
        try:
            out[key] = metadata.version(package)
        except metadata.PackageNotFoundError:
            out[key] = "not installed"
    if gpu_available():
        out["cuda_runtime"] = str(torch.version.cuda)
        out["gpu"] = gpu_name()
        out["driver"] = _driver_version()
    return out


def _driver_version() -> str:
    try:
        import pynvml  # nvidia-ml-py, shipped with CUDA builds of torch's dependencies

        pynvml.nvmlInit()
        return pynvml.nvmlSystemGetDriverVersion()
    except Exception:  # noqa: BLE001 - the driver version is informative only
        return "?"


def timing_event():
    """A device event that can be recorded on the current stream and timed against another
    (`elapsed_time`, ms) once both happened: the GPU's clock for spans of work the host only queues."""
    import torch

    return torch.cuda.Event(enable_timing=True)
