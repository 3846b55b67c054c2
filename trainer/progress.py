"""What a run shows while it trains (rank 0): every train.log_interval steps one line with the
step, loss, learning rate, gradient norm and tokens/s, then step/total, the time this launch has
run and an ETA from this launch's measured step rate:

    2026-11-26 14:03:07 | step 90 | loss 5.7979 | lr 9.100e-04 | grad norm 1.568 | tokens/s 4594 | 90/300 30% | elapsed 0:00:52 | ETA 0:02:03 (14:05:10)

On a terminal the lines scroll above a tqdm bar; elsewhere (a pipe, a file, a SLURM log) they are
plain lines. The same lines, and the run's other events (validation, checkpoints, the summary),
are appended to <run_dir>/train.log, which keeps every launch of the run (each begins with a
`launch` line)."""
from __future__ import annotations

import datetime
import io
import os
import socket
import sys
import time

LOG_NAME = "train.log"


def stamp(now: float | None = None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now))


def duration(seconds: float) -> str:
    """h:mm:ss (days when longer), as tqdm prints it."""
    return str(datetime.timedelta(seconds=int(max(0.0, seconds))))


def append_log(run_dir: str, text: str) -> None:
    """One timestamped line at the end of <run_dir>/train.log; a log that cannot be written (a full
    disk) never stops a run."""
    try:
        with open(os.path.join(run_dir, LOG_NAME), "a", encoding="utf-8") as f:
            f.write(f"{stamp()} | {text}\n")
    except OSError:
        pass


class Progress:
    """Rank 0's progress lines (console and train.log); on other ranks every call does nothing."""

    def __init__(self, run_dir: str, first_step: int, total_steps: int, enabled: bool = True,
                 console=None, clock=time.monotonic):
        self.run_dir, self.first, self.total = run_dir, first_step, total_steps
        self.enabled = enabled
        self.console = console or sys.stdout
        self.clock = clock
        self.launched = self.started = clock()  # the launch; its first step (start_steps)
        self.bar = None
        if not enabled:
            return
        # Output already sent to train.log itself (experiments/depth_1000.py redirects the ranks
        # there): written once.
        self.to_file = not same_file(self.console, os.path.join(run_dir, LOG_NAME))
        if _is_terminal(self.console) and total_steps > first_step:
            from tqdm import tqdm

            # A terminal that reports no size (a pseudo-terminal without one, where tqdm would hide
            # the bar) gets 100 columns.
            width = {"dynamic_ncols": True} if _columns(self.console) > 0 else {"ncols": 100, "nrows": 20}
            self.bar = tqdm(total=total_steps, initial=first_step, unit="step", file=self.console, smoothing=0,
                            leave=True, bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}]{postfix}",
                            **width)
        self.file_line(f"launch at step {first_step} of {total_steps} on {socket.gethostname()} "
                       f"(PID {os.getpid()})")

    # ---- what is shown --------------------------------------------------------------------------
    def start_steps(self) -> None:
        """The steps begin: the rate is measured from here (after the start-up and the step-0
        validation, which a remaining step does not repeat); elapsed counts from the launch."""
        self.started = self.clock()

    def eta(self, step: int) -> tuple[float, float | None]:
        """(seconds since the launch, seconds left at the step rate measured in this launch: its
        time per step so far, validations and checkpoints included; None before its first step)."""
        now = self.clock()
        done = step - self.first
        if done <= 0:
            return now - self.launched, None
        return now - self.launched, (self.total - step) * (now - self.started) / done

    def step_line(self, step: int, loss: float, lr: float, grad_norm: float, tokens_per_s: float) -> str:
        elapsed, left = self.eta(step)
        share = f"{step}/{self.total} {step / self.total:.0%}" if self.total else str(step)
        eta = ("ETA -" if left is None else
               f"ETA {duration(left)} ({time.strftime('%H:%M:%S', time.localtime(time.time() + left))})")
        return (f"step {step} | loss {loss:.4f} | lr {lr:.3e} | grad norm {grad_norm:.3f} | tokens/s "
                f"{tokens_per_s:.0f} | {share} | elapsed {duration(elapsed)} | {eta}")

    # ---- where it goes --------------------------------------------------------------------------
    def advance(self, step: int) -> None:
        """A step ended (every step: the bar moves; nothing else is written)."""
        if self.bar is not None:
            if step >= self.bar.n:
                self.bar.update(step - self.bar.n)
            else:  # a rollback to an earlier checkpoint
                self.bar.n = step
                self.bar.refresh()

    def report(self, step: int, loss: float, lr: float, grad_norm: float, tokens_per_s: float) -> None:
        """The log_interval line."""
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.set_postfix_str(f"loss {loss:.4f}", refresh=False)
        self.log(self.step_line(step, loss, lr, grad_norm, tokens_per_s))

    def log(self, text: str) -> None:
        """A timestamped line on the console (above the bar on a terminal) and in train.log."""
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(f"{stamp()} | {text}", file=self.console)
        else:
            print(f"{stamp()} | {text}", file=self.console, flush=True)
        if self.to_file:
            append_log(self.run_dir, text)

    def file_line(self, text: str) -> None:
        """A line for train.log only (through the console when that is train.log)."""
        if not self.enabled:
            return
        if self.to_file:
            append_log(self.run_dir, text)
        elif self.bar is None:
            print(f"{stamp()} | {text}", file=self.console, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def same_file(stream, path: str) -> bool:
    try:
        return os.path.samestat(os.fstat(stream.fileno()), os.stat(path))
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        return False


def _columns(stream) -> int:
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        return 0


def _is_terminal(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def log0(*args) -> None:
    """A line of rank 0 for the console."""
    import torch.distributed

    if torch.distributed.get_rank() == 0:
        print(*args, flush=True)


def note0(run_dir: str, text: str) -> None:
    """A line of rank 0 for the console and train.log (where the console is not train.log already)."""
    import torch.distributed

    if torch.distributed.get_rank() != 0:
        return
    print(text, flush=True)
    if not same_file(sys.stdout, os.path.join(run_dir, LOG_NAME)):
        append_log(run_dir, text)
