"""./run.sh translate [MODEL] --to LANG: translate lines of text (stdin → stdout, or files).

MODEL is a consolidated model file (`./run.sh convert consolidate`) or a run directory, whose
latest checkpoint is consolidated in memory. Empty lines stay empty; a progress bar and the
decoding speed go to stderr, the translations alone to stdout.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

from launcher.launch import DEFAULT_RUN
from launcher.options import add_decoding_arguments, decode_options, user_path
from schema.text import count

HELP = "translate text with a trained model (stdin → stdout or --input/--output files; --to LANG)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=DEFAULT_RUN, type=user_path,
                        help="consolidated model file or run directory (default runs/default)")
    parser.add_argument("--to", required=True, metavar="LANG", help="target language, e.g. de (tag <2de>)")
    parser.add_argument("--input", "-i", type=user_path, help="file of source sentences, one per line (default: stdin)")
    parser.add_argument("--output", "-o", type=user_path, help="file for the translations (default: stdout)")
    parser.add_argument("--tag", help="checkpoint tag in a run directory (default: its latest)")
    add_decoding_arguments(parser)


def check_paths(input_path: str | None, output_path: str | None) -> None:
    """--input names a readable file and --output a file (not a folder, not the input) in an
    existing folder: checked before the model is loaded."""
    if input_path is not None:
        if os.path.isdir(input_path):
            raise ValueError(f"--input {input_path} is a folder; give a text file, one sentence per line")
        if not os.path.isfile(input_path):
            raise ValueError(f"--input {input_path}: no such file")
    if output_path is not None:
        if os.path.isdir(output_path):
            raise ValueError(f"--output {output_path} is a folder; give a file name for the translations")
        folder = os.path.dirname(os.path.abspath(output_path))
        if not os.path.isdir(folder):
            raise ValueError(f"--output {output_path}: folder {folder} does not exist")
        if input_path is not None and os.path.exists(output_path) and os.path.samefile(input_path, output_path):
            raise ValueError(f"--output {output_path} is the --input file; write the translations to another file")


def run(args: argparse.Namespace) -> int:
    from checkpoint.checkpoints import CheckpointError
    from checkpoint.manifest import replacing
    from translate.translator import InputError, load_translator, threads, translate_stream, utf8_lines

    try:
        check_paths(args.input, args.output)
        options = decode_options(args)
        translator = load_translator(args.model, args.tag)
        translator.check_options(options)
        translator.check_language(args.to)
    except (CheckpointError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    try:
        with contextlib.ExitStack() as stack:
            if args.input:
                source = utf8_lines(stack.enter_context(open(args.input, "rb")), f"--input {args.input}")
            else:
                source = utf8_lines(sys.stdin.buffer, "standard input")
            if not args.output:
                lines, tokens = translate_stream(translator, source, sys.stdout, args.to, options)
            else:  # written under a temporary name: no half-written output file
                with replacing(args.output) as tmp, open(tmp, "w", encoding="utf-8") as sink:
                    lines, tokens = translate_stream(translator, source, sink, args.to, options)
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    seconds = time.perf_counter() - start
    note = f", {count(translator.truncated, 'over-long source')} truncated" if translator.truncated else ""
    print(f"translated {count(lines, 'line')} in {seconds:.1f} s ({lines / max(seconds, 1e-9):.1f} sentences/s, "
          f"{tokens / max(seconds, 1e-9):.0f} tokens/s, beam {options.beam}, {threads()}{note})", file=sys.stderr)
    return 0
