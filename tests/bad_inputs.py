"""What the bad-input tests share (tests/test_bad_inputs.py: configs; tests/test_bad_corpora.py:
corpora and the real command line): the good config and corpus they spoil, the in-process top
level, and the one-line-error check."""
from __future__ import annotations

import os

import yaml

from tests.conftest import TINY_DATA, TINY_MODEL

LANGS = ("de", "fr")


class RankLaunched(Exception):
    """Raised by the `no_launch` fixture (tests/conftest.py) where ranks would have started."""


def base_config(tmp_path, corpus: str = "bundled:django") -> dict:
    return {"run_dir": str(tmp_path / "run"), "model": dict(TINY_MODEL),
            "data": {**TINY_DATA, "corpus": corpus, "languages": [] if corpus != "bundled:django" else ["de"],
                     "workers": 1},
            "parallel": {"pipeline_stages": 2},
            "train": {"max_steps": 2, "log_interval": 1, "warmup_steps": 2}}


def with_key(path: str, value) -> callable:
    """A case that sets `section.key` (path "model.heads") of the good config to `value`."""
    def make(tmp_path):
        cfg = base_config(tmp_path)
        *sections, key = path.split(".")
        target = cfg
        for section in sections:
            target = target.setdefault(section, {})
        target[key] = value
        return yaml.safe_dump(cfg)
    return make


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    from launcher.cli import main

    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code: int, out: str, err: str, words: list[str]) -> None:
    assert "Traceback" not in out + err, out + err
    lines = err.strip().splitlines()
    assert code == 2, (code, out, err)
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for word in words:
        assert word in lines[0], f"{word!r} not in: {lines[0]}"


def written_files(run_dir) -> list[str]:
    """What a failed command left in `run_dir`: every file except a run lock's (a trainer holds
    the run directory while it prepares the data, so a corpus error may leave its lock file)."""
    if not os.path.exists(run_dir):
        return []
    return [os.path.join(folder, name) for folder, _, names in os.walk(run_dir) for name in names
            if not name.startswith(".trainer.lock")]


def write_case(tmp_path, content) -> str:
    path = tmp_path / "cfg.yaml"
    if callable(content):
        content = content(tmp_path)
    if isinstance(content, str):
        path.write_text(content, encoding="utf-8")
    elif isinstance(content, bytes):
        path.write_bytes(content)
    return str(path)


def write_lines(path, lines, encoding="utf-8", newline="\n"):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as handle:
        handle.write("".join(x + newline for x in lines).encode(encoding))


def good_corpus(root) -> str:
    corpus = os.path.join(root, "corpus")
    for lang in LANGS:
        for split, n in (("train", 30), ("dev", 8), ("test", 8)):
            prefix = os.path.join(corpus, f"en-{lang}", f"opus.en-{lang}-{split}")
            write_lines(f"{prefix}.en", [f"This is {split} sentence number {k}." for k in range(n)])
            write_lines(f"{prefix}.{lang}", [f"Satz {k} aus {split} ({lang})." for k in range(n)])
    return corpus
