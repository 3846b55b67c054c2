"""An exported Hugging Face folder → a CTranslate2 model, through CTranslate2's own converter.

CTranslate2's `Converter` base class does the work (validation, quantization, model.bin, the
vocabulary); its BART loader maps every weight of a post-norm transformers encoder-decoder. Its
registered *Marian* loader is not used because it assumes two things of Marian-NMT's models
that do not hold here: that the decoder starts from a zero embedding (this model starts from
bos, a trained embedding) and that the last vocabulary row is an added padding token (it drops
that row; here it is a real piece). So `ct2-transformers-converter` on the transformers folder
would give a wrong model; `./run.sh export --to ctranslate2` gives this one.
"""
from __future__ import annotations

import os

import ctranslate2
from ctranslate2.converters.converter import Converter
from ctranslate2.converters.transformers import BartLoader

QUANTIZATIONS = ("float32", "int8", "int8_float32", "int16", "float16", "int8_float16", "bfloat16",
                 "int8_bfloat16")


class PostNormMarianLoader(BartLoader):
    """BART's weight mapping for a Marian module without BART's embedding LayerNorm; the decoder
    starts from `decoder_start_token_id` (bos) and the vocabulary is taken whole."""

    @property
    def architecture_name(self) -> str:
        return "MarianMTModel"

    def get_model_spec(self, model):
        model.config.normalize_before = False   # Post-LN layers
        model.config.normalize_embedding = False  # no LayerNorm on the embeddings
        return super().get_model_spec(model)


class ExportedModelConverter(Converter):
    """Converts a folder written by export.hf.write_hf; `files` are copied next to model.bin."""

    def __init__(self, hf_dir: str, files: tuple[str, ...] = ()):
        self.hf_dir = hf_dir
        self.files = files

    def _load(self):
        import torch
        import transformers

        with torch.no_grad():
            model = transformers.MarianMTModel.from_pretrained(self.hf_dir, dtype=torch.float32)
            tokenizer = transformers.AutoTokenizer.from_pretrained(self.hf_dir)
            spec = PostNormMarianLoader()(model, tokenizer)
        for name in self.files:
            spec.register_file(os.path.join(self.hf_dir, name))
        return spec


def convert(hf_dir: str, out_dir: str, quantization: str, files: tuple[str, ...]) -> None:
    """Write the CTranslate2 model of `hf_dir` into `out_dir` (replaced if it exists)."""
    ExportedModelConverter(hf_dir, files).convert(out_dir, quantization=quantization, force=True)


def version() -> str:
    return ctranslate2.__version__


def verify_ct2_note(model, ct2_dir: str, pieces: list[str], bos: int, first_piece: int, quantization: str,
                    hf_note: str) -> str:
    """The format line of the CTranslate2 card, with the measured log-probability difference."""
    from export.verify import verify_ct2

    diff = verify_ct2(model, ct2_dir, pieces, bos, first_piece)
    return (f"CTranslate2 {version()} model, weights `{quantization}`, converted by CTranslate2's own converter "
            f"from this model's transformers export. {hf_note} On the same probe batch the CTranslate2 model's "
            f"log-probabilities of the target tokens differ from deepnet-trainer's by at most {diff:.2e}.")
