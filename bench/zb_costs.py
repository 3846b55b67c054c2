"""F, B and W seconds per layer kind on this device: the costs the zero-bubble replay
(bench/zb_replay.py) and the planner (planner/zb.py) put on a schedule.

    ./run.sh bench schedules --measure-costs [--model deepnet-100-100-1024] [--d-model 1024]
                             [--sequences 32 --seq-len 128] [--precision bf16] [--modes eager,compiled]
                             [--timed 4] [--repeats 3] [--out DIR]

One pipeline layer of each kind, built as the pipeline builds it (parallel/pipeline.py
`layer_specs`): the embedding, an encoder layer, a decoder layer, and the output layer with its
chunked loss (parallel/loss.py). Each kind is timed twice: as ZB-H1 runs it, its backward split by
parallel/weight_split.py (F; B, the input gradient with every gradient ZB-H1 keeps in B; W, the
deferred matmul weight gradients), and as 1F1B runs it, unsplit (F_1f1b, BW). `compiled` compiles
the encoder and decoder layers as the trainer does (parallel/compiled.py `compile_layers`; the split
layers then break their graphs at each split linear, which the split's timings include).

Timing: `--timed` micro-batches go through all forwards, then all B, then all W, the device
synchronised around each phase only (a phase's kernels queue as they do in training); per phase
the median over `--repeats` rounds after two warm-up rounds, divided by `--timed`: seconds per
micro-batch. On a GPU wall time; on the CPU process time of one thread (the engine's tuner uses the
same clocks, the launcher one thread per CPU rank).

The output layer's weight gradient is computed in the loss's forward and handed to the tied
embedding in its backward, so its W is 0 and its F holds three matmuls of the logits' size; the
embedding's lookup gradient is computed in B. Writes DIR/zb-costs.json (default
runs/zb-costs) and DIR/zb-costs.md as soon as a mode is measured for every kind (the modes in the
order given), and with `python -m bench.zb_costs ... --jsonl FILE` appends each kind's costs to FILE
as one JSON line the moment they are measured (the GPU check: bench/gpu_results.py `cost_file`).
"""
from __future__ import annotations

import dataclasses
import os
import statistics
import subprocess
import time

KINDS = ("embed", "encoder", "decoder", "output")
DEFAULT_MODEL = "deepnet-100-100-1024"


def scaled_model(name: str, d_model: int | None):
    """The model section of configs/<name>.yaml (or a YAML path), at width `d_model` when given:
    FFN 4·d and d/64 heads (at least 1), as the paper's models are shaped."""
    from planner.planner import named_model
    from trainer.config import load_config

    if os.path.isfile(name):
        cfg = load_config(name).model
        cfg.vocab_size = cfg.vocab_size or load_config(name).data.vocab_size
    else:
        cfg = named_model(name)
    if d_model:
        cfg = dataclasses.replace(cfg, d_model=d_model, ffn_dim=4 * d_model, heads=max(1, d_model // 64))
    return cfg


def config_max_tokens(name: str) -> int:
    """data.max_tokens of configs/<name>.yaml (or a YAML path): a micro-batch's size in the config."""
    import yaml

    from planner.planner import CONFIG_DIR

    path = name if os.path.isfile(name) else os.path.join(CONFIG_DIR, f"{name}.yaml")
    with open(path) as f:
        return int(((yaml.safe_load(f) or {}).get("data") or {}).get("max_tokens", 4096))


def _batch(cfg, sequences: int, src_len: int, tgt_len: int, device, generator):
    """Token ids of one micro-batch (no padding: every pair is full length), and its target."""
    import torch

    def ids(length: int):
        return torch.randint(4, cfg.vocab_size, (sequences, length), generator=generator).to(device)

    return ids(src_len), ids(tgt_len), ids(tgt_len)


class _Kind:
    """One pipeline layer of a kind, split (ZB-H1) or not (1F1B), and how to feed it."""

    def __init__(self, cfg, kind: str, dtype, device, split: bool, compiled: bool):
        from parallel.pipeline import layer_specs
        from parallel.weight_split import WeightGradStore, split_weight_gradients

        specs = layer_specs(cfg, seed=1)
        names = {"embed": "EmbedPipe", "encoder": "EncoderPipe", "decoder": "DecoderPipe"}
        spec = specs[-1] if kind == "output" else next(s for s in specs if s.typename.__name__ == names[kind])
        self.kind, self.cfg, self.dtype, self.device = kind, cfg, dtype, device
        self.module = spec.build().to(device=device, dtype=dtype).train()
        self.forward_fn = getattr(spec, "forward_fn", None)  # the output layer's (output_states)
        self.store = WeightGradStore() if split else None
        if split:
            split_weight_gradients(self.module, self.store)
        if compiled:
            from parallel.compiled import compile_layers

            compile_layers(self.module)

    def inputs(self, batch) -> tuple:
        """What the layer receives in the pipeline: token ids (embedding) or the in-stage flow."""
        import torch

        from model.layers import padding_mask

        src, tgt_in, _ = batch
        if self.kind == "embed":
            return (src, tgt_in)
        shape = (src.size(0), src.size(1) + tgt_in.size(1), self.cfg.d_model)
        h = torch.randn(shape, device=self.device, dtype=self.dtype)
        enc, dec = (t.contiguous().requires_grad_() for t in h.split([src.size(1), tgt_in.size(1)], dim=1))
        return (enc, dec, src, tgt_in, padding_mask(src, self.cfg.pad_id, self.dtype))

    def forward(self, x, batch) -> tuple[list, list | None]:
        """The tensors backward starts from and their gradients (None: a loss)."""
        import torch

        from parallel.loss import tied_output_loss_sum

        if self.kind == "output":
            states = self.forward_fn(self.module, x)
            target = batch[2]
            loss = tied_output_loss_sum(states, target, self.cfg.pad_id, self.cfg.label_smoothing)
            return [loss * (1.0 / target.numel())], None
        out = self.module(x)
        streams = {"embed": list(out[:2]), "encoder": [out[0]], "decoder": [out[1]]}[self.kind]
        return streams, [torch.randn_like(t) for t in streams]

    def backward(self, outputs, grads, micro_batch: int) -> None:
        import contextlib

        import torch

        collect = self.store.collect(micro_batch) if self.store is not None else contextlib.nullcontext()
        with collect:
            torch.autograd.backward(outputs, grads)

    def weight_pass(self, micro_batch: int) -> None:
        if self.store is not None:
            self.store.run(micro_batch)

    def clear(self) -> None:
        for p in self.module.parameters():
            p.grad = None


def _phase(clock, sync, work) -> float:
    sync()
    start = clock()
    work()
    sync()
    return clock() - start


def time_kind(cfg, kind: str, dtype, device, compiled: bool, batch_shape: tuple[int, int, int], timed: int,
              repeats: int, warmup: int = 2) -> dict[str, float]:
    """Seconds per micro-batch of F, B, W (split, as ZB-H1 runs the layer) and F_1f1b, BW (unsplit)."""
    import torch

    from runtime import accelerator

    clock = time.process_time if accelerator.on_host() else time.perf_counter
    sync = accelerator.synchronize
    generator = torch.Generator().manual_seed(7)
    batch = _batch(cfg, *batch_shape, device, generator)
    out: dict[str, float] = {}
    for split in (True, False):
        layer = _Kind(cfg, kind, dtype, device, split, compiled)
        rounds: dict[str, list[float]] = {"F": [], "B": [], "W": []}
        for r in range(warmup + repeats):
            xs = [layer.inputs(batch) for _ in range(timed)]
            results = []
            f = _phase(clock, sync, lambda: results.extend(layer.forward(x, batch) for x in xs))
            b = _phase(clock, sync, lambda: [layer.backward(o, g, k) for k, (o, g) in enumerate(results)])
            w = _phase(clock, sync, lambda: [layer.weight_pass(k) for k in range(timed)])
            results = xs = None  # this round's tensors go before the next round's
            layer.clear()
            if r >= warmup:
                for key, value in (("F", f), ("B", b), ("W", w)):
                    rounds[key].append(value / timed)
        med = {k: statistics.median(v) for k, v in rounds.items()}
        if split:
            out.update(F=med["F"], B=med["B"], W=med["W"])
        else:
            out.update(F_1f1b=med["F"], BW=med["B"] + med["W"])
        layer = None
    return out


def measure(cfg, precision: str, sequences: int, src_len: int, tgt_len: int, modes: list[str], timed: int = 4,
            repeats: int = 3, log=print, kept=None) -> dict:
    """The cost file's content: per mode and layer kind, seconds per micro-batch (module docstring).
    `kept(result, mode, kind)` is called after each kind is measured (the result so far)."""
    import torch

    from parallel import compiled
    from parallel.precision import precision_of
    from runtime import accelerator

    dtype = precision_of(precision).dtype
    device = accelerator.device()
    if accelerator.on_host():
        # One thread, as each training rank on a CPU runs (launcher): process time counts every
        # thread, and OpenMP threads spinning on a shared machine would count as the layer's.
        torch.set_num_threads(1)
    cfg = dataclasses.replace(cfg, max_positions=max(cfg.max_positions, src_len + 2, tgt_len + 2))
    result = {"device": accelerator.HOST if accelerator.on_host() else accelerator.gpu_name(),
              "precision": precision, "model": dataclasses.asdict(cfg),
              "micro_batch": {"sequences": sequences, "src_len": src_len, "tgt_len": tgt_len},
              "timed": timed, "repeats": repeats, "versions": accelerator.versions(), "commit": _commit(),
              "modes": {}}
    for mode in modes:
        result["modes"][mode] = {}
        for kind in KINDS:
            start = time.perf_counter()
            costs = time_kind(cfg, kind, dtype, device, mode == "compiled" and kind in ("encoder", "decoder"),
                              (sequences, src_len, tgt_len), timed, repeats)
            result["modes"][mode][kind] = costs
            if mode == "compiled":
                result["compile"] = compiled.summary()
            log(f"  {mode} {kind}: " + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in costs.items())
                + f" ({time.perf_counter() - start:.1f} s)")
            if kept is not None:
                kept(result, mode, kind)
    return result


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__)))).stdout.strip()
    except OSError:
        return ""


def markdown(costs: dict) -> str:
    mb = costs["micro_batch"]
    m = costs["model"]
    lines = [f"F, B, W per layer kind on {costs['device']}, {costs['precision']}, d = {m['d_model']}, FFN {m['ffn_dim']}, "
             f"{m['heads']} heads, vocabulary {m['vocab_size']}; micro-batch {mb['sequences']} × "
             f"({mb['src_len']} + {mb['tgt_len']}) tokens; ms per micro-batch (median of {costs['repeats']} rounds of "
             f"{costs['timed']}); commit {costs['commit']}.", "",
             "| mode | kind | F | B | W | W / (F + B) | F_1f1b | BW (1F1B) | split / unsplit |", "|---" * 9 + "|"]
    for mode, kinds in costs["modes"].items():
        for kind, c in kinds.items():
            fb = c["F"] + c["B"]
            lines.append(f"| {mode} | {kind} | {c['F'] * 1e3:.3f} | {c['B'] * 1e3:.3f} | {c['W'] * 1e3:.3f} | "
                         f"{c['W'] / fb if fb else 0:.2f} | {c['F_1f1b'] * 1e3:.3f} | {c['BW'] * 1e3:.3f} | "
                         f"{(fb + c['W']) / (c['F_1f1b'] + c['BW']):.2f} |")
    return "\n".join(lines) + "\n"


def run(args) -> int:
    """`--measure-costs`: measure and write OUT/zb-costs.{json,md}."""
    from parallel.precision import precision_of
    from runtime import accelerator

    cfg = scaled_model(args.model, args.d_model)
    if args.sequences is None:
        args.sequences = max(1, config_max_tokens(args.model) // args.seq_len)
    precision = args.precision or ("fp32" if accelerator.on_host() else "bf16")
    if not accelerator.supports(precision_of(precision).dtype):
        print(f"error: --precision {precision}: this accelerator does not train in it", flush=True)
        return 2
    modes = [m for m in args.measure_costs.split(",") if m]
    if not modes or set(modes) - {"eager", "compiled"}:
        print(f"error: --measure-costs {args.measure_costs}: modes are eager and compiled", flush=True)
        return 2
    print(f"measuring F, B, W per layer kind at d = {cfg.d_model} ({', '.join(modes)}) ...", flush=True)
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    name = os.path.splitext(os.path.basename(args.model))[0]
    jsonl = getattr(args, "jsonl", None)

    def kept(result: dict, mode: str, kind: str) -> None:
        """Each kind as it is measured: a JSON line (--jsonl), and the files rewritten with every
        mode measured for all kinds (what the replay and the planner can use)."""
        from bench.gpu_results import append_jsonl, write_json

        meta = {k: v for k, v in result.items() if k != "modes"}
        meta["model_name"] = name
        if jsonl:
            append_jsonl(jsonl, {"part": "costs", "meta": meta, "mode": mode, "kind": kind,
                                 "costs": result["modes"][mode][kind]})
        complete = {m: c for m, c in result["modes"].items() if set(KINDS) <= set(c)}
        if complete:
            write_json(os.path.join(out, "zb-costs.json"), {**meta, "modes": complete})
            with open(os.path.join(out, "zb-costs.md"), "w") as f:
                f.write(markdown({**meta, "modes": complete}))

    costs = measure(cfg, precision, args.sequences, args.seq_len, args.seq_len, modes, args.timed, args.repeats,
                    kept=kept)
    costs["model_name"] = name
    print(markdown(costs), flush=True)
    print(f"wrote {out}/zb-costs.json, zb-costs.md")
    return 0


def add_arguments(parser, note: str = "") -> None:
    """The measurement's options, for this module's command and for `./run.sh bench schedules
    --measure-costs` (`note` prefixes their help there)."""
    parser.add_argument("--model", default=DEFAULT_MODEL, help=f"{note}a config name or YAML path")
    parser.add_argument("--d-model", type=int, help=f"{note}this width (FFN 4·d, d/64 heads) instead of the model's")
    parser.add_argument("--sequences", type=int,
                        help=f"{note}pairs per micro-batch (default: the config's data.max_tokens / --seq-len)")
    parser.add_argument("--seq-len", type=int, default=128, help=f"{note}tokens per source and target sentence")
    parser.add_argument("--precision", help=f"{note}fp32 | bf16 | fp16 (default bf16 on GPUs, fp32 on CPUs)")
    parser.add_argument("--timed", type=int, default=4, help=f"{note}micro-batches per timed phase")
    parser.add_argument("--repeats", type=int, default=3, help=f"{note}timed rounds (the median counts)")


def main(argv: list[str] | None = None) -> int:
    """`python -m bench.zb_costs`: `--measure-costs` alone, with --jsonl (the GPU check's way in)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m bench.zb_costs", description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default="compiled,eager", help="eager, compiled or both, in this order")
    add_arguments(parser)
    parser.add_argument("--out", default="runs/zb-costs", help="output folder")
    parser.add_argument("--jsonl", help="append each kind's costs to this file as one JSON line")
    args = parser.parse_args(argv)
    args.measure_costs = args.modes
    return run(args)


if __name__ == "__main__":
    import sys

    sys.exit(main())
