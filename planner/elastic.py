"""The layout for the nodes a job got: every pp × tp × dp of that many ranks the model takes and
the run's global batch allows, priced by the planner (planner/planner.py), the fastest that fits
in memory. An elastic SLURM job's every start asks it (launcher/elastic.py).

What is not the layout stays the config's: precision, schedule, activation checkpointing, ZeRO
stage, tokens per micro-batch. And so do the layout keys the job fixes (`fixed`: e.g. tensor
parallelism a model needs). The global batch is the run's number of micro-batches per step,
`data_parallel × train.micro_batches`: dp must divide it, and micro_batches = that number / dp.
"""
from __future__ import annotations

import dataclasses

from model.config import ModelConfig
from planner.devices import Device
from planner.planner import Candidate, Plan, plan
from schema.text import count

KEYS = {"pp": "pipeline_stages", "tp": "tensor_parallel", "dp": "data_parallel"}
"""Short names of the layout keys (`--fixed pp,tp`) → the parallel: keys."""


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(model: ModelConfig, world: int, per_node: int, global_micro: int,
            fixed: dict[str, int]) -> tuple[list[tuple[int, int, int]], list[str]]:
    """(every (pp, tp, dp) of `world` ranks the model takes, keeping the fixed keys and the
    global batch; tp within a node of `per_node` ranks), and why each size was left out."""
    found, why = [], []
    layers = model.encoder_layers + model.decoder_layers
    for tp in divisors(world):
        if tp > per_node:
            why.append(f"tp {tp} is more than a node's {count(per_node, 'rank')}")
            continue
        bad = [f"{name} {value}" for name, value in (("model.heads", model.heads), ("model.ffn_dim", model.ffn_dim),
                                                      ("the vocabulary", model.vocab_size)) if value % tp]
        if bad:
            why.append(f"tp {tp} does not divide {', '.join(bad)}")
            continue
        for pp in divisors(world // tp):
            dp = world // tp // pp
            if pp > layers:
                why.append(f"pp {pp} exceeds the model's {count(layers, 'layer')}")
            elif global_micro % dp:
                why.append(f"dp {dp} does not divide the {count(global_micro, 'micro-batch', 'micro-batches')} per step")
            elif any(value != {"pipeline_stages": pp, "tensor_parallel": tp, "data_parallel": dp}[key]
                     for key, value in fixed.items()):
                why.append(f"pp{pp}·tp{tp}·dp{dp} changes a fixed key")
            else:
                found.append((pp, tp, dp))
    return found, list(dict.fromkeys(why))


def choose(model: ModelConfig, base: Candidate, world: int, per_node: int, global_micro: int,
           fixed: dict[str, int], dev: Device, mfu) -> tuple[Plan, int, int]:
    """The planner's best layout of `world` ranks within `dev`'s memory (`base` gives everything
    but the sizes), how many layouts were priced and how many fit; ValueError naming why none does."""
    sizes, why = layouts(model, world, per_node, global_micro, fixed)
    if not sizes:
        kept = ", ".join(f"{key}={value}" for key, value in fixed.items()) or "none"
        raise ValueError(f"no pp × tp × dp layout of {count(world, 'rank')} fits this model and its "
                         f"{count(global_micro, 'micro-batch', 'micro-batches')} per step (fixed: {kept}): {'; '.join(why)}")
    plans = [plan(model, dataclasses.replace(base, pp=pp, tp=tp, dp=dp, micro_batches=global_micro // dp), dev, mfu)
             for pp, tp, dp in sizes]
    fits = [p for p in plans if p.peak_bytes <= dev.usable_bytes()]
    if not fits:
        leanest = min(plans, key=lambda p: p.peak_bytes)
        raise ValueError(f"none of the {count(len(plans), 'layout')} of {count(world, 'rank')} fits in memory: the leanest, "
                         f"{leanest.layout.describe()}, needs {leanest.peak_bytes / 2**30:.1f} GiB of "
                         f"{dev.usable_bytes() / 2**30:.1f} usable per rank")
    # fastest first; at equal speed fewer pipeline stages, then fewer tensor-parallel ranks
    best = min(fits, key=lambda p: (-p.tokens_per_s, p.layout.pp, p.layout.tp))
    return best, len(plans), len(fits)
