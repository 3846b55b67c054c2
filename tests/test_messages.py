"""Messages that say what is true: `./run.sh help` prints its whole header, and every count in a
message takes its noun in the number it needs ("1 stage", "2 stages"; schema/text.py `count`)."""
from __future__ import annotations

import ast
import os
import re
import subprocess

from tests.conftest import ROOT
from tests.test_imports import project_modules

COUNT_NOUNS = ("stages|replicas|ranks|GPUs|nodes|checkpoints|processes|shards|directions|sentences|lines|pairs|"
               "workers|cores|CPUs|threads|times|layers|steps|micro-batches|values|files|runs|examples|batches|"
               "languages")
NOUN_AFTER_NUMBER = re.compile(rf"^ (?:[\w-]+ )?(?:{COUNT_NOUNS})\b")
ALWAYS_PLURAL = {
    # (module, the text after the number): counts that are never 1, and words that are no count's noun
    ("data.gettext_corpus", " pairs"): "2 × (dev_size + test_size), at least 4",
    ("data.corpus", " files) or one .tsv"): "a language code, not a number",
    ("launcher.commands.export", " holds files that are not an e"): "a path, not a number",
    ("launcher.commands.slurm", " assumes nodes like this machi"): "the verb's object, not the count's noun",
    ("launcher.commands.prepare", " directions)"): "shown only for more than 12",
    ("bench.layouts", " values"): "a type name, not a number",
    ("bench.layouts", " runs "): "a layout's name and a verb",
    ("bench.ops_syncs", " ranks (this machine has "): "the accelerator's name, not a number",
    ("launcher.slurm", " nodes"): "an elastic job's range of node counts (1-2), never 1",
    ("launcher.slurm", " ranks"): "an elastic job's range of rank counts, never 1",
}


def plural_after_count() -> list[str]:
    """Every f-string of the project's code in which an integer is followed by a plural noun (or a
    noun written `(s)`), but for ALWAYS_PLURAL: what should go through `count`."""
    found = []
    for module, path in project_modules().items():
        for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
            if not isinstance(node, ast.JoinedStr):
                continue
            parts = node.values
            for number, text in zip(parts, parts[1:]):
                if not (isinstance(number, ast.FormattedValue) and isinstance(text, ast.Constant)):
                    continue
                spec = "".join(v.value for v in number.format_spec.values if isinstance(v, ast.Constant)) \
                    if number.format_spec else ""
                if spec[-1:] in ("f", "e", "g", "%"):  # a rate or a fraction: no count
                    continue
                tail = text.value[:30]
                if NOUN_AFTER_NUMBER.match(text.value) and (module, tail) not in ALWAYS_PLURAL:
                    found.append(f"{module}:{node.lineno}: {{{ast.unparse(number.value)}}}{tail!r}")
            found += [f"{module}:{node.lineno}: {p.value!r}" for p in parts
                      if isinstance(p, ast.Constant) and "(s)" in str(p.value)]
    return found


def test_counts_say_their_noun_in_the_number_it_needs():
    from schema.text import count

    assert (count(1, "stage"), count(2, "stage"), count(0, "process", "processes")) == ("1 stage", "2 stages",
                                                                                        "0 processes")
    assert count(1, "micro-batch", "micro-batches") == "1 micro-batch" and count(1200, "line", spec=",") == "1,200 lines"
    assert plural_after_count() == []
    assert all((module, tail) in {(m, t) for m, t in _texts_after_numbers()} for module, tail in ALWAYS_PLURAL), \
        "an ALWAYS_PLURAL entry no longer matches any message; remove it"


def _texts_after_numbers():
    for module, path in project_modules().items():
        for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
            if isinstance(node, ast.JoinedStr):
                for number, text in zip(node.values, node.values[1:]):
                    if isinstance(number, ast.FormattedValue) and isinstance(text, ast.Constant):
                        yield module, text.value[:30]


def test_help_prints_the_whole_header_of_run_sh():
    """`./run.sh help`: every comment line of run.sh's header, whole sentences, then the commands."""
    header = []
    with open(os.path.join(ROOT, "run.sh"), encoding="utf-8") as f:
        next(f)  # the shebang
        for line in f:
            if not line.startswith("#"):
                break
            header.append(re.sub(r"^# ?", "", line.rstrip("\n")))
    proc = subprocess.run([os.path.join(ROOT, "run.sh"), "help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[:len(header) + 1] == [*header, ""] and lines[len(header) + 1].startswith("usage: run.sh")
    assert header[-1].endswith("commands where it was called from (docs/configuration.md#paths).")
