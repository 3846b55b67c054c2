"""Raw parallel text → validated shards → joint SentencePiece → binarised shards → batches.

The usual path is ``prepare_data(cfg, out_dir)`` once (``./run.sh prepare CONFIG``), then
``PairDataset(split_prefix(out_dir, "train"))`` and a ``BatchStream`` over it. megatron-core
(storage) is imported only when binarised files are written or opened.
"""

from data.batching import BatchStream, collate, epoch_stats, eval_batches
from data.config import DataConfig
from data.dataset import PairDataset
from data.errors import DataError
from data.prepare import (
    corpus_path,
    load_manifest,
    prepare_data,
    split_prefix,
    spm_model_path,
)
from data.spm import Tokenizer, language_tag, load_tokenizer

__all__ = [
    "BatchStream",
    "DataConfig",
    "DataError",
    "PairDataset",
    "Tokenizer",
    "collate",
    "corpus_path",
    "epoch_stats",
    "eval_batches",
    "language_tag",
    "load_manifest",
    "load_tokenizer",
    "prepare_data",
    "split_prefix",
    "spm_model_path",
]
