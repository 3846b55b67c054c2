"""The PNG Gantt chart of a timeline (trainer/timeline.py): one row per rank (stages top to bottom),
one panel per traced step (the first MAX_PANELS), compute spans coloured by kind and labelled with
their micro-batch, receives shaded as waits, sends, loads, reductions and the optimizer step in
their own colours, idle time blank; each panel's title has the step's bubble from the trace and the
simulator's. Drawn with matplotlib (Agg: no display needed)."""
from __future__ import annotations

from schema.text import count

MAX_PANELS = 2
STYLE = {  # label or category → (face colour, hatch, legend text)
    "F": ("#4c72b0", "", "F forward"), "B": ("#55a868", "", "B input gradient"),
    "W": ("#dd8452", "", "W weight gradients"), "BW": ("#2f8f8f", "", "BW whole backward"),
    "recv": ("#e4e4e4", "////", "receive (wait)"), "send": ("#9a9a9a", "\\\\", "send (until the peer takes it)"),
    "load": ("#c9b3dd", "", "load / data loader"), "data": ("#c9b3dd", "", None),
    "reduce": ("#8172b3", "", "all-reduce (tied, data-parallel)"), "optimizer": ("#937860", "", "optimizer step"),
}


def _style(label: str, category: str) -> tuple[str, str, str | None]:
    return STYLE.get(label if category == "compute" else category, ("#bbbbbb", "", None))


def gantt(records: list[dict], report: dict, meta: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    ranks = sorted(records, key=lambda r: (r["stage"], r["replica"], r["tp_rank"]))
    steps = report["steps"][:MAX_PANELS]
    rows = len(ranks)
    height = len(steps) * (0.8 + 0.42 * rows) + 1.3  # inches: the panels, the title and the legend
    fig, axes = plt.subplots(len(steps), 1, figsize=(11, height), squeeze=False)
    several = len(ranks) > max(r["stage"] for r in ranks) + 1
    for ax, step in zip(axes[:, 0], steps):
        spans = {r["rank"]: [s for s in r["steps"].get(str(step), []) if s[1] != "step"] for r in ranks}
        t0 = min(s[3] for row in spans.values() for s in row)
        end = max(s[4] for row in spans.values() for s in row)
        width = (end - t0) / 1e6
        for i, r in enumerate(ranks):
            y = rows - 1 - i
            for label, category, micro_batch, start, stop in spans[r["rank"]]:
                face, hatch, _ = _style(label, category)
                x, w = (start - t0) / 1e6, (stop - start) / 1e6
                ax.broken_barh([(x, w)], (y - 0.38, 0.76), facecolors=face, hatch=hatch, edgecolor="#555555"
                               if hatch else face, linewidth=0.3)
                if category == "compute" and micro_batch is not None and w > width / 90:
                    ax.text(x + w / 2, y, str(micro_batch), ha="center", va="center", fontsize=7, color="white")
        ax.set_yticks(range(rows))
        ax.set_yticklabels([f"stage {r['stage']}" + (f" (rank {r['rank']})" if several else "") for r in reversed(ranks)],
                           fontsize=8)
        ax.set_xlim(0, width * 1.01)
        ax.set_ylim(-0.6, rows - 0.4)
        ax.tick_params(axis="x", labelsize=8)
        traced = report["per_step"][str(step)]
        ax.set_title(f"step {step}: bubble {traced['trace']['bubble']:.3f} in the trace, "
                     f"{traced['simulator']['bubble']:.3f} simulated at its F, B, W costs", fontsize=9)
    axes[-1, 0].set_xlabel("ms from the step's first span (clocks aligned to rank 0)", fontsize=8)
    seen = {label for r in ranks for spans in r["steps"].values() for label, category, *_ in spans
            for label in ([label] if category == "compute" else [category])}
    handles = [Patch(facecolor=face, hatch=hatch, edgecolor="#555555", label=text)
               for key, (face, hatch, text) in STYLE.items() if text and (key in seen or (key == "load" and "data" in seen))]
    fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 4), fontsize=8, frameon=False)
    shown = "" if len(report["steps"]) <= MAX_PANELS else f" (first {MAX_PANELS} of {count(len(report['steps']), 'step')})"
    fig.suptitle(f"{meta.get('schedule_title', '')}, pp={meta.get('pp')} × dp={meta.get('dp')}, "
                 f"{count(meta.get('micro_batches', 0), 'micro-batch', 'micro-batches')}, {meta.get('model', '')}{shown}",
                 fontsize=10)
    fig.tight_layout(rect=(0, 0.6 / height, 1, 1))  # 0.6 inch for the legend
    fig.savefig(path, format="png", dpi=80)
    plt.close(fig)
