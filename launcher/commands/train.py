"""./run.sh train [CONFIG]: prepare the data, then launch the pipeline ranks on this node."""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time

import yaml

from launcher.launch import DEFAULT_CONFIG, ROOT, deepspeed_command, launch_env
from launcher.options import add_config_arguments, caller_cwd, run_dir_override, shown_path
from launcher.preflight import (
    check_checkpoint_files,
    check_device,
    check_directions,
    check_init_from,
    check_relaunch,
    check_resume,
    check_run_dir,
    check_trace_steps,
    end_run_here,
    reshard,
)
from launcher.procs import die_with_parent_shell, supervise
from launcher.runlock import RunDirBusy, RunLock
from runtime import accelerator
from schema.text import count
from trainer.config import ConfigError, config_name, load_config, read_yaml, to_dict
from trainer.run_dir import BELOW, END_HERE, FINISHED, SUMMARY_NAME, launch_facts, record_ending
from trainer.signals import PREEMPTED_EXIT_CODE

HELP = "prepare data and train a model on this node (an existing run directory is resumed)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, DEFAULT_CONFIG)
    parser.add_argument("--eval-sentences", type=int, default=50, metavar="N",
                        help="after training, translate the first N test sentences of every direction "
                             "(beam 5) and print BLEU/chrF (default 50; 0 skips; ./run.sh eval scores all)")


def gpu_count() -> int:
    """GPUs DeepSpeed would use here; 0 when run.sh chose the CPU accelerator (no GPU tooling)."""
    return accelerator.gpu_count()


def former_default_run(path: str, run_dir: str) -> str | None:
    """The run directory a config that names no run_dir had before the default was named after the
    config (runs/default beside it), where that holds a run and the config's own default `run_dir`
    does not exist yet: a launch would start afresh in `run_dir` instead of resuming it. Else None."""
    base = os.path.dirname(os.path.abspath(path))
    old = os.path.join(base, "runs", "default")
    if (run_dir != os.path.join(base, "runs", config_name(path)) or old == run_dir or os.path.exists(run_dir)
            or not os.path.exists(os.path.join(old, "config.json")) or "run_dir" in read_yaml(path)):
        return None
    return old


def run(args: argparse.Namespace) -> int:
    from data.prepare import check_corpus

    if args.eval_sentences < 0:
        raise ConfigError(f"--eval-sentences {args.eval_sentences}: give N >= 0 (0 skips the evaluation)")
    cfg = load_config(args.config, run_dir_override(args), sets=args.sets, cwd=caller_cwd())
    former = former_default_run(args.config, cfg.run_dir)
    if former:
        print(f"note: {shown_path(args.config)} names no run_dir, so it trains in {shown_path(cfg.run_dir)} "
              f"(runs/{{config}} beside it); {shown_path(former)} holds the run such a config had before: set "
              "run_dir: runs/default in it to resume that run", file=sys.stderr, flush=True)
    check_run_dir(cfg, args.config)
    saved = check_resume(cfg, args.config)
    check_checkpoint_files(cfg, args.config)  # nothing the ranks would load can run code
    verdict, line = check_relaunch(cfg, saved)  # before the device check, the data and the ranks
    if verdict == BELOW:
        raise ConfigError(line)
    if verdict == FINISHED:
        print(line, flush=True)
        return 0
    check_trace_steps(cfg, args.config)
    check_device(cfg, args.config)
    check_init_from(cfg, args.config)  # a fine-tuning run's source fits the model and the vocabulary
    check_corpus(cfg.data)  # what needs no pass over the text; the rest is checked while preparing
    try:  # held until this process ends; the ranks die with it (launcher/procs.py)
        lock = RunLock(cfg.run_dir).acquire()
    except RunDirBusy as e:
        raise ConfigError(str(e)) from None
    except OSError as e:
        raise ConfigError(f"{cfg.run_dir}: cannot create the run directory's lock ({e.strerror}); "
                          "choose a writable run_dir") from None
    die_with_parent_shell()
    try:
        if verdict == END_HERE:
            end_run_here(cfg, saved, line)
            print(line, flush=True)
            return 0
        return _train(args, cfg)
    finally:
        lock.release()


def _train(args: argparse.Namespace, cfg) -> int:
    from data.prepare import prepare_data

    p, world = cfg.parallel, cfg.world_size
    layout = (f"pipeline_stages={p.pipeline_stages} × tensor_parallel={p.tensor_parallel} × "
              f"data_parallel={p.data_parallel}")
    gpus = gpu_count()
    if gpus and world > gpus:
        raise ConfigError(f"{args.config}: {layout} needs {count(world, 'rank')}, one per GPU, but this node has "
                          f"{count(gpus, 'GPU')}; lower parallel.data_parallel, or run on several nodes with "
                          f"./run.sh slurm {args.config} --nodes N --gpus-per-node {gpus}")
    env = launch_env(world)
    # Cores this process may use (a cgroup, taskset or SLURM allocation may grant fewer than the
    # machine has), split evenly; unless the user set OMP_NUM_THREADS.
    cores = len(os.sched_getaffinity(0))
    threads = max(1, cores // world)
    if "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = str(threads)
    sets = f" with --set {' '.join(args.sets)}" if args.sets else ""
    print(f"config {shown_path(args.config)}{sets} → run directory {shown_path(cfg.run_dir)}", flush=True)
    check_directions(cfg, prepare_data(cfg.data, os.path.join(cfg.run_dir, "data")), args.config)
    reshard(cfg, args.config)  # a checkpoint of another layout: its universal copy, before the ranks
    with resolved_config(cfg, args.config) as config:
        cmd = deepspeed_command(world, "launcher.worker", ["--config", config, "--run-dir", os.path.abspath(cfg.run_dir)])
        rc = _launch(cmd, env, cfg, layout, world, gpus, cores)
    if rc == 0 and args.eval_sentences > 0:
        from translate.evaluate import evaluate_after_training

        evaluate_after_training(cfg.run_dir, args.eval_sentences)
        record_scores(cfg.run_dir, args.eval_sentences)
    return rc


@contextlib.contextmanager
def resolved_config(cfg, source: str):
    """The config the ranks read: this one as checked here, --set and --run-dir applied and every
    key explicit (so config.json records it, and an edit of `source` during the start-up changes
    nothing), in a temporary file removed when the launch ends."""
    values = json.loads(json.dumps(to_dict(cfg)))  # tuples → lists, for YAML
    name = os.path.splitext(os.path.basename(source))[0]
    with tempfile.TemporaryDirectory(prefix="deepnet-launch-") as folder:
        path = os.path.join(folder, f"{name}.yaml")
        with open(path, "w", encoding="utf-8") as f:
            f.write(f"# {source}, resolved by ./run.sh train for its ranks\n")
            yaml.safe_dump(values, f, sort_keys=False)
        yield path


def record_scores(run_dir: str, sentences: int) -> None:
    """The evaluation's BLEU/chrF (eval/eval.json) at the trained step, into the run's metrics
    (CSV: the mean over directions; TensorBoard: that and every direction) and train.log."""
    from checkpoint import manifest
    from trainer import metrics
    from trainer.progress import append_log

    newest = manifest.newest_committed(os.path.join(run_dir, "checkpoints"))
    try:
        with open(os.path.join(run_dir, "eval", "eval.json"), encoding="utf-8") as f:
            rows = json.load(f)["test"]["rows"]
    except (OSError, ValueError, KeyError):
        return  # the evaluation said why it could not run
    if newest is None:
        return
    step = int(newest[len("step"):])
    means, each = metrics.score_events(rows, step)
    metrics.record(run_dir, means, tensorboard_only=each)
    append_log(run_dir, f"step {step} | test " + " | ".join(f"{tag.split('/')[-1]} {value:.2f}" for tag, value, _ in means)
               + f" (first {count(sentences, 'sentence')} per direction, beam 5; eval/test.md)")


def _recorded_since(run_dir: str, started: float) -> bool:
    """Whether a rank recorded this launch's ending (summary.json written since `started`)."""
    try:
        return os.path.getmtime(os.path.join(run_dir, SUMMARY_NAME)) >= started
    except OSError:
        return False


def _launch(cmd: list[str], env: dict, cfg, layout: str, world: int, gpus: int, cores: int) -> int:
    """Start the ranks under supervision (launcher/procs.py); their exit code, explained."""
    where = (f"{world} of {count(gpus, 'GPU')}" if gpus else
             f"{count(cores, 'CPU core')}, {count(int(env['OMP_NUM_THREADS']), 'thread')} per rank")

    def announce():  # once signals are handled: from here on a SIGTERM gets a checkpoint
        print(f"launching {count(world, 'rank')} ({layout}) on {where}", flush=True)
        if not gpus and world > cores:
            print(f"warning: {count(world, 'rank')} share {count(cores, 'core')}; each step will be slow", flush=True)

    env["DEEPNET_RUN_LOCK_HELD"] = "1"  # the ranks need not take the run lock themselves
    started = time.time()
    rc, ending = supervise(cmd, env, ROOT, cfg.train.stop_grace_seconds, announce, run_dir=cfg.run_dir)
    if (ending is not None or rc != 0) and not _recorded_since(cfg.run_dir, started):
        # summary.json and train.log say how it ended, as the ranks do for the ends they reach
        # (an end they agree on is theirs to record: should none have, it is said here too)
        state, reason = ending or ("failed", "the ranks ended without recording how")
        record_ending(cfg.run_dir, state, reason, rc, known=launch_facts(cfg))
    if rc == PREEMPTED_EXIT_CODE:
        print("training was stopped after saving a checkpoint; run the same command to resume", flush=True)
    elif rc in (129, 130, 143):
        print("training was stopped; run the same command to resume from the last checkpoint", flush=True)
    return rc
