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

HELP = "export a trained model to Hugging Face transformers (--to hf) or CTranslate2 (--to ctranslate2)"
TOLERANCE = 1e-3  # refuse an export whose logits differ more than this from the project's


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="run directory (latest checkpoint, any layout) or consolidated model file")
    parser.add_argument("--to", required=True, choices=["hf", "ctranslate2"], dest="format",
                        help="hf: a transformers MarianMTModel folder; ctranslate2: a CTranslate2 model folder")
    parser.add_argument("out", help="output folder (must not exist, or be empty, unless --force)")
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

    from export.hf import ExportError, export_alphas

    hf_logging.disable_progress_bar()  # no weight-loading bars in the command's output
    # MarianTokenizer recommends sacremoses for a punctuation normaliser it never applies when encoding.
    warnings.filterwarnings("ignore", message="Recommended: pip install sacremoses")
    from parallel.checkpoints import CheckpointError, load_model

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
            note = _export(loaded, alphas, args, work)
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


def _export(loaded, alphas: tuple[float, float], args: argparse.Namespace, work: str) -> str:
    """Write the export into the empty folder `work`; returns the line that describes it."""
    from data.spm import Tokenizer
    from export.card import model_card, run_facts
    from export.hf import TOKENIZER_FILES, ExportError, write_hf
    from export.verify import verify_hf

    hf_dir = work if args.format == "hf" else os.path.join(work, ".hf")
    os.makedirs(hf_dir, exist_ok=True)
    spm_path = os.path.join(work, ".spm.model")
    with open(spm_path, "wb") as f:
        f.write(loaded.spm_model)
    tokenizer = Tokenizer(spm_path)
    first_piece = 4 + len(tokenizer.tags)  # past pad, unk, bos, eos and the tags
    write_hf(loaded.model, loaded.spm_model, tokenizer, hf_dir)
    check = verify_hf(loaded.model, hf_dir, tokenizer.bos_id, first_piece, alphas)
    if check["max_abs_logit_diff"] > TOLERANCE:
        raise ExportError(f"the exported model's logits differ from the project's by "
                          f"{check['max_abs_logit_diff']:.2e} (> {TOLERANCE}); nothing was written")
    note = _hf_note(loaded.model.cfg, alphas, check)
    if args.format == "ctranslate2":
        from export.ctranslate2 import convert, verify_ct2_note

        convert(hf_dir, os.path.join(work, ".ct2"), args.quantization, TOKENIZER_FILES)
        pieces = [tokenizer.sp.id_to_piece(i) for i in range(tokenizer.vocab_size)]
        note = verify_ct2_note(loaded.model, os.path.join(work, ".ct2"), pieces, tokenizer.bos_id, first_piece,
                               args.quantization, note)
        for name in os.listdir(os.path.join(work, ".ct2")):
            os.replace(os.path.join(work, ".ct2", name), os.path.join(work, name))
        shutil.rmtree(os.path.join(work, ".ct2"))
        shutil.rmtree(hf_dir)
    os.remove(spm_path)
    card = model_card(loaded.meta, run_facts(loaded.meta), note, args.format, args.quantization)
    with open(os.path.join(work, "README.md"), "w", encoding="utf-8") as f:
        f.write(card)
    return note


def _hf_note(cfg, alphas: tuple[float, float], check: dict) -> str:
    text = (f"transformers `MarianMTModel` (float32 safetensors), exported from `{cfg.norm}`. "
            f"Checked on a probe batch: max |logit difference| to deepnet-trainer's model "
            f"{check['max_abs_logit_diff']:.2e} (logits up to {check['max_abs_logit']:.1f}).")
    if "with_exact_eps" in check:
        text += (f" DeepNorm's residual weight α (encoder {alphas[0]:.4f}, decoder {alphas[1]:.4f}) is folded "
                 f"into the attention output projections and FFN fc2 (divided by α: LN(α·x + G) = LN(x + G/α) "
                 f"with ε/α²); Marian's LayerNorms keep ε = 1e-5 where ε/α² would be exact, and that accounts "
                 f"for the difference: with ε/α² it is {check['with_exact_eps']:.2e}.")
    return text
