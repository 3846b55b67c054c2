"""Raw parallel text → validated shards → joint SentencePiece → binarised shards → batches.

The usual path is ``prepare_data(cfg, out_dir)`` once (``./run.sh prepare CONFIG``), then
``PairDataset(split_prefix(out_dir, "train"))`` and a ``BatchStream`` over it. megatron-core
(storage) is imported only when binarised files are written or opened. The names below are
imported on first use, so that reading a config or reporting a bad input does not load torch.
"""

import importlib

_HOME = {
    "BatchStream": "data.batching", "collate": "data.batching", "epoch_stats": "data.batching",
    "eval_batches": "data.batching", "DataConfig": "data.config", "PairDataset": "data.dataset",
    "DataError": "data.errors", "corpus_path": "data.prepare", "load_manifest": "data.prepare",
    "prepare_data": "data.prepare", "split_prefix": "data.prepare", "spm_model_path": "data.prepare",
    "Tokenizer": "data.spm", "language_tag": "data.spm", "load_tokenizer": "data.spm",
}

__all__ = sorted(_HOME)


def __getattr__(name: str):
    if name in _HOME:
        return getattr(importlib.import_module(_HOME[name]), name)
    raise AttributeError(f"module 'data' has no attribute {name!r}")
