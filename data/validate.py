"""Validation: which line pairs are kept, and a report of every one that is not.

Nothing is dropped silently. Each line pair gets one reason code, the first rule it breaks:

====================  =========================================================  ============
reason                rule                                                       checked in
====================  =========================================================  ============
``invalid_utf8``      either side is not valid UTF-8                              validation
``empty``             either side is empty after stripping whitespace (or       validation,
                      encodes to no pieces)                                       binarisation
``too_long_chars``    either side is longer than ``data.max_chars`` characters    validation
``duplicate``         the same (source, target) already occurred earlier in      validation
                      this split of this pair
``too_long_tokens``   a side exceeds ``max_source_len``/``max_target_len`` as    binarisation
                      source (with tag and eos) or as target (with eos)
``length_ratio``      one side has more than ``data.max_length_ratio`` times     binarisation
                      the pieces of the other
====================  =========================================================  ============

Mismatched line counts and malformed TSV lines are not dropped but stop the preparation: they
mean the sides are misaligned, and everything after that line would be wrong; so do a selection
without training text or a train split without dev (`check_layout`), and a split of which nothing
is usable or most is not UTF-8 (`check_splits`).
"""

import hashlib
import json
import math
import os

import numpy as np

from data.corpus import CorpusPair
from data.errors import DataError
from data.shards import Shard, raw_rows
from schema.text import count

REASONS = (
    "invalid_utf8",
    "empty",
    "too_long_chars",
    "duplicate",
    "too_long_tokens",
    "length_ratio",
)
KEPT = 0
CODE = {reason: code for code, reason in enumerate(REASONS, start=1)}
# Hashes deduplicated at once; a larger split is processed in hash-range buckets so that the
# main process never sorts more than this many (~0.5 GB of temporaries).
DEDUP_BUCKET = 16_000_000


def work_prefix(work_dir: str, stage: str, shard: Shard) -> str:
    return os.path.join(work_dir, stage, shard.id)


def save_atomic(path: str, array: np.ndarray) -> None:
    """``np.save`` under a temporary name, then rename: a reader never sees a partial file."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}.npy"
    np.save(tmp, array)
    os.replace(tmp, path)


def check_done(work_dir: str, shard: Shard) -> bool:
    return os.path.exists(work_prefix(work_dir, "check", shard) + ".hash.npy")


def check_shard(task: tuple[Shard, str, int]) -> None:
    """Worker: apply the text rules to one shard and hash the surviving pairs.

    Writes ``<work>/check/<id>.reasons.npy`` (uint8 code per line, 0 = kept so far) and
    ``.hash.npy`` (uint64 BLAKE2b of the stripped pair, 0 where dropped); the hash file is
    renamed last and marks the shard done.
    """
    shard, work_dir, max_chars = task
    reasons = np.zeros(shard.lines, dtype=np.uint8)
    digests: list[bytes] = []
    zero = bytes(8)
    line = 0
    for _, rows in raw_rows(shard):
        for raw_a, raw_b in rows:
            try:
                a, b = raw_a.decode("utf-8").strip(), raw_b.decode("utf-8").strip()
            except UnicodeDecodeError:
                reasons[line] = CODE["invalid_utf8"]
                digests.append(zero)
            else:
                if not a or not b:
                    reasons[line] = CODE["empty"]
                    digests.append(zero)
                elif len(a) > max_chars or len(b) > max_chars:
                    reasons[line] = CODE["too_long_chars"]
                    digests.append(zero)
                else:
                    key = a.encode("utf-8") + b"\t" + b.encode("utf-8")
                    digests.append(hashlib.blake2b(key, digest_size=8).digest())
            line += 1
    prefix = work_prefix(work_dir, "check", shard)
    save_atomic(prefix + ".reasons.npy", reasons)
    save_atomic(prefix + ".hash.npy", np.frombuffer(b"".join(digests), dtype="<u8"))


def final_path(work_dir: str, shard: Shard) -> str:
    return work_prefix(work_dir, "final", shard) + ".reasons.npy"


def deduplicate(shards: list[Shard], work_dir: str) -> None:
    """Mark every repeat of an earlier (source, target) of the same pair and split as
    ``duplicate`` (the first occurrence in line order is kept) and write each shard's final
    reasons. ``shards`` are all shards of one pair and split, in order."""
    if all(os.path.exists(final_path(work_dir, shard)) for shard in shards):
        return
    reasons = [np.load(work_prefix(work_dir, "check", s) + ".reasons.npy") for s in shards]
    hashes = [np.load(work_prefix(work_dir, "check", s) + ".hash.npy", mmap_mode="r") for s in shards]
    valid = [r == KEPT for r in reasons]
    keep = [np.zeros(len(r), dtype=bool) for r in reasons]
    starts = np.cumsum([0] + [len(r) for r in reasons])
    total = int(sum(v.sum() for v in valid))
    buckets = 1 << max(0, math.ceil(math.log2(max(total, 1) / DEDUP_BUCKET)))
    shift = np.uint64(64 - max(1, buckets.bit_length() - 1))
    for bucket in range(buckets):
        parts, positions = [], []
        for k, (h, v) in enumerate(zip(hashes, valid, strict=True)):
            selected = v if buckets == 1 else v & ((np.asarray(h) >> shift) == bucket)
            index = np.flatnonzero(selected)
            parts.append(np.asarray(h)[index])
            positions.append(starts[k] + index)
        position = np.concatenate(positions)
        # return_index gives the first occurrence in the (line-ordered) input of each hash.
        _, first = np.unique(np.concatenate(parts), return_index=True)
        kept = position[first]
        owner = np.searchsorted(starts, kept, side="right") - 1
        for k in np.unique(owner):
            keep[k][kept[owner == k] - starts[k]] = True
    for shard, r, v, k in zip(shards, reasons, valid, keep, strict=True):
        final = r.copy()
        final[v & ~k] = CODE["duplicate"]
        save_atomic(final_path(work_dir, shard), final)


def count_reasons(codes: np.ndarray) -> dict[str, int]:
    """``{"kept": n, reason: n, …}`` of an array of reason codes."""
    counts = np.bincount(codes, minlength=len(REASONS) + 1)
    return {"kept": int(counts[KEPT]), **{r: int(counts[CODE[r]]) for r in REASONS}}


def build_report(pairs: list[str], shards: list[Shard], stats: dict[str, dict]) -> dict:
    """``{pair: {split: {"lines", "kept", <reason>: n}}}`` plus ``"total"``, from each binarised
    shard's statistics (which hold the counts of every stage for that shard)."""
    report: dict = {name: {} for name in pairs}
    total = {"lines": 0, "kept": 0, **dict.fromkeys(REASONS, 0)}
    for shard in shards:
        entry = report[shard.name].setdefault(
            shard.split, {"lines": 0, "kept": 0, **dict.fromkeys(REASONS, 0)}
        )
        counts = stats[shard.id]["reasons"]
        entry["lines"] += shard.lines
        total["lines"] += shard.lines
        for key in ("kept", *REASONS):
            entry[key] += counts[key]
            total[key] += counts[key]
    return {"pairs": report, "total": total, "reasons": list(REASONS)}


def write_report(report: dict, out_dir: str) -> list[str]:
    """Write ``validation_report.json`` and a readable ``validation_report.tsv`` (one row per
    pair and split) into ``out_dir``; return the console summary lines."""
    path = os.path.join(out_dir, "validation_report.json")
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as handle:
        json.dump(report, handle, indent=1)
    os.replace(tmp, path)
    header = ["pair", "split", "lines", "kept", *REASONS]
    rows = ["\t".join(header)]
    for name, splits in report["pairs"].items():
        for split, entry in splits.items():
            rows.append("\t".join([name, split, *(str(entry[key]) for key in header[2:])]))
    with open(tmp, "w", encoding="utf-8") as handle:
        handle.write("\n".join(rows) + "\n")
    os.replace(tmp, os.path.join(out_dir, "validation_report.tsv"))

    total = report["total"]
    dropped = total["lines"] - total["kept"]
    share = dropped / max(total["lines"], 1)
    lines = [
        f"data: validation kept {total['kept']:,} of {count(total['lines'], 'line pair', spec=',')}, "
        f"dropped {dropped:,} ({share:.2%})"
        + (": " + ", ".join(f"{r} {total[r]:,}" for r in REASONS if total[r]) if dropped else "")
    ]
    worst = sorted(
        ((entry["lines"] - entry["kept"]) / max(entry["lines"], 1), name, split)
        for name, splits in report["pairs"].items()
        for split, entry in splits.items()
    )[::-1][:3]
    if dropped:
        lines.append(
            "data: most dropped: "
            + ", ".join(f"{name} {split} {rate:.1%}" for rate, name, split in worst if rate > 0)
            + f" (per pair and reason: {os.path.join(out_dir, 'validation_report.tsv')})"
        )
    return lines


def check_layout(pairs: list[CorpusPair]) -> None:
    """Stop unless some pair has training text and every such pair has a dev split (a pair with
    test text only, such as OPUS-100's zero-shot pairs, is for evaluation)."""
    if not any("train" in pair.files for pair in pairs):
        raise DataError("no selected pair has a train split; add train files or change data.languages")
    for index, pair in enumerate(pairs):
        if "train" in pair.files and "dev" not in pair.files:
            a, b = pair.langs
            raise DataError(
                f"pair {pair.name} ({os.path.dirname(pair.files['train'][0])}) has train but no dev split; "
                f"add its dev files (opus.{a}-{b}-dev.{a}/.{b}, dev.{a}-{b}.{a}/.{b} or dev.{a}-{b}.tsv), "
                "a few hundred line pairs held out from training"
            )


def check_splits(pairs: list[CorpusPair], shards: list[Shard], counts: dict[str, dict]) -> None:
    """Stop unless the train and dev split of every pair keep at least one line pair (``counts``:
    per shard id, kept and dropped lines per reason). A split that is mostly not UTF-8 is a file in
    another encoding, not a few bad lines."""
    for index, pair in enumerate(pairs):
        for split, files in pair.files.items():
            mine = [counts[s.id] for s in shards if s.pair == index and s.split == split]
            total = {key: sum(c[key] for c in mine) for key in ("kept", *REASONS)}
            lines = sum(total.values())
            names = " and ".join(files)
            if total["invalid_utf8"] * 2 > lines:
                bad = total["invalid_utf8"]
                raise DataError(f"{names}: {bad:,} of {count(lines, 'line', spec=',')} {'is' if bad == 1 else 'are'} "
                                f"not UTF-8; convert {'the file' if len(files) == 1 else 'the files'} to UTF-8 "
                                "(iconv -f ENCODING -t UTF-8)")
            if split in ("train", "dev") and total["kept"] == 0:
                dropped = ", ".join(f"{r} {total[r]:,}" for r in REASONS if total[r])
                raise DataError(f"{names}: none of the {count(lines, 'line pair', spec=',')} of {split} is usable "
                                f"({dropped}); see data.max_chars, data.max_source_len and "
                                "data.max_length_ratio, or fix the text")
