"""`./run.sh bench model`: the plain model's training step with torch's dropout and with the
hashed CPU dropout (model/dropout.py), steps interleaved in one process.

    ./run.sh bench model [--model tiny-100-100,base-6-6] [--batch 32 --src 32 --tgt 32]
                         [--warmup 2] [--steps 8] [--threads 1] [--out DIR]

Per named shape (configs/<name>.yaml's model, its dropout as configured): the plain
`EncoderDecoder` trained on one fixed synthetic batch of `--batch` × (`--src` + `--tgt`) tokens
(forward, label-smoothed loss, backward, global-norm clipping at 1, fused AdamW), fp32 on
`--threads` threads. Two models with the same weights, one per variant ("torch": torch's dropout
and α·x + dropout(y) as separate ops, the model before the kernel; "hashed": the kernel, α·x +
dropout(y) in one pass), take steps in turn (A, B, A, B, ...), so both see the same load; CPU
seconds per step (`time.process_time`, steadier than wall time on a shared machine), median over
the measured steps, target tokens per CPU-second and the speed-up. Then the same at dropout 0
(every dropout off: both variants run the same ops, so their losses must be equal), with the
largest relative difference of their losses over the measured steps. Writes OUT/model.{md,json} (default runs/bench-model).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

VARIANTS = ("torch", "hashed")


def _step(model, optimizer, batch, cfg) -> float:
    import torch

    from model.transformer import smoothed_loss_sum

    logits = model(batch["src"], batch["tgt_in"])
    loss = smoothed_loss_sum(logits, batch["tgt_out"], cfg.pad_id, cfg.label_smoothing)
    (loss / batch["tgt_out"].numel()).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.detach())


def compare(cfg, batch: dict, warmup: int, steps: int) -> dict:
    """The two variants' interleaved steps on `cfg`: CPU seconds and losses per measured step."""
    import torch

    from model.dropout import torch_dropout
    from model.transformer import EncoderDecoder

    runs = {}
    for name in VARIANTS:
        torch.manual_seed(0)  # the same dropout seed stream for both
        model = EncoderDecoder(cfg, seed=1).train()
        runs[name] = {"model": model, "optimizer": torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True),
                      "rng": torch.get_rng_state(), "cpu_s": [], "losses": []}
    for i in range(warmup + steps):
        for name, run in runs.items():
            torch.set_rng_state(run["rng"])
            start = time.process_time()
            if name == "torch":
                with torch_dropout():
                    loss = _step(run["model"], run["optimizer"], batch, cfg)
            else:
                loss = _step(run["model"], run["optimizer"], batch, cfg)
            seconds = time.process_time() - start
            run["rng"] = torch.get_rng_state()
            if i >= warmup:
                run["cpu_s"].append(seconds)
                run["losses"].append(loss)
    return {name: {"cpu_s": run["cpu_s"], "losses": run["losses"]} for name, run in runs.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="./run.sh bench model", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-100-100,base-6-6", help="named shapes, comma-separated")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--src", type=int, default=32)
    parser.add_argument("--tgt", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="runs/bench-model")
    args = parser.parse_args(argv)

    import torch

    from model.dropout import kernels
    from parallel.planner import named_model

    try:
        shapes = {name: named_model(name) for name in args.model.split(",")}
    except ValueError as e:
        print(f"error: --model: {e}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    if kernels() is None:
        print("error: the hashed dropout kernel could not be built (see the warning above)", file=sys.stderr)
        return 1
    load_before = os.getloadavg()
    rows = []
    for name, cfg in shapes.items():
        generator = torch.Generator().manual_seed(123)
        tokens = torch.randint(4, cfg.vocab_size, (args.batch, args.src + args.tgt + 1), generator=generator)
        batch = {"src": tokens[:, :args.src].contiguous(), "tgt_in": tokens[:, args.src:-1].contiguous(),
                 "tgt_out": tokens[:, args.src + 1:].contiguous()}
        for dropout in (cfg.dropout, 0.0):
            shape = cfg if dropout else dataclasses.replace(cfg, dropout=0.0, attention_dropout=0.0,
                                                            activation_dropout=0.0)
            result = compare(shape, batch, args.warmup, args.steps)
            median = {v: statistics.median(result[v]["cpu_s"]) for v in VARIANTS}
            target = args.batch * args.tgt
            row = {"model": name, "dropout": dropout, "layers": f"{cfg.encoder_layers}L-{cfg.decoder_layers}L",
                   "d_model": cfg.d_model, **{f"{v}_cpu_s": median[v] for v in VARIANTS},
                   **{f"{v}_tokens_per_cpu_s": target / median[v] for v in VARIANTS},
                   "speedup": median["torch"] / median["hashed"], "steps": result,
                   "max_rel_loss_diff": max(abs(a - b) / abs(a) for a, b in
                                            zip(result["torch"]["losses"], result["hashed"]["losses"]))}
            rows.append(row)
            print(f"{name} dropout {dropout}: torch {median['torch']:.3f} CPU-s/step ({row['torch_tokens_per_cpu_s']:.0f} "
                  f"tgt tok/CPU-s), hashed {median['hashed']:.3f} ({row['hashed_tokens_per_cpu_s']:.0f}): "
                  f"{row['speedup']:.3f}x; losses differ by ≤ {row['max_rel_loss_diff']:.1e} (relative)", flush=True)
    os.makedirs(args.out, exist_ok=True)
    lines = [f"Plain model, {args.batch} × ({args.src} + {args.tgt}) tokens, fp32, {args.threads} thread(s), "
             f"{args.warmup} warm-up + {args.steps} measured steps per variant, interleaved; CPU seconds per step "
             f"(median); load average before {' '.join(f'{x:.1f}' for x in load_before)}, after "
             f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}.", "",
             "| model | dropout | torch CPU s | hashed CPU s | torch tgt tok/CPU-s | hashed tgt tok/CPU-s | speed-up "
             "| max relative loss difference |", "|---" * 8 + "|"]
    for r in rows:
        lines.append(f"| {r['model']} ({r['layers']} d={r['d_model']}) | {r['dropout']} | {r['torch_cpu_s']:.3f} "
                     f"| {r['hashed_cpu_s']:.3f} | {r['torch_tokens_per_cpu_s']:.0f} | {r['hashed_tokens_per_cpu_s']:.0f} "
                     f"| {r['speedup']:.3f} | {r['max_rel_loss_diff']:.1e} |")
    with open(os.path.join(args.out, "model.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(args.out, "model.json"), "w") as f:
        json.dump({"args": vars(args), "load_before": load_before, "rows": rows}, f, indent=1)
    print(f"wrote {args.out}/model.md, {args.out}/model.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
