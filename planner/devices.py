"""The accelerators the planner prices: a datasheet table of GPU types, the kernel efficiency
measured on them, and this machine's CPU as a device (planner/planner.py prices layouts on these).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from parallel.accelerator import HOST

GIB = 2**30

# (name, memory GiB, dense peak TFLOP/s by precision, HBM GB/s, intra-node all-reduce bus GB/s per
# GPU, inter-node GB/s per node, GPUs per node). Datasheet peaks; bus bandwidths are typical NCCL
# all-reduce figures (DGX-1 hybrid cube mesh, DGX A100/H100 NVSwitch); inter-node: DGX-1 4×100 Gb/s
# EDR, DGX A100 8×200 Gb/s HDR, DGX H100 8×400 Gb/s NDR.
DEVICES: dict[str, dict] = {
    "v100-32gb": {"name": "V100-SXM2-32GB", "memory_gib": 32, "peak_tflops": {"fp16": 125.0, "fp32": 15.7},
                  "hbm_gbs": 900, "intra_gbs": 130, "inter_node_gbs": 50, "gpus_per_node": 8},
    "a100-80gb": {"name": "A100-SXM4-80GB", "memory_gib": 80,
                  "peak_tflops": {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5},
                  "hbm_gbs": 2039, "intra_gbs": 230, "inter_node_gbs": 200, "gpus_per_node": 8},
    "h100-80gb": {"name": "H100-SXM5-80GB", "memory_gib": 80,
                  "peak_tflops": {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0},
                  "hbm_gbs": 3350, "intra_gbs": 360, "inter_node_gbs": 400, "gpus_per_node": 8},
}
# Kernel efficiency: the fraction of the dense peak that forward + backward reach, before bubble
# and communication (what step_time divides compute by). Per GPU type, measured where a GPU of
# that type ran `./run.sh bench train` (bench/gpu.py: bf16, 4,096-target-token
# micro-batches), one entry per model width measured; a model takes the entry of the nearest
# width. The H100 figures are small because these shapes are host-bound there: the GPU waited
# for Python, DeepSpeed and kernel launches most of the step (docs/bench/gpu-h100/report.md).
# Other types keep the common assumption until measured. (d_model, efficiency, source)
_ASSUMED = [(0, 0.35, "assumed (no measurement on this GPU type)")]
_H100_BENCH = "docs/bench/gpu-h100/results.json"
KERNEL_EFFICIENCY: dict[str, list[tuple[int, float, str]]] = {
    "v100-32gb": _ASSUMED,
    "a100-80gb": _ASSUMED,
    "h100-80gb": [(64, 0.00041, f"measured: 100L-100L d=64, {_H100_BENCH}"),
                  (512, 0.0224, f"measured: 18L-18L d=512, {_H100_BENCH}"),
                  (1024, 0.119, f"measured: 12-layer slice of 100L-100L d=1024, {_H100_BENCH}")],
}
DEFAULT_PRECISION = {"v100-32gb": "fp16", "a100-80gb": "bf16", "h100-80gb": "bf16"}  # V100: no bf16

def kernel_efficiency(key: str, d_model: int) -> tuple[float, str]:
    """The default kernel efficiency for GPU type `key` and a model of width `d_model`, and the
    measurement it comes from (the entry of the nearest measured width, on a log scale)."""
    entries = KERNEL_EFFICIENCY[key]
    _, value, source = min(entries, key=lambda e: abs(math.log2(max(e[0], 1) / d_model)) if e[0] else 0.0)
    return value, source


def device_key(gpu_name: str) -> str | None:
    """The DEVICES key of a GPU as torch names it (e.g. 'NVIDIA H100 80GB HBM3'), None if unknown.
    PCIe and NVL cards have other peaks than the SXM parts listed; they are not mapped."""
    name = gpu_name.upper()
    if "PCIE" in name or "NVL" in name:
        return None
    for key, marker in (("h100-80gb", "H100"), ("a100-80gb", "A100"), ("v100-32gb", "V100")):
        if marker in name:
            return key
    return None


@dataclass(frozen=True, kw_only=True)
class Device:
    """One accelerator and how it is wired."""

    name: str
    memory_gib: float
    peak_tflops: dict
    hbm_gbs: float
    intra_gbs: float
    inter_node_gbs: float
    gpus_per_node: int
    kind: str = "gpu"
    """HOST (the CPU): dropout masks are float tensors (the fused bool-mask kernel is CUDA-only) and no
    memory is reserved for a CUDA context."""

    def usable_bytes(self) -> float:
        """Memory a stage may plan for: 90% of the device (allocator fragmentation) minus 1.5 GiB
        for the CUDA context and NCCL's buffers on GPUs."""
        reserve = 0.0 if self.kind == HOST else 1.5 * GIB
        return 0.9 * self.memory_gib * GIB - reserve


def cpu_device(peak_flops_per_rank: float, memory_bytes: float) -> Device:
    """This machine as the planner sees it when checking itself against CPU runs: one rank is
    one 'device' with its share of the cores; gloo over loopback and DRAM are a few GB/s."""
    return Device(name=HOST, memory_gib=memory_bytes / GIB, peak_tflops={"fp32": peak_flops_per_rank / 1e12},
                  hbm_gbs=20, intra_gbs=2, inter_node_gbs=2, gpus_per_node=10**6, kind=HOST)


def device(key: str, **overrides) -> Device:
    if key not in DEVICES:
        raise ValueError(f"--gpu {key!r}: choose one of {sorted(DEVICES)}")
    return Device(**{**DEVICES[key], **overrides})
