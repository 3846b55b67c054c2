"""A SLURM job's start: `python -m launcher.elastic ...`, run by the job script (launcher/slurm.py)
as a one-task step before the ranks, at every start of the job (a requeue included).

1. The layout for the nodes this start got. An elastic job (`./run.sh slurm --nodes MIN-MAX`):
   the planner's best pp × tp × dp of nodes × ranks-per-node ranks within memory, the keys the
   job fixes kept, the run's micro-batches per step kept (planner/elastic.py). A job of a fixed
   node count: the config's layout, which must match the ranks.
2. Holding the run lock: the checks `./run.sh train` makes before a resume (launcher/preflight.py:
   the model, the data, the global batch), and the universal copy of the newest checkpoint when it
   was written at another layout (checkpoint/elastic.py), said in the job's log and train.log.
3. The config of this start, the layout and train.micro_batches set, written to `--out`: the
   ranks read it.
A refusal is one line and exit 2: the job ends without a requeue (it would be refused again).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from planner.elastic import KEYS
from trainer.config import ConfigError, RunConfig, load_config, to_dict, validate
from schema.text import count


def fixed_keys(text: str | None) -> list[str]:
    """`--fixed pp,tp` (or the parallel: keys' names) → parallel: keys; ConfigError for another word."""
    keys = []
    for word in filter(None, (text or "").split(",")):
        key = KEYS.get(word.strip(), word.strip())
        if key not in KEYS.values():
            raise ConfigError(f"--fixed {text}: {word!r} is not a layout key; use pp, tp, dp (or "
                              f"{', '.join(KEYS.values())})")
        keys.append(key)
    return keys


def node_memory() -> float:
    """Bytes of memory of this node the job may use: SLURM's --mem where set, else the node's."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    granted = os.environ.get("SLURM_MEM_PER_NODE", "")
    return min(total, int(granted) * 2**20) if granted.isdigit() and int(granted) > 0 else total


def pricing(cfg: RunConfig, tasks: int, gpu: str | None, memory: bool = True):
    """(device, kernel efficiency, precision) the planner prices this job's layouts with: the GPU
    type on GPU nodes, this node's memory shared by its ranks on CPU nodes (gloo; `memory` False:
    not this node's, so no bound)."""
    from planner.devices import DEFAULT_PRECISION, cpu_device, device, gpu_type, kernel_efficiency

    if gpu is None:
        return cpu_device(1e11, node_memory() / tasks if memory else float(2**60)), 0.3, "fp32"
    key = gpu_type(gpu)
    dev = device(key, gpus_per_node=tasks)
    precision = cfg.parallel.precision if cfg.parallel.precision in dev.peak_tflops else DEFAULT_PRECISION[key]
    return dev, (lambda layout: kernel_efficiency(key, cfg.model.d_model, layout.sequences * layout.tgt_len)[0]), precision


def global_micro_batches(cfg: RunConfig) -> tuple[int, str]:
    """The run's micro-batches per step (its newest checkpoint's, for a new run the config's, or
    with train.keep_global_batch false the config's) and where that number comes from."""
    from checkpoint import elastic, manifest

    ckpt_dir = os.path.join(cfg.run_dir, "checkpoints")
    tags = manifest.committed_tags(ckpt_dir)
    if tags and cfg.train.keep_global_batch:
        return elastic.global_micro_batches(elastic.recorded(ckpt_dir, tags[0])), f"checkpoint {tags[0]}"
    return cfg.parallel.data_parallel * cfg.train.micro_batches, "the config"


def choose_layout(cfg: RunConfig, nodes: int, tasks: int, gpu: str | None, fixed: list[str], where: str,
                  memory: bool = True) -> str:
    """Set `cfg`'s layout (and train.micro_batches) to the planner's choice for `nodes` × `tasks`
    ranks; the line that says it. `memory` False: CPU nodes priced from elsewhere (`pricing`)."""
    from planner.elastic import choose
    from planner.report import config_layout

    total, source = global_micro_batches(cfg)
    dev, mfu, precision = pricing(cfg, tasks, gpu, memory)
    d = cfg.data
    seq_len = max(d.max_source_len, d.max_target_len)
    base = config_layout(cfg.parallel, cfg.train, d.max_tokens, seq_len, precision)
    model = cfg.model if cfg.model.vocab_size else _with_vocab(cfg)
    kept = {key: getattr(cfg.parallel, key) for key in fixed}
    try:
        best, priced, fit = choose(model, base, nodes * tasks, tasks, total, kept, dev, mfu)
    except ValueError as e:
        raise ConfigError(f"{where}: {count(nodes, 'node')} × {count(tasks, 'rank')}: {e}") from None
    lay = best.layout
    cfg.parallel.pipeline_stages, cfg.parallel.tensor_parallel, cfg.parallel.data_parallel = lay.pp, lay.tp, lay.dp
    cfg.train.micro_batches = lay.micro_batches
    validate(cfg, where)
    fixed_text = ", ".join(f"{key}={value}" for key, value in kept.items()) or "none"
    return (f"layout for {count(nodes, 'node')} × {count(tasks, 'rank')}: pp{lay.pp}·tp{lay.tp}·dp{lay.dp}, "
            f"train.micro_batches {lay.micro_batches} ({count(total, 'micro-batch', 'micro-batches')} per step, as {source}): the planner's fastest of {fit} "
            f"layouts fitting {dev.name if gpu else 'this node'}'s memory ({priced} priced; fixed: {fixed_text})")


def _with_vocab(cfg: RunConfig):
    import dataclasses

    return dataclasses.replace(cfg.model, vocab_size=cfg.data.vocab_size)


def start(args: argparse.Namespace) -> int:
    from launcher.preflight import check_resume, reshard
    from launcher.runlock import RunDirBusy, RunLock

    cfg = load_config(args.config, {"run_dir": args.run_dir})
    where = args.config
    world = args.nodes * args.tasks_per_node
    if args.elastic:
        print(choose_layout(cfg, args.nodes, args.tasks_per_node, args.gpu, fixed_keys(args.fixed), where), flush=True)
    else:
        p = cfg.parallel
        if cfg.world_size != world:
            raise ConfigError(f"{where}: pipeline_stages × tensor_parallel × data_parallel = {p.pipeline_stages} × "
                              f"{p.tensor_parallel} × {p.data_parallel} = {count(cfg.world_size, 'rank')}, but this job has "
                              f"{count(args.nodes, 'node')} × {args.tasks_per_node} = {world}")
        print(f"layout for {count(args.nodes, 'node')} × {count(args.tasks_per_node, 'rank')}: pp{p.pipeline_stages}·"
              f"tp{p.tensor_parallel}·dp{p.data_parallel}, the config's", flush=True)
    try:
        lock = RunLock(cfg.run_dir).acquire()
    except RunDirBusy as e:
        raise ConfigError(str(e)) from None
    try:
        check_resume(cfg, where)  # (train.micro_batches for the global batch, said where it changes)
        reshard(cfg, where)
    finally:
        lock.release()
    import yaml

    from checkpoint.manifest import write_atomic

    values = json.loads(json.dumps(to_dict(cfg)))  # tuples → lists, for YAML
    values.pop("clusters", None)
    write_atomic(args.out, f"# {args.config} as this start of the job trains it (launcher/elastic.py)\n"
                 + yaml.safe_dump(values, sort_keys=False))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launcher.elastic", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="the job's frozen config (<run_dir>/slurm/config.yaml)")
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--nodes", type=int, required=True, help="nodes of this start ($SLURM_JOB_NUM_NODES)")
    parser.add_argument("--tasks-per-node", type=int, required=True)
    parser.add_argument("--elastic", action="store_true", help="choose the layout for the nodes (else the config's)")
    parser.add_argument("--fixed", help="layout keys an elastic job keeps at the config's values: pp,tp,dp")
    parser.add_argument("--gpu", help="GPU type of the nodes, for the planner (none: CPU nodes)")
    parser.add_argument("--out", required=True, help="where to write the config of this start")
    args = parser.parse_args(argv)
    try:
        return start(args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
