"""An export folder as `./run.sh export` writes it: the transformers or CTranslate2 model, its
tokenizer files and a model card, checked against the project's own logits before anything is
written."""
from __future__ import annotations

import os
import shutil

from data.spm import Tokenizer
from export.card import model_card, run_facts
from export.hf import TOKENIZER_FILES, ExportError, write_hf
from export.verify import verify_hf

TOLERANCE = 1e-3  # refuse an export whose logits differ more than this from the project's


def write_export(loaded, alphas: tuple[float, float], fmt: str, quantization: str, work: str) -> str:
    """Write the export of `loaded` (checkpoint/checkpoints.py `load_model`) as `fmt` (hf | ctranslate2)
    into the empty folder `work`: the model, its tokenizer files and the model card, checked against
    the project's logits on a probe batch. Returns the line that describes it."""
    hf_dir = work if fmt == "hf" else os.path.join(work, ".hf")
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
    note = hf_note(loaded.model.cfg, alphas, check)
    if fmt == "ctranslate2":
        from export.ctranslate2 import convert, verify_ct2_note

        convert(hf_dir, os.path.join(work, ".ct2"), quantization, TOKENIZER_FILES)
        pieces = [tokenizer.sp.id_to_piece(i) for i in range(tokenizer.vocab_size)]
        note = verify_ct2_note(loaded.model, os.path.join(work, ".ct2"), pieces, tokenizer.bos_id, first_piece,
                               quantization, note)
        for name in os.listdir(os.path.join(work, ".ct2")):
            os.replace(os.path.join(work, ".ct2", name), os.path.join(work, name))
        shutil.rmtree(os.path.join(work, ".ct2"))
        shutil.rmtree(hf_dir)
    os.remove(spm_path)
    card = model_card(loaded.meta, run_facts(loaded.meta), note, fmt, quantization)
    with open(os.path.join(work, "README.md"), "w", encoding="utf-8") as f:
        f.write(card)
    return note


def hf_note(cfg, alphas: tuple[float, float], check: dict) -> str:
    text = (f"transformers `MarianMTModel` (float32 safetensors), exported from `{cfg.norm}`. "
            f"Checked on a probe batch: max |logit difference| to deepnet-trainer's model "
            f"{check['max_abs_logit_diff']:.2e} (logits up to {check['max_abs_logit']:.1f}).")
    if "with_exact_eps" in check:
        text += (f" DeepNorm's residual weight α (encoder {alphas[0]:.4f}, decoder {alphas[1]:.4f}) is folded "
                 f"into the attention output projections and FFN fc2 (divided by α: LN(α·x + G) = LN(x + G/α) "
                 f"with ε/α²); Marian's LayerNorms keep ε = 1e-5 where ε/α² would be exact, and that accounts "
                 f"for the difference: with ε/α² it is {check['with_exact_eps']:.2e}.")
    return text
