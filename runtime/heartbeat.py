"""Heartbeats: which rank is alive, on which node, and how far it got, so that a rank that meets a
failed collective can name the rank that was lost or hung instead of just saying it lost contact.

Every rank of a training run writes `<run_dir>/heartbeat/rank00007.json` every `INTERVAL` seconds
from a daemon thread: its node (SLURMD_NODENAME, else the hostname), PID, a beat counter, the
launch, and where the training loop is (steps completed, phase, a phase counter that every rank
advances alike: `at`). One small file per rank, written under a temporary name and renamed: on
NFS the close flushes it and a reader on another node opens the new file (close-to-open), so no
clock and no lock is shared. The files are read only when something failed.

- A process that is SIGKILLed or crashes, one that is SIGSTOPped, a node that loses its power or
  its network: its beats stop (a stopped process's threads all stop).
- A rank stuck in a long computation, or inside a collective the others never joined, keeps
  beating; its phase counter says whether it got as far as the others.
- Ranks that leave say so first (`mark`): `exited N`, `failed` (its own error is printed; `failed:
  MESSAGE` when it is one line, which the supervisor of `./run.sh train` records),
  `lost contact` (a survivor that is stopping), so that nobody names them as the lost one.

`diagnose` (in a survivor, after a collective failed) reads every rank twice, `DIAGNOSE_WAIT`
apart, and names the ranks whose beats stopped or that are behind; `claim` lets one rank per
launch report it (the first to create `fault-<launch>.json`, which the SLURM job script reads);
`post_mortem` names the lost ranks from the files alone once every rank has ended (on GPUs NCCL's
watchdog ends the survivors itself: launcher/faults.py).
"""
from __future__ import annotations

import json
import os
import re
import socket
import threading
import time
from dataclasses import dataclass, field

INTERVAL = 2.0
"""Seconds between two beats of a rank."""
DIAGNOSE_WAIT = 2.5 * INTERVAL
"""How long a survivor watches the other ranks' beats before it names the ones that stopped."""
DIR = "heartbeat"
LAUNCH_ENV = "DEEPNET_LAUNCH_ID"
"""Set by the SLURM job script to `<job id>.<restart count>`: the launch the beats belong to."""


def node_name() -> str:
    """SLURM's name of this node (what `scontrol` and the job log call it), else the hostname."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def launch_id() -> str:
    """One id shared by the ranks of one launch: the job script's, else the rendezvous address."""
    given = os.environ.get(LAUNCH_ENV)
    if given:
        return given
    return f"{os.environ.get('MASTER_ADDR', 'local')}-{os.environ.get('MASTER_PORT', '0')}"


def _safe(text: str) -> str:
    return re.sub(r"[^\w.\-]", "_", text)


def rank_path(run_dir: str, rank: int) -> str:
    return os.path.join(run_dir, DIR, f"rank{rank:05d}.json")


def fault_path(run_dir: str, launch: str) -> str:
    return os.path.join(run_dir, DIR, f"fault-{_safe(launch)}.json")


def _write(path: str, text: str) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


class Heartbeat:
    """This rank's beats (one daemon thread); `at` and `mark` change what the next beat says."""

    def __init__(self, run_dir: str, rank: int, world: int, launch: str | None = None):
        self.run_dir, self.rank, self.world = run_dir, rank, world
        self.path = rank_path(run_dir, rank)
        self.record = {"rank": rank, "world": world, "node": node_name(), "pid": os.getpid(),
                       "launch": launch or launch_id(), "beat": 0, "time": 0.0, "step": 0,
                       "phase": "start-up", "seq": 0, "state": "running"}
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.stopped = False

    def start(self) -> Heartbeat:
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        self.beat()
        threading.Thread(target=self._run, name="heartbeat", daemon=True).start()
        return self

    def _run(self) -> None:
        while not self.stopped:
            self.wake.wait(INTERVAL)
            self.wake.clear()
            try:
                self.beat()
            except OSError:  # a full or briefly unreachable file system: the next beat tries again
                pass

    def beat(self) -> None:
        with self.lock:
            self.record["beat"] += 1
            self.record["time"] = time.time()
            text = json.dumps(self.record)
        _write(self.path, text)

    def at(self, step: int, phase: str) -> None:
        """The training loop is in `phase` with `step` steps completed (every rank passes the same
        phases in the same order); written with the next beat."""
        with self.lock:
            self.record.update(step=step, phase=phase, seq=self.record["seq"] + 1)

    def mark(self, state: str) -> None:
        """Why this rank is leaving (`exited 0`, `failed`, `lost contact`); written at once, and
        the beats stop."""
        with self.lock:
            self.record["state"] = state
        self.stopped = True
        try:
            self.beat()
        except OSError:
            pass


_current: Heartbeat | None = None


def start(run_dir: str) -> Heartbeat:
    """Start this rank's beats (once per process and run directory; RANK and WORLD_SIZE as
    torch.distributed has them).
    Rank 0 removes the fault reports of earlier launches (the job script has read them)."""
    global _current
    if _current is not None and _current.run_dir != run_dir:  # another run in this process (tests)
        _current.stopped = True
        _current = None
    if _current is None:
        rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
        _current = Heartbeat(run_dir, rank, world).start()
        if rank == 0:
            mine = os.path.basename(fault_path(run_dir, _current.record["launch"]))
            folder = os.path.join(run_dir, DIR)
            for name in os.listdir(folder):
                if name.startswith("fault-") and name != mine:
                    try:
                        os.remove(os.path.join(folder, name))
                    except OSError:
                        pass
    return _current


def current() -> Heartbeat | None:
    return _current


def at(step: int, phase: str) -> None:
    if _current is not None:
        _current.at(step, phase)


def mark(state: str) -> None:
    if _current is not None and not _current.stopped:
        _current.mark(state)


# ---- reading the beats -------------------------------------------------------------------------

def read_rank(run_dir: str, rank: int) -> dict | None:
    """Rank `rank`'s newest record, of whichever launch (None: no file)."""
    for _ in range(3):  # a reader may catch a file between its write and its rename: retry
        try:
            with open(rank_path(run_dir, rank), encoding="utf-8") as f:
                return json.load(f)
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            time.sleep(0.05)
    return None


def read(run_dir: str, world: int, launch: str) -> dict[int, dict | None]:
    """Every rank's newest record of `launch` (None: no file, or one of another launch)."""
    out: dict[int, dict | None] = {}
    for rank in range(world):
        record = read_rank(run_dir, rank)
        out[rank] = record if record and record.get("launch") == launch else None
    return out


def where(record: dict) -> str:
    """'in step 16 (train)' or 'after step 15 (checkpoint save)'."""
    step, phase = record.get("step", 0), record.get("phase", "?")
    if phase == "train":
        return f"in step {step + 1} (train)"
    if phase == "start-up":
        return f"at start-up (resuming at step {step})" if step else "at start-up"
    return f"after step {step} ({phase})"


def _who(ranks: list[int], records: dict[int, dict | None]) -> str:
    """'rank 1 on node2 (PID 4242)', 'ranks 2, 3 on node5 (PIDs …)', nodes in rank order."""
    by_node: dict[str, list[int]] = {}
    for r in ranks:
        by_node.setdefault((records.get(r) or {}).get("node", "an unknown node"), []).append(r)
    parts = []
    for node, rs in by_node.items():
        pids = [str(records[r]["pid"]) for r in rs if records.get(r)]
        label = f"rank {rs[0]}" if len(rs) == 1 else "ranks " + ", ".join(map(str, rs))
        pid = f" (PID{'s' if len(pids) > 1 else ''} {', '.join(pids)})" if pids else ""
        parts.append(f"{label} on {node}{pid}" if pids else f"{label} (no heartbeat)")
    return "; ".join(parts)


@dataclass
class Finding:
    """What a survivor or the post-mortem found: the ranks to blame and one line saying so."""

    kind: str  # died | unresponsive | stuck | failed | missing | unknown
    ranks: list[int]
    nodes: list[str]
    step: int | None  # steps completed when it happened (the recurrence key of launcher/faults.py)
    where: str
    line: str
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"kind": self.kind, "ranks": self.ranks, "nodes": self.nodes, "step": self.step,
                "where": self.where, "line": self.line, **self.extra}


def diagnose(error_kind: str, timeout_s: float | None, wait: float = DIAGNOSE_WAIT) -> Finding:
    """In a rank whose collective just failed (`error_kind`: 'closed' when a peer's connection
    closed, 'timeout' when nobody answered within `timeout_s`): which ranks are to blame. Takes
    `wait` seconds (two reads of every rank's beats)."""
    me = _current
    if me is None:
        return Finding("unknown", [], [], None, "", "no heartbeats in this process")
    run_dir, world, launch = me.run_dir, me.world, me.record["launch"]
    own = dict(me.record)
    first = read(run_dir, world, launch)
    time.sleep(wait)
    second = read(run_dir, world, launch)
    failed, missing, silent, alive, leaving = [], [], [], {}, False
    for rank in range(world):
        if rank == me.rank:
            continue
        rec = second[rank]
        if rec is None:
            missing.append(rank)
        elif rec["state"].startswith("failed"):
            failed.append(rank)
        elif rec["state"] != "running":  # exited, or a fellow survivor that lost contact too
            leaving = leaving or rec["state"] == "lost contact"
            continue
        elif first[rank] is not None and first[rank]["beat"] == rec["beat"]:
            silent.append(rank)
        else:
            alive[rank] = rec
    records = {r: second[r] for r in range(world)}
    records[me.rank] = own
    waited = f"train.collective_timeout_seconds={timeout_s:g}" if timeout_s else "the collective timeout"
    if failed:
        rec = records[failed[0]]
        return _finding("failed", failed, records, rec, f"{_who(failed, records)} failed {where(rec)} "
                        "(its error is above)")
    if silent:  # its record may be a beat behind: where this rank is, it was (collectives keep them in step)
        rec = own
        age = time.time() - max(records[r]["time"] for r in silent)
        # A closed connection names a dead peer only while no other survivor has left (closing its own).
        died = error_kind == "closed" and not leaving
        if died:
            how = f"died: its connection closed and its heartbeat stopped {age:.0f} s ago"
        else:
            how = (f"stopped responding: no heartbeat for {age:.0f} s and no answer within {waited} "
                   "(a hung or stopped process, or its node or network is gone)")
        kind = "died" if died else "unresponsive"
        return _finding(kind, silent, records, rec, f"lost {_who(silent, records)} {where(rec)}: {how}")
    if missing:
        return _finding("missing", missing, records, own, f"{_who(missing, records)} was lost during start-up "
                        "(it wrote no heartbeat in this launch)")
    if alive:
        furthest = max([own["seq"], *(r["seq"] for r in alive.values())])
        behind = sorted(r for r, rec in alive.items() if rec["seq"] < furthest)
        if behind:
            rec = records[behind[0]]
            ahead = own if own["seq"] == furthest else next(r for r in alive.values() if r["seq"] == furthest)
            return _finding("stuck", behind, records, rec,
                            f"{_who(behind, records)} hung: alive (its heartbeat goes on) but stuck {where(rec)}, "
                            f"never reaching the collective {where(ahead)} that the other ranks waited in "
                            f"for {waited}")
    return _finding("unknown", [], records, own, f"no rank is gone or behind: a collective {where(own)} did not "
                    f"complete within {waited} (a stuck collective)")


def _finding(kind: str, ranks: list[int], records: dict, rec: dict, line: str) -> Finding:
    nodes = sorted({records[r]["node"] for r in ranks if records.get(r)})
    return Finding(kind, ranks, nodes, rec.get("step"), where(rec), line)


def claim(finding: Finding, reporter: int) -> bool:
    """Record `finding` as this launch's fault report if no other rank did yet (an exclusive create:
    one report, one line per launch); whether this rank is the one to print it."""
    me = _current
    if me is None:
        return True
    path = fault_path(me.run_dir, me.record["launch"])
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    except OSError:
        return True  # cannot record it: say it at least
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump({**finding.to_dict(), "reporter": reporter, "launch": me.record["launch"], "time": time.time()}, f)
    return True


def post_mortem(run_dir: str, launch: str) -> Finding | None:
    """From the files alone, once the launch's ranks have all ended: the ranks that ended first
    without saying why (killed, aborted, or their node gone), or that failed; None without beats
    of `launch`. Their last beats are compared across nodes: clocks must agree to a few seconds."""
    folder = os.path.join(run_dir, DIR)
    try:
        names = sorted(n for n in os.listdir(folder) if re.fullmatch(r"rank\d{5}\.json", n))
    except OSError:
        return None
    world = max((int(n[4:9]) for n in names), default=-1) + 1
    records = read(run_dir, world, launch)
    seen = {r: rec for r, rec in records.items() if rec is not None}
    if not seen:
        return None
    world = next(iter(seen.values()))["world"]
    failed = sorted(r for r, rec in seen.items() if rec["state"].startswith("failed"))
    if failed:
        return _finding("failed", failed, seen, seen[failed[0]], f"{_who(failed, seen)} failed "
                        f"{where(seen[failed[0]])} (its error is above)")
    missing = [r for r in range(world) if r not in seen]
    if missing:
        return _finding("missing", missing, seen, next(iter(seen.values())),
                        f"{_who(missing, seen)} was lost during start-up (it wrote no heartbeat in this launch)")
    unsaid = {r: rec for r, rec in seen.items() if rec["state"] == "running"}
    if not unsaid:
        return None
    first = min(rec["time"] for rec in unsaid.values())
    others = [rec["time"] for rec in seen.values() if rec["time"] > first + 2 * INTERVAL]
    lost = sorted(r for r, rec in unsaid.items() if rec["time"] <= first + 2 * INTERVAL)
    rec = max(seen.values(), key=lambda r: r["seq"])  # the furthest record: the others' lag a beat
    gap = f", {min(others) - first:.0f} s before the others'" if others else ""
    return _finding("unresponsive", lost, seen, rec, f"lost {_who(lost, seen)} {where(rec)}: its heartbeat stopped "
                    f"first{gap} (killed, hung, or its node is gone)")
