"""Room for the next checkpoint: what may be deleted to make it, how much is free on every
rank's filesystem, and what a failed write was (trainer/checkpointer.py `make_room` and `save`)."""
from __future__ import annotations

import os
import re
import shutil

try:
    import resource
except ImportError:  # not on every platform
    resource = None

import torch


class NoRoomStop(Exception):
    """Every rank stops before writing a checkpoint that does not fit (exit NO_ROOM_EXIT_CODE)."""


ROOM_MARGIN = 1.05  # a checkpoint's size changes little between steps; the margin covers its manifest
ROOM_WAITS = 5  # re-checks, a second apart, for the room that deleting made
UNKNOWN = 2**62  # free bytes when the filesystem does not say (statfs failed): not a reason to stop


def room_to_make(committed: list[str], keep: int) -> list[str]:
    """The committed checkpoints (newest first) that may be deleted before the next save to make
    room: those rotation would delete once it is committed (all but the newest keep − 1), never
    the newest, which stays the one to resume from should the save fail."""
    return committed[max(keep - 1, 1):]


def write_failure(error: BaseException, where: str) -> str | None:
    """Why writing a checkpoint into `where` failed, in a few words, or None when `error` is not a
    failed write. torch's serializer reports a full disk or a file-size limit as a RuntimeError
    ('file write failed', 'unexpected pos', 'iostream error') without the errno; an OSError keeps it.
    The free space and any file-size limit of the process are added: they are the usual causes."""
    if isinstance(error, OSError):
        what = (error.strerror or str(error)).rstrip(".") + (f": {error.filename}" if error.filename else "")
    elif isinstance(error, RuntimeError) and any(k in str(error) for k in (
            "file write failed", "unexpected pos", "iostream error", "PytorchStreamWriter", "Parent directory")):
        detail = re.sub(r"^\[enforce fail at [^\]]*\][ .]*", "", str(error).strip().splitlines()[-1])[:120]
        what = f"torch could not write a file: {detail}"
    else:
        return None
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0] if resource else -1
    if limit not in (-1, getattr(resource, "RLIM_INFINITY", -1)):
        what += f"; this process may write files of at most {limit / 2**20:.1f} MB (ulimit -f)"
    free = _free_bytes(where)
    return f"{what}; {'unknown space' if free == UNKNOWN else f'{free / 2**20:.0f} MB'} free on that filesystem"


def tree_bytes(path: str) -> int:
    """Bytes of the files under `path` (those that vanish while it is walked count 0)."""
    total = 0
    for root, _, names in os.walk(path):
        for name in names:
            try:
                total += os.path.getsize(os.path.join(root, name))
            except OSError:
                pass
    return total


def _free_bytes(path: str) -> int:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return UNKNOWN


def _agreed_room(need: int, path: str, device, freed: int = 0) -> tuple[int, int, int]:
    """(largest `need`, least free bytes at `path`, largest `freed`) over all ranks: every rank
    decides alike (rank 0 measures what the others pass as 0)."""
    box = torch.tensor([float(need), -float(_free_bytes(path)), float(freed)], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(box, op=torch.distributed.ReduceOp.MAX)
    return int(box[0].item()), int(-box[1].item()), int(box[2].item())
