"""Every schedule in the planner, from its order: each stage's F, B and W (or unsplit BW) from
costs per layer kind, the schedule's pipeline time on its simulated order, and what its order
holds per stage (in-flight activations, pending weight passes: the memory), for the order the
engine would run (planner/planner.py's `pipeline_phase` applies them to candidates). The
zero-bubble schedules' split backward (ZB-H1, ZB-H2) is why the costs come per F, B and W.

Costs per layer kind come from a measurement of this device type (`./run.sh bench schedules
--measure-costs`, bench/zb_costs.py: per kind F, B, W of the split layer and F, BW of the unsplit
one, in seconds) committed as a zb-costs.json under docs/bench/, or, where none exists, from the
FLOP model: F = the forward, W = the matmul weight gradients (`weight_flops`), B = the rest of the
backward; the output layer all F (its loss computes the gradients of the logits, of the decoder
stream and of the tied weight in its forward: parallel/loss.py). The planner keeps its compute time
per kind (3 forwards' FLOPs at the kernel efficiency) and splits it in the measured proportions,
F : B : W for a schedule that splits its backward and F : BW for one that does not, relative to the
unsplit F + BW, so the split's own cost (measured (F + B + W) / (F_1f1b + BW)) makes a splitting
schedule's work longer.

The pipeline: every stage gets the slowest stage's total, split in the stages' mean proportions
(the old 1F1B formula, (m + p − 1) slots, is what the simulation gives 1F1B), on zb_timeline's
simulated orders. With equal stages a step grows by exactly one micro-batch's work per micro-batch
once every stage is past its warm-up (m ≥ p + 2 for 1F1B and ZB-H1, 2p + 2 for ZB-H2;
tests/test_zb_planner.py), so the simulation runs there and extrapolates: a plan of 128 stages
and 1,024 micro-batches costs one simulation of 130. What the orders hold is read from the chosen
order at the real m (GPipe holds all m).
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
    """A kind's F, B, W (split) and F_1f1b, BW (unsplit) as fractions of its unsplit forward + backward."""
    total = costs["F_1f1b"] + costs["BW"]
    return {k: costs[k] / total if total else 0.0 for k in ("F", "B", "W", "F_1f1b", "BW")}


def stage_costs(kinds: list[str], kind_costs: dict, seconds: dict[str, float], recompute: bool,
                split: bool = True) -> dict[str, float]:
    """One stage's F, B, W (`split`) or F, BW: each layer's unsplit seconds (`seconds[kind]`,
    forward + backward) split in its kind's measured shares; recomputation (activation
    checkpointing) repeats F inside the backward."""
    out = {"F": 0.0, "B": 0.0, "W": 0.0} if split else {"F": 0.0, "BW": 0.0}
    names = {"F": "F", "B": "B", "W": "W"} if split else {"F": "F_1f1b", "BW": "BW"}
    for kind in kinds:
        if kind not in kind_costs or not seconds.get(kind):
            continue
        share = kind_shares(kind_costs[kind])
        for k, name in names.items():
            out[k] += seconds[kind] * share[name]
        if recompute and kind in LAYERS:
            out["B" if split else "BW"] += seconds[kind] * share[names["F"]]
    return out


def order_memory(orders: list[list[tuple[str, int]]], share: float = 1.0) -> dict:
    """What these orders hold per stage (planner/planner.py `stage_memory`): `held`, the (in-flight,
    pending W) states that can peak (zb_timeline.held_states); `forwards_first`, whether all
    forwards precede the first backward; `first_share`, the share of its W the first stage defers."""
    from parallel.zb_timeline import forwards_first, held_states

    return {"held": [held_states(o) for o in orders], "forwards_first": [forwards_first(o) for o in orders],
            "first_share": share}


def extrapolated_span(schedule: str, stages: int, micro_batches: int, cost: dict[str, float],
                      bound: int | None) -> tuple[float, dict]:
    """(makespan, order_memory) of the order the engine runs under `schedule` at uniform costs
    `cost` (F, B, W or F, BW): a tuning schedule's choice made at min(m, p + 2) micro-batches (within
    the engine's 0.5% at m: tests/test_zb_planner.py), simulated at m_eff = min(m, `_steady_from`)
    and extended by one micro-batch's work per further one (cached); the memory of that order at m."""
    key = tuple(sorted(cost.items()))
    index = _choice(schedule, stages, min(micro_batches, stages + 2), key, bound)
    m_eff = min(micro_batches, _steady_from(schedule, stages, bound))
    span = _span(schedule, stages, m_eff, key, bound, index)
    return span + (micro_batches - m_eff) * sum(cost.values()), _memory(schedule, stages, micro_batches, bound, index)


@functools.lru_cache(maxsize=1024)
def _steady_from(schedule: str, stages: int, bound: int | None) -> int:
    """Micro-batches from which each further one adds exactly its work to the span: every stage's
    warm-up (forwards before its first backward) done and 3 more (1F1B, ZB-H1: p + 2; ZB-H2, whose
    first stage runs 2p − 1 forwards first: 2p + 2), at most 2p + 2, read from its orders at
    m = 2p + 2 (tests/test_zb_planner.py checks every registry schedule against full simulations)."""
    probe = 2 * stages + 2
    warm = 0
    for orders, _ in _choices(schedule, stages, probe, bound):
        for order in orders:
            kinds = [kind for kind, _ in order]
            warm = max(warm, next((i for i, k in enumerate(kinds) if k in ("B", "BW")), len(kinds)))
    return min(warm + 3, probe)


@functools.lru_cache(maxsize=4096)
def _choice(schedule: str, stages: int, micro_batches: int, cost: tuple, bound: int | None) -> int:
    """Which of the schedule's candidates the engine runs at these costs (Schedule.choose)."""
    from parallel.zb_timeline import choose

    choices = _choices(schedule, stages, micro_batches, bound)
    if all(orders == choices[0][0] for orders, _ in choices):
        return 0
    orders, share, _ = choose(choices, micro_batches, dict(cost))
    return next(i for i, c in enumerate(choices) if c == (orders, share))


@functools.lru_cache(maxsize=4096)
def _span(schedule: str, stages: int, micro_batches: int, cost: tuple, bound: int | None, index: int) -> float:
    from parallel.zb_timeline import span_of, with_first_stage_share

    orders, share = _choices(schedule, stages, micro_batches, bound)[index]
    return span_of(orders, micro_batches, with_first_stage_share(dict(cost), stages, share))


@functools.lru_cache(maxsize=1024)
def _memory(schedule: str, stages: int, micro_batches: int, bound: int | None, index: int) -> dict:
    return order_memory(*_choices(schedule, stages, micro_batches, bound)[index])


@functools.lru_cache(maxsize=256)
def _choices(schedule: str, stages: int, micro_batches: int, bound: int | None) -> list:
    """The schedule's candidate orders at this size (Schedule.choices; cached: built once per plan)."""
    from parallel.schedules import SCHEDULES

    return SCHEDULES[schedule].choices(stages, micro_batches, bound)


def pipeline(schedule: str, stages: int, micro_batches: int, per_stage: list[dict[str, float]], bound: int | None) -> dict:
    """The pipeline phase of `schedule` at these per-stage costs (module docstring): seconds, the
    idle fraction of the slowest stage, the uniform costs used, and order_memory's `held`,
    `forwards_first` and `first_share` of the order it runs."""
    keys = tuple(per_stage[0])
    work = [sum(c[k] for k in keys) for c in per_stage]
    slot, total = max(work), sum(work)
    mean = {k: sum(c[k] for c in per_stage) / total for k in keys}
    key = {k: round(mean[k], 3) for k in keys}  # the cache's key: equal proportions, one simulation
    span, memory = extrapolated_span(schedule, stages, micro_batches, key, bound)
    scale = slot / sum(key.values())
    seconds = span * scale
    return {"seconds": seconds, "bubble_fraction": 1.0 - micro_batches * slot / seconds if seconds else 0.0,
            "cost": {k: slot * mean[k] for k in keys}, **memory}
