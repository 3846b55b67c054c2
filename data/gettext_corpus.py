"""A real English-centric parallel corpus built from the gettext catalogs Django ships.

Gettext catalogs are where OPUS's GNOME/KDE/Ubuntu sets come from: each translated entry is an
English UI string and its human translation. Django (BSD-3) installs ~900 such entries per
language for ~99 languages, so the trainer has real multilingual text without any download.
"""

import glob
import json
import os
import shutil
import tempfile
from collections import defaultdict

import numpy as np
import polib

from data.errors import DataError

SPLITS = ("train", "dev", "test")


def django_locale_root() -> str:
    """Directory of the installed Django package (its catalogs live below it)."""
    import django

    return os.path.dirname(django.__file__)


def catalog_files(language: str) -> list[str]:
    """Every ``.po`` file of one language: the core catalog and those of all contrib apps."""
    root = django_locale_root()
    patterns = [
        os.path.join(root, "conf", "locale", language, "LC_MESSAGES", "*.po"),
        os.path.join(root, "contrib", "*", "locale", language, "LC_MESSAGES", "*.po"),
    ]
    return sorted(path for pattern in patterns for path in glob.glob(pattern))


def available_languages() -> list[str]:
    """Locale codes for which the installed Django has a core catalog."""
    root = os.path.join(django_locale_root(), "conf", "locale")
    return sorted(
        name
        for name in os.listdir(root)
        if glob.glob(os.path.join(root, name, "LC_MESSAGES", "*.po")) and name != "en"
    )


def normalise(text: str) -> str:
    """Collapse every run of whitespace (catalogs wrap long strings over lines) to one space."""
    return " ".join(text.split())


def catalog_pairs(language: str) -> list[tuple[str, str]]:
    """(English, translation) pairs of one language, in catalog order, exact duplicates removed.

    Fuzzy, obsolete and untranslated entries are skipped: their translation is missing or known to
    be stale. A plural entry gives two pairs, msgid→msgstr[0] and msgid_plural→msgstr[1]; for
    languages with a single plural form (ja, zh_Hans) msgstr[0] serves both.
    """
    files = catalog_files(language)
    if not files:
        raise DataError(
            f"Django has no catalogs for language {language!r}; pick data.languages from: "
            + ", ".join(available_languages())
        )
    pairs: dict[tuple[str, str], None] = {}  # insertion-ordered set
    for path in files:
        for entry in polib.pofile(path):
            if entry.obsolete or entry.fuzzy or not entry.translated():
                continue
            if entry.msgid_plural:
                forms = [entry.msgstr_plural[k] for k in sorted(entry.msgstr_plural)]
                plural = forms[min(1, len(forms) - 1)]
                candidates = [(entry.msgid, forms[0]), (entry.msgid_plural, plural)]
            else:
                candidates = [(entry.msgid, entry.msgstr)]
            for english, foreign in candidates:
                english, foreign = normalise(english), normalise(foreign)
                if english and foreign:
                    pairs[(english, foreign)] = None
    return list(pairs)


def split_by_english(
    pairs_by_language: dict[str, list[tuple[str, str]]], dev_size: int, test_size: int, seed: int
) -> dict[str, dict[str, list[tuple[str, str]]]]:
    """Assign every English sentence to one split, the same for all languages.

    Most English strings are translated into every language, so splitting each language on its
    own would put the source of an en→de test pair into en→fr training. Instead the distinct
    English strings are shuffled once (seeded) and handed to test until every language has at
    least ``test_size`` test pairs, then to dev likewise, and the rest to train. Pairs sharing an
    English string (plural forms, context variants) therefore always land together.
    """
    english = sorted({en for pairs in pairs_by_language.values() for en, _ in pairs})
    order = np.random.default_rng(seed).permutation(len(english))
    by_english: dict[str, dict[str, list[tuple[str, str]]]] = defaultdict(lambda: defaultdict(list))
    for language, pairs in pairs_by_language.items():
        for en, foreign in pairs:
            by_english[en][language].append((en, foreign))

    result = {lang: {split: [] for split in SPLITS} for lang in pairs_by_language}
    split_plan = [("test", test_size), ("dev", dev_size)]
    stage = 0
    for position in order:
        sentence = english[position]
        while stage < len(split_plan) and all(
            len(result[lang][split_plan[stage][0]]) >= split_plan[stage][1] for lang in result
        ):
            stage += 1
        split = split_plan[stage][0] if stage < len(split_plan) else "train"
        for language, pairs in by_english[sentence].items():
            result[language][split].extend(pairs)
    for language, splits in result.items():
        if not splits["train"]:
            raise DataError(
                f"language {language!r} has only {sum(map(len, splits.values()))} pairs, too few "
                f"for dev_size={dev_size} and test_size={test_size}; lower them"
            )
    return result


def _write_lines(path: str, lines: list[str]) -> None:
    with open(path, "w", encoding="utf-8", newline="\n") as handle:
        for line in lines:
            handle.write(line + "\n")


def build_django_corpus(
    out_dir: str, languages: list[str], dev_size: int, test_size: int, seed: int
) -> dict:
    """Write an OPUS-100-style corpus ``out_dir/en-<xx>/opus.en-<xx>-{split}.{en,<xx>}``.

    Returns ``{"languages", "pairs": {"en-xx": {split: count}}, "source"}``, which is also saved
    as ``out_dir/corpus.json``. The corpus is written to a temporary sibling folder and renamed
    into place, so an interrupted build never leaves a half corpus under ``out_dir``.
    """
    if not languages:
        raise DataError("data.languages is empty: the bundled corpus needs at least one language")
    import django

    pairs_by_language = {lang: catalog_pairs(lang) for lang in languages}
    splits = split_by_english(pairs_by_language, dev_size, test_size, seed)

    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".corpus-tmp-", dir=parent)
    os.chmod(staging, 0o755)  # mkdtemp's 0700 would hide the corpus from other users
    summary: dict = {
        "languages": list(languages),
        "pairs": {},
        "source": f"Django {django.__version__} gettext catalogs (BSD-3-Clause)",
        "seed": seed,
    }
    try:
        for language in languages:
            name = f"en-{language}"
            os.makedirs(os.path.join(staging, name))
            summary["pairs"][name] = {}
            for split in SPLITS:
                pairs = splits[language][split]
                prefix = os.path.join(staging, name, f"opus.{name}-{split}")
                _write_lines(f"{prefix}.en", [en for en, _ in pairs])
                _write_lines(f"{prefix}.{language}", [foreign for _, foreign in pairs])
                summary["pairs"][name][split] = len(pairs)
        with open(os.path.join(staging, "corpus.json"), "w", encoding="utf-8") as handle:
            json.dump(summary, handle, indent=2, ensure_ascii=False)
        _replace_dir(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return summary


def _replace_dir(new: str, target: str) -> None:
    """Move ``new`` to ``target``; an existing ``target`` is moved aside first and then removed,
    so ``target`` is always either the old complete corpus or the new one."""
    old = None
    if os.path.exists(target):
        old = tempfile.mkdtemp(prefix=".corpus-old-", dir=os.path.dirname(os.path.abspath(target)))
        os.rmdir(old)
        os.rename(target, old)
    os.rename(new, target)
    if old:
        shutil.rmtree(old, ignore_errors=True)
