"""./run.sh train [CONFIG]: prepare the data, then launch the pipeline ranks on this node."""
from __future__ import annotations

import argparse
import os

from launcher.launch import DEFAULT_CONFIG, ROOT, deepspeed_command, launch_env
from trainer.config import ConfigError, load_config
from launcher.preflight import check_device, check_resume, check_run_dir
from launcher.procs import die_with_parent_shell, supervise
from trainer.signals import PREEMPTED_EXIT_CODE
from launcher.runlock import RunDirBusy, RunLock
from parallel import accelerator

HELP = "prepare data and train a model on this node (an existing run directory is resumed)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", default=DEFAULT_CONFIG, help="YAML run config")
    parser.add_argument("--run-dir", help="override run_dir of the config")
    parser.add_argument("--eval-sentences", type=int, default=50, metavar="N",
                        help="after training, translate the first N test sentences of every direction "
                             "(beam 5) and print BLEU/chrF (default 50; 0 skips; ./run.sh eval scores all)")


def gpu_count() -> int:
    """GPUs DeepSpeed would use here; 0 when run.sh chose the CPU accelerator (no GPU tooling)."""
    return accelerator.gpu_count()


def run(args: argparse.Namespace) -> int:
    from data.prepare import check_corpus

    if args.eval_sentences < 0:
        raise ConfigError(f"--eval-sentences {args.eval_sentences}: give N >= 0 (0 skips the evaluation)")
    cfg = load_config(args.config, {"run_dir": args.run_dir} if args.run_dir else None)
    check_run_dir(cfg, args.config)
    check_resume(cfg, args.config)
    check_device(cfg, args.config)
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
        raise ConfigError(f"{args.config}: {layout} needs {world} ranks, one per GPU, but this node has "
                          f"{gpus} GPUs; lower parallel.data_parallel, or run on several nodes with "
                          f"./run.sh slurm {args.config} --nodes N --gpus-per-node {gpus}")
    env = launch_env(world)
    # Cores this process may use (a cgroup, taskset or SLURM allocation may grant fewer than the
    # machine has), split evenly; unless the user set OMP_NUM_THREADS.
    cores = len(os.sched_getaffinity(0))
    threads = max(1, cores // world)
    if "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = str(threads)
    print(f"config {args.config} → run directory {cfg.run_dir}", flush=True)
    prepare_data(cfg.data, os.path.join(cfg.run_dir, "data"))
    cmd = deepspeed_command(world, "launcher.worker",
                            ["--config", os.path.abspath(args.config), "--run-dir", os.path.abspath(cfg.run_dir)])
    where = (f"{world} of {gpus} GPUs" if gpus else
             f"{cores} CPU cores, {env['OMP_NUM_THREADS']} thread(s) per rank")

    def announce():  # once signals are handled: from here on a SIGTERM gets a checkpoint
        print(f"launching {world} ranks ({layout}) on {where}", flush=True)
        if not gpus and world > cores:
            print(f"warning: {world} ranks share {cores} cores; each step will be slow", flush=True)

    env["DEEPNET_RUN_LOCK_HELD"] = "1"  # the ranks need not take the run lock themselves
    rc = supervise(cmd, env, ROOT, cfg.train.stop_grace_seconds, announce)
    if rc == PREEMPTED_EXIT_CODE:
        print("training was stopped after saving a checkpoint; run the same command to resume", flush=True)
    elif rc in (129, 130, 143):
        print("training was stopped; run the same command to resume from the last checkpoint", flush=True)
    if rc == 0 and args.eval_sentences > 0:
        from translate.evaluate import evaluate_after_training

        evaluate_after_training(cfg.run_dir, args.eval_sentences)
    return rc
