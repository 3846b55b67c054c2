"""./run.sh eval [RUN_DIR]: translate the dev/test sets of every direction and score them
(translate/evaluate.py: sacreBLEU's BLEU with the tokenizer each target language needs, chrF,
spBLEU when its model is present); tables and hypotheses under <RUN_DIR>/eval/.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

from launcher.launch import DEFAULT_RUN
from launcher.options import add_decoding_arguments, decode_options, user_path
from schema.text import count

HELP = "translate the dev/test sets of every direction; BLEU/chrF (sacreBLEU) table per split"
SPBLEU_CHOICES = ("auto", "flores200", "flores101", "none")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", nargs="?", default=DEFAULT_RUN, type=user_path,
                        help="run directory: its corpus, and its latest checkpoint (default runs/default)")
    parser.add_argument("--model", type=user_path, help="a consolidated model file to score instead of the run's checkpoint")
    parser.add_argument("--tag", help="checkpoint tag (default: latest)")
    parser.add_argument("--splits", nargs="+", default=["dev", "test"], choices=["dev", "test"])
    parser.add_argument("--max-sentences", type=int, default=0,
                        help="score the first N sentences of each direction (0: all)")
    parser.add_argument("--directions", nargs="+", help="only these directions, e.g. de-en en-de")
    parser.add_argument("--spbleu", default="auto", choices=SPBLEU_CHOICES,
                        help="FLORES SentencePiece model for spBLEU (default auto: flores200 where sacreBLEU's "
                             "folder has it, else none, said in the tables only; a model named here and missing "
                             "is said on the console)")
    parser.add_argument("--out-dir", type=user_path,
                        help="where tables and hypotheses go (default RUN_DIR/eval; with --model FILE, "
                             "RUN_DIR/eval-<FILE's name without .pt>)")
    add_decoding_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from checkpoint.checkpoints import CheckpointError
    from data.prepare import load_manifest
    from translate.evaluate import evaluate, load_sets
    from translate.translator import load_translator

    start = time.perf_counter()
    try:
        options = decode_options(args)
        if args.max_sentences < 0:
            raise ValueError("--max-sentences must be >= 0")
        if args.out_dir and os.path.exists(args.out_dir) and not os.path.isdir(args.out_dir):
            raise ValueError(f"--out-dir {args.out_dir} is a file; give a folder for the tables and hypotheses")
        translator = load_translator(args.model or args.run_dir, None if args.model else args.tag)
        translator.check_options(options)
        manifest = load_manifest(os.path.join(args.run_dir, "data"))
        if manifest.get("spm_sha256", translator.spm_sha256) != translator.spm_sha256:
            raise ValueError(f"the model's SentencePiece model differs from {args.run_dir}/data/spm.model; "
                             "score it on the run it was trained on")
        sets = load_sets(args.run_dir, args.splits, args.directions, args.max_sentences)
        for direction in {d for by_direction in sets.values() for d in by_direction}:
            translator.check_language(direction.split("-")[1])
    except (CheckpointError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    source = translator.meta["source"]
    averaged = source.get("averaged")
    print(f"model: {args.model}, the mean of {count(len(averaged), 'checkpoint')} (steps "
          f"{', '.join(str(a['step']) for a in averaged)})" if averaged else
          f"model: {source['checkpoint']} (step {source['step']})", flush=True)
    # a model file's scores go beside the run's own evaluation (eval/), not over it
    stem = os.path.splitext(os.path.basename(args.model))[0] if args.model else ""
    out_dir = args.out_dir or os.path.join(args.run_dir, f"eval-{stem}" if stem else "eval")
    evaluate(translator, sets, options, args.spbleu, out_dir)
    print(f"eval took {time.perf_counter() - start:.1f} s")
    return 0
