"""Process ownership: the ranks of a run live exactly as long as the `./run.sh train` that started them.

Two halves.

The supervisor (`supervise`, in the `./run.sh train` process) starts the deepspeed launcher in a
session and process group of its own, so the terminal's Ctrl-C/hang-up reaches only the supervisor,
which decides what the ranks get, and one `killpg` reaches every process of the run however the
launcher and the ranks are nested or reparented. The deepspeed launcher does not do this itself:
its runner (`deepspeed`, runner.py) installs no signal handler on one node, so a SIGTERM to it
leaves `deepspeed.launcher.launch` and the ranks running; launch.py forwards SIGINT/SIGTERM to
its children, then SIGKILLs them 30 s later, and ends the rest when one rank exits non-zero.

  SIGTERM (kill, scancel, SLURM's time limit),  → the same signal to every rank: each finishes its
  SIGUSR1                                          step, the ranks checkpoint together and exit with
      PREEMPTED_EXIT_CODE. After SIGTERM, ranks that are not gone `train.stop_grace_seconds` later
      (+5 s) are killed; the last committed checkpoint stays valid (checkpoint/manifest.py).
  SIGINT (Ctrl-C), SIGHUP (terminal closed)      → SIGKILL to every process of the run: they stop at
      once, without a checkpoint (a signal a Python process handles would print a traceback in a
      rank still importing and wait for a rank blocked in a collective).
  a second signal of any kind                    → SIGKILL to the whole group.
  the supervisor itself dies (kill -9)           → every rank watches it (`watch_owner`) and exits.
  its parent shell dies                          → it gets SIGHUP (PR_SET_PDEATHSIG), unless SIGHUP
      was ignored when it started (`nohup ./run.sh train &` keeps running).
  a rank dies or fails                           → the supervisor names it and SIGKILLs the others.

The rank half (`install_rank_handlers`, `watch_owner`) runs in every training process and lives in
trainer/signals.py; under SLURM (no supervisor; srun signals every task itself) only the signal
handlers apply.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from trainer.signals import AGREED_ENDS, OWNER_ENV, prctl_pdeathsig

KILL_AFTER = 5.0  # seconds a rank gets to leave after an immediate stop before it is killed


class Supervisor:
    def __init__(self, cmd: list[str], env: dict, cwd: str, grace_seconds: float,
                 log=lambda msg: print(msg, file=sys.stderr, flush=True), run_dir: str | None = None):
        self.cmd, self.env, self.cwd, self.grace, self.log = cmd, env, cwd, grace_seconds, log
        self.run_dir = run_dir  # where the ranks' heartbeats say why a rank failed (runtime/heartbeat.py)
        self.proc: subprocess.Popen | None = None
        self.deadline: float | None = None
        self.signals: list[int] = []
        self.ranks: dict[int, int] = {}  # pid → global rank
        self.signalled: set[int] = set()
        self.dead_rank: tuple[int, int] | None = None
        self.dead_code = 1  # the exit status of the rank that died first (a signal N: -N)
        self.vanished: dict[int, int] = {}  # pid → rank, ended and already reaped by the launcher
        self.dead_why = ""  # how the rank that died first ended ("exit code 1", "signal SIGKILL")

    # signals arrive in the main thread between polls; the handler only records and forwards
    def _on_signal(self, signum, frame) -> None:
        self.signals.append(signum)
        if len(self.signals) > 1:
            self.log(f"{signal.Signals(signum).name} again: killing every rank now")
            self._killpg(signal.SIGKILL)
            self.deadline = time.monotonic()
            return
        if signum in CHECKPOINT_SIGNALS:
            name = signal.Signals(signum).name
            self.log(f"{name}: the ranks finish their step, checkpoint and exit "
                     f"(killed if not gone {self.grace:.0f} s after they get it)")
            # Until a rank handles it (still starting: `_deliver` holds it back) only a bound on the
            # start-up; each delivery then gives the ranks their grace.
            self.deadline = time.monotonic() + max(START_UP_BOUND, self.grace + KILL_AFTER)
            self._signal_ranks(signum)
        else:
            # Stop at once: SIGKILL to every process of the run. The signal itself would reach a rank
            # still importing as a KeyboardInterrupt (a traceback), the deepspeed launcher as one too,
            # and a rank blocked in a collective only when the call returns; no checkpoint is
            # promised, and a committed one cannot be damaged (checkpoint/manifest.py).
            self.log(f"{signal.Signals(signum).name}: stopping every rank now (the last checkpoint is kept)")
            self._killpg(signal.SIGKILL)
            self.deadline = time.monotonic() + KILL_AFTER

    def _find_ranks(self) -> None:
        import psutil

        if self.proc is None:  # a signal before the launcher started: the ranks get it once they exist
            return

        try:
            for child in psutil.Process(self.proc.pid).children(recursive=True):
                if child.pid not in self.ranks:
                    try:
                        rank = child.environ().get("RANK")
                    except (psutil.Error, OSError):
                        continue
                    if rank is not None:
                        self.ranks[child.pid] = int(rank)
        except psutil.Error:
            pass

    def _signal_ranks(self, signum: int) -> None:
        self._find_ranks()
        for pid in list(self.ranks):
            self._deliver(pid, signum)

    def _deliver(self, pid: int, signum: int) -> None:
        """Send `signum` to a rank; a checkpoint signal waits until the rank handles it (a rank
        still starting Python would die of it without a checkpoint): `_signal_late_ranks` retries."""
        if signum in CHECKPOINT_SIGNALS and not handles(pid, signum):
            if _exit_status(pid) is not None:  # ended (a zombie, or reaped): nothing to wait for
                self.signalled.add(pid)
            return
        self.signalled.add(pid)
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            return
        if signum in CHECKPOINT_SIGNALS and len(self.signals) == 1:
            # the rank's grace (train.stop_grace_seconds) starts now, not when the signal came
            self.deadline = time.monotonic() + self.grace + KILL_AFTER

    def _pending(self) -> bool:
        return len(self.signals) == 1 and bool(set(self.ranks) - self.signalled)

    def _signal_late_ranks(self) -> None:
        """Ranks the launcher started after the signal came, or that were not handling it yet, get
        it too."""
        if self._pending():
            for pid in set(self.ranks) - self.signalled:
                self._deliver(pid, self.signals[0])

    def _killpg(self, signum: int) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass

    def _group_alive(self) -> bool:
        try:
            os.killpg(self.proc.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        # Zombies count for killpg: a group of only zombies (reaped by init later) is gone.
        import psutil

        for p in psutil.process_iter(["status"]):
            try:
                if os.getpgid(p.pid) == self.proc.pid and p.info["status"] != psutil.STATUS_ZOMBIE:
                    return True
            except (ProcessLookupError, psutil.Error, OSError):
                continue
        return False

    def _check_ranks(self) -> None:
        """Name the first rank that dies while the run is neither stopping nor done. A rank that
        ended stays a zombie until the deepspeed launcher reaps it (it polls once a second); its
        exit status is in /proc/PID/stat meanwhile."""
        if self.dead_rank or self.signals:
            return
        dead = []
        for pid, rank in list(self.ranks.items()):  # a signal handler may add ranks meanwhile
            status = _exit_status(pid)
            if status is None:
                continue
            if status == "gone":
                self.vanished.setdefault(pid, rank)
                continue
            code = status >> 8 if status & 0x7F == 0 else -(status & 0x7F)
            if code not in AGREED_ENDS:  # ends the other ranks reach too
                dead.append((code >= 0, rank, pid, code))
        if not dead:
            return
        # A rank killed by a signal first: its peers see their connections close and exit with an
        # error within milliseconds, often in the same 0.1 s between two checks.
        _, rank, pid, code = min(dead)
        why = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        self.dead_rank = (rank, pid)
        self.dead_code = code
        self.dead_why = why
        others = sorted(r for _, r, _, _ in dead if r != rank)
        also = f" (rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))} failed with it)" if others else ""
        how = "died" if code < 0 else "failed"  # killed by a signal, or exited with an error of its own
        self.log(f"rank {rank} (PID {pid}) {how} ({why}); stopping the other ranks{also}")
        # SIGKILL: a peer's collectives can only fail now, and a rank still importing would print a
        # KeyboardInterrupt traceback for SIGINT (its handler is not installed yet)
        self._signal_ranks(signal.SIGKILL)
        self.deadline = time.monotonic() + KILL_AFTER

    def run(self, announce=lambda: None) -> int:
        """Start the launcher and supervise it; `announce` runs once this process handles the
        signals (a signal from then on reaches the ranks, also one sent before they start)."""
        handled = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT, signal.SIGHUP)
        hup_ignored = signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
        previous = {s: signal.getsignal(s) for s in handled}
        env = dict(self.env, **{OWNER_ENV: str(os.getpid())})
        for s in handled:
            if not (s == signal.SIGHUP and hup_ignored):
                signal.signal(s, self._on_signal)
        try:
            announce()
            if self.signals and (len(self.signals) > 1 or self.signals[0] not in CHECKPOINT_SIGNALS):
                return 128 + self.signals[0]  # stop at once, before anything started
            # A SIGTERM that came already is held for the ranks: they checkpoint after one step.
            self.proc = subprocess.Popen(self.cmd, env=env, cwd=self.cwd, start_new_session=True)
            next_scan = next_check = 0.0
            while self.proc.poll() is None:
                now = time.monotonic()
                if now >= next_scan:  # the process tree: often until ranks appear, then rarely
                    self._find_ranks()
                    self._signal_late_ranks()
                    next_scan = now + (2.0 if self.ranks and not self._pending() else 0.1)
                if now >= next_check:  # one /proc read per rank
                    self._check_ranks()
                    next_check = now + 0.1
                if self.deadline is not None and now >= self.deadline:
                    self.log("processes of the run still there past the deadline: killing them")
                    self._killpg(signal.SIGKILL)
                    self.deadline = None
                try:
                    self.proc.wait(timeout=0.1)
                except subprocess.TimeoutExpired:
                    pass
            rc = self.proc.returncode
        finally:
            # Whatever ended the launcher, nothing of the run outlives this function.
            if self.proc is not None:
                if self.proc.poll() is None:
                    self._killpg(signal.SIGKILL)
                    self.proc.wait()
                self._reap_group()
            for s, h in previous.items():
                signal.signal(s, h)
        if rc not in AGREED_ENDS and not self.dead_rank and not self.signals \
                and self.vanished:
            first = next(iter(self.vanished.items()))  # in the order they were seen gone
            self.log(f"rank {first[1]} (PID {first[0]}) ended first; the deepspeed launcher stopped the others")
        if self.dead_rank and not self.signals:  # its status, not the launcher's for the ranks it then ended
            rc = self.dead_code if self.dead_code > 0 else 128 - self.dead_code
        if self.signals and rc not in AGREED_ENDS[1:]:
            rc = 128 + self.signals[0]
        return rc

    def ending(self, rc: int) -> tuple[str, str] | None:
        """(state, reason) of a launch that ended with `rc` in a way the ranks could not record
        themselves (they record the ends they agree on: AGREED_ENDS); None for those."""
        if rc in AGREED_ENDS:
            return None
        if self.signals:
            name = signal.Signals(self.signals[0]).name
            if len(self.signals) > 1:
                return "stopped", f"{name}, then another signal: every process of the run was killed"
            if self.signals[0] in CHECKPOINT_SIGNALS:
                return "stopped", f"{name}: the ranks exited without a checkpoint"
            what = {signal.SIGINT: "Ctrl-C", signal.SIGHUP: "the terminal closed"}.get(self.signals[0], "")
            return "stopped", f"{name}{f' ({what})' if what else ''}: every rank stopped at once, without a checkpoint"
        if self.dead_rank:
            rank, pid = self.dead_rank
            if self.dead_code < 0:
                return "failed", f"rank {rank} (PID {pid}) died ({self.dead_why})"
            said = self._failure_message(rank, pid)  # the end line adds the exit code
            return "failed", f"rank {rank} (PID {pid}) failed{': ' + said if said else ''}"
        return "failed", "the ranks ended with an error"

    def _failure_message(self, rank: int, pid: int) -> str:
        """The message rank `rank` (process `pid`) printed as it failed, from its heartbeat
        (launcher/worker.py marks it `failed: MESSAGE`); "" where it left none."""
        from runtime import heartbeat

        if self.run_dir is None:
            return ""
        record = heartbeat.read_rank(self.run_dir, rank)
        state = (record or {}).get("state", "")
        if not record or record.get("pid") != pid or not state.startswith("failed: "):
            return ""
        return state.removeprefix("failed: ").removeprefix("error: ").removeprefix(f"rank {rank}: ")

    def _reap_group(self) -> None:
        end = time.monotonic() + KILL_AFTER
        while self._group_alive():
            if time.monotonic() >= end:
                self._killpg(signal.SIGKILL)
                end = time.monotonic() + 60
            time.sleep(0.05)


CHECKPOINT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)  # a rank checkpoints and exits 75 (install_rank_handlers)
START_UP_BOUND = 600.0  # s from a SIGTERM to the kill while no rank has taken it yet (still starting)


def handles(pid: int, signum: int) -> bool:
    """Whether process `pid` has a handler for `signum` installed (Linux: the SigCgt mask of
    /proc/PID/status); True where /proc does not tell."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    except FileNotFoundError:
        return not os.path.exists("/proc/self/status")  # gone, or no procfs at all
    except (OSError, ValueError):
        pass
    return True


def _exit_status(pid: int):
    """None while `pid` runs; its wait status while it is a zombie; "gone" once reaped."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return "gone"
    if fields[0] != "Z":
        return None
    return int(fields[49]) if len(fields) > 49 else "gone"  # field 52: exit_code (Linux >= 3.5)


def die_with_parent_shell() -> None:
    """SIGHUP to this process when its parent (the shell that ran ./run.sh) ends, unless SIGHUP is
    ignored (nohup): a shell killed outright sends its jobs nothing."""
    if signal.getsignal(signal.SIGHUP) != signal.SIG_IGN:
        prctl_pdeathsig(signal.SIGHUP)


def supervise(cmd: list[str], env: dict, cwd: str, grace_seconds: float,
              announce=lambda: None, run_dir: str | None = None) -> tuple[int, tuple[str, str] | None]:
    """Run and supervise the launch: (its exit code, (state, reason) where the ranks could not record
    how it ended: `Supervisor.ending`)."""
    supervisor = Supervisor(cmd, env, cwd, grace_seconds, run_dir=run_dir)
    rc = supervisor.run(announce)
    return rc, supervisor.ending(rc)
