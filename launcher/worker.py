"""Training worker: one process per pipeline stage × replica, started by the deepspeed launcher
(`./run.sh train`) or by srun (a SLURM job script, launcher/slurm.py).

    deepspeed --num_gpus 2 --module launcher.worker --config configs/default.yaml

The data must already be prepared in <run_dir>/data (`./run.sh train` does that first). This is
the process around the Trainer (trainer/trainer.py): the run lock when no ./run.sh holds it, the
signal handlers, and how each way of stopping ends the rank with the exit code the launcher and
the job script act on (trainer/signals.py).
"""
from __future__ import annotations

import argparse
import atexit
import os
import re
import sys
import time
import traceback

import torch

from launcher.runlock import RunDirBusy, RunLock
from runtime import accelerator, heartbeat
from trainer import run_dir, signals
from trainer.checkpointer import NoRoomStop
from trainer.config import ConfigError, load_config
from trainer.guard import DivergenceStop
from trainer.run_dir import record_stop
from trainer.trainer import Trainer


def record_ending(trainer: Trainer | None, cfg, state: str, reason: str, code: int) -> None:
    """summary.json and train.log's `end |` line (rank 0) for a launch that ends in `state`: where
    the Trainer got as far as its steps, with its numbers (Trainer.summary); before that (a refusal
    at start, a Trainer that could not be built) with what the config `cfg` says of the launch."""
    if trainer is not None and trainer.started is not None:  # stopped inside run()
        trainer.summary(time.perf_counter() - trainer.started, state, reason, code)
    elif torch.distributed.is_initialized() and torch.distributed.get_rank() == 0:
        run_dir.record_ending(cfg.run_dir, state, reason, code, known=run_dir.launch_facts(cfg))


def record_divergence_stop(trainer: Trainer | None, cfg, error: DivergenceStop) -> None:
    """What every rank does on a divergence stop before it exits with DIVERGED_EXIT_CODE:
    summary.json (rank 0) with the events and the reason, then the message on rank 0's stderr."""
    record_ending(trainer, cfg, "diverged", str(error), signals.DIVERGED_EXIT_CODE)
    if torch.distributed.get_rank() == 0:
        message = f"error: {error}"
        print(message, file=sys.stderr, flush=True)
        if trainer is not None:  # a requeued SLURM job would diverge the same way
            record_stop(trainer.cfg.run_dir, message, signals.DIVERGED_EXIT_CODE)


_run_lock = None  # the run directory's lock when this rank took it (launched without ./run.sh)


def _comm_failure(e: BaseException) -> bool:
    if isinstance(e, getattr(torch.distributed, "DistError", ())):
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and any(k in text for k in ("Connection closed by peer", "Connection reset",
                                                                   "Timed out", "timed out",
                                                                   *accelerator.backend_error_words()))


def error_kind(e: BaseException) -> str:
    """'closed' (a peer's connection closed: it ended), 'timeout' (nobody answered in time) or 'other'."""
    text = str(e)
    if any(k in text for k in ("Connection closed by peer", "Connection reset", "Broken pipe")):
        return "closed"
    if any(k in text for k in ("Timed out", "timed out", "Timeout", "timeout")):
        return "timeout"
    return "other"


def report_lost_contact(e: BaseException, trainer: Trainer | None, rank: str, timeout_s: float) -> None:
    """A collective failed in this rank: name the rank that was lost or hung (runtime/heartbeat.py:
    who stopped beating, or is behind), in one line for the whole launch (the first survivor to
    claim the report prints it; it is also the fault report the SLURM job script reads)."""
    heartbeat.mark("lost contact")  # a fellow survivor reading the beats does not name this rank
    reason = re.sub(r"^\[[^\]]*\] ", "", str(e).splitlines()[0] if str(e) else type(e).__name__)[:120]
    if heartbeat.current() is None:  # lost before the heartbeats started (the rendezvous)
        step = f" at step {trainer.step}" if trainer is not None else ""
        print(f"error: rank {rank}: lost contact with the other ranks{step} ({reason}); stopping; "
              "the last committed checkpoint is kept", file=sys.stderr, flush=True)
        return
    finding = heartbeat.diagnose(error_kind(e), timeout_s)
    if heartbeat.claim(finding, int(rank)):
        print(f"error: rank {rank} ({heartbeat.node_name()}): {finding.line}; stopping, the last committed "
              "checkpoint is kept", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--run-dir", help="override run_dir of the config")
    parser.add_argument("--local_rank", type=int, default=None, help="set by the deepspeed launcher")
    signals.watch_owner()
    args = parser.parse_args(argv)
    rank = os.environ.get("RANK") or os.environ.get("SLURM_PROCID", "0")  # srun sets no RANK yet
    try:
        cfg = load_config(args.config, {"run_dir": args.run_dir} if args.run_dir else None)
    except ConfigError as e:
        sys.exit(f"error: {e}")
    # Before the slow start-up (DeepSpeed imports, engine build), with the run's grace: ./run.sh
    # holds a SIGTERM back until this rank handles it (launcher/procs.py).
    signals.install_rank_handlers(cfg.train.stop_grace_seconds)
    if rank == "0" and not os.environ.get("DEEPNET_RUN_LOCK_HELD"):  # e.g. started by srun
        global _run_lock
        try:  # held until this process ends; released by its exit handlers (exit_rank runs them)
            _run_lock = RunLock(cfg.run_dir).acquire()
        except RunDirBusy as e:
            sys.exit(f"error: {e}")
        atexit.register(_run_lock.release)
    from runtime.distributed import exit_rank

    trainer = None
    try:
        trainer = Trainer(cfg)
        trainer.run()
    except DivergenceStop as e:  # every rank stops at the same step (the guard's all-reduce)
        record_divergence_stop(trainer, cfg, e)
        exit_rank(signals.DIVERGED_EXIT_CODE)
    except NoRoomStop as e:  # every rank, before the same save (make_room's all-reduce)
        record_ending(trainer, cfg, "failed", str(e), signals.NO_ROOM_EXIT_CODE)
        if rank == "0":
            print(e, file=sys.stderr, flush=True)
        exit_rank(signals.NO_ROOM_EXIT_CODE)
    except signals.Refused as e:  # every rank, on the same finding at start; rank 0 printed it
        record_ending(trainer, cfg, "refused", e.message.removeprefix("error: "), e.code)
        if rank == "0":  # a SLURM job is not requeued to meet it again
            record_stop(cfg.run_dir, e.message, e.code)
        exit_rank(e.code)
    except SystemExit as e:
        if e.code == signals.PREEMPTED_EXIT_CODE:  # every rank checkpointed and met at a barrier
            exit_rank(signals.PREEMPTED_EXIT_CODE)
        if not torch.distributed.is_initialized():
            raise
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr, flush=True)  # what Python prints for sys.exit("error: …")
            heartbeat.mark(f"failed: {str(e.code).splitlines()[0]}")  # the supervisor's record of this rank
            record_ending(trainer, cfg, "failed", str(e.code).removeprefix("error: "), 1)
        # The same teardown hazard as a clean end (see exit_rank): keep the exit status asked for.
        exit_rank(e.code if isinstance(e.code, int) else int(e.code is not None), clean=False)
    except Exception as e:
        if not _comm_failure(e):
            heartbeat.mark("failed")  # its own error: the others, meeting a closed connection, say so
            if not torch.distributed.is_initialized():
                raise
            traceback.print_exc()
            exit_rank(1, clean=False)
        report_lost_contact(e, trainer, rank, cfg.train.collective_timeout_seconds)
        os._exit(1)  # no teardown of a broken process group
    exit_rank(0)


if __name__ == "__main__":
    main()
