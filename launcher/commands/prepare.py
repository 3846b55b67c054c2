"""./run.sh prepare [CONFIG]: prepare the data of a run without training."""
from __future__ import annotations

import argparse
import os

from launcher.launch import DEFAULT_CONFIG
from launcher.options import add_config_arguments, caller_cwd, run_dir_override, shown_path, user_path
from trainer.config import load_config
from launcher.preflight import check_device, check_resume, check_run_dir, check_writable_folder
from schema.text import count

HELP = "validate, tokenise and binarise the corpus of a config (resumable); no training"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, DEFAULT_CONFIG)
    parser.add_argument("--out", type=user_path, help="prepare into this folder instead of <run_dir>/data")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument("--check-device", action="store_true",
                        help="also check that this machine's accelerator can train the config (precision, "
                             "memory): for a job's first node, before it starts the ranks")


def run(args: argparse.Namespace) -> int:
    from data.batching import BatchStream, epoch_stats
    from data.dataset import PairDataset
    from data.prepare import check_corpus, prepare_data, split_prefix

    cfg = load_config(args.config, run_dir_override(args), sets=args.sets, cwd=caller_cwd())
    out = args.out or os.path.join(cfg.run_dir, "data")
    if args.out:
        check_writable_folder(args.out, "--out")
    else:
        check_run_dir(cfg, args.config)
        check_resume(cfg, args.config)
    if args.check_device:
        check_device(cfg, args.config)
    check_corpus(cfg.data)  # what needs no pass over the text, before anything is written
    print(f"config {shown_path(args.config)} → {shown_path(out)}", flush=True)
    try:
        prepare_data(cfg.data, out, progress=not args.no_progress)
    except KeyboardInterrupt:
        print(f"\ninterrupted: run the same command again to resume ({out} keeps the finished "
              "shards)", flush=True)
        return 130

    # What training will see: a first epoch of the configured batching, from lengths only.
    stream = BatchStream(PairDataset(split_prefix(out, "train")), cfg.data.max_tokens,
                         cfg.data.seed, cfg.data.sampling_temperature)
    stats = epoch_stats(stream, 0, max_windows=4)
    print(f"data: epoch 0 (windows {stats['windows']}, max_tokens {stats['max_tokens']}, "
          f"T={cfg.data.sampling_temperature}): {count(stats['batches'], 'batch', 'batches', ',')}, "
          f"{count(stats['examples'], 'example', spec=',')}, mean batch {stats['mean_batch_size']:.1f}, "
          f"widest {stats['max_width']} tokens, padding {stats['padding_fraction']:.1%} "
          f"(src {stats['src_padding_fraction']:.1%}, tgt {stats['tgt_padding_fraction']:.1%})")
    shares = stats["examples_per_direction"]
    print("data: examples per direction: "
          + ", ".join(f"{d} {n:,}" for d, n in sorted(shares.items(), key=lambda x: -x[1])[:12])
          + (f", … ({len(shares)} directions)" if len(shares) > 12 else ""))
    return 0
