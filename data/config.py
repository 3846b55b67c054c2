"""Configuration of data preparation and batching."""

from dataclasses import asdict, dataclass, field
from typing import Annotated, Any, Literal

from data.corpus import check_language
from data.errors import DataError
from schema.fields import NonNegative, Positive, Range, Rule, Seed, check_fields

PositiveFloat = Annotated[float, Range(gt=0.0)]
CorpusName = Annotated[str, Rule(lambda v: bool(v.strip()),
                                 "must name a corpus folder, gettext:<folder> or bundled:django")]

BUNDLED_DJANGO = "bundled:django"
GETTEXT_PREFIX = "gettext:"


@dataclass(kw_only=True)
class DataConfig:
    """Where the parallel text comes from and how it becomes batches of token ids."""

    corpus: CorpusName = BUNDLED_DJANGO
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

    directions: list[str] = field(default_factory=list)
    """Translation directions to train on, as ``source-target`` (``en-de``: English to German
    only); empty: both directions of every selected pair. The validation loss follows the same
    selection; ``./run.sh eval`` still scores every direction. Read at train time, so changing it
    prepares nothing again."""

    dev_size: Positive = 100
    """Gettext corpora only: minimum number of dev pairs per language."""

    test_size: Positive = 100
    """Gettext corpora only: minimum number of test pairs per language."""

    vocab_size: Annotated[int, Range(ge=16, le=2**31 - 1)] = 4000
    """Size of the joint SentencePiece vocabulary, including the special ids and language tags.
    OPUS-100 used 64k for 100 languages; 4k suits the ~1k-pair bundled corpus."""

    spm_model_type: Literal["bpe", "unigram"] = "bpe"
    """SentencePiece model type: ``bpe`` (as OPUS-100) or ``unigram``."""

    spm_normalization: Literal["identity", "nmt_nfkc", "nfkc"] = "identity"
    """SentencePiece normalisation: ``identity`` keeps the text exactly, so that decoding the ids
    of a line gives the line back (references keep their "…" and full-width punctuation);
    ``nmt_nfkc`` (SentencePiece's and OPUS-100's default) folds compatibility characters."""

    character_coverage: Annotated[float, Range(gt=0.0, le=1.0)] = 1.0
    """Fraction of characters the SentencePiece model covers; 1.0 keeps every character, which
    OPUS-100 chose so that no script is mapped to <unk>."""

    spm_sample_sentences: Positive = 200_000
    """Size of the temperature-sampled subset of training text SentencePiece is trained on
    (capped at the number of kept training lines over all languages). Paper-scale configs use
    millions of lines for 64k (OPUS-100) or 128k (M2M-100) vocabularies."""

    spm_temperature: PositiveFloat = 5.0
    """Temperature over languages for that subset; 5 lifts small languages so that their
    characters and frequent words still get pieces."""

    spm_model: str = ""
    """An existing SentencePiece model to use instead of training one, so that token ids keep the
    meaning a pretrained model learnt: a ``.model`` file, a run directory (or its prepared
    ``data/`` folder), a checkpoint folder, or a consolidated model file. Empty: train one, unless
    ``train.init_from`` is set, whose model it then is. Every language of the corpus needs its tag
    in it; ``vocab_size`` and the other ``spm_*`` keys are then not used."""

    max_source_len: Annotated[int, Range(ge=3)] = 128
    """Longest source in tokens, counting the language tag and </s>. Every pair trains in both
    directions, so a pair is kept only if each side fits as source and as target; the others
    are dropped and counted (``too_long_tokens`` in the validation report)."""

    max_target_len: Annotated[int, Range(ge=3)] = 128
    """Longest target in tokens, counting </s>; see ``max_source_len``."""

    max_chars: Positive = 2000
    """Longest side in characters; longer pairs are dropped before SentencePiece sees them
    (``too_long_chars``): such lines are concatenated documents or garbage, not sentences."""

    max_length_ratio: Annotated[float, Range(ge=1.0)] = 4.0
    """Largest ratio of the longer side's pieces to the shorter side's (a side under 5 pieces
    counts as 5); pairs beyond it are dropped (``length_ratio``) as misaligned or partial
    translations. Counted in SentencePiece pieces because characters are not comparable across
    scripts (one Chinese character carries about as much as three or four Latin ones). On the
    bundled corpus a plain ratio of 4 without the floor dropped 16 good pairs such as
    "September" → "Сентябрь" (1 vs 7 pieces); with it, none."""

    shard_size: Positive = 1_000_000
    """Line pairs per shard. A shard is the unit of parallel work, of resumption and of storage;
    a worker's memory grows with it (~20 bytes per pair in megatron's builder plus one chunk of
    text) and never with the corpus."""

    workers: NonNegative = 0
    """Worker processes for validation and binarisation; 0 = one per core. The output does not
    depend on it."""

    max_tokens: Positive = 2048
    """Token budget of one micro-batch: ``batch_size * max(padded src len, padded tgt len)``
    never exceeds it. Must be at least the longest sequence allowed above."""

    sampling_temperature: PositiveFloat = 1.5
    """Temperature over translation directions for the training order, ``p_i ∝ (n_i/Σn)^(1/T)``;
    1.0 uses every pair exactly once per epoch (fairseq's default for multilingual is 1.5)."""

    seed: Seed = 1
    """Seed of the corpus split, the SentencePiece sample and the batch order."""

    def __post_init__(self) -> None:
        """Raise ValueError naming the first key whose value is not allowed."""
        check_fields(self, "data")
        if self.max_tokens < max(self.max_source_len, self.max_target_len):
            raise ValueError(
                f"data.max_tokens={self.max_tokens} is below the longest allowed sequence "
                f"({max(self.max_source_len, self.max_target_len)}); raise it or lower "
                "data.max_source_len / data.max_target_len"
            )
        if "en" in self.languages:
            raise ValueError("data.languages lists the non-English languages; remove 'en'")
        for language in self.languages:
            try:
                check_language(language, "data.languages")
            except DataError as error:
                raise ValueError(str(error)) from None
        if len(set(self.languages)) != len(self.languages):
            twice = sorted({x for x in self.languages if self.languages.count(x) > 1})
            raise ValueError(f"data.languages lists {twice} more than once; list each language once")
        self._check_directions()
        if self.corpus.startswith("bundled:") and self.corpus != BUNDLED_DJANGO:
            raise ValueError(f"data.corpus={self.corpus!r}: the bundled corpus is {BUNDLED_DJANGO!r}")
        if self.corpus == BUNDLED_DJANGO and not self.languages:
            raise ValueError("data.languages is empty: the bundled corpus needs the languages to "
                             "build, e.g. [de, fr]")

    def _check_directions(self) -> None:
        for direction in self.directions:
            source, dash, target = direction.partition("-")
            if not dash or source == target or "-" in target:
                raise ValueError(f"data.directions: {direction!r} is not a direction; write source-target, "
                                 "e.g. en-de")
            for language in (source, target):
                try:
                    check_language(language, "data.directions")
                except DataError as error:
                    raise ValueError(str(error)) from None
                if self.languages and language != "en" and language not in self.languages:
                    raise ValueError(f"data.directions: {direction} needs {language!r}, which data.languages "
                                     f"does not list ({', '.join(self.languages)}); add it there")
        if len(set(self.directions)) != len(self.directions):
            raise ValueError("data.directions lists a direction more than once; list each once")

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of the fields, as stored in the manifest."""
        return asdict(self)

    def preparation_key(self) -> dict[str, Any]:
        """The fields that change the prepared files. Batching fields (``max_tokens``,
        ``sampling_temperature``) are read at train time and ``workers`` changes only the speed,
        so changing them must not redo the preparation; nor does ``directions``, a selection made
        at train time. An empty ``spm_model`` is left out, so that data prepared before the key
        existed stays current."""
        key = self.to_dict()
        for name in ("max_tokens", "sampling_temperature", "workers", "directions"):
            key.pop(name)
        if not key["spm_model"]:
            key.pop("spm_model")
        return key
