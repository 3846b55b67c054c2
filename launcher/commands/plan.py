"""./run.sh plan MODEL --gpus N --gpu v100-32gb|a100-80gb|h100-80gb|h200-141gb (or v100, a100, h100, h200): which
layout, how fast, how long.

MODEL is a run config (a path, or the name of one in configs/); its own layout is priced as a row
of the same table (for a cluster its clusters: section lays out, that entry's layout: same GPU
type and count), and the best layout is printed as the config keys that give it. Nothing is
written but --markdown's file."""
from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os

from launcher.options import caller_cwd, user_path
from schema.text import count
from trainer.config import ConfigError, RunConfig

HELP = "plan a pp×tp×dp layout for a model on a GPU cluster: memory per stage, step time, days"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from planner.devices import ALIASES
    from planner.planner import named_shapes

    parser.add_argument("model", help=f"a YAML run config, or the name of one in configs/: {', '.join(named_shapes())}")
    parser.add_argument("--gpus", type=int, help="GPUs in the job (default: those of the config's clusters: entry "
                                                 "for --gpu where it has one, else its pp × tp × dp)")
    parser.add_argument("--gpu", required=True, metavar="TYPE",
                        help="GPU type: " + ", ".join(f"{key} ({alias})" for alias, key in ALIASES.items()))
    parser.add_argument("--nodes", type=int, help="nodes (default: as the clusters: entry compared with, else "
                                                  "GPUs / 8); GPUs per node = gpus / nodes")
    parser.add_argument("--precision", help="fp16 | bf16 (default: fp16 on V100, bf16 on A100/H100)")
    parser.add_argument("--mfu", type=float,
                        help="fraction of peak the kernels reach, before bubble and communication (default: "
                             "planner/devices.py kernel_efficiency: measured per GPU type where its GPU check is committed, "
                             "else one estimate for every type by model width and micro-batch size)")
    parser.add_argument("--global-batch-tokens", type=int,
                        help="target tokens per optimizer step (default: the config's own, or its clusters: "
                             "entry's, data_parallel × micro_batches × max_tokens, in sentences of --seq-len "
                             "tokens), so that the candidates train the batch the config trains")
    parser.add_argument("--seq-len", type=int, default=32, help="tokens per source and per target sentence (32)")
    parser.add_argument("--microbatch-tokens", default="1024,2048,4096,8192",
                        help="target tokens per micro-batch to try, comma-separated")
    parser.add_argument("--tokens", type=float, help="training budget in target tokens")
    parser.add_argument("--flops", type=float, help="training budget in model FLOPs (e.g. 5.2e21)")
    parser.add_argument("--intra-bw", type=float, help="intra-node all-reduce bus bandwidth per GPU, GB/s")
    parser.add_argument("--inter-bw", type=float, help="inter-node bandwidth per node, GB/s")
    parser.add_argument("--pp", help="only these pipeline depths, comma-separated (default: all that divide)")
    parser.add_argument("--tp", help="only these tensor-parallel sizes, comma-separated (default 1,2,4,8)")
    parser.add_argument("--checkpoint", choices=("on", "off"), help="only with / without activation checkpointing")
    parser.add_argument("--top", type=int, default=8, help="rows in the table (8)")
    parser.add_argument("--markdown", type=user_path, help="also write the table and the explanation to this file")
    parser.add_argument("--set", action="append", default=[], dest="sets", metavar="KEY=VALUE",
                        help="change one key of the config before it is planned, e.g. --set train.micro_batches=8 "
                             "(repeatable; typed and checked like the YAML file; over a clusters: entry's keys); "
                             "plan writes no config")


def config_path(spec: str) -> str:
    """The file of the run config `spec` names: a path from the caller's folder, or a config in
    configs/ by its name."""
    from planner.planner import CONFIG_DIR, named_model

    path = user_path(spec)
    if not os.path.exists(path):
        path = os.path.join(CONFIG_DIR, f"{spec}.yaml")
        if os.sep in spec or not os.path.isfile(path):
            try:
                named_model(spec)  # its message names the configs there are
            except ValueError as e:
                raise ConfigError(str(e)) from None
    return path


def load_run_config(spec: str, sets: list[str], cluster: str | None = None) -> RunConfig:
    """The run config `spec` names (`config_path`), its `cluster` layout and `sets` applied. Its
    model's vocabulary comes from its data section when it has none."""
    from trainer.config import load_config

    cfg = load_config(config_path(spec), cluster=cluster, sets=sets, cwd=caller_cwd())
    cfg.model.vocab_size = cfg.model.vocab_size or cfg.data.vocab_size
    return cfg


def _ints(value: str | None, flag: str) -> set[int] | None:
    if value is None:
        return None
    try:
        return {int(x) for x in value.split(",")}
    except ValueError:
        raise ConfigError(f"{flag}: comma-separated integers, e.g. 2,4") from None


def run(args: argparse.Namespace) -> int:
    from planner.devices import DEFAULT_PRECISION, device, gpu_type
    from planner.planner import search
    from planner.report import LEGEND, config_snippet, explain, own_row, params_of, table

    if args.gpus is not None and args.gpus < 1:
        raise ConfigError("--gpus must be >= 1")
    if args.tokens and args.flops:
        raise ConfigError("give --tokens or --flops, not both")
    if args.mfu is not None and not 0 < args.mfu <= 1:
        raise ConfigError("--mfu must be in (0, 1]")
    for flag, value in (("--seq-len", args.seq_len), ("--global-batch-tokens", args.global_batch_tokens),
                        ("--top", args.top), ("--nodes", args.nodes), ("--tokens", args.tokens),
                        ("--flops", args.flops), ("--intra-bw", args.intra_bw), ("--inter-bw", args.inter_bw)):
        if value is not None and not (math.isfinite(value) and value > 0):
            raise ConfigError(f"{flag} {value}: must be a positive number")
    try:
        args.gpu = gpu_type(args.gpu)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    cfg = load_run_config(args.model, args.sets)
    cluster = cluster_for(cfg, args.gpu, args.gpus)
    if cluster is not None:  # the config's own layout for this GPU type
        entry = cfg.clusters[cluster]
        cfg = load_run_config(args.model, args.sets, cluster)
        args.gpus = args.gpus or entry.nodes * entry.gpus_per_node
        if args.nodes is None and entry.gpus_per_node and args.gpus % entry.gpus_per_node == 0:
            args.nodes = args.gpus // entry.gpus_per_node
    args.gpus = args.gpus or cfg.world_size
    if args.global_batch_tokens is None:  # the batch the config trains (before it is scaled to --gpus)
        p, d = cfg.parallel, cfg.data
        args.global_batch_tokens = p.data_parallel * cfg.train.micro_batches * max(1, d.max_tokens // args.seq_len) * args.seq_len
    origin = (f"clusters.{cluster}" if cluster else
              f"its top level; no clusters: entry for {args.gpu}" if cfg.clusters else "")
    cfg, scaling = scaled(cfg, args.gpus)
    model = cfg.model
    from planner.devices import kernel_efficiency

    if args.mfu:
        mfu_note = f"kernel MFU {args.mfu:.1%} (given with --mfu)"
    else:
        efficiency = functools.cache(lambda tokens: kernel_efficiency(args.gpu, model.d_model, tokens))
        args.mfu = lambda layout: efficiency(layout.sequences * layout.tgt_len)[0]
        shown = ", ".join(f"{efficiency(t)[0]:.1%} at {t // 1024}k" for t in (2048, 4096, 8192))
        mfu_note = f"kernel MFU by target tokens per micro-batch {shown} ({efficiency(4096)[1]})"
    overrides = {}
    if args.nodes:
        if args.gpus % args.nodes:
            raise ConfigError(f"--nodes {args.nodes} must divide --gpus {args.gpus}")
        overrides["gpus_per_node"] = args.gpus // args.nodes
    if args.intra_bw is not None:
        overrides["intra_gbs"] = args.intra_bw
    if args.inter_bw is not None:
        overrides["inter_node_gbs"] = args.inter_bw
    dev = device(args.gpu, **overrides)
    precision = args.precision or DEFAULT_PRECISION[args.gpu]
    if precision not in dev.peak_tflops or precision == "fp32":
        raise ConfigError(f"--precision {precision}: {dev.name} trains in {DEFAULT_PRECISION[args.gpu]}")
    try:
        mb_tokens = tuple(dict.fromkeys(int(x) for x in args.microbatch_tokens.split(",")))
    except ValueError:
        raise ConfigError("--microbatch-tokens: comma-separated integers, e.g. 2048,4096") from None
    if min(mb_tokens) < 1:
        raise ConfigError(f"--microbatch-tokens {args.microbatch_tokens}: every value must be >= 1")
    fits, too_big = search(model, args.gpus, dev, args.mfu, global_tokens=args.global_batch_tokens,
                           seq_len=args.seq_len, microbatch_tokens=mb_tokens, precision=precision)
    own = _own_plan(cfg, model, dev, args, precision, "; ".join(x for x in (origin, scaling) if x))
    keep = [_ints(args.pp, "--pp"), _ints(args.tp, "--tp")]
    ckpt = None if args.checkpoint is None else args.checkpoint == "on"

    def wanted(p) -> bool:
        return ((keep[0] is None or p.layout.pp in keep[0]) and (keep[1] is None or p.layout.tp in keep[1])
                and (ckpt is None or bool(p.layout.checkpoint) == ckpt))

    fits, too_big = [p for p in fits if wanted(p)], [p for p in too_big if wanted(p)]
    if not fits and not too_big:
        raise ConfigError("no candidate layout matches --pp/--tp/--checkpoint for this many GPUs")
    from model.flops import training_flops

    per_token = training_flops(model, args.seq_len, args.seq_len) / args.seq_len
    budget = ("tokens", args.tokens) if args.tokens else ("flops", args.flops) if args.flops else None
    title = (f"Projection for {args.model} ({params_of(model) / 1e9:.2f}B parameters, {per_token / 1e9:.1f} GFLOPs "
             f"per target token at {args.seq_len}+{args.seq_len} tokens) on {args.gpus} × {dev.name} "
             f"({dev.gpus_per_node} per node), {precision}, {mfu_note}, global batch "
             f"{args.global_batch_tokens:,} target tokens.")
    out = [title, ""]
    if budget:
        what = f"{budget[1]:.3g} target tokens" if budget[0] == "tokens" else f"{budget[1]:.3g} model FLOPs"
        out += [f"Days for {what}.", ""]
    if not fits:
        leanest = min(too_big, key=lambda p: p.peak_bytes)
        out.append(f"No layout fits: the leanest ({leanest.layout.describe()}) needs "
                   f"{leanest.peak_bytes / 2**30:.1f} GiB per GPU of {dev.usable_bytes() / 2**30:.1f} usable.")
        out.append(LEGEND)
    else:
        out += table(fits[:args.top], dev, budget) + ["", LEGEND, ""] + explain(fits, too_big, dev)
    out.append(f"\n{len(fits)} of {len(fits) + len(too_big)} candidate layouts fit.")
    out += ["", *own_row(own[0], fits[0] if fits else None, dev, budget, args.gpus, own[1])]
    if fits:
        out += ["", *config_snippet(fits[0], dev)]
    text = "\n".join(out)
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text + "\n")
    return 0 if fits else 1


def cluster_for(cfg: RunConfig, gpu: str, gpus: int | None) -> str | None:
    """The config's clusters: entry for GPUs of type `gpu`: the one laid out for `gpus` GPUs, else
    the nearest in size that can be scaled to them (`scaled`); with `gpus` None, the one entry of
    that type. None where the config has no entry for that type."""
    from planner.devices import gpu_type

    def of_type(name: str) -> bool:
        try:
            return gpu_type(cfg.clusters[name].gpu) == gpu
        except ValueError:  # an entry sized for a GPU the planner does not know
            return False

    names = [name for name in cfg.clusters if of_type(name)]
    if gpus is None:
        return names[0] if len(names) == 1 else None

    def distance(name: str) -> tuple:
        layout, world = cfg.clusters[name], cfg.clusters[name].nodes * cfg.clusters[name].gpus_per_node
        per_replica = ((layout.parallel.get("pipeline_stages") or cfg.parallel.pipeline_stages)
                       * (layout.parallel.get("tensor_parallel") or cfg.parallel.tensor_parallel))
        return world != gpus, gpus % per_replica != 0, abs(math.log(gpus / world))

    return min(names, key=distance, default=None)


def scaled(cfg: RunConfig, gpus: int) -> tuple[RunConfig, str]:
    """`cfg` laid out on `gpus` GPUs with its pipeline and tensor-parallel sizes: data_parallel
    scaled to fill them and train.micro_batches scaled the other way, so that the global batch
    stays (the nearest whole number of micro-batches where none keeps it exactly), and a note
    saying so; `cfg` itself and '' when it has that many GPUs, or when pp × tp does not divide
    them (the comparison then says it is another size)."""
    p, t = cfg.parallel, cfg.train
    per_replica = p.pipeline_stages * p.tensor_parallel
    if cfg.world_size == gpus or gpus % per_replica:
        return cfg, ""
    dp = gpus // per_replica
    global_micro = p.data_parallel * t.micro_batches
    micro = max(1, round(global_micro / dp))
    out = dataclasses.replace(cfg, parallel=dataclasses.replace(p, data_parallel=dp),
                              train=dataclasses.replace(t, micro_batches=micro))
    batch = ("the same global batch" if micro * dp == global_micro else
             f"{count(micro * dp, 'micro-batch', 'micro-batches')} per step for its {global_micro} (the nearest whole number)")
    return out, (f"scaled from {cfg.world_size} to {count(gpus, 'GPU')}: data_parallel {p.data_parallel} → {dp}, "
                 f"train.micro_batches {t.micro_batches} → {micro}, {batch}")


def _own_plan(cfg: RunConfig, model, dev, args: argparse.Namespace, precision: str, origin: str) -> tuple:
    """(the config's own layout priced like the candidates, a note on which layout it is and what
    differs from the config): its precision where the GPU type has it, else the planned one."""
    from planner.planner import plan
    from planner.report import config_layout

    mine = cfg.parallel.precision
    notes = [origin] if origin else []
    notes += [] if mine in dev.peak_tflops else [f"priced in {precision}: {dev.name} has no {mine}"]
    note = "; ".join(notes)
    layout = config_layout(cfg.parallel, cfg.train, cfg.data.max_tokens, args.seq_len,
                           mine if mine in dev.peak_tflops else precision)
    return plan(model, layout, dev, args.mfu), note
