"""ZB-H1 in the planner: each stage's F, B and W from costs per layer kind, the schedule's
pipeline time, and the order (hence the memory) the engine would run (planner/planner.py's
`zb_pipeline` applies them to candidates with `schedule: zb-h1`).

Costs per layer kind come from a measurement of this device type (`./run.sh bench schedules
--measure-costs`, bench/zb_costs.py: per kind F, B, W of the split layer and F, BW of the unsplit
one, in seconds) committed as a zb-costs.json under docs/bench/, or, where none exists, from the
FLOP model: F = the forward, W = the matmul weight gradients (`weight_flops`), B = the rest of the
backward; the output layer all F (its loss computes the gradients of the logits, of the decoder
stream and of the tied weight in its forward: parallel/loss.py). The planner keeps its 1F1B
compute time per kind (3 forwards' FLOPs at the kernel efficiency) and splits it in the measured
proportions F : B : W relative to the unsplit F + BW, so the split's own cost (measured
(F + B + W) / (F_1f1b + BW)) makes ZB-H1's work longer than 1F1B's.

The pipeline: every stage gets the slowest stage's total, split in the stages' mean F : B : W
(1F1B's formula uses the slowest stage's slot too), on zb_timeline's simulated orders. With equal
stages a step grows by exactly F + B + W per micro-batch once m ≥ p + 2
(tests/test_zb_planner.py), so the simulation runs at m = min(m, p + 2) and extrapolates: a
plan of 128 stages and 1,024 micro-batches costs one simulation of 130.
"""
from __future__ import annotations

import functools
import glob
import json
import os

from model.config import ModelConfig
from model.flops import layer_forward_flops

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COST_FILES = ("docs/bench/**/zb-costs.json", "docs/bench/**/costs.json")
"""Committed measurements (bench/zb_costs.py; the GPU check names its copy costs.json), found by device."""

LAYERS = ("encoder", "decoder")


def weight_flops(cfg: ModelConfig, kind: str, src_len: float, tgt_len: float) -> float:
    """FLOPs of one plan layer's deferred weight gradients (W): one matmul per weight matrix, as
    large as its forward matmul. Attention's score and mixing matmuls have no weights (all of their
    backward is B); the output layer's weight gradient is part of its loss's forward."""
    if kind not in LAYERS:
        return 0.0
    d, s, t = cfg.d_model, float(src_len), float(tgt_len)
    attention = {"encoder": 4 * d * s * s, "decoder": 4 * d * (t * t + t * s)}[kind]
    return layer_forward_flops(cfg, kind, s, t) - attention


def weight_grad_bytes(cfg: ModelConfig, kind: str, sequences: int, src_len: int, tgt_len: int,
                      element: int) -> float:
    """Bytes ZB-H1 keeps per plan layer and micro-batch between its B and its W: each linear's
    input and output gradient (biases, LayerNorms and the embedding get their gradients in B, the
    output layer's weight its gradient in the loss's forward).

    Encoder layer, per source token: inputs 3d + f (attention input, shared by Q, K, V; output
    projection; fc1; fc2), gradients 5d + f. Decoder layer, per target token inputs 5d + f and
    gradients 7d + f; per source token the cross-attention K/V input and their two gradients (3d).
    """
    d, f = cfg.d_model, cfg.ffn_dim
    ns, nt = sequences * src_len, sequences * tgt_len
    if kind == "encoder":
        return ns * element * (8 * d + 2 * f)
    if kind == "decoder":
        return nt * element * (12 * d + 2 * f) + ns * element * 3 * d
    return 0.0


def flop_costs(cfg: ModelConfig, src_len: float, tgt_len: float) -> dict[str, dict[str, float]]:
    """Per-kind costs from the FLOP model (one sequence pair; FLOPs, not seconds)."""
    out = {}
    for kind in ("encoder", "decoder", "output"):
        fwd = layer_forward_flops(cfg, kind, src_len, tgt_len)
        if kind == "output":
            out[kind] = {"F": 3 * fwd, "B": 0.0, "W": 0.0, "F_1f1b": 3 * fwd, "BW": 0.0}
        else:
            w = weight_flops(cfg, kind, src_len, tgt_len)
            out[kind] = {"F": fwd, "B": 2 * fwd - w, "W": w, "F_1f1b": fwd, "BW": 2 * fwd}
    return out


@functools.lru_cache(maxsize=64)
def measured_costs(device_name: str, d_model: int) -> tuple[dict | None, str]:
    """(per-kind costs, where they come from) for a planner Device name ('H100-SXM5-80GB', or the
    host) and a model width: the committed measurement (docs/bench/**/zb-costs.json) of that device
    type at the nearest width, in the mode the trainer runs there (compiled layers on GPUs, eager
    on CPUs); (None, 'FLOP model ...') without one."""
    import math

    from planner.devices import DEVICES, device_key

    found = []
    names = sorted({n for pattern in COST_FILES for n in glob.glob(os.path.join(ROOT, pattern), recursive=True)})
    for name in names:
        with open(name) as f:
            costs = json.load(f)
        if not isinstance(costs, dict) or not {"device", "modes", "model"} <= set(costs):
            continue  # another benchmark's file
        key = device_key(costs["device"])
        if (DEVICES[key]["name"] if key else costs["device"]) == device_name:
            found.append((abs(math.log2(costs["model"]["d_model"] / d_model)), name, key, costs))
    if not found:
        return None, "FLOP model (F = forward, W = weight matmuls; no measurement on this device type)"
    _, name, key, costs = min(found, key=lambda x: x[0])
    mode = "compiled" if key and "compiled" in costs["modes"] else "eager"
    return costs["modes"][mode], (f"measured at d = {costs['model']['d_model']} ({mode}): "
                                  f"{os.path.relpath(name, ROOT)}")


def kind_shares(costs: dict[str, float]) -> dict[str, float]:
    """A kind's F, B, W as fractions of its unsplit (1F1B) forward + backward."""
    total = costs["F_1f1b"] + costs["BW"]
    return {k: costs[k] / total if total else 0.0 for k in ("F", "B", "W")}


def stage_costs(kinds: list[str], kind_costs: dict, seconds: dict[str, float], recompute: bool) -> dict[str, float]:
    """One stage's F, B, W: each layer's 1F1B seconds (`seconds[kind]`, forward + backward) split in
    its kind's measured shares; recomputation (activation checkpointing) repeats F inside B."""
    out = {"F": 0.0, "B": 0.0, "W": 0.0}
    for kind in kinds:
        if kind not in kind_costs or not seconds.get(kind):
            continue
        share = kind_shares(kind_costs[kind])
        for k in out:
            out[k] += seconds[kind] * share[k]
        if recompute and kind in LAYERS:
            out["B"] += seconds[kind] * share["F"]
    return out


def extrapolated_span(stages: int, micro_batches: int, f: float, b: float, w: float, bound: int | None) -> tuple:
    """(makespan, per-stage pending-W peaks, the first stage's deferred share) of the order the
    engine runs at uniform costs F = f, B = b, W = w: simulated at m_eff = min(m, p + 2)
    micro-batches (`_schedule`, cached) and extended by F + B + W per further one."""
    m_eff = min(micro_batches, stages + 2)
    span, peaks, share = _schedule(stages, m_eff, f, b, w, bound)
    return span + (micro_batches - m_eff) * (f + b + w), peaks, share


@functools.lru_cache(maxsize=4096)
def _schedule(stages: int, micro_batches: int, f: float, b: float, w: float, bound: int | None) -> tuple:
    """Makespan, pending-W peaks and first-stage share of the order the engine runs at these
    costs: with a bound of 0 each W after its own B (the engine does not tune then); otherwise
    zb_timeline's tuned choice within the bound."""
    from parallel.zb_timeline import pending_peak, simulate, tuned_schedule_span, zb_h1_order

    p, m = stages, micro_batches
    cost = {"F": f, "B": b, "W": w}
    if bound == 0:
        orders, share = [zb_h1_order(p, m, s, 0) for s in range(p)], 1.0
        span = max(ops[-1][1] for ops in simulate(p, m, cost, lambda _p, _m, s: orders[s]))
    else:
        orders, share, span = tuned_schedule_span(p, m, cost, bound)
    return span, tuple(pending_peak(o) for o in orders), share


def pipeline(stages: int, micro_batches: int, per_stage: list[dict[str, float]], bound: int | None) -> dict:
    """ZB-H1's pipeline phase at these per-stage costs (module docstring): seconds, the idle
    fraction of the slowest stage, the uniform F, B, W used, each stage's pending-W peak and the
    share of its W the first stage defers."""
    total = sum(c["F"] + c["B"] + c["W"] for c in per_stage)
    slot = max(c["F"] + c["B"] + c["W"] for c in per_stage)
    mean = {k: sum(c[k] for c in per_stage) / total for k in ("F", "B", "W")}
    key = tuple(round(mean[k], 3) for k in ("F", "B", "W"))  # the cache's key: equal proportions, one simulation
    span, peaks, share = extrapolated_span(stages, micro_batches, *key, bound)
    seconds = span * slot / sum(key)
    return {"seconds": seconds, "bubble_fraction": 1.0 - micro_batches * slot / seconds if seconds else 0.0,
            "cost": {k: slot * mean[k] for k in mean}, "pending_peaks": list(peaks), "first_share": share}
