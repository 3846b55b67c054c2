"""`./run.sh experiment depth-1000`: 200L-200L and 500L-500L models trained by the real trainer.

Every run is the real trainer (`trainer/trainer.py`) under the real deepspeed launcher as a
2-stage pipeline (2 CPU ranks, one thread each), on the bundled corpus, with 64-128-2 models
(d = 64, FFN 128, 2 heads, dropout 0.1), seed 1. Two kinds of run per strategy and depth:

  fig4   the paper's Fig. 4 extended to 500L-500L: FIG4_STEPS steps of exactly the recipe of
         `./run.sh experiment update-norms` part 1 (AdamW (0.9, 0.98), lr rising linearly to
         5e-4 over 4000 steps as fairseq's IWSLT'14 recipe, one 256-token batch per step, no
         clipping), with the stability instruments on every step: ‖ΔF‖ (RMS per target token of
         the decoder output's change on the middle dev batch; model/instruments.py), per-layer
         gradient norms, LayerNorm input sizes. Same data, probe and definition as update-norms,
         so its 6L–100L curves and these 200L/500L ones are one figure.
  train  TRAIN_STEPS steps of a training recipe (lr 3e-4, linear warm-up over 25 steps then
         inverse square root, 2 micro-batches of ≤ 256 tokens per step, clipping at 1.0), the
         dev loss every VALID_EVERY steps against the unigram baseline (a model that predicts
         the training targets' token frequencies, i.e. stuck).

Resumable: each run lives in `--work`/<run>/ (its own trainer run directory with checkpoints);
a finished run is not redone, an interrupted one resumes from its last checkpoint (the trainer
restores weights, optimizer, data position and RNG, so the numbers equal an uninterrupted run's).
Progress: one tqdm bar over all runs, weighted by layers × tokens, with an ETA.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass

import yaml
from schema.text import count

DEPTHS = (200, 500)
STRATEGIES = ("deepnorm", "postln")
MAX_TOKENS = 256
FIG4_STEPS = 20
FIG4_LR, FIG4_WARMUP = 5e-4, 4000
TRAIN_STEPS = 300
TRAIN_DEPTHS = (200, 500)
TRAIN_LR, TRAIN_WARMUP, TRAIN_MICRO_BATCHES, TRAIN_CLIP = 3e-4, 25, 2, 1.0
# Why 3e-4 (measured with the plain model, single process, this recipe otherwise, 200 steps; dev
# loss at step 200 against the unigram 6.770): 100L-100L 6.58 at lr 1e-3 but 6.76 (stuck at the
# unigram level) at 3e-3; 200L-200L 6.77 (stuck) at 1e-3 but 6.67 and falling at 4e-4. Under Adam
# DeepNet's early update grows with depth (‖ΔF‖ ≈ N^0.66, the fig4 runs), so the largest lr that
# escapes the unigram plateau falls with depth: 1e-3 at 100L corresponds to ≈ 3.5e-4 at 500L, and
# the first recipe (1e-3 at 500L, ≈ 3e-3 at 100L) ended at the unigram level after 200 steps.
VALID_EVERY = 50
SAVE_EVERY = 25
# The budget (about 90 minutes on 2 cores): measured here (fig4 runs, start-up included), a
# 256-token step costs 4–5 CPU-seconds (fwd + bwd, both stages) at 200L-200L and 12–15 at
# 500L-500L; two runs side by side (JOBS) fill the idle third of a 2-stage pipeline's slots. The
# train runs take 300 steps at both depths (at lr 3e-4 DeepNet's 500L-500L dev loss is still
# 0.3 nats above the unigram level at step 150): measured here, the 500L-500L pair 66 min, the
# 200L-200L pair 24, the four fig4 runs 6 (two pairs of 1.8 and 4.1 min), ≈ 95 min in all.
RANKS = 2
JOBS = 2
DATA = {"data": {}, "data-small-dev": {"dev_size": 10}}
"""Data of the fig4 runs: update-norms' (the bundled default, 256-token batches), so that the probe
batch and the training batches are the same. Of the train runs: the same corpus with 10 dev pairs
per language (100 dev pairs in all, both directions), since the trainer validates on the whole dev
split and a 500L-500L pass over update-norms' 1,000 dev pairs takes minutes on this CPU."""


@dataclass(frozen=True)
class Run:
    kind: str
    """'fig4' (instruments every step, warm-up 4000) or 'train' (loss over TRAIN_STEPS)."""
    strategy: str
    depth: int
    steps: int

    @property
    def name(self) -> str:
        return f"{self.kind}-{self.strategy}-{self.depth}"

    @property
    def data(self) -> str:
        """Prepared data folder (under --work) of this kind of run; see DATA."""
        return "data" if self.kind == "fig4" else "data-small-dev"

    @property
    def micro_batches(self) -> int:
        return TRAIN_MICRO_BATCHES if self.kind == "train" else 1

    @property
    def cost(self) -> int:
        """Work units for the progress bar: plan layers × micro-batches × steps."""
        return (2 * self.depth + 2) * self.micro_batches * self.steps

    def config(self, work: str) -> dict:
        fig4 = self.kind == "fig4"
        return {
            "run_dir": os.path.abspath(os.path.join(work, self.name)),
            "model": {"encoder_layers": self.depth, "decoder_layers": self.depth, "d_model": 64, "heads": 2,
                      "ffn_dim": 128, "norm": self.strategy, "dropout": 0.1,
                      "branchnorm_max_norm_step": FIG4_WARMUP if fig4 else TRAIN_WARMUP},
            "data": {"max_tokens": MAX_TOKENS, **DATA[self.data]},
            "parallel": {"pipeline_stages": RANKS, "zero_stage": 1},
            "train": {"max_steps": self.steps, "micro_batches": self.micro_batches,
                      "lr": FIG4_LR if fig4 else TRAIN_LR, "warmup_steps": FIG4_WARMUP if fig4 else TRAIN_WARMUP,
                      "clip_norm": 0.0 if fig4 else TRAIN_CLIP, "log_interval": 1,
                      "valid_interval": self.steps if fig4 else VALID_EVERY,
                      "save_interval": self.steps if fig4 else SAVE_EVERY, "keep_checkpoints": 1,
                      "instrument_interval": 1 if fig4 else VALID_EVERY, "seed": 1},
        }


def plan(quick: bool, branchnorm: bool, depths: tuple[int, ...] | None, train_steps: int | None,
         train_depths: tuple[int, ...] | None = None) -> list[Run]:
    strategies = STRATEGIES + (("branchnorm",) if branchnorm else ())
    depths = depths or ((2, 3) if quick else DEPTHS)
    train_depths = train_depths or ((3,) if quick else TRAIN_DEPTHS)
    fig4_steps = 3 if quick else FIG4_STEPS
    steps = train_steps or (4 if quick else TRAIN_STEPS)
    runs = [Run("fig4", s, d, fig4_steps) for d in depths for s in strategies]
    return runs + [Run("train", s, d, steps) for d in train_depths for s in strategies]


# ---- reading a run directory ------------------------------------------------------------------
def _csv_series(path: str) -> dict[int, float]:
    """step → value from one of DeepSpeed's CSV monitor files (a resumed run may repeat steps
    logged after its last checkpoint; they are recomputed identically, the last one is kept)."""
    if not os.path.exists(path):
        return {}
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    return {int(r[0]): float(r[1]) for r in rows[1:] if len(r) >= 2}


def read_run(run_dir: str) -> dict[int, dict[str, float]]:
    """step → {train_loss, lr, grad_norm, valid_loss, delta_f, ln_input_max, layer_grad_norm_max}."""
    metrics = os.path.join(run_dir, "metrics", "train")
    names = {"train_loss": "train_loss", "train_lr": "lr", "train_grad_norm": "grad_norm", "valid_loss": "valid_loss",
             "stability_delta_f": "delta_f", "stability_ln_input_max": "ln_input_max",
             "stability_layer_grad_norm_max": "layer_grad_norm_max"}
    out: dict[int, dict[str, float]] = {}
    for file, key in names.items():
        for step, value in _csv_series(os.path.join(metrics, file + ".csv")).items():
            out.setdefault(step, {})[key] = value
    # The trainer prints the step-0 validation but does not send it to the monitor: read the log.
    log = os.path.join(run_dir, "train.log")
    if os.path.exists(log):
        with open(log, errors="replace") as f:
            for match in re.finditer(r"step (\d+) \| valid loss ([0-9.naif]+)", f.read()):
                out.setdefault(int(match.group(1)), {}).setdefault("valid_loss", float(match.group(2)))
    return out


def finished(run_dir: str, steps: int) -> str | None:
    """'done' or 'diverged' when the run needs no more launches, else None."""
    if os.path.exists(os.path.join(run_dir, "diverged.json")):
        return "diverged"
    summary = os.path.join(run_dir, "summary.json")
    if os.path.exists(summary):
        with open(summary) as f:
            if json.load(f)["steps"] >= steps:
                return "done"
    return None


# ---- running ----------------------------------------------------------------------------------
CPU_WRAPPER = ("import json, resource, subprocess, sys\n"
               "code = subprocess.call(sys.argv[2:])\n"
               "r = resource.getrusage(resource.RUSAGE_CHILDREN)\n"
               "json.dump({'cpu_seconds': r.ru_utime + r.ru_stime}, open(sys.argv[1], 'w'))\n"
               "sys.exit(code)")
"""Runs a launch and writes its CPU seconds (the launcher and every rank it waited for): exact per
run even while several runs share the machine, which the parent's RUSAGE_CHILDREN is not."""


class Launch:
    """One launch (or resumption) of a run under the deepspeed launcher, in the background."""

    def __init__(self, run: Run, work: str, bar):
        from launcher.launch import ROOT, deepspeed_command, launch_env

        cfg = run.config(work)
        self.run, self.bar, self.run_dir = run, bar, cfg["run_dir"]
        os.makedirs(self.run_dir, exist_ok=True)
        link = os.path.join(self.run_dir, "data")
        if not os.path.exists(link):
            os.symlink(os.path.abspath(os.path.join(work, run.data)), link)
        cfg_path = os.path.join(self.run_dir, "experiment.yaml")
        with open(cfg_path, "w") as f:
            yaml.safe_dump(cfg, f)
        env = launch_env(RANKS)
        env["OMP_NUM_THREADS"] = "1"  # one thread per rank; tiny matmuls gain nothing from more
        self.per_step = run.cost / run.steps
        self.done_before = max(read_run(self.run_dir), default=0)
        bar.update(self.done_before * self.per_step)
        self.seen, self.load0, self.t0 = self.done_before, os.getloadavg()[0], time.time()
        self.cpu_file = os.path.join(self.run_dir, ".launch-cpu.json")
        if os.path.exists(self.cpu_file):
            os.remove(self.cpu_file)
        self.log = open(os.path.join(self.run_dir, "train.log"), "a")
        module = "experiments.fig4_worker" if run.kind == "fig4" else "launcher.worker"
        command = deepspeed_command(RANKS, module, ["--config", cfg_path])
        try:
            self.proc = subprocess.Popen([sys.executable, "-c", CPU_WRAPPER, self.cpu_file, *command],
                                         env=env, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT)
        except BaseException:
            self.log.close()
            raise

    def poll(self) -> bool:
        """Advance the bar by the steps logged since the last poll; True while the run is going."""
        running = self.proc.poll() is None
        now = max((s for s, v in read_run(self.run_dir).items() if "train_loss" in v), default=self.seen)
        if now > self.seen:
            self.bar.update((now - self.seen) * self.per_step)
            self.bar.set_postfix_str(f"{self.run.name} step {now}/{self.run.steps}")
            self.seen = now
        return running

    def finish(self) -> dict:
        """Record the launch in the run's launches.json; mark a non-finite loss as diverged."""
        self.log.close()
        code = self.proc.returncode
        self.bar.update(max(0, self.run.steps - self.seen) * self.per_step if code == 0 else 0)
        cpu = json.load(open(self.cpu_file))["cpu_seconds"] if os.path.exists(self.cpu_file) else float("nan")
        info = {"wall_seconds": time.time() - self.t0, "cpu_seconds": cpu, "load_start": self.load0,
                "load_end": os.getloadavg()[0], "from_step": self.done_before, "returncode": code}
        launches = os.path.join(self.run_dir, "launches.json")
        history = json.load(open(launches)) if os.path.exists(launches) else []
        with open(launches, "w") as f:
            json.dump(history + [info], f, indent=2)
        if code != 0:
            with open(os.path.join(self.run_dir, "train.log")) as f:
                text = f.read()[-20000:]
            if "FloatingPointError" in text:  # the trainer stops on a non-finite loss
                with open(os.path.join(self.run_dir, "diverged.json"), "w") as f:
                    json.dump({"after_step": max(read_run(self.run_dir), default=0)}, f)
            else:
                info["failed"] = True
        return info


def run_all(todo: list[Run], work: str, bar, jobs: int) -> list[str]:
    """Launch `todo` in order, at most `jobs` at a time; the names of runs that failed (after one
    fails, the running ones finish and no new one starts)."""
    pending, active, failed = list(todo), [], []
    while (pending and not failed) or active:
        while pending and len(active) < jobs and not failed:
            bar.set_postfix_str(f"{pending[0].name} starting")
            active.append(Launch(pending.pop(0), work, bar))
        time.sleep(2)
        for launch in [x for x in active if not x.poll()]:
            active.remove(launch)
            info = launch.finish()
            status = finished(launch.run_dir, launch.run.steps) or ("failed" if info.get("failed") else "stopped")
            bar.write(f"  {launch.run.name}: {status} in {info['wall_seconds'] / 60:.1f} min (CPU "
                      f"{info['cpu_seconds'] / 60:.1f} min, load {info['load_start']:.1f} → {info['load_end']:.1f})")
            if info.get("failed"):
                failed.append(launch.run.name)
    return failed


def unigram_baseline(data_dir: str, vocab: int) -> float:
    """Dev loss (label-smoothed, ε = 0.1, whole dev split as the trainer validates) of a model
    that predicts the training targets' token frequencies."""
    from data.batching import PairDataset, eval_batches
    from experiments.update_norms import unigram_dev_loss

    dev = eval_batches(PairDataset(os.path.join(data_dir, "dev")), MAX_TOKENS)
    return unigram_dev_loss(PairDataset(os.path.join(data_dir, "train")), dev, vocab, 0.1)


def collect(runs: list[Run], work: str) -> list[dict]:
    results = []
    for run in runs:
        run_dir = os.path.join(work, run.name)
        launches_path = os.path.join(run_dir, "launches.json")
        launches = json.load(open(launches_path)) if os.path.exists(launches_path) else []
        results.append({"run": run, "status": finished(run_dir, run.steps) or "incomplete",
                        "rows": read_run(run_dir), "launches": launches})
    return results


def main(argv: list[str] | None = None) -> int:
    from tqdm import tqdm

    from data.config import DataConfig
    from data.prepare import prepare_data
    from experiments.depth_report import write_outputs

    parser = argparse.ArgumentParser(prog="run.sh experiment depth-1000", description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="tables, plot and CSVs (default docs/depth-1000; with --quick "
                        "runs/experiments/depth-1000-quick/out)")
    parser.add_argument("--work", help="run directories, resumed when present (default "
                        "runs/experiments/depth-1000, or runs/experiments/depth-1000-quick)")
    parser.add_argument("--quick", action="store_true", help="2L/3L smoke version (a few minutes)")
    parser.add_argument("--branchnorm", action="store_true", help="also BranchNorm (T = the warm-up)")
    parser.add_argument("--depths", help="comma-separated depths N (NL-NL), default 200,500")
    parser.add_argument("--train-depths", help="comma-separated depths of the train runs, default "
                        + ",".join(map(str, TRAIN_DEPTHS)))
    parser.add_argument("--train-steps", type=int, help=f"steps of the train runs (default {TRAIN_STEPS})")
    parser.add_argument("--jobs", type=int, default=JOBS, help="runs trained at once, each a 2-rank "
                        f"pipeline (default {JOBS}: a 2-stage pipeline of 2 micro-batches leaves a third of "
                        "its rank-slots idle, which a second run fills)")
    parser.add_argument("--only", choices=("fig4", "train"), help="run only one kind of run")
    parser.add_argument("--replot", action="store_true",
                        help="write the outputs from what --work holds now (finished and partial runs), no training")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs {args.jobs}: give at least 1 (runs trained at once)")
    args.work = args.work or f"runs/experiments/depth-1000{'-quick' if args.quick else ''}"
    args.out = args.out or (os.path.join(args.work, "out") if args.quick else "docs/depth-1000")
    depths = tuple(int(x) for x in args.depths.split(",")) if args.depths else None
    train_depths = tuple(int(x) for x in args.train_depths.split(",")) if args.train_depths else None
    runs = plan(args.quick, args.branchnorm, depths, args.train_steps, train_depths)
    if args.only:
        runs = [r for r in runs if r.kind == args.only]
    command = " ".join(["./run.sh experiment depth-1000", *(argv or [])])

    t0, load0 = time.time(), os.getloadavg()[0]
    for name, extra in DATA.items():
        manifest = prepare_data(DataConfig(max_tokens=MAX_TOKENS, **extra), os.path.join(args.work, name),
                                log=lambda *_: None)
    baseline = unigram_baseline(os.path.join(args.work, "data-small-dev"), manifest["vocab_size"])
    sessions_path = os.path.join(args.work, "sessions.json")
    sessions = json.load(open(sessions_path)) if os.path.exists(sessions_path) else []
    if args.replot:
        paths = write_outputs(collect(runs, args.work), args.out, command, baseline, sessions)
        print("depth-1000: wrote " + ", ".join(paths), flush=True)
        return 0
    todo = [r for r in runs if not finished(os.path.join(args.work, r.name), r.steps)]
    print(f"depth-1000: {count(len(runs), 'run')} ({len(runs) - len(todo)} already finished) in {args.work}; "
          f"unigram dev baseline {baseline:.3f}", flush=True)
    with tqdm(total=sum(r.cost for r in todo), unit="layer-step", unit_scale=True, dynamic_ncols=True,
              bar_format="{l_bar}{bar}| {percentage:3.0f}% [{elapsed}<{remaining}] {postfix}") as bar:
        failed = run_all(todo, args.work, bar, args.jobs)
    session = {"wall_seconds": time.time() - t0, "load_start": load0, "load_end": os.getloadavg()[0],
               "runs_launched": [r.name for r in todo], "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(t0)),
               "command": command}
    sessions.append(session)
    with open(sessions_path, "w") as f:
        json.dump(sessions, f, indent=2)
    paths = write_outputs(collect(runs, args.work), args.out, command, baseline, sessions)
    print(f"depth-1000: {session['wall_seconds'] / 60:.1f} min; wrote " + ", ".join(paths), flush=True)
    if failed:
        raise SystemExit(f"depth-1000: {', '.join(failed)} failed; see train.log in "
                         + ", ".join(os.path.join(args.work, name) for name in failed)
                         + "; run the same command to resume")
    return 0


if __name__ == "__main__":
    sys.exit(main())
