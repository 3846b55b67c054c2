"""`./run.sh experiment update-norms`: DeepNet's stability findings on CPU-sized models.

Part 1 (paper Fig. 4): 64-128-2 models (d=64, FFN 128, 2 heads) at 6L-6L, 18L-18L, 50L-50L and
100L-100L for every strategy in PART1_STRATEGIES, trained from the same seed on the bundled
corpus for the first PART1_STEPS steps; ‖ΔF‖ (model/instruments.py) is measured on a fixed probe
batch along the way, with the LayerNorm input sizes and per-layer gradient norms.

Part 2 (paper Tables I and XI): 50L-50L models trained longer with and without DeepNorm; which
diverge (non-finite loss) or stall (dev loss no better than predicting target-token frequencies).

Recipe, the same for every strategy: AdamW β = (0.9, 0.98), peak lr 5e-4, no weight decay, no
clipping, dropout 0.1, label smoothing 0.1, one 256-token batch per step, seed 1.
  * Part 1 uses the warm-up of fairseq's IWSLT'14 recipe (the data set of the paper's Fig. 4):
    lr rises linearly to 5e-4 over 4000 steps, so the first 40 steps see lr ≤ 5e-6. (Without
    warm-up, ‖ΔF‖ of every strategy saturated near √2·‖F‖ — an output unrelated to the initial
    one — within about ten steps, which hides any dependence on depth; see docs/update-norms.md.)
  * Part 2 uses no warm-up at all (the full lr from step 1, then constant: these runs are far
    shorter than any decay), the harshest setting, for both arms.
Runs are single-process (plain model) and independent, so they are spread over `--workers`
processes of one thread each.

`--study seeds` (the Fig. 4 question with evidence): part 1's recipe for Post-LN and DeepNet at
6L–100L with several seeds (weights and data order), once with AdamW as above and once with
plain SGD (the optimizer of the paper's Theorem analysis) on the same warm-up, recording three
readings of the update: ‖ΔF‖ as RMS per target token (the default), the total Frobenius norm
of eq. 1, and the encoder output's RMS change. Each finished run is kept in `--work`, so an
interrupted study resumes where it stopped.
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field

import torch

from data.batching import BatchStream, PairDataset, eval_batches
from data.config import DataConfig
from model.config import ModelConfig
from model.instruments import OutputCapture, ProbeMonitor
from model.norms import set_training_step, step_blocks
from model.step import plain_step
from model.transformer import EncoderDecoder, smoothed_loss_sum
from schema.text import count

DEPTHS = (6, 18, 50, 100)
PART1_STRATEGIES = ("postln", "preln", "deepnorm", "subln", "branchnorm")
PART1_STEPS = 40
PART1_WARMUP = 4000
PART1_MEASURE = (0, 1, 2, 3, 4, 5, 6, 8, 10, 12, 15, 20, 25, 30, 35, 40)
PART2_DEPTH = 50
PART2_STEPS = 300
PART2_ARMS = (("postln", 0), ("deepnorm", 0))
"""(strategy, warm-up steps): Post-LN and DeepNorm, both without warm-up."""
PART2_EVAL_EVERY = 100
LR = 5e-4
MAX_TOKENS = 256
BRANCHNORM_T = PART1_WARMUP
"""BranchNorm's T: relaxed to Post-LN over the warm-up, as the model's defaults pair them. Its
λ_t changes the function even with frozen weights, so BranchNorm runs also record that part of
‖ΔF‖ alone (`delta_f_schedule`: the initial weights evaluated at λ_t against λ_0)."""
STALL_MARGIN = 0.1
"""A run stalls if its final dev loss is not at least this much below the unigram baseline."""
DEV_SENTENCES = 200
"""Dev pairs used for part 2's dev loss (the middle of the length-sorted dev split)."""
SEEDS = (1, 2, 3)
SEED_STRATEGIES = ("postln", "deepnorm")
SEED_OPTIMIZERS = ("adam", "sgd")
SGD_LR = 0.5
"""Peak lr of the SGD arm (same linear warm-up over 4000 steps, so ≤ 5e-3 in the first 40 steps).
Only ratios across depth are compared between arms, not levels."""


@dataclass
class Spec:
    """One training run."""

    part: int
    strategy: str
    depth: int
    steps: int
    warmup: int = 0
    measure_at: tuple[int, ...] = ()
    eval_every: int = 0
    seed: int = 1
    optimizer: str = "adam"
    """'adam' (AdamW as in the module docstring) or 'sgd' (plain SGD, peak lr SGD_LR)."""
    freeze: str = ""
    """Parameters kept at their initial values: '' (none), 'layernorm' (every LayerNorm's gain and
    bias) or 'embedding' (the shared embedding); a probe of where the update comes from."""
    extra: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        frozen = f"-freeze_{self.freeze}" if self.freeze else ""
        return f"p{self.part}-{self.strategy}-{self.depth}-w{self.warmup}-s{self.seed}-{self.optimizer}{frozen}"

    @property
    def cost(self) -> float:
        """Relative run time (layers × steps plus the output layer's share)."""
        return self.steps * (self.depth + 4)


def model_config(strategy: str, depth: int, vocab: int) -> ModelConfig:
    return ModelConfig(encoder_layers=depth, decoder_layers=depth, d_model=64, heads=2, ffn_dim=128,
                       vocab_size=vocab, norm=strategy, dropout=0.1, branchnorm_max_norm_step=BRANCHNORM_T)


def lr_at(step: int, warmup: int, peak: float = LR) -> float:
    """lr of optimizer step `step` (1-based): linear warm-up over `warmup` steps, then constant."""
    return peak * min(1.0, step / warmup) if warmup > 0 else peak


def unigram_dev_loss(train: PairDataset, dev_batches: list[dict], vocab: int, eps: float) -> float:
    """Label-smoothed loss on the dev batches of a model that ignores its input and predicts the
    training targets' token frequencies (add-one smoothed): the level a stuck model sits at."""
    counts = torch.ones(vocab, dtype=torch.float64)
    for i in range(len(train)):
        counts += torch.bincount(torch.from_numpy(train[i][1].astype("int64")), minlength=vocab).double()
    log_p = (counts / counts.sum()).log().float()
    total, tokens = 0.0, 0
    for b in dev_batches:
        logits = log_p.expand(*b["tgt_out"].shape, vocab)
        total += float(smoothed_loss_sum(logits, b["tgt_out"], 0, eps))
        tokens += b["ntokens"]
    return total / tokens


def dev_loss(model: EncoderDecoder, batches: list[dict]) -> float:
    model.eval()
    total, tokens = 0.0, 0
    with torch.no_grad():
        for b in batches:
            total += float(smoothed_loss_sum(model(b["src"], b["tgt_in"]), b["tgt_out"], 0, 0.1))
            tokens += b["ntokens"]
    model.train()
    return total / tokens


def _layer_summary(values: dict[str, float], depth: int, prefix: str) -> dict[str, float]:
    if not values:
        return {}
    enc = [values[f"encoder_layers.{i}"] for i in range(depth)]
    dec = [values[f"decoder_layers.{i}"] for i in range(depth)]
    both = enc + dec
    return {f"{prefix}_enc_first": enc[0], f"{prefix}_enc_last": enc[-1], f"{prefix}_dec_first": dec[0],
            f"{prefix}_dec_last": dec[-1], f"{prefix}_max": max(both), f"{prefix}_mean": sum(both) / len(both)}


def run_one(spec: Spec, data_dir: str, vocab: int) -> dict:
    """Train one model; return its measured rows and a summary. Runs in a worker process."""
    torch.set_num_threads(1)
    start, cpu_start = time.perf_counter(), time.process_time()
    cfg = model_config(spec.strategy, spec.depth, vocab)
    model = EncoderDecoder(cfg, seed=spec.seed)
    train = PairDataset(os.path.join(data_dir, "train"))
    dev_all = eval_batches(PairDataset(os.path.join(data_dir, "dev")), MAX_TOKENS)
    probe = dev_all[len(dev_all) // 2]  # typical lengths (the split is length-sorted)
    stream = BatchStream(train, MAX_TOKENS, seed=spec.seed, temperature=1.5)
    if spec.freeze == "layernorm":
        for module in model.modules():
            if isinstance(module, torch.nn.LayerNorm):
                module.requires_grad_(False)
    elif spec.freeze == "embedding":
        model.embed.requires_grad_(False)
    elif spec.freeze:
        raise ValueError(f"freeze={spec.freeze!r}: use layernorm or embedding")
    trained = [p for p in model.parameters() if p.requires_grad]
    peak = SGD_LR if spec.optimizer == "sgd" else LR
    if spec.optimizer == "sgd":
        opt = torch.optim.SGD(trained, lr=peak)
    else:
        opt = torch.optim.AdamW(trained, lr=LR, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.0)
    # The encoder output (the decoder's cross-attention memory) is captured in the same probe
    # forwards as F, for a second reading of the update.
    enc_module = model.encoder_norm if model.encoder_norm is not None else model.encoder_layers[-1]
    src_mask = probe["src"] != cfg.pad_id
    with OutputCapture(enc_module) as enc_capture:
        monitor = ProbeMonitor(model, probe, cfg.pad_id)
    enc_reference = enc_capture.value
    probe_tokens = int(monitor.mask.sum())
    frozen = copy.deepcopy(model) if step_blocks(model) else None
    schedule = ProbeMonitor(frozen, probe, cfg.pad_id) if frozen is not None else None
    rows, status, diverged_at = [], "trains", None
    norms = []

    def gradient_norm():  # the step's, before the update (no clipping)
        norms.append(math.sqrt(sum(float(p.grad.pow(2).sum()) for p in model.parameters() if p.grad is not None)))

    dev = _dev_subset(dev_all) if spec.eval_every else []
    for step in range(spec.steps + 1):
        row = {"step": step}
        if step > 0:
            set_training_step(model, step - 1)
            batch = stream.next_step(1)[0]
            for group in opt.param_groups:
                group["lr"] = lr_at(step, spec.warmup, peak)
            with monitor.gradients() as grads:
                done = plain_step(model, [batch], opt, after_backward=gradient_norm)
            grad_norm = norms[-1]
            row.update(loss=done.loss, grad_norm=grad_norm, lr=lr_at(step, spec.warmup, peak))
            row.update(_layer_summary(grads.result(), spec.depth, "layer_grad"))
            if not (math.isfinite(row["loss"]) and math.isfinite(grad_norm)):
                status, diverged_at = "diverged", step
                rows.append(row)
                break
        set_training_step(model, step)
        if step in spec.measure_at or (spec.eval_every and step % spec.eval_every == 0) or step == spec.steps:
            with OutputCapture(enc_module) as enc_capture:
                m = monitor.measure()
            row["delta_f"] = m["delta_f"]
            row["delta_f_total"] = m["delta_f"] * math.sqrt(probe_tokens)  # eq. 1's Frobenius norm
            row["delta_enc"] = (enc_capture.value - enc_reference)[src_mask].pow(2).sum(-1).mean().sqrt().item()
            if schedule is not None:
                set_training_step(frozen, step)
                row["delta_f_schedule"] = schedule.measure()["delta_f"]
            row.update(_layer_summary(m["ln_input"], spec.depth, "ln_input"))
        if dev and (step % spec.eval_every == 0 or step == spec.steps):
            row["dev_loss"] = dev_loss(model, dev)
        rows.append(row)
    summary = {**asdict(spec), "status": status, "diverged_at": diverged_at,
               "seconds": time.perf_counter() - start, "cpu_seconds": time.process_time() - cpu_start}
    if dev:
        summary["unigram_dev_loss"] = unigram_dev_loss(train, dev, vocab, 0.1)
        last = [r["dev_loss"] for r in rows if "dev_loss" in r]
        summary["final_dev_loss"] = last[-1] if last and status != "diverged" else float("nan")
        if status == "trains" and summary["final_dev_loss"] > summary["unigram_dev_loss"] - STALL_MARGIN:
            summary["status"] = "stalled"
    return {"spec": summary, "rows": rows}


def _dev_subset(batches: list[dict]) -> list[dict]:
    """About DEV_SENTENCES dev pairs of typical length (the middle of the length-sorted split)."""
    mid, chosen, n = len(batches) // 2, [], 0
    for b in batches[mid:] + batches[:mid]:
        if n >= DEV_SENTENCES:
            break
        chosen.append(b)
        n += b["nsentences"]
    return chosen


def specs(quick: bool) -> list[Spec]:
    """Every run of both parts (`quick`: a minutes-long smoke version with shallow models)."""
    depths = (2, 4) if quick else DEPTHS
    steps1 = 6 if quick else PART1_STEPS
    out = [Spec(1, s, d, steps1, warmup=PART1_WARMUP, measure_at=tuple(x for x in PART1_MEASURE if x <= steps1))
           for s in PART1_STRATEGIES for d in depths]
    depth2, steps2 = (4, 20) if quick else (PART2_DEPTH, PART2_STEPS)
    out += [Spec(2, s, depth2, steps2, warmup=w if not quick else min(w, 5),
                 eval_every=PART2_EVAL_EVERY if not quick else 10) for s, w in PART2_ARMS]
    return out


def seed_specs(quick: bool, seeds: tuple[int, ...], optimizers: tuple[str, ...],
               strategies: tuple[str, ...] = SEED_STRATEGIES, freeze: str = "") -> list[Spec]:
    """The seeds study: part 1's recipe for `strategies` at every depth, seed and optimizer."""
    depths = (2, 4) if quick else DEPTHS
    steps = 6 if quick else PART1_STEPS
    return [Spec(3, s, d, steps, warmup=PART1_WARMUP, measure_at=tuple(x for x in PART1_MEASURE if x <= steps),
                 seed=seed, optimizer=opt, freeze=freeze)
            for opt in optimizers for s in strategies for d in depths for seed in seeds]


def run_kept(spec: Spec, data_dir: str, vocab: int, keep: str) -> dict:
    """`run_one`, or its result kept in `keep` by an earlier (interrupted) invocation."""
    path = os.path.join(keep, spec.name + ".json")
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    result = run_one(spec, data_dir, vocab)
    os.makedirs(keep, exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(path + ".tmp", path)
    return result


def main_seeds(args: argparse.Namespace, argv: list[str]) -> int:
    from tqdm import tqdm

    from data.prepare import prepare_data
    from experiments.report import write_seed_outputs

    out = args.out or ("runs/experiments/update-norms/seeds-quick" if args.quick else "docs/update-norms/seeds")
    seeds = tuple(int(x) for x in args.seeds.split(","))
    optimizers = tuple(args.optimizers.split(","))
    strategies = tuple(args.strategies.split(","))
    t0, load0 = time.perf_counter(), os.getloadavg()[0]
    data_dir = os.path.join(args.work, "data")
    manifest = prepare_data(DataConfig(max_tokens=MAX_TOKENS), data_dir, log=lambda *_: None)
    keep = os.path.join(args.work, "seeds-quick" if args.quick else "seeds")
    # Whole seeds first (every depth and optimizer of seed 1, then seed 2, ...), so that an
    # interrupted study has complete depth series of both optimizers to show.
    runs = sorted(seed_specs(args.quick, seeds, optimizers, strategies, args.freeze),
                  key=lambda s: (seeds.index(s.seed), optimizers.index(s.optimizer), s.depth, s.strategy))
    done = sum(os.path.exists(os.path.join(keep, r.name + ".json")) for r in runs)
    if args.replot:  # what the kept runs say now, without training the missing ones
        runs = [r for r in runs if os.path.exists(os.path.join(keep, r.name + ".json"))]
        results = [run_kept(r, data_dir, manifest["vocab_size"], keep) for r in runs]
        meta = {"wall_seconds": None, "load_start": load0, "load_end": load0, "workers": args.workers,
                "kept_from_earlier": done, "runs_planned": len(seed_specs(args.quick, seeds, optimizers, strategies, args.freeze)),
                "command": " ".join(["./run.sh experiment update-norms", *argv])}
        paths = write_seed_outputs(results, out, meta)
        print(f"update-norms seeds: {count(len(results), 'kept run')}; wrote " + ", ".join(paths), flush=True)
        return 0
    print(f"update-norms seeds: {count(len(runs), 'run')} ({done} kept from earlier) on {count(args.workers, 'worker')}; "
          f"finished runs are kept in {keep}", flush=True)
    results = []
    with ProcessPoolExecutor(max_workers=args.workers) as pool, \
            tqdm(total=sum(r.cost for r in runs), unit="layer-step", unit_scale=True, dynamic_ncols=True) as bar:
        futures = {pool.submit(run_kept, spec, data_dir, manifest["vocab_size"], keep): spec for spec in runs}
        for future in futures:
            results.append(future.result())
            bar.update(futures[future].cost)
            bar.set_postfix_str(futures[future].name)
    wall = time.perf_counter() - t0
    meta = {"wall_seconds": wall, "load_start": load0, "load_end": os.getloadavg()[0], "workers": args.workers,
            "kept_from_earlier": done, "runs_planned": len(runs),
            "command": " ".join(["./run.sh experiment update-norms", *argv])}
    paths = write_seed_outputs(results, out, meta)
    print(f"update-norms seeds: {wall / 60:.1f} min; wrote " + ", ".join(paths), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    from data.prepare import prepare_data
    from experiments.report import load_results, write_outputs

    parser = argparse.ArgumentParser(prog="run.sh experiment update-norms", description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="where the CSV, PNG and tables go (default docs/update-norms; "
                        "with --quick runs/experiments/update-norms/quick, to keep the committed results)")
    parser.add_argument("--work", default="runs/experiments/update-norms", help="prepared data")
    parser.add_argument("--workers", type=int, default=2, help="parallel single-threaded runs")
    parser.add_argument("--quick", action="store_true", help="shallow smoke version (about a minute)")
    parser.add_argument("--replot", action="store_true",
                        help="redraw the plots and tables from the CSVs in --out, without training")
    parser.add_argument("--study", choices=("paper", "seeds"), default="paper",
                        help="'paper': parts 1 and 2 (default); 'seeds': Post-LN and DeepNet at 6L–100L over "
                             "several seeds with AdamW and SGD (writes docs/update-norms/seeds)")
    parser.add_argument("--seeds", default=",".join(map(str, SEEDS)), help="--study seeds: comma-separated seeds")
    parser.add_argument("--optimizers", default=",".join(SEED_OPTIMIZERS),
                        help="--study seeds: comma-separated optimizers (adam, sgd)")
    parser.add_argument("--strategies", default=",".join(SEED_STRATEGIES),
                        help="--study seeds: comma-separated strategies")
    parser.add_argument("--freeze", default="", choices=("", "layernorm", "embedding"),
                        help="--study seeds: keep these parameters at their initial values (where does the "
                             "update come from?)")
    args = parser.parse_args(argv)
    if args.study == "seeds":
        return main_seeds(args, argv or [])
    args.out = args.out or ("runs/experiments/update-norms/quick" if args.quick else "docs/update-norms")
    if args.replot:
        results, meta = load_results(args.out)
        paths = write_outputs(results, args.out, meta["wall_seconds"], meta["command"], meta["workers"])
        print("update-norms: redrew " + ", ".join(paths), flush=True)
        return 0

    t0 = time.perf_counter()
    data_cfg = DataConfig(max_tokens=MAX_TOKENS)  # the bundled default corpus (configs/default.yaml)
    data_dir = os.path.join(args.work, "data")
    manifest = prepare_data(data_cfg, data_dir, log=lambda *_: None)
    runs = sorted(specs(args.quick), key=lambda s: -s.cost)  # longest first: better packing
    print(f"update-norms: {count(len(runs), 'run')} on {count(args.workers, 'worker')}; data {data_dir}", flush=True)
    results = []
    with ProcessPoolExecutor(max_workers=args.workers) as pool:
        futures = [pool.submit(run_one, spec, data_dir, manifest["vocab_size"]) for spec in runs]
        for future in futures:
            result = future.result()
            s = result["spec"]
            results.append(result)
            print(f"  part {s['part']} {s['strategy']:<11} {s['depth']:>3}L-{s['depth']}L "
                  f"warm-up {s['warmup']:>3}: {s['status']:<8} {s['seconds']:6.1f} s "
                  f"({time.perf_counter() - t0:.0f} s elapsed)", flush=True)
    wall = time.perf_counter() - t0
    paths = write_outputs(results, args.out, wall, " ".join(["./run.sh experiment update-norms", *(argv or [])]),
                          args.workers)
    print(f"update-norms: {wall / 60:.1f} min; wrote " + ", ".join(paths), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
