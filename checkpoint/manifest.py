"""Checkpoints that prove themselves: a manifest of every file's size and SHA-256, committed last.

A checkpoint `<ckpt_dir>/<tag>/` counts only once `<tag>/manifest.json` exists. `commit` runs on
every rank after all of them have written their files: rank 0 lists the folder and deals the files
out (largest first, to the least loaded rank), each rank reads its share back, hashes it and
fsyncs it, and rank 0 writes the manifest (temporary file, fsync, rename, fsync of the folder) and
only then `latest`. A process killed anywhere before that leaves the previous checkpoint as the
newest committed one. `verify` deals the manifest's files out the same way and each rank checks
size, then hash of its share; every rank gets the same list of problems.

Hashing reads every file once more (from page cache, at the CPU's SHA-256 rate: see
docs/operations.md for the measured cost); with ranks hashing their shares in parallel the wall
time of a stage is its largest share over the disk's read rate.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re

import torch

from schema.text import count

MANIFEST = "manifest.json"
LATEST = "latest"
FORMAT = "deepnet-checkpoint-manifest-1"
_STEP_TAG = re.compile(r"^step(\d+)$")


def _deal(files: dict[str, int], world: int) -> list[list[str]]:
    """Files (name → size) dealt to `world` ranks, largest first to the least loaded."""
    shares: list[list[str]] = [[] for _ in range(world)]
    load = [0] * world
    for name in sorted(files, key=lambda n: (-files[n], n)):
        r = load.index(min(load))
        shares[r].append(name)
        load[r] += files[name] + 1
    return shares


def sha256(path: str, sync: bool = False) -> str:
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
        if sync:
            os.fsync(f.fileno())
    return digest


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def replacing(path: str):
    """Yields a temporary name beside `path` to write; when the block ends normally it replaces
    `path` (a rename), otherwise it is removed: `path` is either whole or untouched."""
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_atomic(path: str, text: str) -> None:
    """`text` into `path` whole or not at all (`replacing`, fsynced, then the folder fsynced)."""
    with replacing(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(os.path.dirname(path) or ".")


def _listing(tag_dir: str) -> dict[str, int]:
    out = {}
    for root, _, names in os.walk(tag_dir):
        for name in names:
            rel = os.path.relpath(os.path.join(root, name), tag_dir)
            if rel != MANIFEST and not rel.endswith(".tmp"):
                out[rel] = os.path.getsize(os.path.join(root, name))
    return out


def _world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def broadcast(obj):
    """Rank 0's `obj` on every rank (itself without a process group)."""
    rank, world = _world()
    if world == 1:
        return obj
    box = [obj if rank == 0 else None]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def _gather(obj) -> list:
    rank, world = _world()
    if world == 1:
        return [obj]
    out = [None] * world
    torch.distributed.all_gather_object(out, obj)
    return out


def commit(ckpt_dir: str, tag: str, step: int, extra: dict | None = None) -> dict:
    """Hash the complete checkpoint `tag` on all ranks, then write its manifest (with `extra`'s
    keys, e.g. the run's config) and `latest`. Collective: call on every rank after every rank has
    written its files."""
    rank, world = _world()
    if world > 1:
        torch.distributed.barrier()
    tag_dir = os.path.join(ckpt_dir, tag)
    files = broadcast(_listing(tag_dir) if rank == 0 else None)
    mine = {name: {"size": files[name], "sha256": sha256(os.path.join(tag_dir, name), sync=True)}
            for name in _deal(files, world)[rank]}
    entries = {}
    for part in _gather(mine):
        entries.update(part)
    assert not set(extra or {}) & {"format", "tag", "step", "files"}, "extra may not replace a manifest key"
    manifest = {"format": FORMAT, "tag": tag, "step": step, **(extra or {}), "files": dict(sorted(entries.items()))}
    if rank == 0:
        write_atomic(os.path.join(tag_dir, MANIFEST), json.dumps(manifest, indent=1))
        write_atomic(os.path.join(ckpt_dir, LATEST), tag)
    if world > 1:
        torch.distributed.barrier()
    return manifest


def _hash_all(tag_dir: str, names: list[str], threads: int, sync: bool) -> dict[str, str]:
    """SHA-256 of every file of `names` in `tag_dir`, `threads` at a time (hashlib releases the
    GIL while it hashes, so threads read and hash in parallel)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        return dict(zip(names, pool.map(lambda n: sha256(os.path.join(tag_dir, n), sync=sync), names)))


def commit_local(tag_dir: str, tag: str, step: int, extra: dict | None = None, threads: int = 4) -> dict:
    """`commit` by one process for a folder it wrote alone (a universal copy made before the ranks
    start, checkpoint/elastic.py): hashes with `threads` threads, writes the manifest; `latest`
    is left alone."""
    files = _listing(tag_dir)
    hashes = _hash_all(tag_dir, sorted(files), threads, sync=True)
    entries = {name: {"size": files[name], "sha256": hashes[name]} for name in sorted(files)}
    manifest = {"format": FORMAT, "tag": tag, "step": step, **(extra or {}), "files": entries}
    write_atomic(os.path.join(tag_dir, MANIFEST), json.dumps(manifest, indent=1))
    return manifest


def verify_local(tag_dir: str, threads: int = 4) -> list[str]:
    """`verify` by one process (no collective), hashing with `threads` threads."""
    manifest = read(tag_dir)
    if manifest is None:
        return [f"{os.path.join(tag_dir, MANIFEST)} is missing or unreadable"]
    problems, present = [], []
    for name, want in manifest["files"].items():
        path = os.path.join(tag_dir, name)
        if not os.path.isfile(path):
            problems.append(f"{path} is missing")
        elif os.path.getsize(path) != want["size"]:
            size = os.path.getsize(path)
            problems.append(f"{path} has {size} bytes, the manifest says {want['size']} "
                            f"({'truncated' if size < want['size'] else 'grown'})")
        else:
            present.append(name)
    for name, digest in _hash_all(tag_dir, present, threads, sync=False).items():
        if digest != manifest["files"][name]["sha256"]:
            problems.append(f"{os.path.join(tag_dir, name)} has changed since it was written (SHA-256 differs "
                            "from the manifest)")
    return sorted(problems)


def read(tag_dir: str) -> dict | None:
    try:
        with open(os.path.join(tag_dir, MANIFEST), encoding="utf-8") as f:
            manifest = json.load(f)
        if manifest.get("format") == FORMAT and isinstance(manifest.get("files"), dict):
            return manifest
    except (OSError, ValueError):
        pass
    return None


def committed_tags(ckpt_dir: str) -> list[str]:
    """Tags `stepN` with a manifest, newest first."""
    try:
        names = os.listdir(ckpt_dir)
    except OSError:
        return []
    tags = [n for n in names if _STEP_TAG.match(n) and os.path.exists(os.path.join(ckpt_dir, n, MANIFEST))]
    return sorted(tags, key=lambda n: -int(n[4:]))


def uncommitted_tags(ckpt_dir: str) -> list[str]:
    try:
        names = os.listdir(ckpt_dir)
    except OSError:
        return []
    return [n for n in names if _STEP_TAG.match(n) and os.path.isdir(os.path.join(ckpt_dir, n))
            and not os.path.exists(os.path.join(ckpt_dir, n, MANIFEST))]


def has_checkpoints(ckpt_dir: str) -> bool:
    """Whether a run has checkpoints of its own (committed ones, a universal one from `./run.sh
    convert reshard`, or a `latest` naming one that is gone or damaged): it resumes, or says why it
    cannot; a run without starts now (from train.init_from where set)."""
    return bool(committed_tags(ckpt_dir) or os.path.exists(os.path.join(ckpt_dir, "latest_universal"))
                or read_latest(ckpt_dir)[1])


def read_latest(ckpt_dir: str) -> tuple[str | None, str]:
    """(tag named by `latest`, '' ) or (None, why it cannot be used); (None, '') without a file."""
    path = os.path.join(ckpt_dir, LATEST)
    if not os.path.exists(path):
        return None, ""
    try:
        with open(path, "rb") as f:
            raw = f.read(256)
    except OSError as e:
        return None, f"{path} cannot be read ({e.strerror})"
    try:
        tag = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        tag = ""
    if not tag or not re.fullmatch(r"[\w.\-]+", tag):
        return None, f"{path} holds {raw[:40]!r}, not a checkpoint name"
    if not os.path.isdir(os.path.join(ckpt_dir, tag)):
        return None, f"{path} names {tag!r}, which does not exist"
    return tag, ""


def verify(tag_dir: str) -> list[str]:
    """Problems of checkpoint `tag_dir` against its manifest ([] = intact). Collective."""
    rank, world = _world()
    manifest = read(tag_dir)
    if manifest is None:
        return [f"{os.path.join(tag_dir, MANIFEST)} is missing or unreadable"]
    files = {name: int(entry["size"]) for name, entry in manifest["files"].items()}
    problems = []
    for name in _deal(files, world)[rank]:
        path = os.path.join(tag_dir, name)
        want = manifest["files"][name]
        if not os.path.isfile(path):
            problems.append(f"{path} is missing")
            continue
        size = os.path.getsize(path)
        if size != want["size"]:
            problems.append(f"{path} has {count(size, 'byte')}, the manifest says {want['size']} "
                            f"({'truncated' if size < want['size'] else 'grown'})")
        elif sha256(path) != want["sha256"]:
            problems.append(f"{path} has changed since it was written (SHA-256 differs from the manifest)")
    return sorted(p for part in _gather(problems) for p in part)


def set_aside(ckpt_dir: str, tags: list[str]) -> None:
    """Move damaged checkpoints to `<ckpt_dir>/damaged/` (an earlier damaged copy of the same step
    is kept: the new one gets a suffix, `step1500.1`) and point `latest` at the newest committed
    one left. One process, holding the run (the ranks' rank 0, or the launcher before them)."""
    aside = os.path.join(ckpt_dir, "damaged")
    os.makedirs(aside, exist_ok=True)
    for tag in tags:
        name, n = tag, 1
        while os.path.lexists(os.path.join(aside, name)):
            name, n = f"{tag}.{n}", n + 1
        os.replace(os.path.join(ckpt_dir, tag), os.path.join(aside, name))
    good = newest_committed(ckpt_dir)
    if good:
        write_atomic(os.path.join(ckpt_dir, LATEST), good)


def newest_committed(ckpt_dir: str) -> str | None:
    tags = committed_tags(ckpt_dir)
    return tags[0] if tags else None
