"""summary.md of the GPU check (gpucheck/check.py): what ran, what was cut, the command that runs
just the missing parts, the first number and the numbers against the goals (docs/gpu-check.md
says how to read them). Standard library only, apart from planner/devices.py's estimate."""
from __future__ import annotations

import math

from bench import gpu_results as results

FIRST = ("layers-d1024", "compiled", 4096)
"""The first number: compiled d = 1024 stage layers at 4k target tokens per micro-batch."""
GOALS = {8192: 0.40, 4096: 0.30}
"""MFU of the d = 1024 layers, compiled, by target tokens per micro-batch (the product's goals)."""
REHEARSAL_FIRST = ("tiny", "compiled", 256)


def _row(train: list[dict], shape: str, variant: str, tokens: int) -> tuple[dict | None, dict | None]:
    for r in train:
        if r["shape"] == shape and r["variant"] == variant:
            for row in r["rows"]:
                if row["target_tokens_per_micro_batch"] == tokens:
                    return r, row
    return None, None


def _pct(x) -> str:
    return results.fmt(x, ".1%", "not measured")


def first_number(train: list[dict], rehearsal: bool) -> list[str]:
    shape, variant, tokens = REHEARSAL_FIRST if rehearsal else FIRST
    r, row = _row(train, shape, variant, tokens)
    if row is None:
        return [f"No first number: {shape} {variant} at {tokens} target tokens per micro-batch did not come back."]
    busy = row.get("gpu_busy_fraction")
    host = 1 - busy if isinstance(busy, float) and math.isfinite(busy) else None
    return [f"**{shape} {variant}, {tokens} target tokens per micro-batch: MFU {_pct(row.get('mfu'))}, GPU busy "
            f"{_pct(busy)} (host-bound {_pct(host)}), {results.fmt(row.get('target_tokens_per_s'), ',.0f')} target "
            f"tokens/s, {results.fmt(row.get('host_syncs_per_step'))} host syncs per step (CUDA's sync debug mode: "
            f"{results.fmt(row.get('sync_debug_mode_per_step'), '', 'not on a GPU')}); written "
            f"{results.fmt(row.get('seconds_since_start'), '.0f')} s after its setup began** (first step "
            f"{results.fmt(row.get('first_step_seconds'), '.1f')} s, compile included)."]


def goals(train: list[dict], ops: dict) -> list[str]:
    lines = ["| goal | measured | |", "|---|---|---|"]
    for tokens, goal in sorted(GOALS.items(), reverse=True):
        _, row = _row(train, "layers-d1024", "compiled", tokens)
        mfu = row.get("mfu") if row else None
        verdict = "—" if mfu is None else ("met" if mfu >= goal else "not met")
        lines.append(f"| MFU ≥ {goal:.0%} at {tokens // 1024}k tokens, d = 1024 layers, compiled | {_pct(mfu)} | {verdict} |")
    for tokens in (4096, 8192):
        for variant in ("compiled", "eager"):
            _, row = _row(train, "layers-d1024", variant, tokens)
            busy = row.get("gpu_busy_fraction") if row else None
            host = 1 - busy if isinstance(busy, float) and math.isfinite(busy) else None
            lines.append(f"| host-bound fraction at {tokens // 1024}k, {variant} (1 − GPU busy; small: the GPU "
                         f"is fed) | {_pct(host)} | |")
    syncs = ops.get("syncs_pp1", {}).get("ranks", [{}])[0]
    lines.append(f"| 1 host sync per step on the GPU, 0 per micro-batch (pp = 1) | "
                 f"{syncs.get('per_step', 'not measured')} per step, {syncs.get('per_microbatch', '—')} per "
                 f"micro-batch; sync debug mode {syncs.get('sync_debug_mode_per_step', '—')} | "
                 f"{'met' if syncs.get('per_step') == 1.0 and syncs.get('per_microbatch') == 0.0 else '—'} |")
    from planner.devices import estimated_efficiency

    for tokens in (2048, 4096, 8192):
        _, row = _row(train, "layers-d1024", "compiled", tokens)
        estimate = f"estimate {estimated_efficiency(1024, tokens):.0%}"
        lines.append(f"| planner basis: kernel efficiency, d = 1024, {tokens // 1024}k ({estimate}) | "
                     f"{_pct(row.get('kernel_efficiency') if row else None)} | train.json → "
                     "docs/bench/gpu-<type>/train.json |")
    return lines


def compilation(train: list[dict], ops: dict) -> list[str]:
    lines = ["| measurement | compile s per kind (graphs) | cache hits / misses (inductor; AOTAutograd) | "
             "first step s |", "|---|---|---|---|"]
    for r in train:
        if r["variant"] != "compiled":
            continue
        kinds = ", ".join(f"{k} {v['seconds']:.1f} ({int(v['graphs'])})" for k, v in sorted(r.get("compile", {}).items()))
        c = r.get("compile_cache", {})
        depth = r.get("alpha_depth", ["?", "?"])
        lines.append(f"| {r['shape']} (α of {depth[0]}L-{depth[1]}L) | {kinds or '—'} | "
                     f"{c.get('inductor_fxgraph_cache_hit', 0)} / {c.get('inductor_fxgraph_cache_miss', 0)}; "
                     f"{c.get('aot_autograd_autograd_cache_hit', 0)} / {c.get('aot_autograd_autograd_cache_miss', 0)}"
                     f" | {results.fmt(r['rows'][0].get('first_step_seconds'), '.1f')} |")
    if "compilations_per_layer_kind" in ops:
        lines.append(f"| bench ops: varying shapes, a batch of one, evaluation | {ops['compile_seconds']} "
                     f"({ops['compilations_per_layer_kind']}); {ops['graph_breaks']} graph breaks | | |")
    return lines


def summary(header: dict, outcomes: list[dict], made: dict, order: list[str]) -> str:
    rehearsal = header["mode"].startswith("rehearsal")
    train, ops, costs = made.get("train", []), made.get("ops", {}), made.get("costs")
    done = sum(o.get("seconds", 0) for o in outcomes)
    scale = f", limits × {header['scale']}" if rehearsal else ""
    lines = [f"# GPU check: {header['mode']}, {header['started']}", "",
             f"Command: `gpucheck/gpu_check.sh {' '.join(header['argv'])}`; budget {header['budget']:.0f} s"
             f"{scale}; "
             f"{len(outcomes)} of {len(order)} parts decided, {done:.0f} s in parts.", "",
             "## First number", "", *first_number(train, rehearsal), "", "## Parts", "",
             "| part | outcome | seconds | CPU s | limit |", "|---|---|---|---|---|"]
    kept = {}
    for record in made.get("records", []):
        name = {"train": "train", "ops": "ops", "costs": "costs"}.get(record.get("part"))
        if name:
            kept[name] = kept.get(name, 0) + 1
    for o in outcomes:
        lines.append(f"| {o['name']} | {o['status']} | {o.get('seconds', '—')} | {o.get('cpu_seconds', '—')} | "
                     f"{o.get('limit', '—')} |")
    lines.append(f"\nRecords in results.jsonl by kind: {kept or 'none'}.")
    missing = [o["name"] for o in outcomes if o["status"] != "ok"] + order[len(outcomes):]
    if "replay" in missing and "costs" not in missing:  # the replay reads the costs of its own folder
        missing.insert(missing.index("replay"), "costs")
    if missing:
        lines += ["", f"Not complete: {', '.join(missing)}. Run just those (into another folder; "
                      "`python -m gpucheck.check OUT --merge A B` joins the two):", "",
                  f"    gpucheck/gpu_check.sh OUT2 --only {','.join(missing)}"
                  f"{' --rehearse' if rehearsal else ''}"]
    else:
        lines += ["", "Every part completed."]
    lines += ["", "## Against the goals", "", *goals(train, ops), "", "## Training", "", results.train_table(train),
              "## Compilation", "", *compilation(train, ops), ""]
    if ops.get("kernel_ops_per_layer"):
        lines += ["## Operations (bench ops)", "", "| layer kind | eager | compiled |", "|---|---|---|"]
        lines += [f"| {k} | {v['eager']} | {v.get('compiled', '—')} |" for k, v in ops["kernel_ops_per_layer"].items()]
        lines.append("")
    if "engine_ops_per_step" in ops:
        lines.append(f"Engine operations per step beyond the model: {ops['engine_ops_per_step']}.")
    for key in sorted(k for k in ops if k.startswith("syncs_pp")):
        ranks, where = ops[key]["ranks"], ops[key]["pp_ranks_on"]
        lines.append(f"Host syncs at pp = {key[len('syncs_pp'):]}" + (f" ({where})" if where else "") + ": " +
                     "; ".join(f"rank {i}: {r['per_microbatch']:g} per micro-batch, {r['per_step']:g} per step "
                               f"({r['host_copies_per_step']:g} of them copies to the device)"
                               for i, r in enumerate(ranks)) + ".")
    for o in outcomes:
        if o["name"] == "tests" and o.get("last_line"):
            lines.append(f"GPU suite (./run.sh test-gpu): {o['last_line']}")
    if costs:
        lines.append(f"Zero-bubble costs measured: {', '.join(costs['modes'])} (costs.json).")
    lines += timeline(ops)
    replays = [r["text"] for r in made.get("records", []) if r.get("part") == "replay"]
    if replays:
        lines += ["", "## Zero-bubble replay (bench/zb_replay.py on costs.json)", "", replays[-1].strip()]
    return "\n".join(lines) + "\n"


def timeline(ops: dict) -> list[str]:
    """The traced steps of the syncs and pp2 parts (bench ops' trace_pp<N>): syncs with the tracer on,
    and the pipelined one's bubble, whose timeline is trace.json."""
    lines = []
    for key in sorted(k for k in ops if k.startswith("trace_pp")):
        t, pp = ops[key], key[len("trace_pp"):]
        clock = "device events" if t.get("device_clock") else f"host clock, {t.get('device')}"
        lines.append(f"Traced step at pp = {pp} ({clock}" + (f"; {t['ranks_on']}" if t.get("ranks_on") else "") +
                     f"): {t['per_microbatch']:g} host syncs per micro-batch, {t['per_step']:g} in the step with the "
                     "tracer's own (its clock exchange, one read of the events after the step, the gather).")
        bubble = t.get("bubble")
        if bubble and pp != "1":
            row = (lambda values: " / ".join(f"{v:.3f}" for v in values))
            lines.append(f"Pipeline bubble per stage at pp = {pp}: {row(bubble['trace']['stage_bubble'])} in the trace, "
                         f"{row(bubble['simulator']['stage_bubble'])} simulated at its F, B, W costs; trace.json opens in "
                         "ui.perfetto.dev (Open trace file) or chrome://tracing.")
    return lines
