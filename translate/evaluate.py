"""Scoring translations of the dev/test sets of every direction.

Scores come from sacreBLEU's Python API, as the paper reports them, on detokenised, case-sensitive
text: BLEU with the tokenizer the target language needs (BLEU_TOKENIZERS: '13a' for languages that
put spaces between words, sacreBLEU's 'zh' for Chinese, 'ja-mecab' and 'ko-mecab' for Japanese and
Korean where those are installed; none for Thai, Lao, Khmer and Burmese, which get chrF only), chrF,
and spBLEU when the FLORES SentencePiece model is already in sacreBLEU's models folder (it is never
downloaded here). References are the raw lines of the corpus, not ids decoded back to text. Per
split, a Markdown and a CSV table (per direction with its BLEU tokenizer, then the X→En, En→X and
overall averages), the signatures and the hypotheses are written to the output folder; the console
gets the tables and at most one line of notes.
"""
from __future__ import annotations

import csv
import io
import json
import os
import sys
import time

from schema.text import count
from translate.translator import idle_cores, load_translator, progress_bar, threads


# ---- scoring (sacreBLEU) ----------------------------------------------------------------------

BLEU_TOKENIZERS = {"zh": "zh", "ja": "ja-mecab", "ko": "ko-mecab"}
"""sacreBLEU's tokenizer for BLEU into these languages (by ISO 639-1 code; zh_CN is zh); '13a'
for every other. 13a splits at spaces and punctuation: on Chinese, Japanese or Korean text it
counts whole clauses as words, and BLEU means nothing."""
WITHOUT_SPACES = {"th": "Thai", "lo": "Lao", "km": "Khmer", "my": "Burmese"}
"""Scripts written without spaces between words, for which sacreBLEU has no word tokenizer: chrF
only (and spBLEU, whose SentencePiece model covers them)."""
SPBLEU_MODELS = ("flores200", "flores101")


def spbleu_model_path(name: str) -> str:
    """Where sacreBLEU looks for the FLORES SentencePiece model `name` (flores200/flores101)."""
    from sacrebleu.tokenizers import tokenizer_spm

    url = tokenizer_spm.SPM_MODELS[name]["url"]
    return os.path.join(tokenizer_spm.SACREBLEU_DIR, "models", os.path.basename(url))


def language_of(code: str) -> str:
    """The language of a corpus code: zh_CN, zh-Hans and ZH are zh."""
    return code.lower().replace("-", "_").split("_")[0]


def bleu_tokenizer(language: str) -> tuple[str | None, str]:
    """sacreBLEU's tokenizer for BLEU into `language`, or None (chrF only) and why."""
    from sacrebleu.metrics import BLEU

    base = language_of(language)
    if base in WITHOUT_SPACES:
        return None, (f"{WITHOUT_SPACES[base]} is written without spaces between words and sacreBLEU has no "
                      "tokenizer for it")
    name = BLEU_TOKENIZERS.get(base, "13a")
    try:
        BLEU(tokenize=name)
    except Exception:  # ja-mecab, ko-mecab: their dictionaries are an extra install
        return None, f"sacreBLEU's {name} tokenizer is not installed (pip install 'sacrebleu[{base}]')"
    return name, ""


class Scores:
    """The metrics of one evaluation: BLEU with the tokenizer each target language needs, chrF,
    spBLEU (`spbleu`: flores200 or flores101, or auto: flores200 where its model is present; none).
    `notes` are for the tables; `said` for the console, once per evaluation."""

    def __init__(self, spbleu: str) -> None:
        from sacrebleu.metrics import BLEU, CHRF

        self.metrics = {"chrF": CHRF()}
        self.bleu: dict[str, object] = {}
        self.tokenizers: dict[str, str | None] = {}
        self.notes: list[str] = []
        self.said: list[str] = []
        name = "flores200" if spbleu == "auto" else spbleu
        if name in SPBLEU_MODELS:
            path = spbleu_model_path(name)
            if os.path.exists(path):
                self.metrics["spBLEU"] = BLEU(tokenize=name)
            else:
                note = (f"spBLEU skipped: sacreBLEU needs the {name} SentencePiece model at {path} (nothing is "
                        "downloaded here; copy the file there, or point $SACREBLEU at a folder whose models/ holds it)")
                self.notes.append(note)
                if spbleu != "auto":  # asked for by name: said
                    self.said.append(note)

    @property
    def columns(self) -> list[str]:
        return ["BLEU", "tokenizer", *self.metrics]

    def tokenizer(self, language: str) -> str | None:
        if language not in self.tokenizers:
            name, why = bleu_tokenizer(language)
            self.tokenizers[language] = name
            if name is None:
                note = f"{language}: chrF only, no BLEU ({why})"
                self.notes.append(note)
                self.said.append(note)
        return self.tokenizers[language]

    def score(self, hypotheses: list[str], references: list[str], language: str) -> dict:
        """{BLEU (None: not scored), tokenizer, chrF[, spBLEU]} of one direction into `language`."""
        from sacrebleu.metrics import BLEU

        name = self.tokenizer(language)
        row: dict = {"BLEU": None, "tokenizer": name or "–"}
        if name is not None:
            if name not in self.bleu:  # one per tokenizer (ja/ko load their dictionaries)
                self.bleu[name] = BLEU(tokenize=name)
            metric = self.bleu[name]
            row["BLEU"] = metric.corpus_score(hypotheses, [references]).score
        for column, metric in self.metrics.items():
            row[column] = metric.corpus_score(hypotheses, [references]).score
        return row

    def signatures(self) -> dict[str, str]:
        """sacreBLEU's signature of every metric used: BLEU once per tokenizer."""
        sigs = {f"BLEU ({name})": str(metric.get_signature()) for name, metric in self.bleu.items()}
        return {**sigs, **{name: str(metric.get_signature()) for name, metric in self.metrics.items()}}


def average_rows(rows: list[dict], columns: list[str]) -> list[dict]:
    """X→En, En→X and all-direction means of each score column (Table III of the paper); BLEU over
    the directions that have one, its tokenizers named."""
    groups = {"X→En average": [r for r in rows if r["direction"].endswith("-en")],
              "En→X average": [r for r in rows if r["direction"].startswith("en-")],
              "all average": rows}
    out = []
    for name, members in groups.items():
        if members:
            row = {"direction": name, "sentences": sum(r["sentences"] for r in members)}
            for c in columns:
                if c == "tokenizer":
                    row[c] = "+".join(sorted({r[c] for r in members if r["BLEU"] is not None})) or "–"
                    continue
                values = [r[c] for r in members if r[c] is not None]
                row[c] = sum(values) / len(values) if values else None
            out.append(row)
    return out


def _cell(value) -> str:
    return "–" if value is None else f"{value:.2f}" if isinstance(value, float) else str(value)


def markdown(rows: list[dict], columns: list[str]) -> str:
    head = ["direction", "sentences", *columns]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(_cell(r[c]) for c in head) + " |")
    return "\n".join(lines)


def write_tables(prefix: str, header: str, rows: list[dict], columns: list[str], sigs: dict[str, str],
                 notes: list[str]) -> str:
    """<prefix>.md (table, signatures, notes) and <prefix>.csv; returns the Markdown table."""
    table = markdown(rows, columns)
    footer = "".join(f"- {name}: `{sig}`\n" for name, sig in sigs.items()) + "".join(f"- {n}\n" for n in notes)
    _write(prefix + ".md", f"{header}\n\n{table}\n\n{footer}")
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=["direction", "sentences", *columns])
    writer.writeheader()
    writer.writerows({k: ("" if v is None else f"{v:.4f}" if isinstance(v, float) else v) for k, v in r.items()}
                     for r in rows)
    _write(prefix + ".csv", buffer.getvalue())
    return table


def _write(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


# ---- the test sets ----------------------------------------------------------------------------

def load_sets(run_dir: str, splits: list[str], directions: list[str] | None, cap: int) -> dict:
    """{split: {direction: (sources, references)}} from the run's raw corpus."""
    from data.corpus import list_pairs, read_direction
    from data.prepare import corpus_path, load_manifest

    data_dir = os.path.join(run_dir, "data")
    manifest = load_manifest(data_dir)
    pairs = {p.name: p for p in list_pairs(corpus_path(data_dir, manifest))}
    by_direction = {d: p for p in pairs.values() for d in p.directions()}
    wanted = directions or manifest["directions"]
    unknown = [d for d in wanted if d not in by_direction]
    if unknown:
        raise ValueError(f"directions {unknown} are not in the corpus; it has {sorted(by_direction)}")
    sets: dict = {}
    for split in splits:
        for direction in wanted:
            lines = list(read_direction(by_direction[direction], split, direction))
            if cap:
                lines = lines[:cap]
            if lines:
                sets.setdefault(split, {})[direction] = ([s for s, _ in lines], [t for _, t in lines])
    return sets


def evaluate(translator, sets: dict, options, spbleu: str, out_dir: str, log=print) -> dict:
    """Translate and score every set; write the tables; return {split: {rows, signatures, ...}}.
    Printed: each split's table and speed, then at most one line of notes (what was not scored and
    why) and one warning where every hypothesis of a direction is empty."""
    scores = Scores(spbleu)
    os.makedirs(out_dir, exist_ok=True)
    report = {}
    empty: dict[str, list[str]] = {}  # split → directions whose hypotheses are all empty
    for split, by_direction in sets.items():
        texts, targets, owners = [], [], []
        for direction, (sources, _) in by_direction.items():
            texts += sources
            targets += [direction.split("-")[1]] * len(sources)
            owners += [direction] * len(sources)
        bar = progress_bar(len(texts), f"{split}")
        start = time.perf_counter()
        try:  # every direction in one call: batches mix target languages by their tags
            hyps, generated = translator.translate(texts, targets, options, bar.update)
        finally:
            bar.close()
        seconds = time.perf_counter() - start
        rows = []
        hyp_dir = os.path.join(out_dir, split)
        os.makedirs(hyp_dir, exist_ok=True)
        for direction, (_, references) in by_direction.items():
            mine = [h for h, owner in zip(hyps, owners, strict=True) if owner == direction]
            _write(os.path.join(hyp_dir, f"{direction}.hyp"), "".join(h + "\n" for h in mine))
            if mine and not any(h.strip() for h in mine):
                empty.setdefault(split, []).append(direction)
            rows.append({"direction": direction, "sentences": len(mine),
                         **scores.score(mine, references, direction.split("-")[1])})
        columns = scores.columns
        rows += average_rows(rows, columns)
        sigs = scores.signatures()
        speed = {"sentences": len(texts), "seconds": seconds, "sentences_per_s": len(texts) / seconds,
                 "tokens_per_s": generated / seconds, "beam": options.beam, "on": threads()}
        header = f"# {split}: {count(len(by_direction), 'direction')}, beam {options.beam}, lenpen {options.lenpen}"
        table = write_tables(os.path.join(out_dir, split), header, rows, columns, sigs, scores.notes)
        log(f"\n{header}\n\n{table}")
        log(f"decoded {count(len(texts), 'sentence')} in {seconds:.1f} s: {speed['sentences_per_s']:.1f} sentences/s, "
            f"{speed['tokens_per_s']:.0f} tokens/s (beam {options.beam}, {threads()})")
        report[split] = {"rows": rows, "signatures": sigs, "speed": speed, "notes": scores.notes}
    # the model scored (its checkpoint and step, or the checkpoints it averages): the model card
    # of an export shows a table only for the model it was made from
    report["model"] = (getattr(translator, "meta", None) or {}).get("source")
    _write(os.path.join(out_dir, "eval.json"), json.dumps(report, indent=2, ensure_ascii=False))
    if scores.said:
        log("note: " + "; ".join(dict.fromkeys(scores.said)))
    if empty:
        print("warning: " + empty_hypotheses(empty, sets), file=sys.stderr, flush=True)
    log(f"tables, signatures and hypotheses written to {out_dir}")
    return report


def empty_hypotheses(empty: dict[str, list[str]], sets: dict) -> str:
    """One line on the directions (per split) whose every hypothesis is empty."""
    every = all(set(empty.get(split, [])) == set(by_direction) for split, by_direction in sets.items())
    if every:
        sentences = sum(len(sources) for by_direction in sets.values() for sources, _ in by_direction.values())
        return (f"every hypothesis is empty ({count(sentences, 'sentence')} of {', '.join(sets)}): the model generated "
                "no tokens, so its scores are 0 and its tokens/s say nothing")
    which = "; ".join(f"{split}: {', '.join(directions)}" for split, directions in empty.items())
    return f"every hypothesis of these directions is empty ({which}): the model generated no tokens for them"


def evaluate_after_training(run_dir: str, max_sentences: int) -> None:
    """The short evaluation that ends ./run.sh train: the first `max_sentences` test sentences of
    every direction, beam 5, tables in <run_dir>/eval/ (./run.sh eval scores everything)."""
    import torch

    from model.decoding import DecodeOptions

    start = time.perf_counter()
    torch.set_num_threads(idle_cores())
    print(f"\n== evaluation: first {count(max_sentences, 'test sentence')} per direction, beam 5 "
          f"(./run.sh eval {run_dir} scores all) ==", flush=True)
    try:
        translator = load_translator(run_dir)
        sets = load_sets(run_dir, ["test"], None, max_sentences)
    except ValueError as e:  # CheckpointError, DataError: the trained run itself is fine
        print(f"error: cannot evaluate {run_dir}: {e}", file=sys.stderr)
        return
    evaluate(translator, sets, DecodeOptions(), "auto", os.path.join(run_dir, "eval"))
    print(f"evaluation took {time.perf_counter() - start:.1f} s", flush=True)
