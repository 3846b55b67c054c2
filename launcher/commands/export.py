"""./run.sh export MODEL --to hf|ctranslate2 OUT: a trained model for transformers or CTranslate2.

MODEL is a run directory (its latest checkpoint, or --tag; pipeline- and tensor-parallel
checkpoints are consolidated on the way) or a consolidated model file. The output folder is
written under a temporary name and renamed when complete, after the export has been checked
against the project's model on a probe batch (export/verify.py).
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

from launcher.options import user_path

HELP = "export a trained model to Hugging Face transformers (--to hf) or CTranslate2 (--to ctranslate2)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", type=user_path, help="run directory (latest checkpoint, any layout) or consolidated model file")
    parser.add_argument("--to", required=True, choices=["hf", "ctranslate2"], dest="format",
                        help="hf: a transformers MarianMTModel folder; ctranslate2: a CTranslate2 model folder")
    parser.add_argument("out", type=user_path, help="output folder (must not exist, or be empty, unless --force)")
    parser.add_argument("--tag", help="checkpoint tag in a run directory (default: its latest)")
    parser.add_argument("--quantization", default="float32",
                        help="CTranslate2 weight type: float32 (default), int8, int8_float32, int16, float16, "
                             "bfloat16, int8_float16, int8_bfloat16")
    parser.add_argument("--force", action="store_true",
                        help="replace an existing export in the output folder (never the model's own folder "
                             "or one that is not an export)")


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def _replace_problem(out: str, model: str, shown: str) -> str | None:
    """Why `--force` must not replace the existing, non-empty `out` (None: it may): it is or holds
    the model being exported, or it is not a previous export (no config.json, which every export
    writes). --force replaces an export, never a run directory or anything else."""
    real_out, real_model = os.path.realpath(out), os.path.realpath(model)
    if real_model == real_out or real_model.startswith(real_out.rstrip(os.sep) + os.sep):
        return f"{shown} is or contains the model being exported ({model}); choose another output folder"
    if not os.path.isdir(out):
        return f"{shown} is a file, not an export folder; choose another output folder"
    if not os.path.isfile(os.path.join(out, "config.json")):
        return (f"{shown} holds files that are not an export (no config.json); --force replaces only a "
                f"previous export: choose another output folder or remove it yourself")
    return None


def run(args: argparse.Namespace) -> int:
    out = os.path.abspath(args.out)
    if os.path.exists(out) and not (os.path.isdir(out) and not os.listdir(out)):
        if not args.force:
            return _fail(f"{args.out} exists and is not empty; choose another folder or pass --force")
        problem = _replace_problem(out, args.model, args.out)
        if problem:
            return _fail(problem)
    if args.format == "ctranslate2":
        try:
            from export.ctranslate2 import QUANTIZATIONS
        except ImportError as e:
            return _fail(f"CTranslate2 is not installed ({e}); ./run.sh installs requirements.txt")
        if args.quantization not in QUANTIZATIONS:
            return _fail(f"--quantization {args.quantization}: choose one of {', '.join(QUANTIZATIONS)}")
    elif args.quantization != "float32":
        return _fail("--quantization applies to --to ctranslate2 only (transformers weights are float32)")

    import warnings

    import torch
    from transformers.utils import logging as hf_logging

    from export.bundle import write_export
    from export.hf import ExportError, export_alphas

    hf_logging.disable_progress_bar()  # no weight-loading bars in the command's output
    # MarianTokenizer recommends sacremoses for a punctuation normaliser it never applies when encoding.
    warnings.filterwarnings("ignore", message="Recommended: pip install sacremoses")
    from checkpoint.checkpoints import CheckpointError, load_model

    start = time.perf_counter()
    torch.set_num_threads(1)
    try:
        loaded = load_model(args.model, args.tag)
        alphas = export_alphas(loaded.model)
    except (CheckpointError, ExportError) as e:
        return _fail(str(e))
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    work = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.", dir=parent)
    try:
        try:
            note = write_export(loaded, alphas, args.format, args.quantization, work)
        except ExportError as e:
            shutil.rmtree(work, ignore_errors=True)
            return _fail(str(e))
        umask = os.umask(0)
        os.umask(umask)
        for folder, _, names in os.walk(work):  # mkdtemp and some writers create private files
            os.chmod(folder, 0o777 & ~umask)
            for name in names:
                os.chmod(os.path.join(folder, name), 0o666 & ~umask)
        if os.path.exists(out):
            shutil.rmtree(out)
        os.replace(work, out)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    print(f"{note}\nwrote {args.out} in {time.perf_counter() - start:.1f} s")
    return 0
