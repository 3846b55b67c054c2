"""The docs against the code: README.md and every docs/**/*.md are read, and what they name is
checked against what the project has.

1. Command lines. Every `./run.sh COMMAND ...` they show goes through the real command line: the
   parser launcher/cli.py builds (its `main`, with parsing stopped before the command runs), then,
   for `bench TARGET` and `experiment NAME`, the benchmark's or experiment's own parser (after
   launcher/commands/bench.py's `split_arguments`, as `./run.sh bench` does; `bench train` is
   bench/layouts.py on CPUs and bench/gpu.py on a GPU: either may take the line). The parse must
   not fail. `test`, `test-gpu` and `help` are run.sh's own (pytest's arguments) and are accepted.
   Every `--set KEY=VALUE` must name a config key.
2. Repository paths (`parallel/engine.py`, `docs/x.md`, `tests/test_x*.py`, globs), links between
   the docs (and their #anchors), dotted Python names (`launcher.worker`,
   `parallel.engine_config.adamw`), and config keys in the `section.key` form (and the keys of YAML
   blocks) exist.
3. Every `--flag` they name is an option of some command, benchmark or experiment parser, or an
   option of another tool listed in ALLOWED with its reason.

How the docs write command lines, so that this test reads them:
- In a code block a `./run.sh` line is a whole command (`\\` continuations joined); in inline code
  (or prose) it is a mention, which may leave out required arguments but whatever it gives must
  parse. The command ends at a pipe, `;`, `&&`, a redirection or a `#` comment; what precedes
  `./run.sh` (`echo ... |`, `VAR=value`) is the shell's.
- Placeholders are UPPERCASE words (CONFIG, N, OUT, MODEL, ...) or `<name>`. Those that a parser
  types get a sample value (SAMPLES); the others are passed as written. `[...]` marks an optional
  part (checked as if given), `a|b` (`a\\|b` in a table) alternatives (each checked), `...` or `…`
  arguments left out.
"""
from __future__ import annotations

import ast
import dataclasses
import difflib
import glob
import os
import re
import shlex
import subprocess

import pytest
import yaml

from tests.docs_reading import (CODE_SPAN, LINK, SECTIONS, URL, Ref, blank, blocks, check_command, cli_main, commands,
                                 config_fields, key_problems, line_of, options, run_parser, sub_mains, variants,
                                 words)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "**", "*.md"),
                                                                          recursive=True))

# Flags of the repository's scripts (not argparse): the script must contain them.
SCRIPT_FLAGS: dict[str, str] = {}

# What the docs name that is not in the repository or the parsers on purpose: (kind, reference) ->
# why. Every entry must still be needed (an unused one fails too).
ALLOWED = {
    ("path", "configs/mine.yaml"): "the reader's own copy of a config, made with the `cp` line of configuration.md",
    # the hand-written CPU kernels of commits 2b0b70d..d39ec3b, removed since; the pages naming them say so
    ("path", "model/csrc"): "historical: the CPU kernels' folder, removed",
    ("path", "model/csrc/dropout.cpp"): "historical: the hashed dropout kernel (docs/bench/hashed-dropout.md), removed",
    ("path", "model/csrc/attention.cpp"): "historical: the short-sequence attention kernel, removed",
    ("path", "model/dropout.py"): "historical: the hashed dropout's Python side, removed",
    ("path", "model/kernels.py"): "historical: the kernels' build, removed",
    ("key", "train.max_stepz"): "configuration.md's example of a misspelt key and the error that names it",
    ("flag", "--module"): "deepspeed's launcher option (`deepspeed --module launcher.worker`)",
    ("flag", "--kill-on-bad-exit"): "srun's option, in the SLURM job script",
    ("flag", "--requeue"): "sbatch's option, in the SLURM job script",
    ("flag", "--mincpus"): "sbatch's option, in an elastic SLURM job's script",
    ("flag", "--ntasks-per-node"): "sbatch's and srun's option, in the SLURM job script",
    ("flag", "--signal"): "sbatch's `--signal=B:USR1@300` and scancel's `--signal=USR1`",
}



def tracked_folders() -> list[str]:
    """The repository's top-level folders (git's view: not .venv, runs/ or a local corpora/)."""
    try:
        files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return sorted(p for p in os.listdir(ROOT) if os.path.isdir(os.path.join(ROOT, p)) and
                      p not in {".git", ".venv", "runs", "corpora", "__pycache__", ".pytest_cache"})
    return sorted({f.split("/")[0] for f in files.splitlines() if "/" in f})


TOP = tracked_folders()
PACKAGES = sorted(p for p in TOP if os.path.exists(os.path.join(ROOT, p, "__init__.py"))) + ["tests"]
EXTENSIONS = {"py", "md", "json", "yaml", "yml", "csv", "txt", "sh", "pt", "png", "log", "lock", "sbatch", "out",
              "jsonl", "html", "tsv", "bin", "ini", "safetensors"}


# ----------------------------------------------------------------------------- names

def defined_names(path: str) -> set[str]:
    """Names a module defines at top level (and `Class.attr` for its classes' attributes)."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        names.add(f"{node.name}.{item.name}")
                    elif isinstance(item, (ast.Assign, ast.AnnAssign)):
                        for t in (item.targets if isinstance(item, ast.Assign) else [item.target]):
                            if isinstance(t, ast.Name):
                                names.add(f"{node.name}.{t.id}")
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                for n in ast.walk(t):
                    if isinstance(n, ast.Name):
                        names.add(n.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def module_problems(dotted: str) -> list[str]:
    """Why `dotted` is not a module (a file or package of the repository) or a name in one."""
    parts = dotted.split(".")
    for k in range(len(parts), 0, -1):
        base = os.path.join(ROOT, *parts[:k])
        if os.path.isfile(base + ".py"):
            path = base + ".py"
        elif os.path.isdir(base):
            path = os.path.join(base, "__init__.py")
        else:
            continue
        rest = ".".join(parts[k:])
        if not rest or (os.path.isfile(path) and rest in defined_names(path)):
            return []
        return [f"{'.'.join(parts[:k])} defines no {rest!r}"]
    return [f"no module {parts[0]}"]


def slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    text = re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: str) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    for block in blocks(lines):
        if block.kind != "text":
            continue
        for line in block.text.split("\n"):
            m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
            if m:
                s = slug(m.group(1))
                out.add(s if s not in seen else f"{s}-{seen[s]}")
                seen[s] = seen.get(s, 0) + 1
    return out


def path_problems(path: str) -> list[str]:
    """Why the repository path `path` (globs and {a,b} allowed) names nothing."""
    braces = re.search(r"\{([^}]*)\}", path)
    if braces:
        return [p for choice in braces.group(1).split(",")
                for p in path_problems(path[:braces.start()] + choice + path[braces.end():])]
    if any(c in path for c in "*?["):
        return [] if glob.glob(os.path.join(ROOT, path), recursive=True) else ["matches no file"]
    return [] if os.path.exists(os.path.join(ROOT, path)) else ["no such file or folder"]


TOPS = "|".join(re.escape(t) for t in TOP)
PATH = re.compile(rf"(?<![\w./~$<>@:+-])((?:{TOPS})/(?:[\w.*/-]|\{{[\w.,-]*\}})*)")
TEST_FILE = re.compile(r"(?<![\w./-])(test_[\w*]+\.py)\b")
NAMES = "|".join(PACKAGES + ["train"])
DOTTED = re.compile(rf"(?<![\w./$-])((?:{NAMES})(?:\.(?:[A-Za-z_]\w*|\*))+)(?![\w/-])")
FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9_-]*)")


# ----------------------------------------------------------------------------- the scan

@dataclasses.dataclass
class Scan:
    commands: list = dataclasses.field(default_factory=list)   # (Ref, argv, elided)
    paths: list = dataclasses.field(default_factory=list)      # Ref
    links: list = dataclasses.field(default_factory=list)      # Ref (target)
    dotted: list = dataclasses.field(default_factory=list)     # Ref
    yaml_keys: list = dataclasses.field(default_factory=list)  # Ref (dotted key)
    flags: list = dataclasses.field(default_factory=list)      # Ref
    bare_keys: list = dataclasses.field(default_factory=list)  # Ref: `key: value` in inline code


def scan_doc(doc: str, scan: Scan) -> None:
    with open(os.path.join(ROOT, doc), encoding="utf-8") as f:
        lines = f.read().split("\n")
    for block in blocks(lines):
        for ref in commands(doc, block):
            for variant in variants(ref.text):
                argv, elided = words(variant)
                if argv:
                    scan.commands.append((ref, argv, elided or ref.kind == "mention"))
        text = block.text
        if block.kind == "text":
            for m in CODE_SPAN.finditer(text):
                pair = re.fullmatch(r"([a-z_][a-z0-9_]*): +[^\s{].*", m.group(2))
                if pair:
                    scan.bare_keys.append(Ref(doc, line_of(block, m.start()), pair.group(1)))
            for m in LINK.finditer(text):
                scan.links.append(Ref(doc, line_of(block, m.start()), m.group(2)))
            text = blank(text, LINK, 2)
        text = blank(text, URL)
        if block.lang in ("yaml", "yml"):
            try:
                data = yaml.safe_load(text)
            except yaml.YAMLError as e:
                scan.yaml_keys.append(Ref(doc, block.line, f"<yaml: {e}>"))
                data = None
            if isinstance(data, dict):
                for key, value in data.items():
                    subkeys = [f"{key}.{k}" for k in value] if isinstance(value, dict) and key in SECTIONS else [key]
                    scan.yaml_keys += [Ref(doc, block.line, k) for k in subkeys]
        for m in PATH.finditer(text):
            path = m.group(1).rstrip(".,:;")
            following = text[m.end(1):m.end(1) + 1]
            if following in ("<", "$") or not path or path.endswith("-") or \
                    any(re.fullmatch(r"[A-Z][A-Z0-9_]*", part.split(".")[0]) for part in path.split("/")):
                continue  # a template: docs/bench/gpu-<type>/, tests/dist/<worker>, configs/SHAPE.yaml
            scan.paths.append(Ref(doc, line_of(block, m.start(1)), path))
        for m in TEST_FILE.finditer(text):
            scan.paths.append(Ref(doc, line_of(block, m.start(1)), "tests/**/" + m.group(1)))
        for m in DOTTED.finditer(text if block.lang != "python" else ""):  # a Python example's own names
            name = m.group(1)
            if name.rsplit(".", 1)[-1] in EXTENSIONS:
                continue
            scan.dotted.append(Ref(doc, line_of(block, m.start(1)), name))
        for m in FLAG.finditer(text):
            scan.flags.append(Ref(doc, line_of(block, m.start(1)), m.group(1)))


@pytest.fixture(scope="module")
def scan() -> Scan:
    out = Scan()
    for doc in DOCS:
        scan_doc(doc, out)
    return out


def allowed(kind: str, reference: str) -> bool:
    return (kind, reference) in ALLOWED


def report(problems: list[str], what: str) -> None:
    assert not problems, f"{len(problems)} {what}:\n" + "\n".join(problems)


# ----------------------------------------------------------------------------- the checks

def test_every_command_line_parses(scan):
    from trainer.config import ConfigError

    problems = []
    for ref, argv, mention in scan.commands:
        try:
            why = check_command(argv, mention)
        except ConfigError as e:  # bench's split_arguments: a --set without KEY=VALUE
            why = [str(e)]
        problems += [f"{ref.where()}: ./run.sh {shlex.join(argv)}: {w}" for w in why]
    report(problems, "command lines the command line refuses")


def test_every_repository_path_exists(scan):
    problems = []
    for ref in scan.paths:
        if allowed("path", ref.text):
            continue
        problems += [f"{ref.where()}: {ref.text}: {w}" for w in path_problems(ref.text)]
    report(problems, "paths that name nothing in the repository")


def test_every_link_between_the_docs_resolves(scan):
    problems = []
    for ref in scan.links:
        if re.match(r"[a-z][a-z0-9+.-]*:", ref.text):
            continue  # a URL
        target, _, anchor = ref.text.partition("#")
        path = os.path.normpath(os.path.join(os.path.dirname(os.path.join(ROOT, ref.doc)), target)) if target \
            else os.path.join(ROOT, ref.doc)
        if not os.path.exists(path):
            problems.append(f"{ref.where()}: link {ref.text}: no such file or folder")
        elif anchor and path.endswith(".md") and anchor not in anchors(path):
            problems.append(f"{ref.where()}: link {ref.text}: {os.path.relpath(path, ROOT)} has no heading #{anchor}")
    report(problems, "links that lead nowhere")


def test_every_module_and_config_key_exists(scan):
    problems = []
    for ref in scan.dotted:
        head = ref.text.split(".")[0]
        if allowed("key", ref.text) or (head in SECTIONS and not key_problems(ref.text)):
            continue
        if head == "train" or (head in SECTIONS and module_problems(ref.text)):
            problems.append(f"{ref.where()}: {ref.text}: {key_problems(ref.text)[0]}")
        elif head not in SECTIONS:
            problems += [f"{ref.where()}: {ref.text}: {w}" for w in module_problems(ref.text)]
    for ref in scan.yaml_keys:
        problems += [f"{ref.where()}: {ref.text}: {w}" for w in key_problems(ref.text)]
    every_key = config_fields() | {k for section in SECTIONS for k in config_fields(section)}
    for ref in scan.bare_keys:  # `key: value` in inline code names a config key when it nearly spells one
        near = difflib.get_close_matches(ref.text, every_key, n=1, cutoff=0.8)
        if near and ref.text not in every_key:
            problems.append(f"{ref.where()}: `{ref.text}: ...`: no config key of this name (did you mean {near[0]}?)")
    report(problems, "modules or config keys that do not exist")


@pytest.fixture(scope="module")
def cli_options() -> set[str]:
    from launcher.cli import commands
    from launcher.commands.bench import names as bench_names
    from launcher.commands.experiment import EXPERIMENTS

    found = set()
    for name in commands():
        parser, _, _ = run_parser(cli_main, [name.replace("_", "-"), "--help"])
        found |= options(parser)
    for command, names in (("bench", bench_names()), ("experiment", EXPERIMENTS)):
        for name in names:
            for main in sub_mains(command, name):
                found |= options(run_parser(main, ["--help"])[0])
    return found


def test_every_flag_named_exists(scan, cli_options):
    problems = []
    for ref in scan.flags:
        if ref.text in cli_options or allowed("flag", ref.text):
            continue
        if ref.text in SCRIPT_FLAGS:
            with open(os.path.join(ROOT, SCRIPT_FLAGS[ref.text]), encoding="utf-8") as f:
                if ref.text in f.read():
                    continue
        problems.append(f"{ref.where()}: {ref.text}: no command, benchmark or experiment has this option")
    report(problems, "flags that no parser takes")


def test_the_scan_finds_what_the_docs_name_and_every_allowance_is_needed(scan, cli_options):
    """The counts keep the reading honest (a broken pattern would find nothing), and an allowance
    stays only while the docs name its reference and the reference fails without it."""
    keys = [r for r in scan.dotted if r.text.split(".")[0] in SECTIONS and not key_problems(r.text)]
    sets = [a for _, argv, _ in scan.commands for i, a in enumerate(argv[1:]) if argv[i] == "--set" or
            a.startswith("--set=")]
    counts = {"command lines": len(scan.commands), "paths": len(scan.paths), "links": len(scan.links),
              "config keys": len(keys) + len(scan.yaml_keys) + len(sets), "modules": len(scan.dotted) - len(keys),
              "flags": len(scan.flags)}
    print("docs checked:", ", ".join(f"{v} {k}" for k, v in counts.items()))
    assert counts["command lines"] > 150 and counts["paths"] > 250 and counts["links"] > 100
    assert counts["config keys"] > 80 and counts["modules"] > 5 and counts["flags"] > 250
    named = {"path": {r.text for r in scan.paths}, "flag": {r.text for r in scan.flags},
             "key": {r.text for r in scan.dotted}}
    fails = {"path": lambda ref: path_problems(ref), "flag": lambda ref: ref not in cli_options,
             "key": lambda ref: key_problems(ref)}
    unneeded = [entry for entry in ALLOWED if entry[1] not in named[entry[0]] or not fails[entry[0]](entry[1])]
    unneeded += [flag for flag in SCRIPT_FLAGS if flag not in named["flag"] or flag in cli_options]
    assert not unneeded, f"allowances nothing needs any more: {unneeded}"
