"""Importing gettext catalogs (.po/.mo) as an English-centric parallel corpus.

Gettext catalogs are where OPUS's GNOME/KDE/Ubuntu sets come from: each translated entry is an
English UI string (msgid) and its human translation. Django (BSD-3) installs ~900 such entries per
language for ~99 languages, so the trainer has real multilingual text without any download
(``data.corpus: bundled:django``); ``data.corpus: gettext:<folder>`` imports any other tree of
catalogs the same way.
"""

import glob
import json
import os
import shutil
import tempfile
from collections import defaultdict

import numpy as np
import polib

from data.corpus import check_language
from data.errors import DataError
from schema.text import count

SPLITS = ("train", "dev", "test")
# GNU modifiers that name a script; the rest of a gettext locale name is already a valid code.
_MODIFIERS = {"latin": "Latn", "cyrillic": "Cyrl"}


def django_locale_root() -> str:
    """Directory of the installed Django package (its catalogs live below it)."""
    import django

    return os.path.dirname(django.__file__)


def _language_of(path: str) -> str:
    """Locale of a catalog: the folder above ``LC_MESSAGES`` (``de/LC_MESSAGES/x.po``) or the file
    name (``po/de.po``, GNOME style); ``sr@latin`` becomes ``sr_Latn``."""
    parent = os.path.basename(os.path.dirname(path))
    name = (
        os.path.basename(os.path.dirname(os.path.dirname(path)))
        if parent == "LC_MESSAGES"
        else os.path.splitext(os.path.basename(path))[0]
    )
    base, _, modifier = name.partition("@")
    if modifier:
        if modifier not in _MODIFIERS:
            raise DataError(f"{path}: unsupported locale modifier @{modifier}; rename the catalog")
        base = f"{base}_{_MODIFIERS[modifier]}"
    return check_language(base, path)


def find_catalogs(root: str) -> dict[str, list[str]]:
    """Catalog files per language under ``root`` (any depth). A ``.mo`` is skipped when its
    ``.po`` source sits beside it; English catalogs (``en``) translate nothing and are skipped."""
    if not os.path.isdir(root):
        raise DataError(f"gettext folder {root!r} does not exist")
    found: dict[str, list[str]] = defaultdict(list)
    paths = sorted(glob.glob(os.path.join(root, "**", "*.po"), recursive=True))
    paths += sorted(
        path
        for path in glob.glob(os.path.join(root, "**", "*.mo"), recursive=True)
        if not os.path.exists(path[:-3] + ".po")
    )
    for path in paths:
        language = _language_of(path)
        if language != "en":
            found[language].append(path)
    if not found:
        raise DataError(f"no .po or .mo catalogs under {root!r}")
    return {language: sorted(files) for language, files in sorted(found.items())}


def _open_catalog(path: str):
    try:
        return polib.mofile(path) if path.endswith(".mo") else polib.pofile(path)
    except (OSError, ValueError) as error:
        raise DataError(f"{path}: not a readable gettext catalog ({error})") from None


def normalise(text: str) -> str:
    """Collapse every run of whitespace (catalogs wrap long strings over lines) to one space."""
    return " ".join(text.split())


def catalog_pairs(files: list[str]) -> list[tuple[str, str]]:
    """(English, translation) pairs of one language's catalogs, in catalog order, exact
    duplicates removed.

    Fuzzy, obsolete and untranslated entries are skipped: their translation is missing or known to
    be stale. A plural entry gives two pairs, msgid→msgstr[0] and msgid_plural→msgstr[1]; for
    languages with a single plural form (ja, zh_Hans) msgstr[0] serves both.
    """
    pairs: dict[tuple[str, str], None] = {}  # insertion-ordered set
    for path in files:
        for entry in _open_catalog(path):
            # .mo entries carry no flags (msgfmt leaves fuzzy ones out) and no translated().
            if entry.obsolete or getattr(entry, "fuzzy", False):
                continue
            if entry.msgid_plural:
                if not entry.msgstr_plural or not all(entry.msgstr_plural.values()):
                    continue
            elif not entry.msgstr:
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
                f"language {language!r} has only {count(sum(map(len, splits.values())), 'pair')}, too few "
                f"for dev_size={dev_size} and test_size={test_size}; lower them"
            )
    return result


def _write_lines(path: str, lines: list[str]) -> None:
    with open(path, "w", encoding="utf-8", newline="\n") as handle:
        handle.writelines(line + "\n" for line in lines)


def build_gettext_corpus(
    out_dir: str,
    root: str,
    languages: list[str],
    dev_size: int,
    test_size: int,
    seed: int,
    source: str,
) -> dict:
    """Write an OPUS-100-style corpus ``out_dir/en-<xx>/opus.en-<xx>-{split}.{en,<xx>}`` from the
    catalogs under ``root``.

    ``languages`` selects catalogs; an empty list takes every language with at least
    ``2·(dev_size + test_size)`` pairs (the others are listed under ``"skipped"``). Returns
    ``{"languages", "pairs": {"en-xx": {split: count}}, "source", "skipped"}``, also saved as
    ``out_dir/corpus.json``. The corpus is written to a temporary sibling folder and renamed into
    place, so an interrupted build never leaves a half corpus under ``out_dir``.
    """
    catalogs = find_catalogs(root)
    skipped: dict[str, int] = {}
    if languages:
        missing = [language for language in languages if language not in catalogs]
        if missing:
            raise DataError(
                f"no catalogs for {missing} under {root}; available: {', '.join(catalogs)}"
            )
        pairs_by_language = {language: catalog_pairs(catalogs[language]) for language in languages}
    else:
        pairs_by_language = {}
        for language, files in catalogs.items():
            pairs = catalog_pairs(files)
            if len(pairs) >= 2 * (dev_size + test_size):
                pairs_by_language[language] = pairs
            else:
                skipped[language] = len(pairs)
        if not pairs_by_language:
            raise DataError(f"no language under {root} has {2 * (dev_size + test_size)} pairs")
    splits = split_by_english(pairs_by_language, dev_size, test_size, seed)

    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".corpus-tmp-", dir=parent)
    os.chmod(staging, 0o755)  # mkdtemp's 0700 would hide the corpus from other users
    summary: dict = {
        "languages": list(pairs_by_language),
        "pairs": {},
        "source": source,
        "seed": seed,
        "skipped": skipped,
    }
    try:
        for language in pairs_by_language:
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


def build_django_corpus(
    out_dir: str, languages: list[str], dev_size: int, test_size: int, seed: int
) -> dict:
    """The bundled corpus: :func:`build_gettext_corpus` over the catalogs of the installed Django."""
    import django

    if not languages:
        raise DataError("data.languages is empty: the bundled corpus needs at least one language")
    source = f"Django {django.__version__} gettext catalogs (BSD-3-Clause)"
    return build_gettext_corpus(
        out_dir, django_locale_root(), languages, dev_size, test_size, seed, source
    )


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
