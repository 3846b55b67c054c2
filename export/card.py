"""The model card (README.md) of an exported folder: languages, training data and steps,
validation loss, the evaluation table when the run has one, and how to use the model."""
from __future__ import annotations

import csv
import glob
import json
import os

from runtime.accelerator import HOST
from schema.text import count


def run_facts(meta: dict) -> dict:
    """What the run directory behind a loaded model says about its training (empty values when
    the model file travelled without its run directory)."""
    source = meta.get("source", {})
    checkpoint = source.get("checkpoint") or ""
    run_dir = os.path.dirname(os.path.dirname(checkpoint)) if checkpoint else ""
    facts: dict = {"step": source.get("step"), "run_dir": run_dir, "valid_loss": None, "eval_table": None,
                   "corpus": None, "pairs": {}, "layout": (source.get("pipeline_stages"), source.get("data_parallel"))}
    if not run_dir or not os.path.isdir(run_dir):
        return facts
    if not source.get("averaged"):  # an average has no validation of its own
        facts["valid_loss"] = _valid_loss(run_dir, facts["step"])
    manifest = _read_json(os.path.join(run_dir, "data", "manifest.json"))
    if manifest:
        facts["pairs"] = manifest.get("pairs", {})
        facts["corpus"] = (manifest.get("config") or {}).get("corpus")
    config = _read_json(os.path.join(run_dir, "config.json"))
    if config and not facts["corpus"]:
        facts["corpus"] = (config.get("data") or {}).get("corpus")
    table = os.path.join(run_dir, "eval", "test.md")
    scored = (_read_json(os.path.join(run_dir, "eval", "eval.json")) or {}).get("model") or {}
    if os.path.exists(table) and _same_model(scored, source):  # the run's evaluation of this very model
        with open(table, encoding="utf-8") as f:
            facts["eval_table"] = f.read().strip()
    return facts


def _same_model(scored: dict, source: dict) -> bool:
    keys = ("checkpoint", "step", "averaged")
    return bool(scored) and all(scored.get(k) == source.get(k) for k in keys)


def _read_json(path: str) -> dict | None:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _valid_loss(run_dir: str, step: int | None) -> tuple[int, float] | None:
    """(step, loss) of the last validation at or before `step`, from the run's metrics CSV
    (DeepSpeed's csv monitor) or, failing that, summary.json."""
    rows: list[tuple[int, float]] = []
    for path in glob.glob(os.path.join(run_dir, "metrics", "**", "*.csv"), recursive=True):
        name = os.path.relpath(path, run_dir).lower()
        if "valid" in name and "loss" in name:
            with open(path, encoding="utf-8") as f:
                for row in csv.reader(f):
                    try:
                        rows.append((int(float(row[0])), float(row[1])))
                    except (ValueError, IndexError):
                        continue  # the header
    rows = sorted(r for r in rows if step is None or r[0] <= step)
    if rows:
        return rows[-1]
    summary = _read_json(os.path.join(run_dir, "summary.json"))
    if summary and summary.get("last_valid_loss") is not None:
        return summary.get("steps"), summary["last_valid_loss"]
    return None


def _params(cfg: dict) -> int:
    d, f, v = cfg["d_model"], cfg["ffn_dim"], cfg["vocab_size"]
    attention = 4 * (d * d + d)
    ffn = d * f + f + f * d + d
    encoder = cfg["encoder_layers"] * (attention + ffn + 2 * 2 * d)
    decoder = cfg["decoder_layers"] * (2 * attention + ffn + 3 * 2 * d)
    return v * d + encoder + decoder


def model_card(meta: dict, facts: dict, export_note: str, fmt: str, quantization: str = "float32") -> str:
    """README.md for an export to `fmt` ('hf' or 'ctranslate2')."""
    cfg = meta["model_config"]
    languages = meta.get("languages", [])
    directions = meta.get("directions", [])
    example_lang = next((lang for lang in languages if lang != "en"), languages[0] if languages else "xx")
    front = ["---", "language:"] + [f"- {lang.split('_')[0]}" for lang in languages]
    front += ["library_name: " + ("transformers" if fmt == "hf" else "ctranslate2"),
              "pipeline_tag: translation", "tags:", "- translation", "- marian", f"- {cfg['norm']}", "---", ""]
    shape = (f"{cfg['encoder_layers']}L-{cfg['decoder_layers']}L, d_model {cfg['d_model']}, {cfg['heads']} heads, "
             f"FFN {cfg['ffn_dim']}, {cfg['activation']}, vocabulary {cfg['vocab_size']} (joint SentencePiece)")
    lines = [f"# deepnet-trainer translation model ({cfg['norm']}, {'/'.join(languages)})", "",
             f"A multilingual encoder-decoder Transformer trained with deepnet-trainer: {shape}, "
             f"about {_params(cfg) / 1e6:.1f}M parameters, one embedding shared by encoder, decoder and "
             f"output layer. Normalisation: `{cfg['norm']}`.", "",
             "## Format", "", export_note, ""]
    lines += ["## Training", ""]
    lines.append(f"- languages: {', '.join(languages)}; directions: {', '.join(directions)}")
    if facts.get("corpus"):
        lines.append(f"- corpus: `{facts['corpus']}`")
    for pair, counts in sorted(facts.get("pairs", {}).items()):
        lines.append(f"  - {pair}: " + ", ".join(f"{split} {n}" for split, n in counts.items()) + " line pairs")
    if facts.get("step") is not None:
        stages, replicas = facts.get("layout", (None, None))
        layout = f" ({count(stages, 'pipeline stage')} × {count(replicas, 'replica')})" if stages else ""
        lines.append(f"- optimizer steps: {facts['step']}{layout}")
    started = meta.get("init_from")
    if started:
        lines.append(f"- fine-tuned from `{started['checkpoint']}` (step {started['step']}; train.init_from="
                     f"`{started['init_from']}`): its weights, with a fresh optimizer, schedule and data order")
    averaged = (meta.get("source") or {}).get("averaged")
    if averaged:
        lines.append(f"- weights: the element-wise mean of {count(len(averaged), 'checkpoint')} (steps "
                     f"{', '.join(str(a['step']) for a in averaged)}; ./run.sh convert average)")
    if facts.get("valid_loss"):
        step, loss = facts["valid_loss"]
        lines.append(f"- validation loss (label-smoothed cross-entropy, ε = {cfg['label_smoothing']}, nats per "
                     f"target token) at step {step}: {loss:.4f}")
    lines.append("")
    if facts.get("eval_table"):
        lines += ["## Evaluation (from the run's last `./run.sh eval` / end-of-training evaluation)", "",
                  facts["eval_table"], ""]
    lines += ["## Usage", "",
              f"The target language is chosen by its tag before the source text, with no space between: "
              f"`<2{example_lang}>`. Tags of this model: " + ", ".join(f"`<2{lang}>`" for lang in languages) + ".",
              ""]
    lines += _usage_hf(example_lang) if fmt == "hf" else _usage_ct2(example_lang, [f"<2{lang}>" for lang in languages])
    return "\n".join(front + lines) + "\n"


def _usage_hf(lang: str) -> list[str]:
    return ["```python", "from transformers import AutoModelForSeq2SeqLM, AutoTokenizer", "",
            'path = "."  # this folder', "tokenizer = AutoTokenizer.from_pretrained(path)",
            "model = AutoModelForSeq2SeqLM.from_pretrained(path).eval()",
            'texts = ["Save and continue editing", "Enter a valid email address."]',
            f'batch = tokenizer(["<2{lang}>" + t for t in texts], return_tensors="pt", padding=True)',
            "# beam 5, length penalty 1.0 and the tokens never generated (pad, bos, language tags) come from",
            "# generation_config.json; as deepnet-trainer: at most 1.2 × source tokens + 10, plus eos and the start token",
            "out = model.generate(**batch, max_length=int(1.2 * batch.input_ids.shape[1]) + 12)",
            "print(tokenizer.batch_decode(out, skip_special_tokens=True))", "```", "",
            "Needs `transformers`, `torch` and `sentencepiece`. The tokenizer gives exactly the ids of "
            "`./run.sh translate`: the tag, the SentencePiece pieces of the text, `</s>`."]


def _usage_ct2(lang: str, tags: list[str]) -> list[str]:
    return ["```python", "import ctranslate2", "import sentencepiece as spm", "",
            'path = "."  # this folder', 'sp = spm.SentencePieceProcessor(model_file=f"{path}/source.spm")',
            f'translator = ctranslate2.Translator(path, device="{HOST}")',
            'texts = ["Save and continue editing", "Enter a valid email address."]',
            f'source = [["<2{lang}>"] + sp.encode(t, out_type=str) + ["</s>"] for t in texts]',
            f'tags = {tags!r}  # never generated, as in ./run.sh translate',
            "results = translator.translate_batch(source, beam_size=5, length_penalty=1.0,",
            "                                     max_decoding_length=256, suppress_sequences=[[t] for t in tags + [\"<s>\", \"<pad>\"]])",
            "print([sp.decode(r.hypotheses[0]) for r in results])", "```", "",
            "Needs `ctranslate2` and `sentencepiece`. The same folder also loads with "
            "`transformers.AutoTokenizer.from_pretrained` (source.spm, vocab.json, tokenizer_config.json)."]
