"""One trainer per run directory: an exclusive lock on <run_dir>/.trainer.lock.

The lock is the `filelock` package's FileLock: `flock(2)` on an open file, which the kernel drops
when the holding process ends however it ends (kill -9 included), so a lock left by a dead trainer
is simply taken by the next one; nothing has to decide whether a PID is stale. Beside it,
<run_dir>/.trainer.lock.json names the holder (host, PID, start time) for the message a refused
trainer prints; it is written after the lock is won and is only informative.

Where it holds across nodes (flock semantics of the file system): local file systems; NFS (the
Linux client emulates flock with NFS byte-range locks, so nodes see each other's locks; NFSv3
needs lockd); Lustre mounted with `-o flock` (with `localflock` a lock holds on one node only,
with `noflock` flock fails and filelock falls back to its soft lock: an exclusive-create marker
file, which a dead holder leaves behind and which filelock then judges by its owner record);
GPFS/Spectrum Scale and BeeGFS with global file locks enabled.
"""
from __future__ import annotations

import json
import os
import socket
import time

from filelock import FileLock, Timeout

LOCK_NAME = ".trainer.lock"
HOLDER_NAME = ".trainer.lock.json"


class RunDirBusy(RuntimeError):
    """Another live trainer holds the run directory; the message names it."""


def _holder(run_dir: str) -> str:
    try:
        with open(os.path.join(run_dir, HOLDER_NAME), encoding="utf-8") as f:
            h = json.load(f)
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(h["started"]))
        return f"host {h['host']}, PID {h['pid']}, since {since}"
    except (OSError, ValueError, KeyError, TypeError):
        return "a process whose host and PID were not recorded"


class RunLock:
    """Hold the run directory for this process until `release()` or exit."""

    def __init__(self, run_dir: str):
        self.run_dir = run_dir
        self.lock = FileLock(os.path.join(run_dir, LOCK_NAME), timeout=0, thread_local=False)

    def acquire(self) -> RunLock:
        os.makedirs(self.run_dir, exist_ok=True)
        try:
            self.lock.acquire()
        except Timeout:
            raise RunDirBusy(f"{self.run_dir} is in use by another trainer ({_holder(self.run_dir)}); "
                             "stop it first, or train into another run_dir") from None
        record = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}
        tmp = os.path.join(self.run_dir, f"{HOLDER_NAME}.{os.getpid()}.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(record, f)
        os.replace(tmp, os.path.join(self.run_dir, HOLDER_NAME))
        return self

    def release(self) -> None:
        if self.lock.is_locked:
            self.lock.release()
