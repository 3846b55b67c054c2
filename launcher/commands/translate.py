"""./run.sh translate [MODEL] --to LANG: translate lines of text (stdin → stdout, or files).

MODEL is a consolidated model file (`./run.sh convert consolidate`) or a run directory, whose
latest checkpoint is consolidated in memory. Empty lines stay empty; a progress bar and the
decoding speed go to stderr, the translations alone to stdout.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import itertools
import os
import sys
import tempfile
import time
from collections.abc import Callable

from parallel import accelerator

HELP = "translate text with a trained model (stdin → stdout or --input/--output files; --to LANG)"
DEFAULT_MODEL = "runs/default"
CHUNK_LINES = 2000  # lines decoded per call: bounds memory on long inputs, keeps batches full


def add_decoding_arguments(parser: argparse.ArgumentParser) -> None:
    """Search options shared by translate and eval."""
    from model.decoding import DecodeOptions

    d = DecodeOptions()
    group = parser.add_argument_group("decoding")
    group.add_argument("--beam", type=int, default=d.beam, help=f"beam size (default {d.beam})")
    group.add_argument("--greedy", action="store_true", help="greedy search (same as --beam 1)")
    group.add_argument("--lenpen", type=float, default=d.lenpen,
                       help=f"length penalty: score = Σ log p / length^lenpen (default {d.lenpen})")
    group.add_argument("--max-len-a", type=float, default=d.max_len_a,
                       help=f"output at most a·|source| + b tokens (default a={d.max_len_a})")
    group.add_argument("--max-len-b", type=int, default=d.max_len_b, help=f"(default b={d.max_len_b})")
    group.add_argument("--max-tokens", type=int, default=d.max_tokens,
                       help=f"source tokens per batch (default {d.max_tokens})")
    group.add_argument("--threads", type=int, default=0,
                       help="CPU threads (default 0: the cores the load average shows idle, at least 1)")


def idle_cores() -> int:
    """Cores this process may use minus the 1-minute load average, at least 1.

    Decoding is a long series of small matrix products, and OpenMP threads spin while they wait
    for each other: on a 2-core machine busy with other work, 2 threads decoded 4–9× slower than 1.
    On an idle machine every core is used.
    """
    cores = len(os.sched_getaffinity(0))
    return max(1, min(cores, cores - round(os.getloadavg()[0])))


def decode_options(args: argparse.Namespace):
    """The DecodeOptions of the command line (and the thread count applied)."""
    import torch

    from model.decoding import DecodeOptions

    if args.threads < 0:
        raise ValueError("--threads must be >= 0")
    torch.set_num_threads(args.threads or idle_cores())
    options = DecodeOptions(beam=1 if args.greedy else args.beam, lenpen=args.lenpen, max_len_a=args.max_len_a,
                            max_len_b=args.max_len_b, max_tokens=args.max_tokens)
    options.validate()
    return options


class Translator:
    """A loaded model and its SentencePiece model: text in, text out, any target per line."""

    def __init__(self, loaded) -> None:
        from data.spm import Tokenizer

        self.model = loaded.model.to(accelerator.device_type())  # the search follows the model
        self.meta = loaded.meta
        self.spm_sha256 = hashlib.sha256(loaded.spm_model).hexdigest()
        with tempfile.TemporaryDirectory() as tmp:  # SentencePiece reads the model into memory
            path = os.path.join(tmp, "spm.model")
            with open(path, "wb") as f:
                f.write(loaded.spm_model)
            self.tokenizer = Tokenizer(path)
        self.truncated = 0
        """Sources cut to the model's position table so far."""

    def check_options(self, options) -> None:
        """Options the loaded model cannot honour: a beam wider than its vocabulary."""
        vocab = self.model.cfg.vocab_size
        if options.beam > vocab:
            raise ValueError(f"--beam {options.beam} is wider than the model's vocabulary of {vocab} pieces; "
                             f"use at most {vocab} (4-6 is usual)")

    def check_language(self, language: str) -> None:
        if language not in self.tokenizer.tags:
            raise ValueError(f"the model has no tag <2{language}>; it translates into "
                             f"{', '.join(sorted(self.tokenizer.tags))}")

    def translate(self, texts: list[str], targets: list[str], options,
                  progress: Callable[[int], None] | None = None) -> tuple[list[str], int]:
        """Translations of `texts`, text i into language targets[i]; also the number of tokens
        generated (without eos). Empty texts give empty translations."""
        from model.decoding import generate

        tok = self.tokenizer
        limit = self.model.cfg.max_positions
        todo = [i for i, text in enumerate(texts) if text.strip()]
        sources = []
        for i in todo:
            ids = tok.encode_source(texts[i], targets[i])
            if len(ids) > limit:  # keep the tag and the eos
                ids = ids[:limit - 1] + [tok.eos_id]
                self.truncated += 1
            sources.append(ids)
        hyps = generate(self.model, sources, options, bos=tok.bos_id, eos=tok.eos_id,
                        banned=list(tok.tags.values()), progress=progress)
        out = [""] * len(texts)
        for i, hyp in zip(todo, hyps, strict=True):
            out[i] = tok.decode(hyp.tokens)
        if progress is not None and len(todo) < len(texts):
            progress(len(texts) - len(todo))
        return out, sum(len(h.tokens) for h in hyps)


def load_translator(source: str, tag: str | None = None) -> Translator:
    from parallel.checkpoints import load_model

    return Translator(load_model(source, tag))


def on_gpu() -> bool:
    """Decode on a GPU when there is one and run.sh did not choose the CPU accelerator."""
    return accelerator.gpu_available()


def threads() -> str:
    """The compute the decoding ran on, for speed reports."""
    import torch

    return "GPU" if on_gpu() else f"{torch.get_num_threads()} CPU thread(s)"


def progress_bar(total: int, what: str):
    """A tqdm bar on stderr (hidden when stderr is not a terminal)."""
    from tqdm import tqdm

    return tqdm(total=total, unit="sent", desc=what, file=sys.stderr, disable=None, leave=False)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=DEFAULT_MODEL,
                        help=f"consolidated model file or run directory (default {DEFAULT_MODEL})")
    parser.add_argument("--to", required=True, metavar="LANG", help="target language, e.g. de (tag <2de>)")
    parser.add_argument("--input", "-i", help="file of source sentences, one per line (default: stdin)")
    parser.add_argument("--output", "-o", help="file for the translations (default: stdout)")
    parser.add_argument("--tag", help="checkpoint tag in a run directory (default: its latest)")
    add_decoding_arguments(parser)


class InputError(ValueError):
    """Input text that cannot be translated (the message names the file and line)."""


def utf8_lines(binary, name: str):
    """The lines of a binary stream as text without their line ends; a line that is not UTF-8
    raises InputError naming `name`, the line and the byte."""
    for number, raw in enumerate(binary, 1):
        try:
            yield raw.decode("utf-8").rstrip("\r\n")
        except UnicodeDecodeError as e:
            raise InputError(f"{name} line {number} is not UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1}); "
                             f"convert the text to UTF-8 first (e.g. iconv -f latin1 -t utf-8)") from None


def translate_stream(translator: Translator, source, sink, language: str, options) -> tuple[int, int]:
    """Translate the lines of `source` (text, without line ends) into `language`, writing them
    to `sink` chunk by chunk; returns (lines, generated tokens)."""
    lines = tokens = 0
    bar = progress_bar(0, f"→ {language}")
    try:
        chunk: list[str] = []
        for line in itertools.chain(source, [None]):
            if line is not None:
                chunk.append(line.rstrip("\n"))
            if chunk and (line is None or len(chunk) == CHUNK_LINES):
                bar.total = (bar.total or 0) + len(chunk)
                out, generated = translator.translate(chunk, [language] * len(chunk), options, bar.update)
                sink.write("".join(text + "\n" for text in out))
                sink.flush()
                lines, tokens, chunk = lines + len(out), tokens + generated, []
    finally:
        bar.close()
    return lines, tokens


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
    from parallel.checkpoints import CheckpointError
    from parallel.manifest import replacing

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
    note = f", {translator.truncated} over-long sources truncated" if translator.truncated else ""
    print(f"translated {lines} lines in {seconds:.1f} s ({lines / max(seconds, 1e-9):.1f} sentences/s, "
          f"{tokens / max(seconds, 1e-9):.0f} tokens/s, beam {options.beam}, {threads()}{note})", file=sys.stderr)
    return 0
