"""Outputs of the update-norms experiment: CSVs, Fig. 4-style plots and Markdown tables."""
from __future__ import annotations

import csv
import json
import math
import os

import matplotlib
import numpy as np

matplotlib.use("Agg")  # no display on CI machines
import matplotlib.pyplot as plt

from schema.text import count

LABELS = {"postln": "Post-LN", "preln": "Pre-LN", "deepnorm": "DeepNet (DeepNorm)", "subln": "Sub-LN (Pre-LN DeepNet)",
          "branchnorm": "BranchNorm", "postln-init": "Post-LN-init", "deepnorm-xavier-1.15": "DeepNorm (Xavier, encoder constant 1.15)"}


def _write_csv(path: str, rows: list[dict]) -> None:
    keys = list(dict.fromkeys(k for row in rows for k in row))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        writer.writerows(rows)


def _series(result: dict, key: str) -> tuple[list[int], list[float]]:
    points = [(r["step"], r[key]) for r in result["rows"] if key in r]
    return [p[0] for p in points], [p[1] for p in points]


def _fmt(x: float | None, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "—"
    return f"{x:.{digits}g}" if abs(x) < 1000 else f"{x:.0f}"


def plot_part1(part1: list[dict], path: str) -> None:
    """One panel per strategy, one line per depth: linear axis as the paper (top), log (bottom)."""
    strategies = list(dict.fromkeys(r["spec"]["strategy"] for r in part1))
    depths = sorted({r["spec"]["depth"] for r in part1})
    colors = dict(zip(depths, plt.cm.viridis([i / max(len(depths) - 1, 1) for i in range(len(depths))])))
    fig, axes = plt.subplots(2, len(strategies), figsize=(3.2 * len(strategies), 6.2), sharey="row", squeeze=False)
    for col, strategy in enumerate(strategies):
        for r in sorted((r for r in part1 if r["spec"]["strategy"] == strategy), key=lambda r: r["spec"]["depth"]):
            d = r["spec"]["depth"]
            steps, delta = _series(r, "delta_f")
            for ax in axes[:, col]:
                ax.plot(steps, delta, marker="o", markersize=2.5, color=colors[d], label=f"{d}L-{d}L")
            if any("delta_f_schedule" in row for row in r["rows"]):  # BranchNorm: λ_t's own share
                for ax in axes[:, col]:
                    ax.plot(*_series(r, "delta_f_schedule"), linestyle="--", linewidth=1, color=colors[d])
        axes[0, col].set_title(LABELS.get(strategy, strategy), fontsize=10)
        if any("delta_f_schedule" in row for r in part1 if r["spec"]["strategy"] == strategy for row in r["rows"]):
            axes[1, col].text(0.03, 0.03, "dashed: λ_t alone, θ_0 frozen", transform=axes[1, col].transAxes, fontsize=7)
        axes[1, col].set_yscale("log", nonpositive="mask")
        axes[1, col].set_xlabel("step")
        for ax in axes[:, col]:
            ax.grid(alpha=0.3)
    axes[0, 0].set_ylabel("‖ΔF‖")
    axes[1, 0].set_ylabel("‖ΔF‖ (log scale)")
    axes[0, -1].legend(fontsize=8, title="64-128-2", title_fontsize=8)
    fig.suptitle("Model update ‖F(x, θ_t) − F(x, θ_0)‖ (decoder output, RMS per target token) at the start "
                 "of training (cf. DeepNet Fig. 4)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_part2(part2: list[dict], path: str) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    for r in part2:
        s = r["spec"]
        label = f"{LABELS.get(s['strategy'], s['strategy'])}, warm-up {s['warmup']} ({s['status']})"
        steps, loss = _series(r, "loss")
        line, = axes[0].plot(steps, loss, linewidth=0.5, alpha=0.35)
        k = min(20, len(loss))  # per-batch losses are noisy: draw their 20-step moving average
        if k:
            smooth = np.convolve(loss, np.ones(k) / k, mode="valid")
            axes[0].plot(steps[k - 1:], smooth, color=line.get_color(), linewidth=1.6, label=label)
        axes[1].plot(*_series(r, "dev_loss"), marker="o", label=label)
    if part2 and "unigram_dev_loss" in part2[0]["spec"]:
        axes[1].axhline(part2[0]["spec"]["unigram_dev_loss"], color="grey", linestyle="--",
                        label="unigram baseline (stuck)")
    d = part2[0]["spec"]["depth"] if part2 else 0
    axes[0].set_title(f"{d}L-{d}L training loss (20-step moving average)")
    axes[0].legend(fontsize=7)
    axes[1].set_title(f"{d}L-{d}L dev loss")
    for ax in axes:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _at(result: dict, key: str, step: int) -> float | None:
    for r in result["rows"]:
        if r["step"] == step and key in r:
            return r[key]
    return None


def part1_tables(part1: list[dict]) -> list[str]:
    strategies = list(dict.fromkeys(r["spec"]["strategy"] for r in part1))
    depths = sorted({r["spec"]["depth"] for r in part1})
    last = max(r["spec"]["steps"] for r in part1)
    early = min((s for s in (10, last) if s <= last), default=last)
    by = {(r["spec"]["strategy"], r["spec"]["depth"]): r for r in part1}
    head = "| strategy | " + " | ".join(f"{d}L-{d}L" for d in depths) + f" | {depths[-1]}L / {depths[0]}L |"
    rule = "|---|" + "---|" * (len(depths) + 1)
    lines = [f"‖ΔF‖ at step {early} / at step {last}:", "", head, rule]
    verdicts = []
    for s in strategies:
        cells, finals = [], []
        for d in depths:
            r = by.get((s, d))
            a, b = (_at(r, "delta_f", early), _at(r, "delta_f", last)) if r else (None, None)
            cells.append(f"{_fmt(a)} / {_fmt(b)}")
            finals.append(b)
        ratio = finals[-1] / finals[0] if finals[0] and finals[-1] is not None else None
        lines.append(f"| {LABELS.get(s, s)} | " + " | ".join(cells) + f" | {_fmt(ratio)} |")
        grows = all(x is not None for x in finals) and all(b > a for a, b in zip(finals, finals[1:]))
        trend = "increases with every depth step" if grows else "does not increase monotonically with depth"
        verdicts.append(f"- {LABELS.get(s, s)}: ‖ΔF‖ at step {last} {trend} ({' → '.join(_fmt(x) for x in finals)}).")
    lines += ["", "Largest residual LayerNorm input ‖x‖₂ over all layers at step "
              f"{last} (√d = 8 for d = 64):", "", head.replace(f" | {depths[-1]}L / {depths[0]}L |", " |"),
              "|---|" + "---|" * len(depths)]
    for s in strategies:
        cells = [_fmt(_at(by[(s, d)], "ln_input_max", last)) if (s, d) in by else "—" for d in depths]
        lines.append(f"| {LABELS.get(s, s)} | " + " | ".join(cells) + " |")
    lines += ["", f"Gradient norm of the last decoder layer at step 1 / step {last} (cf. the paper's Fig. 2):", "",
              head.replace(f" | {depths[-1]}L / {depths[0]}L |", " |"), "|---|" + "---|" * len(depths)]
    for s in strategies:
        grad = lambda d, step: _fmt(_at(by[(s, d)], "layer_grad_dec_last", step))  # noqa: E731
        cells = [f"{grad(d, 1)} / {grad(d, last)}" if (s, d) in by else "—" for d in depths]
        lines.append(f"| {LABELS.get(s, s)} | " + " | ".join(cells) + " |")
    return lines + ["", "Measured trend:", ""] + verdicts


def part2_table(part2: list[dict]) -> list[str]:
    lines = ["| model | warm-up | outcome | diverged at | train loss (mean of last 20 steps) | dev loss | "
             "unigram baseline | max ‖ΔF‖ | max LN input |", "|---|---|---|---|---|---|---|---|---|"]
    for r in part2:
        s = r["spec"]
        losses = [x["loss"] for x in r["rows"] if "loss" in x][-20:]
        mean_loss = sum(losses) / len(losses) if losses else None
        deltas = [x["delta_f"] for x in r["rows"] if "delta_f" in x and math.isfinite(x["delta_f"])]
        lns = [x["ln_input_max"] for x in r["rows"] if "ln_input_max" in x and math.isfinite(x["ln_input_max"])]
        lines.append(f"| {s['depth']}L-{s['depth']}L {LABELS.get(s['strategy'], s['strategy'])} | {s['warmup']} | "
                     f"{s['status']} | {s['diverged_at'] or '—'} | {_fmt(mean_loss)}"
                     f" | {_fmt(s.get('final_dev_loss'))} | {_fmt(s.get('unigram_dev_loss'))} | "
                     f"{_fmt(max(deltas) if deltas else None)} | {_fmt(max(lns) if lns else None)} |")
    return lines


def _number(text: str):
    if text == "":
        return None
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def load_results(out: str) -> tuple[list[dict], dict]:
    """The results and run metadata of an earlier run, read back from its CSVs and meta.json."""
    def rows(name: str) -> list[dict]:
        with open(os.path.join(out, name), newline="") as f:
            return [{k: _number(v) for k, v in row.items() if v != ""} for row in csv.DictReader(f)]

    with open(os.path.join(out, "meta.json")) as f:
        meta = json.load(f)
    measured = {1: rows("update_norms.csv"), 2: rows("long_runs.csv")}
    results = []
    for spec in rows("runs.csv"):
        spec.setdefault("diverged_at", None)
        key = (spec["strategy"], spec["depth"], spec["warmup"])
        mine = [r for r in measured[spec["part"]] if (r["strategy"], r["depth"], r["warmup"]) == key]
        results.append({"spec": spec, "rows": [{k: v for k, v in r.items() if k not in ("strategy", "depth", "warmup")}
                                               for r in mine]})
    return results, meta


def write_outputs(results: list[dict], out: str, wall: float, command: str, workers: int) -> list[str]:
    """Write everything under `out`; return the paths written."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "meta.json"), "w") as f:
        json.dump({"command": command, "wall_seconds": wall, "workers": workers}, f, indent=2)
    part1 = [r for r in results if r["spec"]["part"] == 1]
    part2 = [r for r in results if r["spec"]["part"] == 2]
    paths = {name: os.path.join(out, name) for name in
             ("update_norms.csv", "long_runs.csv", "runs.csv", "meta.json", "fig4_update_norms.png", "long_runs.png",
              "results.md")}
    flat = lambda rs: [{"strategy": r["spec"]["strategy"], "depth": r["spec"]["depth"],  # noqa: E731
                        "warmup": r["spec"]["warmup"], **row} for r in rs for row in r["rows"]]
    _write_csv(paths["update_norms.csv"], flat(part1))
    _write_csv(paths["long_runs.csv"], flat(part2))
    _write_csv(paths["runs.csv"], [{k: v for k, v in r["spec"].items() if k not in ("measure_at", "extra")}
                                   for r in results])
    plot_part1(part1, paths["fig4_update_norms.png"])
    plot_part2(part2, paths["long_runs.png"])
    cpu = sum(r["spec"]["seconds"] for r in results)
    md = ["# update-norms: results", "", f"Made by `{command}` in {wall / 60:.1f} min wall-clock "
          f"({cpu / 60:.1f} min of single-thread run time on {count(workers, 'worker')}). Written by the command; "
          "see docs/update-norms.md for the discussion.", "",
          "## Part 1: model update at the start of training (Fig. 4)", "",
          "![Fig. 4](fig4_update_norms.png)", ""]
    md += part1_tables(part1)
    md += ["", "## Part 2: longer training of deep models (Tables I and XI)", "", "![long runs](long_runs.png)", ""]
    md += part2_table(part2)
    md += ["", "Outcome: *diverged* = non-finite loss or gradient; *stalled* = final dev loss not at least "
           "0.1 below the unigram baseline (a model that predicts target-token frequencies, i.e. stuck "
           "in the spurious optimum the paper describes); *trains* otherwise.", ""]
    with open(paths["results.md"], "w") as f:
        f.write("\n".join(md))
    return list(paths.values())


# ---- the seeds study (`--study seeds`) ---------------------------------------------------------
SEED_QUANTITIES = {"delta_f": "‖ΔF‖, decoder output, RMS per target token",
                   "delta_f_total": "‖ΔF‖, decoder output, total Frobenius norm (eq. 1)",
                   "delta_enc": "‖ΔF_enc‖, encoder output, RMS per source token"}


def _stats(values: list[float]) -> tuple[float, float, float, float]:
    """mean, sample std, min, max."""
    a = np.array(values, dtype=float)
    return float(a.mean()), float(a.std(ddof=1)) if len(a) > 1 else 0.0, float(a.min()), float(a.max())


def _seed_values(results: list[dict], optimizer: str, strategy: str, depth: int, key: str, step: int) -> list[float]:
    return [v for r in results for v in [_at(r, key, step)] if v is not None and r["spec"]["optimizer"] == optimizer
            and r["spec"]["strategy"] == strategy and r["spec"]["depth"] == depth]


def seed_summary(results: list[dict]) -> list[dict]:
    """One row per optimizer, strategy, depth, step and quantity: mean, std, min, max over seeds."""
    rows = []
    keys = sorted({(r["spec"]["optimizer"], r["spec"]["strategy"], r["spec"]["depth"]) for r in results})
    steps = sorted({row["step"] for r in results for row in r["rows"] if "delta_f" in row})
    for optimizer, strategy, depth in keys:
        for step in steps:
            for q in SEED_QUANTITIES:
                values = _seed_values(results, optimizer, strategy, depth, q, step)
                if values:
                    mean, std, lo, hi = _stats(values)
                    rows.append({"optimizer": optimizer, "strategy": strategy, "depth": depth, "step": step,
                                 "quantity": q, "seeds": len(values), "mean": mean, "std": std, "min": lo, "max": hi})
    return rows


def plot_seeds(results: list[dict], path: str, step: int) -> None:
    """‖ΔF‖ at `step` against depth (log-log), mean ± std over seeds and every seed as a dot."""
    optimizers = list(dict.fromkeys(r["spec"]["optimizer"] for r in results))
    fig, axes = plt.subplots(len(SEED_QUANTITIES) - 1, len(optimizers), figsize=(5 * len(optimizers), 7.5),
                             squeeze=False)
    for col, optimizer in enumerate(optimizers):
        for row, q in enumerate(k for k in SEED_QUANTITIES if k != "delta_f_total"):
            ax = axes[row, col]
            for strategy in dict.fromkeys(r["spec"]["strategy"] for r in results):
                depths = sorted({r["spec"]["depth"] for r in results if r["spec"]["strategy"] == strategy
                                 and _seed_values(results, optimizer, strategy, r["spec"]["depth"], q, step)})
                stats = [_stats(_seed_values(results, optimizer, strategy, d, q, step)) for d in depths]
                line = ax.errorbar(depths, [s[0] for s in stats], yerr=[s[1] for s in stats], marker="o",
                                   capsize=3, label=LABELS.get(strategy, strategy))
                for d in depths:
                    vals = _seed_values(results, optimizer, strategy, d, q, step)
                    ax.scatter([d] * len(vals), vals, s=8, color=line[0].get_color(), alpha=0.5)
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xticks(depths, [f"{d}L" for d in depths])
            ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
            ax.set_title(f"{optimizer.upper() if optimizer == 'sgd' else 'AdamW'}: {SEED_QUANTITIES[q]}", fontsize=8)
            ax.set_xlabel("depth (NL-NL)")
            ax.grid(alpha=0.3, which="both")
            ax.legend(fontsize=7)
    fig.suptitle(f"Update at step {step} against depth: mean ± std over seeds (dots: single seeds)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def seed_tables(results: list[dict], step: int) -> list[str]:
    lines = []
    depths = sorted({r["spec"]["depth"] for r in results})
    seeds = sorted({r["spec"]["seed"] for r in results})
    for q, title in SEED_QUANTITIES.items():
        lines += [f"### {title}, step {step}", "", "mean ± std over seeds " + ", ".join(map(str, seeds))
                  + f"; ratio: {depths[-1]}L / {depths[0]}L per seed, mean ± std (min–max); slope: least-squares "
                  "exponent k of ‖ΔF‖ ∝ N^k over the depths, per seed, mean ± std", "",
                  "| optimizer | strategy | " + " | ".join(f"{d}L-{d}L" for d in depths) + " | ratio | slope |",
                  "|---|---|" + "---|" * (len(depths) + 2)]
        for optimizer in dict.fromkeys(r["spec"]["optimizer"] for r in results):
            for strategy in dict.fromkeys(r["spec"]["strategy"] for r in results):
                cells = []
                for d in depths:
                    v = _seed_values(results, optimizer, strategy, d, q, step)
                    few = f" (n={len(v)})" if 0 < len(v) < len(seeds) else ""
                    cells.append(f"{_fmt(_stats(v)[0])} ± {_fmt(_stats(v)[1], 2)}{few}" if v else "—")
                ratios, slopes = [], []
                for seed in seeds:
                    pick = {r["spec"]["depth"]: _at(r, q, step) for r in results if r["spec"]["seed"] == seed
                            and r["spec"]["optimizer"] == optimizer and r["spec"]["strategy"] == strategy}
                    if pick.get(depths[0]) and pick.get(depths[-1]) is not None:
                        ratios.append(pick[depths[-1]] / pick[depths[0]])
                    have = [d for d in depths if pick.get(d)]
                    if len(have) >= 2:
                        slopes.append(float(np.polyfit(np.log(have), np.log([pick[d] for d in have]), 1)[0]))
                ratio = (f"{_fmt(_stats(ratios)[0])} ± {_fmt(_stats(ratios)[1], 2)} ({_fmt(min(ratios))}–"
                         f"{_fmt(max(ratios))}), n={len(ratios)}") if ratios else "—"
                slope = f"{_stats(slopes)[0]:.2f} ± {_stats(slopes)[1]:.2f}" if slopes else "—"
                name = "SGD" if optimizer == "sgd" else "AdamW"
                lines.append(f"| {name} | {LABELS.get(strategy, strategy)} | " + " | ".join(cells)
                             + f" | {ratio} | {slope} |")
        lines.append("")
    return lines


def write_seed_outputs(results: list[dict], out: str, meta: dict) -> list[str]:
    os.makedirs(out, exist_ok=True)
    paths = {n: os.path.join(out, n) for n in ("seeds.csv", "seeds_summary.csv", "fig4_seeds.png",
                                                "fig4_seeds_step10.png", "results.md", "meta.json")}
    with open(paths["meta.json"], "w") as f:
        json.dump(meta, f, indent=2)
    _write_csv(paths["seeds.csv"], [{"optimizer": r["spec"]["optimizer"], "strategy": r["spec"]["strategy"],
                                     "depth": r["spec"]["depth"], "seed": r["spec"]["seed"], **row}
                                    for r in results for row in r["rows"]])
    _write_csv(paths["seeds_summary.csv"], seed_summary(results))
    last = max(r["spec"]["steps"] for r in results)
    plot_seeds(results, paths["fig4_seeds.png"], last)
    plot_seeds(results, paths["fig4_seeds_step10.png"], min(10, last))
    cpu = sum(r["spec"]["seconds"] for r in results)
    cpu_time = sum(r["spec"].get("cpu_seconds", 0.0) for r in results)
    if meta["wall_seconds"] is None:
        made = (f"Written by `{meta['command']}` from the {len(results)} of {count(meta['runs_planned'], 'run')} finished so far "
                f"(each run's own wall time, summed: {cpu / 60:.1f} min, CPU time {cpu_time / 60:.1f} min; single-thread "
                "workers on a shared machine). ")
    else:
        made = (f"Made by `{meta['command']}` in {meta['wall_seconds'] / 60:.1f} min wall-clock on "
                f"{count(meta['workers'], 'worker')} ({meta['kept_from_earlier']} of {count(len(results), 'run')} kept from an earlier, interrupted "
                f"invocation; {cpu / 60:.1f} min of summed per-run wall time, {cpu_time / 60:.1f} min of CPU time; load average {meta['load_start']:.1f} → "
                f"{meta['load_end']:.1f}). ")
    md = ["# update-norms --study seeds: results", "",
          made + "Seeds differ in the weights and the data order. See docs/update-norms.md for the discussion.", "",
          f"![step {last}](fig4_seeds.png)", ""]
    md += seed_tables(results, min(10, last)) + seed_tables(results, last)
    with open(paths["results.md"], "w") as f:
        f.write("\n".join(md) + "\n")
    return list(paths.values())
