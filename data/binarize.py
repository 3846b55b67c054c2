"""Binarising a corpus split into megatron-core indexed datasets.

Per split three sets of files are written, aligned by position:

- ``<split>.src.{bin,idx}``: ``[<2tgt>] + pieces(source) + [eos]``
- ``<split>.tgt.{bin,idx}``: ``pieces(target) + [eos]`` (the decoder input ``[bos] + target[:-1]``
  is built at batch time, so it costs no disk)
- ``<split>.dir.npy``: int16 index into the manifest's list of directions

Every pair gives two examples, one per direction; each side is encoded once and reused for both.
"""

import os
import warnings
from collections.abc import Iterator

import numpy as np
import torch

from data.corpus import CorpusPair, read_pair
from data.errors import DataError
from data.spm import Tokenizer

DROP_REASONS = ("empty", "too_long")
# Lines encoded per SentencePiece call: large enough for its thread pool to pay off, small
# enough that a big split never sits in memory whole.
CHUNK_LINES = 20_000


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
        raise DataError(f"missing {prefix}.bin/.idx; run data preparation first")
    return module.IndexedDataset(prefix)


def _chunks(pair: CorpusPair, split: str) -> Iterator[list[tuple[str, str]]]:
    chunk: list[tuple[str, str]] = []
    for both in read_pair(pair, split):
        chunk.append(both)
        if len(chunk) == CHUNK_LINES:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def binarize_split(
    pairs: list[CorpusPair],
    split: str,
    tokenizer: Tokenizer,
    out_prefix: str,
    directions: list[str],
    max_source_len: int,
    max_target_len: int,
) -> dict:
    """Encode one split of every pair, both directions, into ``out_prefix.*``.

    Empty lines and examples longer than the limits (counted in tokens with tag and eos) are
    dropped and counted per direction. Files are written under temporary names and renamed once
    complete. Returns ``{"counts": {direction: kept}, "dropped": {direction: {reason: n}}}``.
    """
    module = _megatron_indexed()
    dtype = token_dtype(tokenizer.vocab_size)
    index = {name: i for i, name in enumerate(directions)}
    counts = {name: 0 for name in directions}
    dropped = {name: dict.fromkeys(DROP_REASONS, 0) for name in directions}
    folder, base = os.path.split(os.path.abspath(out_prefix))
    tmp_prefix = os.path.join(folder, f".tmp-{base}")
    final = {
        f"{tmp_prefix}.{side}.{ext}": f"{out_prefix}.{side}.{ext}"
        for side in ("src", "tgt")
        for ext in ("bin", "idx")
    }
    builders = {
        side: module.IndexedDatasetBuilder(f"{tmp_prefix}.{side}.bin", dtype=dtype)
        for side in ("src", "tgt")
    }
    dir_ids: list[int] = []
    try:
        for pair in pairs:
            a, b = pair.langs
            forward, backward = f"{a}-{b}", f"{b}-{a}"
            for chunk in _chunks(pair, split):
                ids_a = tokenizer.encode_batch([left for left, _ in chunk])
                ids_b = tokenizer.encode_batch([right for _, right in chunk])
                for pieces_a, pieces_b in zip(ids_a, ids_b, strict=True):
                    for name, source, target, tag in (
                        (forward, pieces_a, pieces_b, tokenizer.tag_id(b)),
                        (backward, pieces_b, pieces_a, tokenizer.tag_id(a)),
                    ):
                        # A side that encodes to nothing (empty, or only characters the
                        # normaliser removes) has nothing to learn from.
                        if not pieces_a or not pieces_b:
                            dropped[name]["empty"] += 1
                        elif len(source) + 2 > max_source_len or len(target) + 1 > max_target_len:
                            dropped[name]["too_long"] += 1
                        else:
                            src = np.array([tag, *source, tokenizer.eos_id], dtype=dtype)
                            tgt = np.array([*target, tokenizer.eos_id], dtype=dtype)
                            builders["src"].add_item(torch.from_numpy(src))
                            builders["tgt"].add_item(torch.from_numpy(tgt))
                            dir_ids.append(index[name])
                            counts[name] += 1
        # The whole split is one megatron "document"; pairs are addressed by sequence index.
        for side, builder in builders.items():
            builder.end_document()
            builder.finalize(f"{tmp_prefix}.{side}.idx")
        with open(f"{tmp_prefix}.dir.npy", "wb") as handle:
            np.save(handle, np.asarray(dir_ids, dtype=np.int16))
        final[f"{tmp_prefix}.dir.npy"] = f"{out_prefix}.dir.npy"
        for tmp, path in final.items():
            os.replace(tmp, path)
    except BaseException:
        for side in builders:
            builders[side].data_file.close()
        for tmp in [*final, f"{tmp_prefix}.dir.npy"]:
            if os.path.exists(tmp):
                os.remove(tmp)
        raise
    return {"counts": counts, "dropped": dropped}
