"""Command-line options shared by the commands that decode (`translate`, `eval`)."""
from __future__ import annotations

import argparse


def add_decoding_arguments(parser: argparse.ArgumentParser) -> None:
    """Search options shared by translate and eval."""
    from model.decoding import DecodeOptions

    d = DecodeOptions()
    group = parser.add_argument_group("decoding")
    group.add_argument("--beam", type=int, default=d.beam, help=f"beam size (default {d.beam})")
    group.add_argument("--greedy", action="store_true", help="greedy search (same as --beam 1)")
    group.add_argument("--lenpen", type=float, default=d.lenpen,
                       help=f"length penalty: score = Σ log p / length^lenpen (default {d.lenpen})")
    group.add_argument("--max-len-a", type=float, default=d.max_len_a,
                       help=f"output at most a·|source| + b tokens (default a={d.max_len_a})")
    group.add_argument("--max-len-b", type=int, default=d.max_len_b, help=f"(default b={d.max_len_b})")
    group.add_argument("--max-tokens", type=int, default=d.max_tokens,
                       help=f"source tokens per batch (default {d.max_tokens})")
    group.add_argument("--threads", type=int, default=0,
                       help="CPU threads (default 0: the cores the load average shows idle, at least 1)")


def decode_options(args: argparse.Namespace):
    """The DecodeOptions of the command line (and the thread count applied)."""
    import torch

    from model.decoding import DecodeOptions
    from translate.translator import idle_cores

    if args.threads < 0:
        raise ValueError("--threads must be >= 0")
    torch.set_num_threads(args.threads or idle_cores())
    options = DecodeOptions(beam=1 if args.greedy else args.beam, lenpen=args.lenpen, max_len_a=args.max_len_a,
                            max_len_b=args.max_len_b, max_tokens=args.max_tokens)
    options.validate()
    return options
