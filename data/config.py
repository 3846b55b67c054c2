"""Configuration of data preparation and batching."""

from dataclasses import asdict, dataclass, field
from typing import Any

BUNDLED_DJANGO = "bundled:django"


@dataclass(kw_only=True)
class DataConfig:
    """Where the parallel text comes from and how it becomes batches of token ids."""

    corpus: str = BUNDLED_DJANGO
    """``bundled:django`` builds an English-centric corpus from the gettext catalogs that the
    installed Django ships (real translations, no download). Anything else is a path to an
    OPUS-100-style folder: one sub-folder per pair holding line-aligned
    ``opus.<src>-<tgt>-{train,dev,test}.{<src>,<tgt>}`` files."""

    languages: list[str] = field(default_factory=lambda: ["de", "es", "fr", "ru", "it"])
    """Non-English languages, as Django locale codes (``pt_BR``, ``zh_Hans``). For the bundled
    corpus these are the catalogs read; for a folder corpus they select the pairs whose every
    language is English or listed, and an empty list takes every pair of the folder. The tag of a
    language is ``<2code>``; English is ``<2en>``."""

    dev_size: int = 100
    """Bundled corpus only: minimum number of dev pairs per language."""

    test_size: int = 100
    """Bundled corpus only: minimum number of test pairs per language."""

    vocab_size: int = 4000
    """Size of the joint SentencePiece vocabulary, including the special ids and language tags.
    OPUS-100 used 64k for 100 languages; 4k suits the ~1k-pair bundled corpus."""

    spm_model_type: str = "bpe"
    """SentencePiece model type: ``bpe`` (as OPUS-100) or ``unigram``."""

    character_coverage: float = 1.0
    """Fraction of characters the SentencePiece model covers; 1.0 keeps every character, which
    OPUS-100 chose so that no script is mapped to <unk>."""

    spm_sample_sentences: int = 200_000
    """Size of the temperature-sampled subset of training text SentencePiece is trained on
    (capped at the number of distinct training sentences)."""

    spm_temperature: float = 5.0
    """Temperature over languages for that subset; 5 lifts small languages so that their
    characters and frequent words still get pieces."""

    max_source_len: int = 128
    """Longest source in tokens, counting the language tag and </s>; longer pairs are dropped and
    counted in the manifest."""

    max_target_len: int = 128
    """Longest target in tokens, counting </s>; longer pairs are dropped and counted."""

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
        bad = [lang for lang in self.languages if not lang or "-" in lang or "/" in lang]
        if bad:
            problems.append(f"data.languages has invalid codes {bad} (use e.g. pt_BR, not pt-BR)")
        if problems:
            raise ValueError("; ".join(problems))

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of the fields, as stored in the manifest."""
        return asdict(self)

    def preparation_key(self) -> dict[str, Any]:
        """The fields that change the prepared files. Batching fields (``max_tokens``,
        ``sampling_temperature``) are read at train time, so changing them must not redo the
        preparation."""
        key = self.to_dict()
        for name in ("max_tokens", "sampling_temperature"):
            key.pop(name)
        return key
