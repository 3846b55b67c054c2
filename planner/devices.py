"""The accelerators the planner prices: a datasheet table of GPU types, the kernel efficiency
measured on them, and this machine's CPU as a device (planner/planner.py prices layouts on these).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from runtime.accelerator import HOST

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
    # the H100's compute (the same dense peaks) with 141 GB of HBM3e at 4.8 TB/s (DGX H200)
    "h200-141gb": {"name": "H200-SXM5-141GB", "memory_gib": 141,
                   "peak_tflops": {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0},
                   "hbm_gbs": 4800, "intra_gbs": 360, "inter_node_gbs": 400, "gpus_per_node": 8},
}
# Kernel efficiency: the fraction of the dense peak that forward + backward reach, before bubble
# and communication (what step_time divides compute by). One basis for every GPU type: until the
# GPU check (gpucheck/gpu_check.sh) has measured a type on the trainer's current path
# (compiled layers, one sync per step), an estimate, the same for every type, that grows with the
# micro-batch's target tokens and the model's width:
#     E_MAX · t / (t + T_HALF) · d / (d + D_HALF)
# A layer's matrix products are [t × d] × [d × 4d]-sized; at t = 2k and d = 1024 they are too small
# to fill a GPU for most of the step, at 8k close to it (cuBLAS's bf16 GEMMs of that size reach
# ~70% of the peak), and attention, LayerNorms and launches take the rest: 28% at 2k, 35% at 4k,
# 40% at 8k for d = 1024, which is where measurements of Megatron-style training sit at this width
# (42–48% MFU is reported for far wider models). Measured: a type whose GPU check is committed as
# docs/bench/gpu-<type>/train.json (bench/gpu.py's results) takes its measured kernel efficiency of
# the nearest (width, tokens). The H100 measurement of the eager, host-bound path (0.04–12%,
# docs/bench/gpu-h100/report.md) no longer describes the trainer and is not used.
E_MAX, T_HALF, D_HALF = 0.6, 1500.0, 256.0
BASIS_SHAPES = ("layers-d1024", "6L-6L-d512", "tiny")
"""bench/gpu.py's shapes whose kernel efficiency is the planner's for their width (a stage's
layers, not a slice that holds the output layer): preferred over other shapes of that width."""
_MEASURED = "docs/bench/gpu-{key}/train.json"
DEFAULT_PRECISION = {"v100-32gb": "fp16", "a100-80gb": "bf16", "h100-80gb": "bf16", "h200-141gb": "bf16"}  # V100: no bf16
ALIASES = {"v100": "v100-32gb", "a100": "a100-80gb", "h100": "h100-80gb", "h200": "h200-141gb"}
"""Short names of the GPU types (`--gpu a100`): each has one memory size here."""


def gpu_type(name: str) -> str:
    """The DEVICES key of a GPU type as a user writes it: a key or an alias, in any case; a
    ValueError naming the known types (and the nearest) for anything else."""
    import difflib

    text = name.strip().lower()
    key = ALIASES.get(text, text)
    if key in DEVICES:
        return key
    known = ", ".join(f"{key} ({alias})" for alias, key in ALIASES.items())
    near = difflib.get_close_matches(text, [*DEVICES, *ALIASES], n=1, cutoff=0.6)
    hint = f"did you mean {ALIASES.get(near[0], near[0])}? " if near else ""
    raise ValueError(f"--gpu {name}: not a GPU type the planner knows; {hint}known: {known}")


def estimated_efficiency(d_model: int, tokens: float) -> float:
    return E_MAX * tokens / (tokens + T_HALF) * d_model / (d_model + D_HALF)


def measured_efficiency(key: str, root: str | None = None) -> list[tuple[int, int, float]]:
    """(d_model, target tokens per micro-batch, kernel efficiency) of the committed GPU check of
    type `key` (bench/gpu.py results: the compiled variant where measured), [] when none."""
    import json
    import os

    root = root or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.path.join(root, _MEASURED.format(key=key.split("-")[0]))
    if not os.path.exists(path):
        return []
    with open(path) as f:
        results = json.load(f)
    best: dict[tuple[int, int], tuple[tuple[bool, bool], float]] = {}
    for r in results:
        rank = (r["variant"] == "compiled", r.get("shape") in BASIS_SHAPES)  # later rows win ties
        for row in r["rows"]:
            key = (r["model"][2], row["target_tokens_per_micro_batch"])
            if math.isfinite(row["kernel_efficiency"]) and (key not in best or rank >= best[key][0]):
                best[key] = (rank, row["kernel_efficiency"])
    return [(d, t, e) for (d, t), (_, e) in sorted(best.items())]


def kernel_efficiency(key: str, d_model: int, tokens: float = 4096, root: str | None = None) -> tuple[float, str]:
    """The kernel efficiency of GPU type `key` for a model of width `d_model` at `tokens` target
    tokens per micro-batch, and where it comes from (see above)."""
    measured = measured_efficiency(key, root)
    if measured:
        d, t, e = min(measured, key=lambda m: abs(math.log2(m[0] / d_model)) + abs(math.log2(m[1] / tokens)))
        return e, f"measured on {DEVICES[key]['name']} at d={d}, {t} tokens ({_MEASURED.format(key=key.split('-')[0])})"
    return estimated_efficiency(d_model, tokens), "estimated, as for every GPU type not yet measured (planner/devices.py)"


def device_key(gpu_name: str) -> str | None:
    """The DEVICES key of a GPU as torch names it (e.g. 'NVIDIA H100 80GB HBM3'), None if unknown.
    PCIe and NVL cards have other peaks than the SXM parts listed; they are not mapped."""
    name = gpu_name.upper()
    if "PCIE" in name or "NVL" in name:
        return None
    for key, marker in (("h200-141gb", "H200"), ("h100-80gb", "H100"), ("a100-80gb", "A100"), ("v100-32gb", "V100")):
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
    return Device(**{**DEVICES[gpu_type(key)], **overrides})
