"""./run.sh slurm CONFIG --nodes N --gpus-per-node G: write (and with --submit, submit) a SLURM job."""
from __future__ import annotations

import argparse
import math
import os
import shlex
import shutil
import subprocess
import sys

from data.errors import DataError
from launcher.options import add_config_arguments, caller_cwd, run_dir_override, shown_path
from launcher.preflight import (
    check_checkpoint_files,
    check_init_from,
    check_resume,
    check_run_dir,
    check_trace_steps,
    newest_step,
)
from launcher.slurm import JobSpec, node_cpus, resolved_config_text, tokens_per_step, write_job
from schema.text import count
from trainer.config import ConfigError, RunConfig, load_config, parse_set
from trainer.run_dir import BELOW, TRAIN, launched_max_steps, relaunch

HELP = "write an sbatch script for multi-node training into the run directory (--submit submits it)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument("--cluster", help="one of the config's clusters: layouts (sets the layout, "
                                          "--nodes and --gpus-per-node)")
    parser.add_argument("--nodes", metavar="N|MIN-MAX",
                        help="nodes of the job; MIN-MAX: an elastic job that SLURM may start on any count in the "
                             "range, each start (a requeue too) choosing the layout for the nodes it got")
    parser.add_argument("--fixed", metavar="KEYS",
                        help="elastic jobs: layout keys kept at the config's values, e.g. tp or pp,tp (default: "
                             "none; the planner chooses pp, tp and dp within memory)")
    parser.add_argument("--gpu", metavar="TYPE",
                        help="elastic jobs on GPU nodes: the GPU type the planner prices layouts for (v100, a100, "
                             "h100, h200; default: the --cluster entry's)")
    parser.add_argument("--gpus-per-node", type=int,
                        help="GPUs per node, one rank each; 0 runs on CPU nodes with gloo")
    parser.add_argument("--tasks-per-node", type=int,
                        help="CPU nodes only: ranks per node (default: all ranks spread evenly)")
    parser.add_argument("--cpus-per-task", type=int,
                        help="CPUs per rank (sets OMP_NUM_THREADS; default: the node's CPUs as sinfo reports "
                             "them for --partition, divided by its GPUs, or on CPU nodes by its ranks)")
    parser.add_argument("--partition", help="SLURM partition")
    parser.add_argument("--time", help="time limit, e.g. 2-00:00:00; the job checkpoints and "
                                       "requeues itself --signal-before seconds earlier")
    parser.add_argument("--account", help="SLURM account to charge")
    parser.add_argument("--signal-before", type=int, default=300,
                        help="seconds before the time limit to checkpoint and requeue (default 300: "
                             "the current step plus saving a multi-GB checkpoint)")
    parser.add_argument("--name", help="job name (default: the config file's name)")
    parser.add_argument("--keep-batch", action="store_true",
                        help="where --set changes data_parallel × train.micro_batches × data.max_tokens, scale "
                             "train.micro_batches to keep the config's tokens per step (or the nearest fit, named)")
    parser.add_argument("--submit", action="store_true", help="submit the script with sbatch")
    parser.add_argument("--dry-run", action="store_true",
                        help="write the script even without the corpus (saying what is missing); submit nothing")


def node_range(text: str) -> tuple[int, int]:
    """--nodes N or MIN-MAX → (min, max); ConfigError naming the flag for anything else."""
    low, _, high = text.partition("-")
    try:
        nodes = (int(low), int(high or low))
    except ValueError:
        raise ConfigError(f"--nodes {text!r}: give a node count N or a range MIN-MAX, e.g. 8-16") from None
    if not 1 <= nodes[0] <= nodes[1]:
        raise ConfigError(f"--nodes {text!r}: nodes must be >= 1, MIN <= MAX")
    return nodes


def _layout_flags(args: argparse.Namespace, cfg, cluster) -> tuple[tuple[int, int], int, int]:
    """((min, max) nodes, gpus_per_node, tasks_per_node), checked against the config's pp × tp × dp
    (an elastic job: against every node count of its range, launcher/elastic.py's choice)."""
    nodes = node_range(args.nodes) if args.nodes is not None else ((cluster.nodes,) * 2 if cluster else None)
    gpus = args.gpus_per_node if args.gpus_per_node is not None else (cluster.gpus_per_node if cluster else None)
    if nodes is None or gpus is None:
        raise ConfigError("give --nodes and --gpus-per-node (0 for CPU nodes), or --cluster NAME of "
                          "the config's clusters: section")
    if gpus < 0:
        raise ConfigError("--gpus-per-node must be >= 0")
    world = cfg.world_size
    if gpus > 0:
        if args.tasks_per_node not in (None, gpus):
            raise ConfigError("--tasks-per-node: on GPU nodes there is one rank per GPU; leave it out")
        tasks = gpus
    else:
        tasks = args.tasks_per_node or max(1, world // nodes[1])
    p = cfg.parallel
    if nodes[0] < nodes[1]:
        _check_elastic(args, cfg, nodes, tasks, gpus, cluster)
    elif args.fixed or args.gpu:
        raise ConfigError(f"--{'fixed' if args.fixed else 'gpu'} is for elastic jobs (--nodes MIN-MAX)")
    elif nodes[0] * tasks != world:
        raise ConfigError(
            f"{args.config}: the layout needs pipeline_stages × tensor_parallel × data_parallel = "
            f"{p.pipeline_stages} × {p.tensor_parallel} × {p.data_parallel} = {count(world, 'rank')}, but "
            f"--nodes {nodes[0]} × {'--gpus-per-node' if gpus else '--tasks-per-node'} {tasks} = "
            f"{nodes[0] * tasks}; change the flags or parallel.data_parallel in the config, or let the job choose "
            f"with --nodes MIN-MAX")
    return nodes, gpus, tasks


def _check_elastic(args: argparse.Namespace, cfg, nodes: tuple[int, int], tasks: int, gpus: int, cluster) -> None:
    """Every node count of an elastic job's range has a layout (the GPU type's memory checked with
    --gpu; CPU nodes' memory is the start's to check), before anything is written."""
    import copy

    from launcher.elastic import choose_layout, fixed_keys

    if gpus and not (args.gpu or (cluster and cluster.gpu)):
        raise ConfigError("an elastic job on GPU nodes needs --gpu TYPE (v100, a100, h100, h200) for the planner")
    args.gpu = args.gpu or (cluster.gpu if cluster and gpus else None)
    fixed = fixed_keys(args.fixed)
    for n in range(nodes[0], nodes[1] + 1):
        choose_layout(copy.deepcopy(cfg), n, tasks, args.gpu if gpus else None, fixed, args.config,
                      memory=bool(gpus))


def slurm_seconds(limit: str) -> float:
    """Seconds of a SLURM time limit (sbatch --time formats: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S;
    UNLIMITED or infinite: inf); ValueError for anything else."""
    text = limit.strip()
    if text.lower() in ("unlimited", "infinite"):
        return math.inf
    days, _, clock = text.rpartition("-")
    parts = clock.split(":")
    if not all(part.isdigit() for part in parts + ([days] if days else [])) or len(parts) > 3:
        raise ValueError(limit)
    numbers = [int(part) for part in parts]
    if days:  # D-H, D-H:M, D-H:M:S
        hours, minutes, seconds = (numbers + [0, 0])[:3]
        return ((int(days) * 24 + hours) * 60 + minutes) * 60 + seconds
    if len(numbers) == 1:
        return numbers[0] * 60.0
    if len(numbers) == 2:
        return numbers[0] * 60.0 + numbers[1]
    return (numbers[0] * 60 + numbers[1]) * 60.0 + numbers[2]


def _check_job_flags(args: argparse.Namespace) -> None:
    for flag, value in (("--tasks-per-node", args.tasks_per_node), ("--cpus-per-task", args.cpus_per_task)):
        if value is not None and value < 1:
            raise ConfigError(f"{flag} {value}: must be >= 1")
    if args.signal_before < 1:
        raise ConfigError("--signal-before must be at least 1 second")
    if args.time is not None:
        try:
            seconds = slurm_seconds(args.time)
        except ValueError:
            raise ConfigError(f"--time {args.time}: not a SLURM time limit; use minutes, M:S, H:M:S, D-H, D-H:M "
                              "or D-H:M:S (e.g. 2-00:00:00)") from None
        if seconds <= args.signal_before:
            raise ConfigError(f"--time {args.time} ({seconds:.0f} s) is not longer than --signal-before "
                              f"{args.signal_before} s: the checkpoint signal would come before the job starts "
                              "training; raise --time or lower --signal-before")


def _command_line(args: argparse.Namespace) -> str:
    """The ./run.sh command with the flags that were given, for the script's header."""
    words = ["./run.sh", "slurm", args.config]
    if args.nodes is not None:
        words += ["--nodes", args.nodes]
    for flag in ("cluster", "fixed", "gpu", "gpus_per_node", "tasks_per_node", "cpus_per_task", "partition",
                 "time", "account", "signal_before", "run_dir", "name"):
        value = getattr(args, flag)
        if value is not None and not (flag == "signal_before" and value == 300):
            words += ["--" + flag.replace("_", "-"), str(value)]
    for item in args.sets:
        words += ["--set", item]
    return shlex.join(words + (["--keep-batch"] if args.keep_batch else []))


def _keep_promises(args: argparse.Namespace, cfg: RunConfig) -> tuple[RunConfig, str, str]:
    """The tokens per step of the config as written (its --cluster layout applied) against those
    --set gives: a change is said, or with --keep-batch undone by scaling train.micro_batches (the
    nearest fit where none is exact, named). Returns the config, the line to print before the job
    is written, and where the tokens per step differ from the file's, what the file's are."""
    tokens, product = tokens_per_step(cfg)
    if not args.sets:
        return cfg, "", ""
    try:
        written = load_config(args.config, run_dir_override(args), cluster=args.cluster, cwd=caller_cwd())
    except ConfigError:  # only the --set values make it a valid config: nothing to compare
        return cfg, "", ""
    before, before_product = tokens_per_step(written)
    if before == tokens:
        return cfg, "", ""
    origin = shown_path(args.config) + (f" with clusters.{args.cluster}" if args.cluster else "")
    per_micro_batch = cfg.parallel.data_parallel * cfg.data.max_tokens
    fit = max(1, round(before / per_micro_batch))
    exact = fit * per_micro_batch == before
    if not args.keep_batch:
        said = (f"warning: --set {' '.join(args.sets)} changes the tokens per step (data_parallel × "
                f"train.micro_batches × data.max_tokens) from {origin}'s {before_product} = {before:,} to "
                f"{product} = {tokens:,}; --keep-batch sets train.micro_batches={fit} for "
                f"{f'{before:,}' if exact else f'the nearest fit, {fit * per_micro_batch:,}'}")
        return cfg, said, f" ({origin}: {before:,})"
    if any(parse_set(item)[0] == "train.micro_batches" for item in args.sets):
        raise ConfigError("--keep-batch chooses train.micro_batches itself; leave out --set train.micro_batches "
                          "or --keep-batch")
    kept = load_config(args.config, run_dir_override(args), cluster=args.cluster,
                       sets=[*args.sets, f"train.micro_batches={fit}"], cwd=caller_cwd())
    after, product = tokens_per_step(kept)
    how = ("as" if exact else f"the nearest fit to {before:,} (an exact one needs "
           f"{before / per_micro_batch:.2f} micro-batches) of")
    said = (f"--keep-batch: train.micro_batches {cfg.train.micro_batches} → {fit}: {product} = {after:,} tokens "
            f"per step, {how} {origin}")
    return kept, said, "" if exact else f" ({origin}: {before:,})"


def _cpus_per_task(args: argparse.Namespace, gpus: int, tasks: int) -> tuple[int, str]:
    """--cpus-per-task, or the node's CPUs (sinfo; else this machine's, said to be a guess) divided
    by its GPUs (CPU nodes: by its ranks); and the script's header line saying which."""
    if args.cpus_per_task:
        return args.cpus_per_task, f"CPUs per rank: --cpus-per-task={args.cpus_per_task}, as given"
    share = count(gpus, "GPU") if gpus else f"{count(tasks, 'rank')} per node"
    cpus, how = node_cpus(args.partition)
    if cpus is not None:
        n = max(1, cpus // (gpus or tasks))
        return n, f"CPUs per rank: --cpus-per-task={n} = {count(cpus, 'CPU')} per node ({how}) / {share}"
    cpus = os.cpu_count() or 1
    n = max(1, cpus // (gpus or tasks))
    print(f"note: --cpus-per-task {n} assumes nodes like this machine ({count(cpus, 'CPU')} / {share}): {how}; "
          "give --cpus-per-task for the compute nodes", file=sys.stderr)
    return n, (f"CPUs per rank: --cpus-per-task={n} = {count(cpus, 'CPU')} / {share}, this machine's CPUs ({how}), "
               "assumed to be a node's; regenerate with --cpus-per-task for other nodes")


def _summary(spec: JobSpec, script: str, notes: list[str]) -> list[str]:
    """What was written and the facts of the job, in a few lines: the script itself is in the file
    (its header holds every note: how --cpus-per-task was chosen, a --dry-run's missing corpus)."""
    ranks = spec.nodes * spec.tasks_per_node
    on = f"{count(spec.gpus_per_node, 'GPU')} each, NCCL" if spec.gpus_per_node else "CPU nodes, gloo"
    on += f"; --cpus-per-task={spec.cpus_per_task}" if spec.cpus_per_task else ""
    limit = (f"time limit {spec.time} (checkpoint and requeue {spec.signal_before} s before it)" if spec.time
             else "the partition's time limit")
    where = "".join(f", {key} {value}" for key, value in (("partition", spec.partition), ("account", spec.account))
                    if value)
    return [f"wrote {shown_path(script)} and the config it reads, {shown_path(spec.config)}",
            f"  job {spec.name}: {count(spec.nodes, 'node')} × {count(spec.tasks_per_node, 'rank')} per node = "
            f"{count(ranks, 'rank')} ({spec.layout}; {on}), {limit}{where}",
            f"  {notes[0]}",  # the tokens per step (the script's header has every note)
            f"  logs: {shown_path(os.path.join(spec.run_dir, 'slurm', 'logs'))}/{spec.name}-<job id>.out; "
            f"the run: {shown_path(spec.run_dir)}"]


def run(args: argparse.Namespace) -> int:
    from data.prepare import check_corpus

    if args.dry_run and args.submit:
        raise ConfigError("--dry-run submits nothing; leave out --submit (or --dry-run)")
    cfg = load_config(args.config, run_dir_override(args), cluster=args.cluster, sets=args.sets, cwd=caller_cwd())
    cluster = cfg.clusters.get(args.cluster) if args.cluster else None
    _check_job_flags(args)
    nodes, gpus, tasks = _layout_flags(args, cfg, cluster)
    cfg, said, promised = _keep_promises(args, cfg)
    # The checks of ./run.sh train and prepare, before anything is written: a job that would fail
    # on them fails here rather than after it was queued. (The device is the compute nodes': the
    # job's ranks check it.)
    check_run_dir(cfg, args.config)
    elastic = nodes[0] < nodes[1]
    saved = check_resume(cfg, args.config, batch=not elastic)  # an elastic start keeps the batch with its dp
    # What the job will do with the run directory (its ranks decide again when it starts)
    verdict, line = relaunch(shown_path(cfg.run_dir), newest_step(cfg), cfg.train.max_steps, launched_max_steps(saved))
    if verdict == BELOW:
        raise ConfigError(line)
    check_trace_steps(cfg, args.config)
    check_checkpoint_files(cfg, args.config)  # the job's ranks check again before they load
    if not args.dry_run:  # the source of a fine-tuning job (a dry run may precede it)
        check_init_from(cfg, args.config)
    missing = None
    try:
        check_corpus(cfg.data)
    except DataError as e:
        if not args.dry_run:
            raise
        missing = str(e)
    if said:  # every check passed; nothing is written yet
        print(said, file=sys.stderr)
    if verdict != TRAIN:  # finished (the job trains nothing), or ended where it stopped
        print(f"note: {line}", file=sys.stderr)
    if missing:
        print(f"note: --dry-run: {missing}; the script is written without it, and its data step needs it",
              file=sys.stderr)
    cpus, cpus_note = _cpus_per_task(args, gpus, tasks)
    tokens, product = tokens_per_step(cfg)
    notes = [f"Tokens per step: data_parallel × train.micro_batches × data.max_tokens = {product} = "
             f"{tokens:,}{promised}", cpus_note]
    if missing:
        notes.append(f"Written with --dry-run without the corpus: {missing}")
    run_dir = os.path.abspath(cfg.run_dir)
    cfg.run_dir = run_dir
    p = cfg.parallel
    layout = (f"chosen at each start; fixed: {args.fixed or 'none'}" if elastic else
              f"pp={p.pipeline_stages} × tp={p.tensor_parallel} × dp={p.data_parallel}")
    spec = JobSpec(
        name=args.name or os.path.splitext(os.path.basename(args.config))[0],
        run_dir=run_dir, config=os.path.join(run_dir, "slurm", "config.yaml"),
        nodes=nodes[0], max_nodes=nodes[1], gpus_per_node=gpus, tasks_per_node=tasks, layout=layout,
        fixed=args.fixed, gpu=args.gpu,
        cpus_per_task=cpus, partition=args.partition, time=args.time,
        account=args.account, signal_before=args.signal_before,
        command=_command_line(args), notes=tuple(notes),
    )
    source = f"{args.config} with --set {' '.join(args.sets)}" if args.sets else args.config
    source += " and --keep-batch" if args.keep_batch and args.sets else ""
    script = write_job(spec, resolved_config_text(cfg, source, args.cluster))
    print("\n".join(_summary(spec, script, notes)))
    if args.dry_run:
        then = (f"once the corpus is there: {_command_line(args)} --submit" if missing
                else f"submit with: sbatch {shown_path(script)}")
        print(f"--dry-run: nothing submitted; {then}")
        return 0
    if not args.submit:
        print(f"submit with: sbatch {shown_path(script)}")
        return 0
    if shutil.which("sbatch") is None:
        raise ConfigError("--submit: sbatch is not on PATH (run this on a SLURM login node)")
    proc = subprocess.run(["sbatch", "--parsable", script], capture_output=True, text=True)
    if proc.returncode != 0:
        print(f"error: sbatch refused the job: {proc.stderr.strip()}", file=sys.stderr)
        return proc.returncode
    job_id = proc.stdout.strip().split(";")[0]
    print(f"submitted job {job_id}; log: {run_dir}/slurm/logs/{spec.name}-{job_id}.out")
    return 0
