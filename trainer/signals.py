"""The rank's half of process ownership: what signals ask of a training process, and the exit
codes every rank of a run agrees on. The supervisor's half (the `./run.sh train` process that
starts and signals the ranks) is launcher/procs.py.

  SIGUSR1, the first SIGTERM   finish the step; the ranks agree on it by an all-reduce at the step
                               boundary, checkpoint together and exit with PREEMPTED_EXIT_CODE;
                               after SIGTERM a rank leaves without one train.stop_grace_seconds later
  a second SIGTERM, SIGINT,    the rank ends at once (checkpoints are committed atomically, so
  SIGHUP                       none is left half-valid)
  the owner ends               every rank watches the ./run.sh train that started it (`watch_owner`)

Under SLURM (no supervisor; srun signals every task itself) only the signal handlers apply.
"""
from __future__ import annotations

import ctypes
import os
import select
import signal
import sys
import threading
import time
from typing import NoReturn

PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL of sysexits.h: checkpointed on request, to be resumed
DIVERGED_EXIT_CODE = 3  # every rank stopped at the same diverged step (trainer/guard.py), not a crash
NO_ROOM_EXIT_CODE = 4  # every rank stopped before a checkpoint the filesystem has no room for (checkpointer.py)
REFUSED_EXIT_CODE = 2  # every rank refused the launch at start on the same finding (`refuse_together`), as
#                        ./run.sh refuses a config or relaunch before any rank starts (also 2)
AGREED_ENDS = (0, PREEMPTED_EXIT_CODE, DIVERGED_EXIT_CODE, NO_ROOM_EXIT_CODE, REFUSED_EXIT_CODE)  # all ranks end alike
OWNER_ENV = "DEEPNET_OWNER_PID"
PR_SET_PDEATHSIG = 1


def prctl_pdeathsig(sig: int) -> bool:
    """Ask the kernel to send `sig` to this process when its parent ends (Linux only)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False

class Refused(SystemExit):
    """Every rank refuses this launch on the same finding (`refuse_together`): exit REFUSED_EXIT_CODE;
    `message` is the one line rank 0 printed (launcher/worker.py records it as summary.json's reason)."""

    def __init__(self, message: str):
        super().__init__(REFUSED_EXIT_CODE)
        self.message = message


def refuse_together(message: str) -> NoReturn:
    """Called by every rank alike: rank 0 prints `message` before any rank exits (the deepspeed
    launcher ends the others as soon as one exits), then every rank raises Refused."""
    import torch.distributed as dist

    if dist.get_rank() == 0:
        print(message, file=sys.stderr, flush=True)
    dist.barrier()
    raise Refused(message)


class StopRequest:
    """What signals asked of this rank; read by the training loop at step boundaries."""

    def __init__(self):
        self.checkpoint = False  # SIGUSR1 / first SIGTERM: finish the step, checkpoint, exit 75
        self.signal_name = ""
        self.saved = False  # the stop checkpoint is committed: later signals just end the rank
        self.grace_seconds = 0.0  # after SIGTERM, the rank exits without a checkpoint this much later


stop = StopRequest()


def _rank() -> str:
    return os.environ.get("RANK", "0")


def _exit_now(code: int, why: str) -> None:
    print(f"rank {_rank()}: {why}", file=sys.stderr, flush=True)
    os._exit(code)


def install_rank_handlers(grace_seconds: float) -> None:
    """SIGUSR1 and SIGTERM ask for a checkpoint and exit at the next step boundary (the ranks agree
    on it by an all-reduce); after SIGTERM the rank exits anyway `grace_seconds` later, without a
    checkpoint (SLURM's KillWait is 30 s by default). A second SIGTERM, SIGINT and SIGHUP end the
    rank at once; checkpoints are committed atomically, so none is left half-valid."""

    stop.grace_seconds = grace_seconds

    def on_checkpoint_signal(signum, frame):
        name = signal.Signals(signum).name
        if stop.saved:  # the launcher ending the ranks after the checkpoint: nothing left to do
            os._exit(PREEMPTED_EXIT_CODE)
        if stop.checkpoint and signum == signal.SIGTERM and stop.signal_name == "SIGTERM":
            _exit_now(143, "SIGTERM again: exiting without a checkpoint")
        first = not stop.checkpoint
        stop.checkpoint, stop.signal_name = True, name
        if first and signum == signal.SIGTERM and grace_seconds > 0:
            def out_of_grace():
                if stop.saved:  # the checkpoint is committed; the rank is on its way out with 75
                    return
                _exit_now(143, f"no checkpoint within {grace_seconds:.0f} s of SIGTERM "
                               "(train.stop_grace_seconds); exiting without one")

            timer = threading.Timer(grace_seconds, out_of_grace)
            timer.daemon = True
            timer.start()

    signal.signal(signal.SIGUSR1, on_checkpoint_signal)
    signal.signal(signal.SIGTERM, on_checkpoint_signal)
    # The kernel's default action ends the process at once, also while it waits inside a
    # collective (a Python handler would run only once the call returns); the supervisor says why.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    # A file-size limit (`ulimit -f`, some clusters set one) would kill the rank mid-write; ignored,
    # the write fails with EFBIG instead and the checkpoint save reports it (trainer/checkpointer.py).
    if hasattr(signal, "SIGXFSZ"):
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)


def watch_owner() -> None:
    """Exit when the supervising ./run.sh train (DEEPNET_OWNER_PID) ends, and when this rank's
    parent (the deepspeed launcher) ends (PR_SET_PDEATHSIG)."""
    prctl_pdeathsig(signal.SIGKILL)
    owner = os.environ.get(OWNER_ENV)
    if not owner:
        return
    pid = int(owner)
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        _exit_now(1, f"the ./run.sh train that started this rank (PID {pid}) is gone; exiting")
    except (OSError, AttributeError):
        fd = None

    def wait_for_owner():
        if fd is not None:
            select.select([fd], [], [])  # readable once the process has exited
        else:  # no pidfd (old kernel): poll
            while os.path.exists(f"/proc/{pid}"):
                time.sleep(1.0)
        _exit_now(1, f"the ./run.sh train that started this rank (PID {pid}) is gone; exiting")

    threading.Thread(target=wait_for_owner, name="owner-watch", daemon=True).start()
