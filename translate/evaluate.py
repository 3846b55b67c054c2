"""Scoring translations of the dev/test sets of every direction.

Scores come from sacreBLEU's Python API, as the paper reports them: BLEU on detokenised,
case-sensitive text with the '13a' tokenizer pinned (the API would otherwise switch to its
zh/ja/ko tokenizers for those targets), chrF, and spBLEU when the FLORES SentencePiece model is
already in sacreBLEU's models folder (it is never downloaded here). References are the raw lines of
the corpus, not ids decoded back to text. Per split, a Markdown and a CSV table (per direction,
then the X→En, En→X and overall averages) and the hypotheses are written to the output folder.
"""
from __future__ import annotations

import csv
import io
import json
import os
import sys
import time

from translate.translator import idle_cores, load_translator, progress_bar, threads


# ---- scoring (sacreBLEU) ----------------------------------------------------------------------

def spbleu_model_path(name: str) -> str:
    """Where sacreBLEU looks for the FLORES SentencePiece model `name` (flores200/flores101)."""
    from sacrebleu.tokenizers import tokenizer_spm

    url = tokenizer_spm.SPM_MODELS[name]["url"]
    return os.path.join(tokenizer_spm.SACREBLEU_DIR, "models", os.path.basename(url))


def metrics(spbleu: str) -> tuple[dict, list[str]]:
    """{column: sacreBLEU metric} and notes for the user (why spBLEU is missing)."""
    from sacrebleu.metrics import BLEU, CHRF

    chosen = {"BLEU": BLEU(tokenize="13a"), "chrF": CHRF()}
    notes = []
    if spbleu != "none":
        path = spbleu_model_path(spbleu)
        if os.path.exists(path):
            chosen["spBLEU"] = BLEU(tokenize=spbleu)
        else:
            notes.append(f"spBLEU skipped: sacreBLEU needs the {spbleu} SentencePiece model at {path} "
                         "(nothing is downloaded here; copy the file there, or point $SACREBLEU at a folder "
                         "whose models/ holds it)")
    return chosen, notes


def score(chosen: dict, hypotheses: list[str], references: list[str]) -> dict[str, float]:
    return {name: metric.corpus_score(hypotheses, [references]).score for name, metric in chosen.items()}


def signatures(chosen: dict) -> dict[str, str]:
    return {name: str(metric.get_signature()) for name, metric in chosen.items()}


def average_rows(rows: list[dict], columns: list[str]) -> list[dict]:
    """X→En, En→X and all-direction means of each score column (Table III of the paper)."""
    groups = {"X→En average": [r for r in rows if r["direction"].endswith("-en")],
              "En→X average": [r for r in rows if r["direction"].startswith("en-")],
              "all average": rows}
    out = []
    for name, members in groups.items():
        if members:
            row = {"direction": name, "sentences": sum(r["sentences"] for r in members)}
            row.update({c: sum(r[c] for r in members) / len(members) for c in columns})
            out.append(row)
    return out


def markdown(rows: list[dict], columns: list[str]) -> str:
    head = ["direction", "sentences", *columns]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in rows:
        cells = [r["direction"], str(r["sentences"])] + [f"{r[c]:.2f}" for c in columns]
        lines.append("| " + " | ".join(cells) + " |")
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
    writer.writerows({k: (f"{v:.4f}" if isinstance(v, float) else v) for k, v in r.items()} for r in rows)
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
    """Translate and score every set; write the tables; return {split: {rows, signatures, ...}}."""
    chosen, notes = metrics(spbleu)
    columns = list(chosen)
    for note in notes:
        log(note)
    os.makedirs(out_dir, exist_ok=True)
    report = {}
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
            rows.append({"direction": direction, "sentences": len(mine), **score(chosen, mine, references)})
        rows += average_rows(rows, columns)
        sigs = signatures(chosen)
        speed = {"sentences": len(texts), "seconds": seconds, "sentences_per_s": len(texts) / seconds,
                 "tokens_per_s": generated / seconds, "beam": options.beam, "on": threads()}
        header = f"# {split}: {len(by_direction)} directions, beam {options.beam}, lenpen {options.lenpen}"
        table = write_tables(os.path.join(out_dir, split), header, rows, columns, sigs, notes)
        log(f"\n{header}\n\n{table}")
        for name, sig in sigs.items():
            log(f"{name} signature: {sig}")
        log(f"decoded {len(texts)} sentences in {seconds:.1f} s: {speed['sentences_per_s']:.1f} sentences/s, "
            f"{speed['tokens_per_s']:.0f} tokens/s (beam {options.beam}, {threads()})")
        report[split] = {"rows": rows, "signatures": sigs, "speed": speed, "notes": notes}
    _write(os.path.join(out_dir, "eval.json"), json.dumps(report, indent=2, ensure_ascii=False))
    log(f"tables written to {out_dir}")
    return report


def evaluate_after_training(run_dir: str, max_sentences: int) -> None:
    """The short evaluation that ends ./run.sh train: the first `max_sentences` test sentences of
    every direction, beam 5, tables in <run_dir>/eval/ (./run.sh eval scores everything)."""
    import torch

    from model.decoding import DecodeOptions

    start = time.perf_counter()
    torch.set_num_threads(idle_cores())
    print(f"\n== evaluation: first {max_sentences} test sentences per direction, beam 5 "
          f"(./run.sh eval {run_dir} scores all) ==", flush=True)
    try:
        translator = load_translator(run_dir)
        sets = load_sets(run_dir, ["test"], None, max_sentences)
    except ValueError as e:  # CheckpointError, DataError: the trained run itself is fine
        print(f"error: cannot evaluate {run_dir}: {e}", file=sys.stderr)
        return
    evaluate(translator, sets, DecodeOptions(), "flores200", os.path.join(run_dir, "eval"))
    print(f"evaluation took {time.perf_counter() - start:.1f} s", flush=True)
