"""How tests/test_docs.py reads the docs: code blocks and inline code, and the `./run.sh` command
lines in them, parsed with the real command line (its docstring says how docs write them)."""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import io
import os
import re
import shlex
from unittest import mock


SECTIONS = ("model", "data", "parallel", "train")
# Placeholders a parser types or checks against its choices, and their sample values.
SAMPLES = {"N": "2", "MIN-MAX": "1-2", "G": "8", "K": "2", "TYPE": "h100-80gb", "LANG": "de", "CONFIG": "configs/default.yaml",
           "COMMAND": "train", "KEY=VALUE": "train.max_steps=400", "run_dir": "runs/default"}

# ----------------------------------------------------------------------------- reading the docs

@dataclasses.dataclass
class Block:
    kind: str   # "code" or "text"
    lang: str
    line: int   # 1-based line of the block's first line
    text: str


def blocks(lines: list[str]) -> list[Block]:
    """Fenced and indented code blocks, and paragraphs of text."""
    out: list[Block] = []
    para: list[str] = []
    start = 0
    previous_is_list = False

    def flush():
        nonlocal para, previous_is_list
        if para:
            text = "\n".join(para)
            indented = all(line.startswith("    ") for line in para) and not previous_is_list
            out.append(Block("code" if indented else "text", "", start, text))
            previous_is_list = bool(re.match(r"\s*([-*]|\d+\.)\s", para[0])) or (previous_is_list and indented)
        para = []

    i = 0
    while i < len(lines):
        fence = re.match(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)", lines[i])
        if fence:
            flush()
            indent, mark, lang = len(fence.group(1)), fence.group(2), fence.group(3)
            body, j = [], i + 1
            while j < len(lines) and not lines[j].strip().startswith(mark):
                body.append(lines[j][indent:] if lines[j][:indent].strip() == "" else lines[j])
                j += 1
            out.append(Block("code", lang, i + 2, "\n".join(body)))
            i = j + 1
            continue
        if lines[i].strip():
            if not para:
                start = i + 1
            para.append(lines[i])
        else:
            flush()
        i += 1
    flush()
    return out


CODE_SPAN = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.DOTALL)
LINK = re.compile(r"\[([^\]]*)\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
URL = re.compile(r"<?\b[a-z][a-z0-9+.-]*://[^\s)>]+>?")
RUN_SH = re.compile(r"(?<![\w./-])\./run\.sh\b")


@dataclasses.dataclass
class Ref:
    doc: str
    line: int
    text: str
    kind: str = ""  # commands: "line" (a code block's) or "mention"

    def where(self) -> str:
        return f"{self.doc}:{self.line}"


def line_of(block: Block, offset: int) -> int:
    return block.line + block.text.count("\n", 0, offset)


def blank(text: str, pattern: re.Pattern, group: int = 0) -> str:
    """`text` with the matches of `pattern` (or one group of them) replaced by spaces, offsets kept."""
    def spaces(m):
        a, b = m.span(group)
        s = m.group(0)
        return s[:a - m.start()] + re.sub(r"[^\n]", " ", s[a - m.start():b - m.start()]) + s[b - m.start():]
    return pattern.sub(spaces, text)


# ----------------------------------------------------------------------------- command lines

def logical_lines(block: Block):
    """(offset, line) of a code block, backslash continuations joined."""
    offset, pending, pending_at = 0, "", None
    for line in block.text.split("\n"):
        if pending_at is None:
            pending_at = offset
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
        else:
            yield pending_at, pending + line
            pending, pending_at = "", None
        offset += len(line) + 1
    if pending_at is not None:
        yield pending_at, pending


def prose_end(rest: str) -> str:
    """A command written in prose ends at the parenthesis it sits in, or at the line's end."""
    depth = 0
    for i, c in enumerate(rest):
        depth += c == "("
        if c == ")":
            if depth == 0:
                return rest[:i]
            depth -= 1
    return rest.split("\n")[0].rstrip(".,;:")


def commands(doc: str, block: Block) -> list[Ref]:
    found = []
    if block.kind == "code":
        for offset, line in logical_lines(block):
            for m in RUN_SH.finditer(line):
                found.append(Ref(doc, line_of(block, offset), line[m.end():], "line"))
        return found
    text = blank(block.text, URL)
    for span in CODE_SPAN.finditer(text):
        inner = span.group(2).replace("\n", " ")
        for m in RUN_SH.finditer(inner):
            found.append(Ref(doc, line_of(block, span.start()), inner[m.end():], "mention"))
    prose = blank(text, CODE_SPAN)
    for m in RUN_SH.finditer(prose):
        found.append(Ref(doc, line_of(block, m.start()), prose_end(prose[m.end():]), "mention"))
    return found


ALTERNATIVES = re.compile(r"[\w.-]+(?:\\?\|[\w.-]+)+")
SHELL_ENDS = {"|", "||", "&&", ";", "&", ">", ">>", "<", "<<", "(", ")", "|&", ">&"}


def variants(rest: str) -> list[str]:
    """`rest` once per choice of its `a|b` alternatives."""
    m = ALTERNATIVES.search(rest)
    if not m:
        return [rest]
    out = []
    for choice in re.split(r"\\?\|", m.group(0)):
        out += variants(rest[:m.start()] + choice + rest[m.end():])
    return out


def words(rest: str) -> tuple[list[str], bool]:
    """The arguments after `./run.sh` (placeholders filled in) and whether some were left out."""
    rest = re.sub(r"<([\w-]+)>", lambda m: SAMPLES.get(m.group(1), m.group(1)), rest)
    lexer = shlex.shlex(rest, posix=True, punctuation_chars=";&|<>()")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    out, elided = [], False
    for word in lexer:
        if word in SHELL_ENDS or set(word) <= set(";&|<>()"):
            if out and out[-1].isdigit() and word.startswith(">"):
                out.pop()  # 2> ...
            break
        if word.startswith("[") and len(word) > 1 and not word.startswith("[["):
            word = word[1:]  # an optional part [--flag VALUE] is checked as given
        if word.endswith("]") and "[" not in word:
            word = word[:-1]
        if word in ("...", "…", ""):
            elided = True
            continue
        out.append(SAMPLES.get(word, word))
    return out, elided


class _Parsed(Exception):
    def __init__(self, parser, namespace):
        self.parser, self.namespace = parser, namespace


class _Refused(Exception):
    def __init__(self, parser, message):
        super().__init__(message)
        self.parser, self.message = parser, message


class _Exited(Exception):
    def __init__(self, parser, status):
        self.parser, self.status = parser, status


@contextlib.contextmanager
def parse_only():
    """argparse that parses and then stops: nothing after the parse runs, nothing is printed."""
    real = argparse.ArgumentParser.parse_args

    def parse_args(self, args=None, namespace=None):
        raise _Parsed(self, real(self, args, namespace))

    def error(self, message):
        raise _Refused(self, message)

    def exit(self, status=0, message=None):
        raise _Exited(self, status)

    sink = io.StringIO()
    with mock.patch.object(argparse.ArgumentParser, "parse_args", parse_args), \
            mock.patch.object(argparse.ArgumentParser, "error", error), \
            mock.patch.object(argparse.ArgumentParser, "exit", exit), \
            contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
        yield


def run_parser(main, argv):
    """(the parser, the namespace or None, the error message or None) of `main(argv)`'s parse."""
    try:
        with parse_only():
            main(argv)
    except _Parsed as e:
        return e.parser, e.namespace, None
    except _Exited as e:
        return e.parser, None, None if e.status == 0 else f"exit {e.status}"
    except _Refused as e:
        return e.parser, None, e.message
    raise AssertionError(f"{main.__module__}.main({argv}) returned without parsing")


def options(parser: argparse.ArgumentParser) -> set[str]:
    """Every option string of `parser` and of its sub-commands."""
    found = set(parser._option_string_actions)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found |= options(sub)
    return found


def cli_main(argv):
    """launcher/cli.py's `main`, leaving this process's folder and the caller's folder as they were."""
    import launcher.options
    from launcher.cli import main
    cwd, caller, env = os.getcwd(), launcher.options._caller_cwd, os.environ.get(launcher.options.CALLER_CWD_ENV)
    try:
        return main(argv)
    finally:
        os.chdir(cwd)
        launcher.options._caller_cwd = caller
        if env is not None:
            os.environ[launcher.options.CALLER_CWD_ENV] = env


def sub_mains(command: str, name: str) -> list:
    """The `main` functions behind `./run.sh bench NAME` / `./run.sh experiment NAME`."""
    if command == "bench":
        from launcher.commands.bench import modules as bench_modules
        modules = bench_modules(name)
    else:
        from launcher.commands.experiment import EXPERIMENTS
        modules = [EXPERIMENTS[name]]
    return [importlib.import_module(m).main for m in modules]


def own_command(argv: list[str]) -> bool:
    """run.sh's own commands: pytest arguments and the help text."""
    return not argv or argv[0] in ("test", "test-gpu", "help", "-h", "--help")


def check_command(argv: list[str], mention: bool) -> list[str]:
    """What is wrong with `./run.sh ARGV` (empty: it parses)."""
    if own_command(argv):
        return []

    def refused(parser, message, given):
        # a mention may leave out required arguments; the flags it gives must still exist
        if mention and message.startswith("the following arguments are required"):
            unknown = [w.split("=")[0] for w in given if w.startswith("-") and w.split("=")[0] not in options(parser)]
            return [f"unknown option {u}" for u in unknown]
        return [message]

    parser, ns, message = run_parser(cli_main, argv)
    if message:
        return refused(parser, message, argv)
    if ns is None or ns.command not in ("bench", "experiment"):
        return [f"--set {s}: {why}" for s in getattr(ns, "sets", None) or [] for why in key_problems(s.split("=")[0])]
    name = ns.target if ns.command == "bench" else ns.name
    rest, problems = ns.args, []
    if ns.command == "bench":
        from launcher.commands.bench import split_arguments
        rest, sets, _ = split_arguments(name, ns.args)
        problems = [f"--set {s}: {why}" for s in sets for why in key_problems(s.split("=")[0])]
    errors = []
    for main in sub_mains(ns.command, name):
        parser, _, message = run_parser(main, rest)
        why = refused(parser, message, rest) if message else []
        if not why:
            return problems
        errors.append(f"{main.__module__}: {'; '.join(why)}")
    return problems + errors


# ----------------------------------------------------------------------------- config keys

def config_fields(section: str | None = None) -> set[str]:
    from trainer.config import RunConfig
    cfg = RunConfig()
    obj = getattr(cfg, section) if section else cfg
    return {f.name for f in dataclasses.fields(obj)}


def key_problems(key: str) -> list[str]:
    """Why `key` (dotted, as --set takes it) is not a config key; empty when it is."""
    parts = key.split(".")
    if parts[0] not in config_fields():
        return [f"no config key {parts[0]!r} (trainer/config.py RunConfig)"]
    if len(parts) > 1 and parts[0] in SECTIONS and parts[1] != "*" and parts[1] not in config_fields(parts[0]):
        return [f"no key {parts[1]!r} in the {parts[0]}: section"]
    return []
