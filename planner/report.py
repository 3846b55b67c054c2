"""The planner's answer as text: the table of the best layouts and why the best one wins
(`./run.sh plan`)."""
from __future__ import annotations

from model.config import ModelConfig
from parallel.schedules import DEFAULT_SCHEDULE, SCHEDULES
from planner.devices import Device
from planner.planner import layer_params
from schema.text import count


def params_of(model: ModelConfig) -> float:
    return (model.encoder_layers * layer_params(model, "encoder") + model.decoder_layers * layer_params(model, "decoder")
            + layer_params(model, "embed"))


def explain(fits: list, too_big: list, dev: Device) -> list[str]:
    """Why the best plan wins: what it fits in, what the alternatives would cost."""
    best = fits[0]
    lay = best.layout
    worst = max(best.memory, key=lambda m: m["peak"])
    gib = 2**30
    lines = [f"Best: {lay.describe()} — {best.tokens_per_s:,.0f} target tokens/s, MFU {best.mfu(dev):.1%}."]
    lines.append(f"- Memory: its heaviest stage needs {worst['peak'] / gib:.1f} GiB of {dev.usable_bytes() / gib:.1f} "
                 f"usable (weights+grads {worst['weights_grads'] / gib:.1f}, optimizer {worst['optimizer'] / gib:.1f}, "
                 f"activations {worst['activations'] / gib:.1f}, buffers {worst['buffers'] / gib:.1f}; peak in the "
                 f"{worst['peak_phase']}).")
    t = best.time
    how = f"{SCHEDULES[lay.schedule].title}'s order, simulated"
    lines.append(f"- Step {t['total']:.2f} s: compute {t['compute']:.2f}, bubble {t['bubble']:.2f} "
                 f"({t['bubble_fraction']:.1%} = {how}), TP {t['tp_comm']:.2f}, PP {t['pp_comm']:.2f}, "
                 f"DP {t['dp_comm']:.2f}, optimizer {t['optimizer']:.2f}.")
    lines += schedule_lines(best, fits + too_big, dev)
    shallower = [p for p in too_big if p.layout.pp < lay.pp]
    if shallower and not any(p.layout.pp < lay.pp for p in fits):
        p = min(shallower, key=lambda p: p.peak_bytes)
        lines.append(f"- Fewer stages do not fit: the leanest such plan ({p.layout.describe()}) needs "
                     f"{p.peak_bytes / gib:.1f} GiB per GPU.")
    for label, pick in (("with activation checkpointing" if not lay.checkpoint else "without checkpointing",
                         lambda p: bool(p.layout.checkpoint) != bool(lay.checkpoint)),
                        ("with a different tensor-parallel size", lambda p: p.layout.tp != lay.tp),
                        ("with a different pipeline depth", lambda p: p.layout.pp != lay.pp)):
        alt = next((p for p in fits if pick(p)), None)
        if alt is not None:
            lines.append(f"- Best plan {label}: {alt.layout.describe()}, {alt.tokens_per_s / best.tokens_per_s - 1:+.1%} "
                         "throughput.")
    return lines


def schedule_lines(best, plans: list, dev: Device) -> list[str]:
    """The best layout under every other schedule priced (the registry's, each pending bound): step
    time against the default schedule's, bubble and heaviest stage."""
    import dataclasses

    lay = best.layout
    if lay.pp == 1:
        return []
    same = [p for p in plans if p.layout == dataclasses.replace(lay, schedule=p.layout.schedule,
                                                                  zb_max_pending=p.layout.zb_max_pending)]
    base = next((p for p in same if p.layout.schedule == DEFAULT_SCHEDULE), None)
    if base is None or len(same) < 2:
        return []
    gib, usable = 2**30, dev.usable_bytes()
    parts = []
    for p in sorted(same, key=lambda p: (p.time["total"], p.peak_bytes)):
        fits = "" if p.peak_bytes <= usable else ", does not fit"
        gain = "" if p is base else f", {p.time['total'] / base.time['total'] - 1:+.1%}"
        parts.append(f"{p.layout.schedule_name} {p.time['total']:.3f} s{gain} (bubble {p.time['bubble_fraction']:.1%}, "
                     f"heaviest stage {p.peak_bytes / gib:.1f} GiB{fits})")
    source = base.time["pipeline"]["source"]
    return [f"- Schedules of this layout (against {DEFAULT_SCHEDULE}): " + "; ".join(parts)
            + f". F, B, W per layer kind: {source}."]


def table(plans: list, dev: Device, budget: tuple[str, float] | None) -> list[str]:
    head = "| layout | peak GiB/GPU | step s | bubble | target tok/s | MFU |"
    if budget:
        head += " days |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for p in plans:
        row = (f"| {p.layout.describe()} | {p.peak_bytes / 2**30:.1f} | {p.time['total']:.2f} | "
               f"{p.time['bubble_fraction']:.1%} | {p.tokens_per_s:,.0f} | {p.mfu(dev):.1%} |")
        if budget:
            kind, amount = budget
            seconds = amount / p.tokens_per_s if kind == "tokens" else amount / (p.model_flops_per_step / p.time["total"])
            row += f" {seconds / 86400:.1f} |"
        lines.append(row)
    return lines


def config_layout(parallel, train, max_tokens: int, seq_len: int, precision: str):
    """The layout a run config trains with (its parallel: section, train.micro_batches and
    data.max_tokens) as a planner Candidate of sentences of `seq_len` tokens on each side:
    data.max_tokens bounds batch size × the longer side, so a micro-batch holds
    max_tokens // seq_len sentence pairs."""
    from planner.planner import Candidate

    return Candidate(pp=parallel.pipeline_stages, tp=parallel.tensor_parallel, dp=parallel.data_parallel,
                     micro_batches=train.micro_batches, sequences=max(1, max_tokens // seq_len), src_len=seq_len,
                     tgt_len=seq_len, checkpoint=parallel.activation_checkpoint_interval, precision=precision,
                     schedule=parallel.schedule,
                     zb_max_pending=None if parallel.zb_max_pending_w < 0 else parallel.zb_max_pending_w,
                     zero=parallel.zero_stage)


def own_row(own, best, dev: Device, budget: tuple[str, float] | None, gpus: int, note: str = "") -> list[str]:
    """The config's own layout as a row of the same table, and how it compares with the best."""
    head, rule, row = table([own], dev, budget)
    lines = ["The config's own layout" + (f" ({note})" if note else "") + ":", "", head, rule,
             row.replace("| ", "| config: ", 1)]
    usable = dev.usable_bytes()
    if own.peak_bytes > usable:
        lines.append(f"- It does not fit: its heaviest stage needs {own.peak_bytes / 2**30:.1f} GiB of "
                     f"{usable / 2**30:.1f} usable per GPU.")
    other = own.layout.world != gpus
    if other:
        lines.append(f"- It uses {count(own.layout.world, 'GPU')}, not the {gpus} planned for (its pipeline × "
                     "tensor-parallel size does not divide them); compared per GPU.")
    if best is not None and own.peak_bytes <= usable:
        gain = (best.tokens_per_s / gpus) / (own.tokens_per_s / own.layout.world) - 1
        lines.append(f"- The best layout above reaches {gain:+.1%} throughput{' per GPU' if other else ''} "
                     "against it.")
    return lines


LEGEND = ("Layout: ppP·tpT·dpD = P pipeline stages × T-way tensor parallelism × D replicas; m = micro-batches "
          "per step; mb=B×(S+T) = B sentence pairs of S source + T target tokens per micro-batch; acK = recompute "
          "every K layers (no-ac: none); then the precision; then the schedule (parallel.schedule: "
          + ", ".join(f"{name} = {s.title}" for name, s in SCHEDULES.items() if name != DEFAULT_SCHEDULE)
          + f"; none named: {SCHEDULES[DEFAULT_SCHEDULE].title}), (w=N) keeping at most N weight passes waiting "
          "(-1: no bound).")
"""What the layout column of the tables says (Candidate.describe, planner/planner.py), under the table."""


def config_snippet(best, dev: Device) -> list[str]:
    """The best layout as the config keys that give it, ready to paste, and as --set flags."""
    lay = best.layout
    values = {"parallel": {"pipeline_stages": lay.pp, "tensor_parallel": lay.tp, "data_parallel": lay.dp,
                           "activation_checkpoint_interval": lay.checkpoint, "precision": lay.precision},
              "data": {"max_tokens": lay.sequences * max(lay.src_len, lay.tgt_len)},
              "train": {"micro_batches": lay.micro_batches}}
    if lay.schedule != DEFAULT_SCHEDULE:
        values["parallel"]["schedule"] = lay.schedule
    if SCHEDULES[lay.schedule].pending_bounds:
        values["parallel"]["zb_max_pending_w"] = -1 if lay.zb_max_pending is None else lay.zb_max_pending
    nodes = max(1, lay.world // dev.gpus_per_node)
    per_node = lay.world // nodes
    text = [f"{section}:" + "".join(f"\n  {key}: {value}" for key, value in keys.items())
            for section, keys in values.items()]
    flags = " ".join(f"--set {section}.{key}={value}" for section, keys in values.items() for key, value in keys.items())
    return ["The best layout as config keys (replace these in the config's sections):", "", "```yaml",
            *"\n".join(text).splitlines(), "```", "",
            f"or on the command line: {flags}",
            f"(a SLURM job of {count(nodes, 'node')} × {count(per_node, 'GPU')}: ./run.sh slurm CONFIG --nodes {nodes} "
            f"--gpus-per-node {per_node})"]
