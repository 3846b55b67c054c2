"""Outputs of the depth-1000 experiment: CSVs, one figure, Markdown tables, meta.json."""
from __future__ import annotations

import csv
import json
import math
import os

import matplotlib
import numpy as np

matplotlib.use("Agg")  # no display on CI machines
import matplotlib.pyplot as plt

from experiments.report import LABELS
from schema.text import count

UPDATE_NORMS_CSV = "docs/update-norms/update_norms.csv"
"""Part 1 of update-norms (6L–100L, same recipe as the fig4 runs): drawn beside them when present."""
FIG4_AT = (1, 5, 10, 20)


def _fmt(x: float | None, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "—"
    return f"{x:.{digits}g}" if abs(x) < 1000 else f"{x:.0f}"


def _series(rows: dict[int, dict], key: str) -> tuple[list[int], list[float]]:
    steps = sorted(s for s, v in rows.items() if key in v)
    return steps, [rows[s][key] for s in steps]


def shallow_fig4(path: str = UPDATE_NORMS_CSV) -> dict[tuple[str, int], dict[int, float]]:
    """(strategy, depth) → step → ‖ΔF‖ of update-norms part 1 (seed 1), if its CSV exists."""
    if not os.path.exists(path):
        return {}
    out: dict[tuple[str, int], dict[int, float]] = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            if row.get("delta_f") and row.get("seed", "1") in ("", "1"):
                out.setdefault((row["strategy"], int(row["depth"])), {})[int(row["step"])] = float(row["delta_f"])
    return out


def plot(results: list[dict], baseline: float, path: str) -> None:
    fig4 = [r for r in results if r["run"].kind == "fig4"]
    train = [r for r in results if r["run"].kind == "train"]
    shallow = shallow_fig4()
    strategies = list(dict.fromkeys(r["run"].strategy for r in results))
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    depths = sorted({d for (_, d) in shallow} | {r["run"].depth for r in results})
    colors = dict(zip(depths, plt.cm.viridis(np.linspace(0, 0.9, max(len(depths), 1)))))
    styles = {s: ls for s, ls in zip(strategies, ("-", "--", ":", "-."))}
    for (strategy, depth), series in sorted(shallow.items(), key=lambda kv: kv[0][1]):
        if strategy in strategies:
            steps = [s for s in sorted(series) if s <= max((r["run"].steps for r in fig4), default=20)]
            axes[0].plot(steps, [series[s] for s in steps], styles[strategy], color=colors[depth], linewidth=1,
                         alpha=0.7)
    for r in fig4:
        run = r["run"]
        axes[0].plot(*_series(r["rows"], "delta_f"), styles[run.strategy], marker="o", markersize=3,
                     color=colors[run.depth], linewidth=2,
                     label=f"{LABELS.get(run.strategy, run.strategy)} {run.depth}L-{run.depth}L")
    axes[0].set_yscale("log")
    axes[0].set_title("‖ΔF‖ at the start (warm-up 4000; thin: update-norms 6L–100L)", fontsize=9)
    axes[0].set_xlabel("step")
    axes[0].legend(fontsize=7)
    for r in train:
        run = r["run"]
        label = f"{LABELS.get(run.strategy, run.strategy)} {run.depth}L-{run.depth}L ({r['status']})"
        steps, loss = _series(r["rows"], "train_loss")
        k = min(20, len(loss))
        if k:
            smooth = np.convolve(loss, np.ones(k) / k, mode="valid")
            axes[1].plot(steps[k - 1:], smooth, styles[run.strategy], color=colors[run.depth], label=label)
        axes[2].plot(*_series(r["rows"], "valid_loss"), styles[run.strategy], marker="o", color=colors[run.depth],
                     label=label)
    axes[1].set_title("training loss (20-step moving average)", fontsize=9)
    axes[2].axhline(baseline, color="grey", linestyle="--", linewidth=1, label="unigram baseline (stuck)")
    axes[2].set_title("dev loss", fontsize=9)
    for ax in axes[1:]:
        ax.set_xlabel("step")
        ax.legend(fontsize=7)
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.suptitle("64-128-2 encoder-decoders trained by the trainer as a 2-stage pipeline", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _wall(r: dict) -> tuple[float, float]:
    return (sum(x["wall_seconds"] for x in r["launches"]) / 60, sum(x["cpu_seconds"] for x in r["launches"]) / 60)


def tables(results: list[dict], baseline: float) -> list[str]:
    fig4 = [r for r in results if r["run"].kind == "fig4"]
    train = [r for r in results if r["run"].kind == "train"]
    shallow = shallow_fig4()
    lines = ["## ‖ΔF‖ at the start of training (Fig. 4 extended)", "",
             "RMS per target token of the decoder output's change on the probe batch, at steps "
             + ", ".join(map(str, FIG4_AT)) + " (6L–100L: `docs/update-norms/update_norms.csv`, same recipe, seed 1).",
             "", "| strategy | depth | " + " | ".join(f"step {s}" for s in FIG4_AT) + " | source |",
             "|---|---|" + "---|" * (len(FIG4_AT) + 1)]
    for strategy in dict.fromkeys(r["run"].strategy for r in fig4):
        for (s, d), series in sorted(shallow.items(), key=lambda kv: kv[0][1]):
            if s == strategy:
                lines.append(f"| {LABELS.get(s, s)} | {d}L-{d}L | "
                             + " | ".join(_fmt(series.get(x)) for x in FIG4_AT) + " | update-norms |")
        for r in sorted((r for r in fig4 if r["run"].strategy == strategy), key=lambda r: r["run"].depth):
            d = r["run"].depth
            lines.append(f"| {LABELS.get(strategy, strategy)} | {d}L-{d}L | "
                         + " | ".join(_fmt(r["rows"].get(x, {}).get("delta_f")) for x in FIG4_AT)
                         + f" | this experiment ({r['status']}) |")
    lines += ["", "## Training", "",
              f"Dev loss of the unigram baseline (stuck model): {baseline:.3f}.", "",
              "| run | status | steps done | train loss (mean of last 20) | dev loss: first → last (min) | "
              "below baseline | max LN input | wall min | CPU min |", "|---|---|---|---|---|---|---|---|---|"]
    for r in fig4 + train:
        run, rows = r["run"], r["rows"]
        _, loss = _series(rows, "train_loss")
        _, valid = _series(rows, "valid_loss")
        _, ln = _series(rows, "ln_input_max")
        last20 = sum(loss[-20:]) / len(loss[-20:]) if loss else None
        below = baseline - valid[-1] if valid else None
        dev = f"{_fmt(valid[0])} → {_fmt(valid[-1])} ({_fmt(min(valid))})" if valid else "—"
        wall, cpu = _wall(r)
        lines.append(f"| {run.name} | {r['status']} | {max((s for s, v in rows.items() if 'train_loss' in v), default=0)}"
                     f"/{run.steps} | {_fmt(last20)} | {dev} | {_fmt(below)} | {_fmt(max(ln) if ln else None)} | "
                     f"{wall:.1f} | {cpu:.1f} |")
    at = sorted({s for r in train for s, v in r["rows"].items() if "valid_loss" in v})
    if at:
        lines += ["", f"Dev loss at each validation (unigram baseline {baseline:.3f}):", "",
                  "| run | " + " | ".join(f"step {s}" for s in at) + " |", "|---|" + "---|" * len(at)]
        for r in train:
            lines.append(f"| {r['run'].name} | "
                         + " | ".join(_fmt(r["rows"].get(s, {}).get("valid_loss"), 4) for s in at) + " |")
    return lines


def write_outputs(results: list[dict], out: str, command: str, baseline: float, sessions: list[dict]) -> list[str]:
    os.makedirs(out, exist_ok=True)
    paths = {n: os.path.join(out, n) for n in ("curves.csv", "runs.csv", "depth1000.png", "results.md", "meta.json")}
    with open(paths["meta.json"], "w") as f:
        json.dump({"command": command, "baseline": baseline, "sessions": sessions}, f, indent=2)
    keys = ["train_loss", "lr", "grad_norm", "valid_loss", "delta_f", "ln_input_max", "layer_grad_norm_max"]
    with open(paths["curves.csv"], "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["run", "kind", "strategy", "depth", "step", *keys])
        for r in results:
            run = r["run"]
            for step in sorted(r["rows"]):
                w.writerow([run.name, run.kind, run.strategy, run.depth, step, *(r["rows"][step].get(k, "") for k in keys)])
    with open(paths["runs.csv"], "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["run", "kind", "strategy", "depth", "steps", "status", "launches", "wall_minutes", "cpu_minutes"])
        for r in results:
            run = r["run"]
            wall, cpu = _wall(r)
            w.writerow([run.name, run.kind, run.strategy, run.depth, run.steps, r["status"], len(r["launches"]),
                        f"{wall:.2f}", f"{cpu:.2f}"])
    plot(results, baseline, paths["depth1000.png"])
    launches = [x for r in results for x in r["launches"]]
    # Runs may train side by side (--jobs): the commands' own wall time is the total, not the
    # sum over runs (a run's wall time in the tables overlaps its neighbour's).
    total_wall = (sum(s["wall_seconds"] for s in sessions) if sessions else
                  sum(x["wall_seconds"] for x in launches)) / 60
    total_cpu = sum(x["cpu_seconds"] for x in launches) / 60
    loads = [x[k] for x in launches for k in ("load_start", "load_end")]
    unfinished = [r["run"].name for r in results if r["status"] == "incomplete"]
    md = ["# depth-1000: results", "",
          f"Written by `{command}` from {count(len(launches), 'trainer launch', 'trainer launches')} in "
          f"{count(len(sessions), 'command') if sessions else 'unrecorded commands'}: {total_wall:.1f} min of wall-clock time and {total_cpu:.1f} min of CPU time (all ranks) in all"
          + (f", at load averages {min(loads):.1f}–{max(loads):.1f}" if loads else "")
          + " (per run: runs.csv, where runs trained side by side overlap in wall time; per launch: each run "
          "directory's launches.json). "
          + (f"**Incomplete runs: {', '.join(unfinished)}** (rows so far are shown). " if unfinished else "")
          + "See docs/depth-1000.md for the discussion.", "",
          "![depth-1000](depth1000.png)", ""]
    md += tables(results, baseline)
    with open(paths["results.md"], "w") as f:
        f.write("\n".join(md) + "\n")
    return list(paths.values())


