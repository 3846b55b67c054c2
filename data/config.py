"""Configuration of data preparation and batching."""

from dataclasses import asdict, dataclass, field
from typing import Any

from data.corpus import check_language
from data.errors import DataError

BUNDLED_DJANGO = "bundled:django"
GETTEXT_PREFIX = "gettext:"


@dataclass(kw_only=True)
class DataConfig:
    """Where the parallel text comes from and how it becomes batches of token ids."""

    corpus: str = BUNDLED_DJANGO
    """``bundled:django`` builds an English-centric corpus from the gettext catalogs that the
    installed Django ships (real translations, no download); ``gettext:<folder>`` does the same
    from any folder of ``.po``/``.mo`` catalogs. Anything else is a corpus folder holding
    OPUS-100 files (``<a>-<b>/opus.<a>-<b>-{train,dev,test}.{<a>,<b>}`` or ``….tsv``) and/or
    plain line-aligned file pairs (``{train,dev,test}.<a>-<b>.{<a>,<b>}`` or ``….tsv``)."""

    languages: list[str] = field(default_factory=lambda: ["de", "es", "fr", "ru", "it"])
    """Non-English languages, as Django locale codes (``pt_BR``, ``zh_Hans``). For the bundled
    corpus these are the catalogs read; for a folder corpus they select the pairs whose every
    language is English or listed, and an empty list takes every pair of the folder. The tag of a
    language is ``<2code>``; English is ``<2en>``."""

    dev_size: int = 100
    """Gettext corpora only: minimum number of dev pairs per language."""

    test_size: int = 100
    """Gettext corpora only: minimum number of test pairs per language."""

    vocab_size: int = 4000
    """Size of the joint SentencePiece vocabulary, including the special ids and language tags.
    OPUS-100 used 64k for 100 languages; 4k suits the ~1k-pair bundled corpus."""

    spm_model_type: str = "bpe"
    """SentencePiece model type: ``bpe`` (as OPUS-100) or ``unigram``."""

    spm_normalization: str = "identity"
    """SentencePiece normalisation: ``identity`` keeps the text exactly, so that decoding the ids
    of a line gives the line back (references keep their "…" and full-width punctuation);
    ``nmt_nfkc`` (SentencePiece's and OPUS-100's default) folds compatibility characters."""

    character_coverage: float = 1.0
    """Fraction of characters the SentencePiece model covers; 1.0 keeps every character, which
    OPUS-100 chose so that no script is mapped to <unk>."""

    spm_sample_sentences: int = 200_000
    """Size of the temperature-sampled subset of training text SentencePiece is trained on
    (capped at the number of kept training lines over all languages). Paper-scale configs use
    millions of lines for 64k (OPUS-100) or 128k (M2M-100) vocabularies."""

    spm_temperature: float = 5.0
    """Temperature over languages for that subset; 5 lifts small languages so that their
    characters and frequent words still get pieces."""

    max_source_len: int = 128
    """Longest source in tokens, counting the language tag and </s>. Every pair trains in both
    directions, so a pair is kept only if each side fits as source and as target; the others
    are dropped and counted (``too_long_tokens`` in the validation report)."""

    max_target_len: int = 128
    """Longest target in tokens, counting </s>; see ``max_source_len``."""

    max_chars: int = 2000
    """Longest side in characters; longer pairs are dropped before SentencePiece sees them
    (``too_long_chars``): such lines are concatenated documents or garbage, not sentences."""

    max_length_ratio: float = 4.0
    """Largest ratio of the longer side's pieces to the shorter side's (a side under 5 pieces
    counts as 5); pairs beyond it are dropped (``length_ratio``) as misaligned or partial
    translations. Counted in SentencePiece pieces because characters are not comparable across
    scripts (one Chinese character carries about as much as three or four Latin ones). On the
    bundled corpus a plain ratio of 4 without the floor dropped 16 good pairs such as
    "September" → "Сентябрь" (1 vs 7 pieces); with it, none."""

    shard_size: int = 1_000_000
    """Line pairs per shard. A shard is the unit of parallel work, of resumption and of storage;
    a worker's memory grows with it (~20 bytes per pair in megatron's builder plus one chunk of
    text) and never with the corpus."""

    workers: int = 0
    """Worker processes for validation and binarisation; 0 = one per core. The output does not
    depend on it."""

    max_tokens: int = 2048
    """Token budget of one micro-batch: ``batch_size * max(padded src len, padded tgt len)``
    never exceeds it. Must be at least the longest sequence allowed above."""

    sampling_temperature: float = 1.5
    """Temperature over translation directions for the training order, ``p_i ∝ (n_i/Σn)^(1/T)``;
    1.0 uses every pair exactly once per epoch (fairseq's default for multilingual is 1.5)."""

    seed: int = 1
    """Seed of the corpus split, the SentencePiece sample and the batch order."""

    def __post_init__(self) -> None:
        problems = []
        if self.vocab_size < 16:
            problems.append(f"data.vocab_size={self.vocab_size} is too small (at least 16)")
        if self.spm_model_type not in ("bpe", "unigram"):
            problems.append(f"data.spm_model_type={self.spm_model_type!r}: use 'bpe' or 'unigram'")
        if self.spm_normalization not in ("identity", "nmt_nfkc", "nfkc"):
            problems.append(
                f"data.spm_normalization={self.spm_normalization!r}: use identity, nmt_nfkc or nfkc"
            )
        if not 0.0 < self.character_coverage <= 1.0:
            problems.append("data.character_coverage must be in (0, 1]")
        if self.spm_temperature <= 0 or self.sampling_temperature <= 0:
            problems.append("data.spm_temperature and data.sampling_temperature must be > 0")
        if min(self.max_source_len, self.max_target_len) < 3:
            problems.append("data.max_source_len and data.max_target_len must be at least 3")
        if self.max_tokens < max(self.max_source_len, self.max_target_len):
            problems.append(
                f"data.max_tokens={self.max_tokens} is below the longest allowed sequence "
                f"({max(self.max_source_len, self.max_target_len)}); raise it or lower "
                "data.max_source_len / data.max_target_len"
            )
        if self.dev_size < 1 or self.test_size < 1:
            problems.append("data.dev_size and data.test_size must be at least 1")
        if "en" in self.languages:
            problems.append("data.languages lists the non-English languages; remove 'en'")
        for language in self.languages:
            try:
                check_language(language, "data.languages")
            except DataError as error:
                problems.append(str(error))
        if self.max_chars < 1 or self.max_length_ratio < 1.0:
            problems.append("data.max_chars must be >= 1 and data.max_length_ratio >= 1.0")
        if self.shard_size < 1 or self.workers < 0:
            problems.append("data.shard_size must be >= 1 and data.workers >= 0 (0 = all cores)")
        if self.corpus.startswith("bundled:") and self.corpus != BUNDLED_DJANGO:
            problems.append(f"data.corpus={self.corpus!r}: the bundled corpus is {BUNDLED_DJANGO!r}")
        if problems:
            raise ValueError("; ".join(problems))

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of the fields, as stored in the manifest."""
        return asdict(self)

    def preparation_key(self) -> dict[str, Any]:
        """The fields that change the prepared files. Batching fields (``max_tokens``,
        ``sampling_temperature``) are read at train time and ``workers`` changes only the speed,
        so changing them must not redo the preparation."""
        key = self.to_dict()
        for name in ("max_tokens", "sampling_temperature", "workers"):
            key.pop(name)
        return key
