"""A rank process's start and end: its rank variables (under srun too), torch.distributed through
DeepSpeed on the accelerator's backend, and a clean exit."""
from __future__ import annotations

import logging
import os
import random
import socket
import subprocess
import sys
from typing import NoReturn

from runtime import heartbeat
from runtime.accelerator import HOST, collective_fault_env, keep_freed_host_memory


def ephemeral_port_range() -> tuple[int, int]:
    """The kernel's range of ports for outgoing connections and bind(0) (Linux's default if unknown)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A TCP port free now on this host, chosen below the ephemeral range where there is room.

    A port from bind(0) is an ephemeral one: between this check and the rendezvous binding it,
    another process's outgoing connection may take it (two trainers started together failed with
    EADDRINUSE on the master port: the other one's gloo connections had it). Ports below the
    ephemeral range are taken only by explicit binds. The draw uses the OS's randomness, not the
    training RNG streams.
    """
    low, _ = ephemeral_port_range()
    draw = random.SystemRandom()
    if low - 4096 > 1024:
        for _ in range(64):
            port = draw.randrange(max(1024, low - 12000), low)
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def slurm_rank_env(environ: dict | None = None) -> dict[str, str]:
    """torch.distributed's rank variables for a task started by `srun`, one task per device.

    srun sets SLURM_PROCID/SLURM_LOCALID/SLURM_STEP_NUM_TASKS but no RANK/LOCAL_RANK/WORLD_SIZE,
    and deepspeed.init_distributed does not read SLURM_* (it tries MPI discovery and fails).
    Ranks are started by srun itself rather than by torchrun per node, so that SLURM signals and
    kills every rank directly: the preemption signal reaches each trainer (torchrun's agent would
    not forward SIGUSR1) and `--kill-on-bad-exit` ends the job when one rank dies instead of
    leaving the others blocked in a collective. MASTER_ADDR is the step's first node (where task 0
    runs); MASTER_PORT is derived from the job id so that every task finds the same one alone.
    Empty outside an srun step (the batch script has no SLURM_STEP_ID) or when a launcher
    (deepspeed, torchrun) has already set RANK.
    """
    env = os.environ if environ is None else environ
    if "RANK" in env or "SLURM_STEP_ID" not in env or "SLURM_PROCID" not in env:
        return {}
    out = {"RANK": env["SLURM_PROCID"], "LOCAL_RANK": env.get("SLURM_LOCALID", "0"),
           "WORLD_SIZE": env.get("SLURM_STEP_NUM_TASKS", env.get("SLURM_NTASKS", "1"))}
    if "MASTER_ADDR" not in env:
        nodelist = env.get("SLURM_STEP_NODELIST", env.get("SLURM_JOB_NODELIST", ""))
        try:
            hosts = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                                   text=True, check=True, timeout=60).stdout.split()
        except (OSError, subprocess.SubprocessError) as e:
            raise SystemExit(f"error: cannot expand SLURM's node list {nodelist!r} with `scontrol show "
                             f"hostnames` ({e}); export MASTER_ADDR=<first node> before srun") from None
        out["MASTER_ADDR"] = hosts[0]
    if "MASTER_PORT" not in env:
        out["MASTER_PORT"] = str(20000 + int(env.get("SLURM_JOB_ID", "0")) % 20000)
    return out


def setup_distributed(timeout_seconds: float | None = None) -> None:
    """Initialise torch.distributed through DeepSpeed on the accelerator's own backend.

    Without a launcher (plain `python`), a world of one process is assumed. On CPU, DeepSpeed
    would JIT-compile a shared-memory all-reduce op (60–90 s, needs g++/ninja) that only its
    inference path uses; marking no op as compatible skips the build. `__compatible_ops__` is
    read only by that one check in deepspeed.comm.torch (0.19.8). `timeout_seconds`: how long a
    collective may wait for the other ranks before it fails (train.collective_timeout_seconds).
    """
    import datetime

    import deepspeed
    import deepspeed.comm as dist
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    if dist.is_initialized():
        return
    for key, value in slurm_rank_env().items():
        os.environ.setdefault(key, value)
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"),
                       ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    for key, value in collective_fault_env().items():  # a lost rank fails collectives, not hangs them
        os.environ.setdefault(key, value)
    accelerator = get_accelerator()
    if accelerator.device_name() == HOST:
        deepspeed.ops.__compatible_ops__ = {}
        keep_freed_host_memory()  # tensors live in host memory: reuse it rather than fault it in each step
    else:
        accelerator.set_device(int(os.environ["LOCAL_RANK"]))
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    timeout = {} if timeout_seconds is None else {"timeout": datetime.timedelta(seconds=timeout_seconds)}
    deepspeed.init_distributed(dist_backend=accelerator.communication_backend_name(),
                               auto_mpi_discovery=False, verbose=False, **timeout)


def finish_distributed() -> None:
    """Wait for every rank (a barrier), then destroy the process groups. Only for clean ends
    (done, preempted, agreed divergence stop), where every rank reaches this call: after an error
    another rank may still be inside a collective, and the launcher ends the ranks anyway.
    Entry points end through `exit_rank`, which calls this first."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def exit_rank(code: int = 0, clean: bool = True) -> NoReturn:
    """End a rank that finished cleanly with exit status `code`, skipping interpreter teardown.
    `clean=False` (a rank that failed: another may still be inside a collective, so no barrier and
    no thread is waited for) keeps only the exit handlers, the flush and the os._exit.

    Why not a plain return: gloo's worker threads release finished collectives on their own
    schedule, also after the barrier and `destroy_process_group` have returned (the groups live
    on while anything holds them). Releasing one drops tensors that own Python objects, which
    takes the GIL; once the interpreter has begun to finalize, CPython 3.11 ends such a thread
    with pthread_exit, whose unwinding through the noexcept destructor calls std::terminate
    ("terminate called without an active exception", SIGABRT). Seen here in 1 of 40 runs of a
    two-rank job on 2 loaded cores; pytorch/pytorch#190489 (torch's decref guards on
    Py_IsInitialized, still true while finalizing). A finished run then reports a failed rank and
    a preempted one exits with -6 instead of the requeue code, so SLURM does not requeue it.

    So: meet the other ranks and destroy the groups (`finish_distributed`; should another rank be
    gone already, say so and go on), wait for this process's non-daemon threads and run its
    atexit handlers and flush stdio, as a normal exit would, then `os._exit(code)` before
    finalization begins. Every file the ranks write is
    closed (checkpoints committed, metrics appended and closed, TensorBoard flushed per write)
    before this is reached."""
    import atexit
    import threading

    heartbeat.mark(f"exited {code}")  # a rank leaving on purpose is not named as a lost one
    if clean:
        try:
            finish_distributed()
        except Exception as e:  # another rank is gone; this one's work is done: leave all the same
            print(f"rank {os.environ.get('RANK', '0')}: could not meet the other ranks at exit "
                  f"({str(e).splitlines()[0][:120] if str(e) else type(e).__name__})", file=sys.stderr, flush=True)
        else:
            threading._shutdown()  # what Py_FinalizeEx does first: join the non-daemon threads
    atexit._run_exitfuncs()  # then its exit handlers (logging's flush among them)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing more can be said
            pass
    os._exit(code)
