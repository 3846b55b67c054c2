"""Binarising shards into megatron-core indexed datasets.

A shard of pair ``a-b`` becomes ``<prefix>.a.{bin,idx}`` and ``<prefix>.b.{bin,idx}``: the
SentencePiece pieces of each side of every kept line pair, aligned by position, without tag or
eos. Both translation directions are built from them at batch time (``[<2tgt>] + source +
[eos]``, ``target + [eos]``), so each side is stored and encoded once, not twice. The shard's
statistics ``<prefix>.json`` are written last and mark it finished; a rerun skips it.
"""

import json
import os
import warnings
from itertools import chain

import numpy as np

from data.errors import DataError
from data.shards import Shard, output_prefix, raw_rows
from data.spm import load_tokenizer
from data.validate import CODE, KEPT, count_reasons, final_path
from data.workers import worker_state

SIDES = ("a", "b")
RATIO_FLOOR = 5


def _megatron_indexed():
    """megatron-core's indexed dataset module, imported on first use: importing megatron.core
    costs seconds and prints warnings about optional CUDA packages that do not concern data."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets import indexed_dataset
    return indexed_dataset


def token_dtype(vocab_size: int) -> type[np.number]:
    """uint16 while every id fits (half the disk and page cache), int32 beyond; megatron-core's
    own rule, so readers and writers agree."""
    return _megatron_indexed().DType.optimal_dtype(vocab_size)


def open_indexed(prefix: str):
    """Open ``<prefix>.{bin,idx}`` as a memory-mapped ``IndexedDataset``."""
    module = _megatron_indexed()
    if not module.IndexedDataset.exists(prefix):
        raise DataError(f"missing {prefix}.bin/.idx; run data preparation again")
    return module.IndexedDataset(prefix)


def shard_done(out_dir: str, shard: Shard) -> bool:
    return os.path.exists(output_prefix(out_dir, shard) + ".json")


def load_stats(out_dir: str, shard: Shard) -> dict:
    with open(output_prefix(out_dir, shard) + ".json", encoding="utf-8") as handle:
        return json.load(handle)


def token_rules(
    len_a: np.ndarray, len_b: np.ndarray, max_source_len: int, max_target_len: int, ratio: float
) -> np.ndarray:
    """Reason code per pair from the piece counts of its sides (0 = kept). Every pair trains in
    both directions, so each side must fit as a source (tag + pieces + eos) and as a target
    (pieces + eos). The length ratio counts a side shorter than ``RATIO_FLOOR`` pieces as that
    long: one English word is often one piece and its translation four or five ("September" →
    "Сентябрь"), which says nothing about misalignment."""
    longest = np.maximum(len_a, len_b)
    shortest = np.minimum(len_a, len_b)
    codes = np.zeros(len(len_a), dtype=np.uint8)
    too_long = (longest + 2 > max_source_len) | (longest + 1 > max_target_len)
    codes[longest > ratio * np.maximum(shortest, RATIO_FLOOR)] = CODE["length_ratio"]
    codes[too_long] = CODE["too_long_tokens"]
    codes[shortest == 0] = CODE["empty"]
    return codes


def binarize_shard(task: tuple[Shard, str, str, dict]) -> dict:
    """Worker: encode the kept pairs of one shard and write its indexed datasets and statistics.

    Memory is bounded by the shard size: text is read ``CHUNK_LINES`` at a time and the megatron
    builders hold only the per-sequence lengths of this shard. Returns the statistics.
    """
    shard, out_dir, work_dir, limits = task
    tokenizer = worker_state().get("tokenizer") or load_tokenizer(limits["spm_model"])
    module = _megatron_indexed()
    dtype = token_dtype(tokenizer.vocab_size)
    reasons = np.load(final_path(work_dir, shard))
    prefix = output_prefix(out_dir, shard)
    os.makedirs(os.path.dirname(prefix), exist_ok=True)
    tmp = {side: f"{prefix}.{side}.tmp-{os.getpid()}" for side in SIDES}
    builders = {side: module.IndexedDatasetBuilder(tmp[side] + ".bin", dtype=dtype) for side in SIDES}
    tokens = dict.fromkeys(SIDES, 0)
    try:
        line = 0
        for _, rows in raw_rows(shard):
            codes = reasons[line : line + len(rows)]
            kept = np.flatnonzero(codes == KEPT)
            texts_a = [rows[i][0].decode("utf-8").strip() for i in kept]
            texts_b = [rows[i][1].decode("utf-8").strip() for i in kept]
            ids = {"a": tokenizer.encode_batch(texts_a, threads=1),
                   "b": tokenizer.encode_batch(texts_b, threads=1)}
            lens = {side: np.fromiter(map(len, ids[side]), np.int64, len(kept)) for side in SIDES}
            verdict = token_rules(lens["a"], lens["b"], limits["max_source_len"],
                                  limits["max_target_len"], limits["max_length_ratio"])
            codes[kept] = verdict  # writes through to `reasons`
            good = np.flatnonzero(verdict == KEPT)
            for side in SIDES:
                pieces = [ids[side][i] for i in good]
                count = int(lens[side][good].sum())
                flat = np.fromiter(chain.from_iterable(pieces), dtype=dtype, count=count)
                builders[side].add_document(flat, lens[side][good].tolist())
                tokens[side] += count
            line += len(rows)
        for side in SIDES:
            builders[side].finalize(tmp[side] + ".idx")
        for side in SIDES:
            for ext in ("bin", "idx"):
                os.replace(f"{tmp[side]}.{ext}", f"{prefix}.{side}.{ext}")
        stats = {"shard": shard.id, "lines": shard.lines, "reasons": count_reasons(reasons),
                 "tokens": tokens}
        with open(f"{prefix}.json.tmp-{os.getpid()}", "w", encoding="utf-8") as handle:
            json.dump(stats, handle)
        os.replace(f"{prefix}.json.tmp-{os.getpid()}", f"{prefix}.json")
    except BaseException:
        for side in SIDES:
            builders[side].data_file.close()
            for ext in ("bin", "idx"):
                if os.path.exists(f"{tmp[side]}.{ext}"):
                    os.remove(f"{tmp[side]}.{ext}")
        raise
    return stats
