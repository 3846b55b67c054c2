"""Training worker: one process per pipeline stage × replica, started by the deepspeed launcher.

    deepspeed --num_gpus 2 launcher/train.py --config configs/default.yaml

The data must already be prepared in <run_dir>/data (`launcher/cli.py train` does that first).
Every rank builds the same deterministic batch stream; replica r takes micro-batches
[r·m, (r+1)·m) of each global step. An existing checkpoint in <run_dir>/checkpoints is resumed,
including the stream position and every rank's RNG state (parallel/rng.py), so a resumed run
computes exactly the losses of an uninterrupted one.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from launcher.config import RunConfig, load_config, to_dict  # noqa: E402
from model.norms import set_training_step, step_blocks  # noqa: E402
from parallel import rng  # noqa: E402


def log0(*args) -> None:
    if torch.distributed.get_rank() == 0:
        print(*args, flush=True)


# Preemption: SLURM sends SIGUSR1 before the time limit (sbatch --signal=B:USR1@T; the job script
# forwards it to every rank), or anyone may `kill -USR1` a single rank. The handler only sets a
# flag; the ranks agree on it by a MAX all-reduce at every step boundary, so all of them stop after
# the same step (a rank that left alone would leave the others blocked in the pipeline's send/recv),
# save one checkpoint together, and exit with PREEMPTED_EXIT_CODE after rank 0 wrote
# <run_dir>/preempted.json, which tells the job script to requeue the job.
PREEMPT_SIGNAL = signal.SIGUSR1
PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL of sysexits.h: a temporary failure, to be retried
PREEMPTED_MARKER = "preempted.json"
_preempt_requested = False


def _on_preempt_signal(signum, frame) -> None:
    global _preempt_requested
    _preempt_requested = True


def install_preemption_handler() -> None:
    signal.signal(PREEMPT_SIGNAL, _on_preempt_signal)


def preemption_agreed() -> bool:
    """True on every rank once any rank has received the preemption signal (a collective call)."""
    from deepspeed.accelerator import get_accelerator

    flag = torch.tensor([int(_preempt_requested)], dtype=torch.int32,
                        device=get_accelerator().current_device_name())
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    return bool(flag.item())


def to_pipe(batches: list[dict], scale_num: int, total_tokens: int) -> list[tuple]:
    """Micro-batches in the pipeline's ((inputs), (labels)) form; see parallel/pipeline.py."""
    scale = torch.tensor(scale_num / max(total_tokens, 1), dtype=torch.float32)
    return [((b["src"], b["tgt_in"]), (b["tgt_out"], scale)) for b in batches]


class Trainer:
    def __init__(self, cfg: RunConfig, max_steps: int | None = None):
        from data.batching import BatchStream, PairDataset
        from data.prepare import load_manifest
        from parallel.engine import build_engine, setup_distributed

        install_preemption_handler()
        setup_distributed()
        self.cfg = cfg
        self.max_steps = max_steps or cfg.train.max_steps
        self.data_dir = os.path.join(cfg.run_dir, "data")
        self.ckpt_dir = os.path.join(cfg.run_dir, "checkpoints")
        manifest = load_manifest(self.data_dir)
        cfg.model.vocab_size = cfg.model.vocab_size or manifest["vocab_size"]
        # A run directory made by `./run.sh convert reshard` holds a universal checkpoint of another
        # layout (parallel/checkpoints.py); once this run saves its own, 'latest' takes over.
        has_latest = os.path.exists(os.path.join(self.ckpt_dir, "latest"))
        universal = not has_latest and os.path.exists(os.path.join(self.ckpt_dir, "latest_universal"))
        self.engine, self.module = build_engine(cfg, cfg.model, load_universal=universal)
        self.dp = self.engine.grid.get_data_parallel_world_size()
        self.dp_rank = self.engine.grid.get_data_parallel_rank()
        rng.seed_dropout(cfg.train.seed, self.engine.stage_id, self.dp_rank)
        if cfg.parallel.tensor_parallel > 1:
            from parallel.tensor import seed_tensor_parallel_rng

            seed_tensor_parallel_rng(cfg.train.seed + 1_000 * self.engine.stage_id + self.dp_rank,
                                     self.module.tp.rank)
        log0(f"pipeline partition ({cfg.parallel.pipeline_stages} stages × tensor-parallel "
             f"{cfg.parallel.tensor_parallel} × {self.dp} replicas, "
             f"{sum(p.numel() for p in self.module.parameters())} parameters on rank 0):\n"
             f"{self.module.describe_partition()}")
        self.train_data = PairDataset(os.path.join(self.data_dir, "train"))
        self.valid_data = PairDataset(os.path.join(self.data_dir, "dev"))
        self.stream = BatchStream(self.train_data, cfg.data.max_tokens, cfg.data.seed,
                                  cfg.data.sampling_temperature)
        self.history: dict[str, list] = {"valid": [], "tokens_per_s": []}
        self.step = 0
        if has_latest or universal:
            self.resume()
        # BranchNorm's λ_t follows the optimizer step: identical on every stage, and restored
        # with the step on resume.
        self.step_blocks = step_blocks(self.module)
        set_training_step(self.step_blocks, self.step)
        self.stability = None
        if cfg.train.instrument_interval > 0:
            from launcher.stability import StabilityLogger

            self.stability = StabilityLogger(self)
            self.stability.start(self.step)

    # ---- checkpoints -------------------------------------------------------------------------
    def resume(self) -> None:
        self.check_compatible()
        path, client = self.engine.load_checkpoint(self.ckpt_dir)
        if path is None:
            raise RuntimeError(f"{self.ckpt_dir}: 'latest' names a checkpoint that cannot be loaded")
        self.step = client["step"]
        self.stream.load_state_dict(client["data"])
        if not rng.load(os.path.dirname(path), torch.distributed.get_rank()):
            print(f"rank {torch.distributed.get_rank()}: {os.path.dirname(path)} holds no RNG state for this "
                  "rank (another layout wrote it); dropout masks start afresh", flush=True)
        self.history = client["history"]
        log0(f"resumed from {path} at step {self.step}")

    def check_compatible(self) -> None:
        """Refuse, with the differing keys named, to resume a run whose model or layout changed."""
        saved_cfg = os.path.join(self.cfg.run_dir, "config.json")
        if not os.path.exists(saved_cfg):
            return
        with open(saved_cfg) as f:
            saved = json.load(f)
        now = to_dict(self.cfg)
        # Activation checkpointing and precision may change between launches; these may not.
        fixed = [("model", key) for key in now["model"] if key != "vocab_size"]
        fixed += [("parallel", key) for key in ("pipeline_stages", "tensor_parallel", "data_parallel", "zero_stage",
                                                 "partition_method")]
        diffs = [f"{section}.{key}: {saved[section].get(key)!r} → {now[section][key]!r}"
                 for section, key in fixed if saved[section].get(key) != now[section][key]]
        if diffs:
            raise SystemExit(f"error: {self.ckpt_dir} was trained with another model or layout "
                             f"({'; '.join(diffs)}). Use a new run_dir, or convert the checkpoint.")

    def save(self) -> str:
        tag = f"step{self.step}"
        client = {"step": self.step, "data": self.stream.state_dict(), "history": self.history,
                  "config": to_dict(self.cfg)}
        rng.save(os.path.join(self.ckpt_dir, tag), torch.distributed.get_rank())
        self.engine.save_checkpoint(self.ckpt_dir, tag=tag, client_state=client)
        torch.distributed.barrier()
        if torch.distributed.get_rank() == 0:
            with open(os.path.join(self.cfg.run_dir, "config.json"), "w") as f:
                json.dump(to_dict(self.cfg), f, indent=2)
            tags = sorted((d for d in os.listdir(self.ckpt_dir) if d.startswith("step")),
                          key=lambda d: int(d[4:]))
            for old in tags[:-self.cfg.train.keep_checkpoints]:
                shutil.rmtree(os.path.join(self.ckpt_dir, old), ignore_errors=True)
        return os.path.join(self.ckpt_dir, tag)

    # ---- steps -------------------------------------------------------------------------------
    def train_step(self) -> dict:
        m = self.cfg.train.micro_batches
        batches = self.stream.next_step(m * self.dp)
        total = sum(int(b["ntokens"]) for b in batches)
        mine = to_pipe(batches[self.dp_rank * m:(self.dp_rank + 1) * m], m * self.dp, total)
        set_training_step(self.step_blocks, self.step)
        start = time.perf_counter()
        with self.stability.gradients(self.step + 1) if self.stability else contextlib.nullcontext() as grads:
            loss = self.engine.train_batch(iter(mine))
        elapsed = time.perf_counter() - start
        self.step += 1
        set_training_step(self.step_blocks, self.step)
        if self.stability:
            self.stability.after_step(self.step, grads)
        norm = self.engine.get_global_grad_norm()
        return {"loss": float(loss), "lr": self.engine.get_lr()[0],
                "grad_norm": float(norm) if norm is not None else float("nan"),
                "tokens": total, "seconds": elapsed}

    def validate(self) -> float:
        """Token-weighted label-smoothed loss over the whole dev split (replicas share the work)."""
        from data.batching import eval_batches

        batches = eval_batches(self.valid_data, self.cfg.data.max_tokens)
        total = sum(int(b["ntokens"]) for b in batches)
        mine = batches[self.dp_rank::self.dp]
        scale_num = len(mine) * self.dp
        pipe_batches = to_pipe(mine, scale_num, total)
        if not pipe_batches:  # more replicas than dev batches: contribute zero
            pipe_batches = [(batches[0]["src"], batches[0]["tgt_in"]),
                            (batches[0]["tgt_out"], torch.tensor(0.0))]
            pipe_batches = [tuple(pipe_batches)]
        loss = self.engine.eval_batch(iter(pipe_batches), num_micro_batches=len(pipe_batches))
        return float(loss)

    def run(self) -> dict:
        cfg = self.cfg.train
        monitor = self.engine.monitor
        if self.step == 0:
            v = self.validate()
            self.history["valid"].append((0, v))
            log0(f"step 0 | valid loss {v:.4f}")
        if self.step >= self.max_steps:
            log0(f"run already at step {self.step} = train.max_steps; raise train.max_steps to continue")
        window_tokens, window_time, t0 = 0, 0.0, time.perf_counter()
        while self.step < self.max_steps:
            out = self.train_step()
            if not math.isfinite(out["loss"]):
                raise FloatingPointError(f"step {self.step}: loss is {out['loss']}; lower train.lr, "
                                         "raise train.warmup_steps or set train.clip_norm")
            window_tokens += out["tokens"]
            window_time += out["seconds"]
            if self.step % cfg.log_interval == 0 or self.step == self.max_steps:
                tps = window_tokens / max(window_time, 1e-9)
                self.history["tokens_per_s"].append(tps)
                log0(f"step {self.step} | loss {out['loss']:.4f} | lr {out['lr']:.3e} | "
                     f"grad norm {out['grad_norm']:.3f} | tokens/s {tps:.0f}")
                monitor.write_events([("train/loss", out["loss"], self.step), ("train/lr", out["lr"], self.step),
                                      ("train/grad_norm", out["grad_norm"], self.step),
                                      ("train/target_tokens_per_s", tps, self.step)])
                window_tokens, window_time = 0, 0.0
            if self.step % cfg.valid_interval == 0 or self.step == self.max_steps:
                v = self.validate()
                self.history["valid"].append((self.step, v))
                log0(f"step {self.step} | valid loss {v:.4f}")
                monitor.write_events([("valid/loss", v, self.step)])
            saved = self.step % cfg.save_interval == 0 or self.step == self.max_steps
            if saved:
                path = self.save()
                log0(f"step {self.step} | saved checkpoint {path}")
            if self.step < self.max_steps and preemption_agreed():
                self.stop_preempted(already_saved=saved)
        wall = time.perf_counter() - t0
        return self.summary(wall)

    def stop_preempted(self, already_saved: bool) -> None:
        """Checkpoint the current step on every rank, leave the marker, exit for a requeue."""
        path = os.path.join(self.ckpt_dir, f"step{self.step}") if already_saved else self.save()
        if torch.distributed.get_rank() == 0:
            with open(os.path.join(self.cfg.run_dir, PREEMPTED_MARKER), "w") as f:
                json.dump({"step": self.step, "checkpoint": path, "signal": PREEMPT_SIGNAL.name,
                           "time": time.time()}, f, indent=2)
        log0(f"step {self.step} | preempted by {PREEMPT_SIGNAL.name}: saved checkpoint {path}; "
             f"exiting with code {PREEMPTED_EXIT_CODE} to be resumed (a SLURM job requeues itself)")
        torch.distributed.barrier()
        raise SystemExit(PREEMPTED_EXIT_CODE)

    def summary(self, wall: float) -> dict:
        valid = self.history["valid"]
        tps = self.history["tokens_per_s"]
        summary = {
            "steps": self.step,
            "first_valid_loss": valid[0][1] if valid else None,
            "last_valid_loss": valid[-1][1] if valid else None,
            "mean_target_tokens_per_s": sum(tps) / len(tps) if tps else None,
            "wall_seconds_this_launch": wall,
            "checkpoint": os.path.join(self.ckpt_dir, f"step{self.step}"),
            "layout": {"pipeline_stages": self.cfg.parallel.pipeline_stages,
                       "tensor_parallel": self.cfg.parallel.tensor_parallel, "data_parallel": self.dp},
        }
        if torch.distributed.get_rank() == 0:
            with open(os.path.join(self.cfg.run_dir, "summary.json"), "w") as f:
                json.dump(summary, f, indent=2)
            print("\n== summary ==", flush=True)
            print(f"steps {summary['steps']} | valid loss {summary['first_valid_loss']:.4f} → "
                  f"{summary['last_valid_loss']:.4f} | target tokens/s "
                  f"{summary['mean_target_tokens_per_s'] or 0:.0f} | {wall:.0f} s this launch")
            print(f"checkpoint: {summary['checkpoint']}", flush=True)
        return summary


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--run-dir", help="override run_dir of the config")
    parser.add_argument("--local_rank", type=int, default=None, help="set by the deepspeed launcher")
    install_preemption_handler()  # before the slow start-up (DeepSpeed imports, engine build)
    args = parser.parse_args(argv)
    cfg = load_config(args.config, {"run_dir": args.run_dir} if args.run_dir else None)
    Trainer(cfg).run()


if __name__ == "__main__":
    main()
