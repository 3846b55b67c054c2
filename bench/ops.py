"""`./run.sh bench ops`: what predicts a GPU step's host time, counted on any device.

    ./run.sh bench ops [CONFIG] [--set KEY=VALUE ...] [--batch 16 --src 24 --tgt 20] [--pp 2]
                       [--skip layers,engine,syncs,compiled] [--out DIR] [--jsonl FILE]

On a GPU the trainer's step is bound by the host: its time follows the number of kernels it
launches and the times it waits for the device, not its FLOPs. Counted here (bench/counting.py
has the rule), for the model of CONFIG (default configs/default.yaml):

  layers       kernel operations of one forward + backward per layer kind (embedding, encoder,
               decoder, output + loss), eager and compiled (parallel/compiled.py), on a batch of
               --batch sentence pairs × (--src + --tgt) tokens with padding, on the accelerator
               (bf16 on a GPU, fp32 on a CPU, there with the GPU's fused dropout:
               bench/counting.py `fused_dropout`)
  engine       the engine's operations per training step beyond the model (gradient
               accumulation, clipping, norms, optimizer, bookkeeping) in fp32 and bf16, at pp = 1
               in this process (`engine_ops_per_step`)
  syncs        host syncs per micro-batch and per step of the real trainer at pp = 1 (this
               process) and at --pp stages (one launch of that many ranks; where the machine has
               fewer GPUs than --pp, CPU ranks, and the result says so): reads of a value and
               blocking host-to-device copies (bench/counting.py), on a GPU also what the sync
               debug mode reports (bench/ops_syncs.py); then one more step of each, traced
               (trace_pp1, trace_pp<N>: its syncs inside the micro-batch instructions, which stay
               0, and its timeline, OUT/work/timeline-pp<N>.json and .png: trainer/timeline.py)
  compiled     graph breaks and graphs compiled per layer kind over micro-batches of varying
               shapes (training, a batch of one, then evaluation), and the seconds compiling took

Prints a table; writes OUT/bench.json (default runs/bench-ops) with the keys
kernel_ops_per_layer.{embedding,encoder,decoder,output}.{eager,compiled},
engine_ops_per_step.{fp32,bf16}, syncs_per_microbatch, syncs_per_step (the worst rank of
syncs_pp1 and syncs_pp<N>, each launch's ranks), graph_breaks, compilations_per_layer_kind (and the
details behind each), rewritten as each result comes; with
--jsonl each result is also appended there as one JSON line {"part": "ops", "result": {...}} (the
GPU check, gpucheck/check.py, merges them).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import time

from bench.gpu_results import append_jsonl, write_json
from bench.ops_syncs import engine_ops_per_step, launch_syncs, new_trainer, sync_counts, traced_step
from launcher.launch import DEFAULT_CONFIG, ROOT

SHAPES = [(8, 12, 10), (5, 17, 23), (12, 9, 9), (3, 30, 11), (8, 12, 10)]
"""(sentences, source, target) of the micro-batches the compilation check runs, in order."""


def _model(cfg):
    from model.config import ModelConfig

    model = dataclasses.replace(cfg.model, vocab_size=cfg.model.vocab_size or cfg.data.vocab_size)
    return ModelConfig(**{f.name: getattr(model, f.name) for f in dataclasses.fields(ModelConfig)})


def _inputs(model, batch: int, src_len: int, tgt_len: int, seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(seed)
    src = torch.randint(4, model.vocab_size, (batch, src_len), generator=g)
    tgt = torch.randint(4, model.vocab_size, (batch, tgt_len + 1), generator=g)
    for row in range(0, batch, 2):  # every other sentence padded, by a third
        src[row, src_len - src_len // 3:] = model.pad_id
        tgt[row, tgt_len - tgt_len // 3:] = model.pad_id
    return src, tgt[:, :-1].contiguous(), tgt[:, 1:].contiguous()


def placement():
    """(device, dtype) the counts run in: the accelerator's device, in bf16 on a GPU (as training
    runs there; the compiled graphs are those of training), fp32 on the host."""
    import torch

    from runtime import accelerator

    return accelerator.device(), torch.float32 if accelerator.on_host() else torch.bfloat16


class Kinds:
    """The four layer kinds of a stage as fwd + bwd closures on one batch (plain modules), on the
    accelerator's device (`placement`)."""

    def __init__(self, model, batch: int, src_len: int, tgt_len: int):
        import torch

        from model.layers import padding_mask
        from model.transformer import build_layer, smoothed_loss_sum

        torch.manual_seed(0)
        device, dtype = placement()
        self.model = model
        self.embed = build_layer(model, "embed").to(device=device, dtype=dtype).train()
        self.encoder = build_layer(model, "encoder").to(device=device, dtype=dtype).train()
        self.decoder = build_layer(model, "decoder").to(device=device, dtype=dtype).train()
        self.src, self.tgt_in, self.tgt_out = (t.to(device) for t in _inputs(model, batch, src_len, tgt_len))
        d = model.d_model
        self.enc = torch.randn(batch, src_len, d).to(device, dtype).requires_grad_()
        self.dec = torch.randn(batch, tgt_len, d).to(device, dtype).requires_grad_()
        pad = model.pad_id

        def embedding():
            mask = padding_mask(self.src, pad, self.embed.weight.dtype)
            return self.embed(self.src), self.embed(self.tgt_in), mask

        def output():
            logits = self.embed.logits(self.dec)
            return smoothed_loss_sum(logits, self.tgt_out, pad, model.label_smoothing)

        self.functions = {"embedding": embedding, "encoder": lambda mask: self.encoder(self.enc, mask),
                          "decoder": lambda mask: self.decoder(self.dec, self.enc, mask), "output": output}
        self.mask = padding_mask(self.src, pad, dtype)

    def step(self, kind: str, function=None, counter=None) -> None:
        """One forward and backward of `kind` (through `function` when given: a compiled one),
        counted by `counter` when given. The gradients start from None, as in a step's first
        micro-batch, and the output gradient is made before counting: neither is the layer's work."""
        import contextlib

        import torch

        for module in (self.embed, self.encoder, self.decoder):
            module.zero_grad(set_to_none=True)
        self.enc.grad = self.dec.grad = None
        fn = function or self.functions[kind]
        with counter or contextlib.nullcontext():
            out = fn(self.mask) if kind in ("encoder", "decoder") else fn()
        loss = out[0].sum() + out[1].sum() if kind == "embedding" else out
        grad = torch.ones_like(loss)
        with counter or contextlib.nullcontext():
            loss.backward(grad)


def count_layers(model, batch: int, src_len: int, tgt_len: int, compiled: bool) -> dict:
    """Kernel operations of one forward + backward per layer kind, eager and compiled."""
    import contextlib

    import torch

    from bench.counting import KernelCounter, fused_dropout
    from parallel import compiled as compiling
    from runtime import accelerator

    kinds = Kinds(model, batch, src_len, tgt_len)
    out = {}
    with fused_dropout() if accelerator.on_host() else contextlib.nullcontext():
        for kind in kinds.functions:
            kinds.step(kind)  # warm-up: lazy initialisation is not the layer's work
            eager = KernelCounter()
            kinds.step(kind, counter=eager)
            out[kind] = {"eager": eager.kernels, "eager_dispatched": eager.dispatched}
        if compiled:
            compiling.configure()
            for kind, fn in kinds.functions.items():
                module = {"encoder": kinds.encoder, "decoder": kinds.decoder}.get(kind)
                function = None
                if module is not None:
                    compiling.compile_layers(module)  # the trainer's way (nn.Module.compile)
                else:
                    function = torch.compile(fn, dynamic=True)
                kinds.step(kind, function)  # compiles
                kinds.step(kind, function)
                counter = KernelCounter()
                kinds.step(kind, function, counter)
                out[kind].update(compiled=counter.kernels, compiled_generated=counter.generated,
                                 compiled_dispatched=counter.dispatched)
    return out


def output_cost_ratio(model, tokens: int = 1024, repeats: int = 3) -> float:
    """Seconds of the output layer with its loss (parallel/loss.py, forward + backward) over those
    of its three matrix products alone (logits, and the gradients of the states and the weight);
    (ratio − 1)·6·d is model/flops.py's LOGIT_COST on this device. Best of `repeats`."""
    import torch

    from parallel.loss import output_loss_sum
    from runtime import accelerator

    device = accelerator.device()
    g = torch.Generator().manual_seed(0)
    h = torch.randn(tokens, model.d_model, generator=g).to(device).requires_grad_()
    weight = (torch.randn(model.vocab_size, model.d_model, generator=g) * model.d_model ** -0.5).to(device)
    weight.requires_grad_()
    target = torch.randint(4, model.vocab_size, (tokens,), generator=g).to(device)

    def products():
        z = h.detach() @ weight.detach().t()
        return z @ weight.detach(), z.t() @ h.detach()

    def loss():
        output_loss_sum(h, weight, target, model.pad_id, model.label_smoothing).backward()

    best = {}
    for name, fn in (("products", products), ("loss", loss)):
        fn()
        times = []
        for _ in range(repeats):
            accelerator.synchronize()
            start = time.perf_counter()
            fn()
            accelerator.synchronize()
            times.append(time.perf_counter() - start)
        best[name] = min(times)
    return best["loss"] / best["products"]


def compilations(model) -> dict:
    """Graphs compiled per layer kind and graph breaks over micro-batches of varying shapes in
    training (fwd + bwd), one of a single sentence (run eagerly), then two in evaluation."""
    import torch
    from torch._dynamo.utils import counters

    from model.layers import padding_mask
    from model.transformer import build_layer
    from parallel import compiled as compiling
    from parallel.compiled import run_layer

    torch.manual_seed(0)
    device, dtype = placement()
    enc_layer, dec_layer = (build_layer(model, kind).to(device=device, dtype=dtype) for kind in ("encoder", "decoder"))
    before = {kind: dict(s) for kind, s in compiling.stats.items()}
    breaks_before = sum(counters["graph_break"].values())
    compiling.compile_layers(torch.nn.ModuleList([enc_layer, dec_layer]))
    start = time.perf_counter()
    shapes = [*SHAPES, (1, 14, 12)]
    for training in (True, False):
        enc_layer.train(training)
        dec_layer.train(training)
        for batch, s, t in shapes if training else shapes[:2]:
            src = _inputs(model, batch, s, t)[0].to(device)
            mask = padding_mask(src, model.pad_id, dtype)
            x = torch.randn(batch, s, model.d_model).to(device, dtype).requires_grad_(training)
            y = torch.randn(batch, t, model.d_model).to(device, dtype).requires_grad_(training)
            with torch.set_grad_enabled(training):
                out = run_layer(enc_layer, x, mask).sum() + run_layer(dec_layer, y, x, mask).sum()
                if training:
                    out.backward()
    graphs = {kind: int(compiling.stats[kind]["graphs"] - before.get(kind, {}).get("graphs", 0))
              for kind in ("encoder", "decoder")}
    seconds = {kind: round(compiling.stats[kind]["seconds"] - before.get(kind, {}).get("seconds", 0.0), 2)
               for kind in ("encoder", "decoder")}
    return {"compilations_per_layer_kind": graphs, "graph_breaks": sum(counters["graph_break"].values()) - breaks_before,
            "compile_seconds": seconds, "wall_seconds": round(time.perf_counter() - start, 2),
            "shapes": {"training": shapes, "evaluation": shapes[:2]}}


def table(result: dict) -> str:
    lines = []
    if "kernel_ops_per_layer" in result:
        rows = ["| layer kind | eager | compiled |", "|---|---|---|"]
        for kind, n in result["kernel_ops_per_layer"].items():
            rows.append(f"| {kind} | {n['eager']} | {n.get('compiled', '—')} |")
        lines += ["Kernel operations per layer, forward + backward:", "", *rows, ""]
    if "output_cost_ratio" in result:
        lines.append(f"Output layer with its loss over its matrix products (time): {result['output_cost_ratio']:.2f}, "
                     f"i.e. {result['logit_cost']:.0f} FLOP-equivalents per logit beyond them (model/flops.py LOGIT_COST)")
    if "engine_ops_per_step" in result:
        e = result["engine_ops_per_step"]
        lines.append("Engine operations per step beyond the model: " + ", ".join(f"{p} {n}" for p, n in e.items()))
    if "syncs_per_microbatch" in result:
        where = result["syncs"].get("pp_ranks_on")
        pps = " and ".join(f"pp = {k[len('syncs_pp'):]}" for k in result if k.startswith("syncs_pp"))
        lines.append(f"Host syncs: {result['syncs_per_microbatch']:g} per micro-batch, {result['syncs_per_step']:g} per "
                     f"step (worst rank, {pps}{f', pp > 1 on {where}' if where else ''}; {result['syncs']['method']})")
    for key in sorted(k for k in result if k.startswith("trace_pp")):
        t = result[key]
        bubble = f", bubble {t['bubble']['trace']['bubble']:.3f} traced, {t['bubble']['simulator']['bubble']:.3f} " \
                 "simulated" if t.get("bubble") else ""
        lines.append(f"A traced step at pp = {key[len('trace_pp'):]} ({'device events' if t['device_clock'] else 'host clock'}): "
                     f"{t['per_microbatch']:g} host syncs per micro-batch, {t['per_step']:g} in the step with the "
                     f"tracer's own{bubble}; {', '.join(t.get('paths', []))}")
    if "graph_breaks" in result:
        c = result["compilations_per_layer_kind"]
        lines.append(f"Compiled layers: {result['graph_breaks']} graph breaks; graphs per kind: encoder {c['encoder']}, "
                     f"decoder {c['decoder']} over {len(SHAPES) + 1} training and 2 evaluation micro-batches "
                     f"(compiling took {result['compile_seconds']})")
    return "\n".join(lines)


def _worst(counted: dict[int, dict]) -> dict:
    """The sync counts of every launch so far (`syncs_pp<N>`) as bench.json's summary keys: the
    worst rank's per micro-batch and per step."""
    ranks = [r for c in counted.values() for r in c["ranks"]]
    where = next((c["pp_ranks_on"] for c in counted.values() if c["pp_ranks_on"]), None)
    return {"syncs": {"pp": max(counted), "ranks": ranks, "method": ranks[0]["method"], "pp_ranks_on": where},
            "syncs_per_microbatch": max(r["per_microbatch"] for r in ranks),
            "syncs_per_step": max(r["per_step"] for r in ranks)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="run.sh bench ops", description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="?", default=DEFAULT_CONFIG, help="YAML run config (its model and data)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    parser.add_argument("--batch", type=int, default=16, help="sentence pairs per batch of the layer counts (16)")
    parser.add_argument("--src", type=int, default=24, help="source tokens (24)")
    parser.add_argument("--tgt", type=int, default=20, help="target tokens (20)")
    parser.add_argument("--pp", type=int, default=2, help="pipeline stages of the sync count's launch (2; 1: none)")
    parser.add_argument("--skip", default="", help="comma-separated parts to leave out: layers, engine, syncs, "
                        "compiled, pp1 (the in-process sync count: with --pp > 1, the launch alone)")
    parser.add_argument("--out", default=os.path.join(ROOT, "runs", "bench-ops"), help="output folder")
    parser.add_argument("--jsonl", help="also append each result as it comes, one JSON line, to this file "
                        "(the GPU check's results.jsonl)")
    args = parser.parse_args(argv)
    from trainer.config import ConfigError, load_config

    skip = {p for p in args.skip.split(",") if p}
    unknown = skip - {"layers", "engine", "syncs", "compiled", "pp1"}
    for flag, value in (("--batch", args.batch), ("--src", args.src), ("--tgt", args.tgt), ("--pp", args.pp)):
        if value < 1:
            raise ConfigError(f"{flag} {value}: must be >= 1")
    if unknown:
        raise ConfigError(f"--skip {args.skip}: unknown part {sorted(unknown)[0]}; choose from layers, engine, syncs, compiled, pp1")
    cfg = load_config(args.config, sets=args.set)
    model = _model(cfg)
    import torch

    torch.set_num_threads(1)
    os.makedirs(args.out, exist_ok=True)
    result: dict = {"config": args.config, "model": dataclasses.asdict(model),
                    "batch": {"sentences": args.batch, "source": args.src, "target": args.tgt}}

    def emit(update: dict) -> None:
        """Keep `update` at once: in bench.json, rewritten whole, and as one line of --jsonl."""
        result.update(update)
        write_json(os.path.join(args.out, "bench.json"), result)
        if args.jsonl:
            append_jsonl(args.jsonl, {"part": "ops", "result": update})

    emit({})
    counted_on = {"config": args.config, "sets": args.set}  # what each count below was counted on
    if "layers" not in skip:
        emit({"kernel_ops_per_layer": count_layers(model, args.batch, args.src, args.tgt, "compiled" not in skip),
              "kernel_ops_counted_on": {**counted_on, "model": result["model"], "batch": result["batch"]}})
        ratio = output_cost_ratio(model)
        emit({"output_cost_ratio": ratio, "logit_cost": (ratio - 1) * 6 * model.d_model})
    if "compiled" not in skip:
        emit(compilations(model))
    if not skip >= {"engine", "syncs"}:
        from data.prepare import prepare_data
        from runtime.distributed import setup_distributed

        data_dir = os.path.join(args.out, "data")
        prepare_data(cfg.data, data_dir, log=lambda *_: None)
        setup_distributed()
        work = os.path.join(args.out, "work")
        os.makedirs(work, exist_ok=True)
        if "engine" not in skip:
            one = dataclasses.replace(cfg.parallel, pipeline_stages=1, data_parallel=1, tensor_parallel=1)
            single = dataclasses.replace(cfg, parallel=one)
            counts = {}
            for p in ("fp32", "bf16"):
                counts[p] = engine_ops_per_step(single, p, data_dir, os.path.join(work, p))
                emit({"engine_ops_per_step": {q: c["beyond_model"] for q, c in counts.items()},
                      "engine_ops_detail": dict(counts)})
        if "syncs" not in skip:
            counted: dict[int, dict] = {}
            if "pp1" not in skip or args.pp == 1:
                trainer = new_trainer(cfg, data_dir, os.path.join(work, "pp1"))
                counted[1] = {"ranks": [sync_counts(trainer)], "pp_ranks_on": None, **counted_on}
                emit({"syncs_pp1": counted[1], **_worst(counted)})
                emit({"trace_pp1": traced_step(trainer, os.path.join(work, "timeline-pp1"))})
            if args.pp > 1:
                ranks, where = launch_syncs(args.config, args.pp, data_dir, work, args.set)
                traced = [rank.pop("trace") for rank in ranks]
                counted[args.pp] = {"ranks": ranks, "pp_ranks_on": where, **counted_on}
                emit({f"syncs_pp{args.pp}": counted[args.pp], **_worst(counted)})
                emit({f"trace_pp{args.pp}": {**traced[0], "ranks_on": where,
                                             "per_microbatch_by_rank": [t["per_microbatch"] for t in traced]}})
    text = table(result)
    print(text)
    with open(os.path.join(args.out, "bench.md"), "w") as f:
        f.write(text + "\n")
    print(f"written to {args.out}/bench.json and bench.md")
    return 0


# What ./run.sh bench reads from this source (launcher/commands/bench.py).
BENCH = dict(name="ops", help="kernel operations per layer and per step, host syncs, graph breaks and compilations: "
             "what predicts a GPU step's host time", config=0, paths=("--out",))


if __name__ == "__main__":
    from runtime.distributed import exit_rank

    exit_rank(main())  # the engine and sync counts set up a process group: it ends as every rank's does
