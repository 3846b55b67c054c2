"""Translation with a trained model: a loaded model and its SentencePiece model, text in and
text out, used by `./run.sh translate`, `./run.sh eval` and the evaluation that ends a training run.

A model is a consolidated model file (`./run.sh convert consolidate`) or a run directory, whose
latest checkpoint is consolidated in memory (checkpoint/checkpoints.py).
"""
from __future__ import annotations

import hashlib
import itertools
import os
import sys
import tempfile
from collections.abc import Callable

from runtime import accelerator
from schema.text import count

CHUNK_LINES = 2000  # lines decoded per call: bounds memory on long inputs, keeps batches full


def idle_cores() -> int:
    """Cores this process may use minus the 1-minute load average, at least 1.

    Decoding is a long series of small matrix products, and OpenMP threads spin while they wait
    for each other: on a 2-core machine busy with other work, 2 threads decoded 4–9× slower than 1.
    On an idle machine every core is used.
    """
    cores = len(os.sched_getaffinity(0))
    return max(1, min(cores, cores - round(os.getloadavg()[0])))


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
    from checkpoint.checkpoints import load_model

    return Translator(load_model(source, tag))


def on_gpu() -> bool:
    """Decode on a GPU when there is one and run.sh did not choose the CPU accelerator."""
    return accelerator.gpu_available()


def threads() -> str:
    """The compute the decoding ran on, for speed reports."""
    import torch

    return "GPU" if on_gpu() else count(torch.get_num_threads(), "CPU thread")


def progress_bar(total: int, what: str):
    """A tqdm bar on stderr (hidden when stderr is not a terminal)."""
    from tqdm import tqdm

    return tqdm(total=total, unit="sent", desc=what, file=sys.stderr, disable=None, leave=False)


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
