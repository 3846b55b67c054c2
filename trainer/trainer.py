"""The training loop of one rank: `Trainer` builds this rank's pipeline stage and engine, feeds
it the deterministic batch stream, validates, saves and resumes through its Checkpointer, and
applies the divergence guard's policy. launcher/worker.py is the process around it.

Every rank builds the same deterministic batch stream; replica r takes micro-batches
[r·m, (r+1)·m) of each global step. An existing checkpoint in <run_dir>/checkpoints is resumed,
including the stream position and every rank's RNG state (runtime/rng.py), so a resumed run
computes exactly the losses of an uninterrupted one.
"""
from __future__ import annotations

import contextlib
import datetime
import functools
import json
import os
import signal
import time

import torch

from checkpoint import manifest
from checkpoint.init_from import agreed_source, load_into
from model.norms import set_training_step, step_blocks
from parallel.compiled import summary as compiled_summary
from runtime import accelerator, heartbeat, rng
from schema.text import count
from trainer import metrics, signals
from trainer.checkpointer import Checkpointer
from trainer.config import RunConfig
from trainer.guard import DivergenceGuard, DivergenceStop
from trainer.progress import LOG_NAME, Progress, append_log, log0, note0
from trainer.run_dir import (
    BELOW,
    END_HERE,
    PREEMPTED_MARKER,
    STOPPED_MARKER,
    TRAIN,
    ended_here,
    launched_max_steps,
    record_ending,
    relaunch,
)
from trainer.timeline import trainer_timeline

# Preemption: SLURM sends SIGUSR1 before the time limit (sbatch --signal=B:USR1@T; the job script
# forwards it to every rank), SIGTERM on scancel and at the limit, or anyone may signal a single
# rank. The handler (trainer/signals.py) only sets a flag; the ranks agree on it by a MAX all-reduce
# at every step boundary, so all of them stop after the same step (a rank that left alone would
# leave the others blocked in the pipeline's send/recv), save one checkpoint together, and exit with
# PREEMPTED_EXIT_CODE after rank 0 wrote <run_dir>/preempted.json, which tells the job script to
# requeue the job. After SIGTERM a rank leaves without a checkpoint once train.stop_grace_seconds
# have passed; SIGINT and SIGHUP stop it at once.
PREEMPT_SIGNAL = signal.SIGUSR1


def preemption_agreed() -> bool:
    """True on every rank once any rank has received the preemption signal (a collective call)."""
    from deepspeed.accelerator import get_accelerator

    flag = torch.tensor([int(signals.stop.checkpoint)], dtype=torch.int32,
                        device=get_accelerator().current_device_name())
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    return bool(flag.item())


def set_collective_timeout(seconds: float) -> None:
    """Every process group, including those DeepSpeed creates for the pipeline, times out after
    `seconds`: torch.distributed's new_group reads these module defaults when given no timeout."""
    from torch.distributed import distributed_c10d

    distributed_c10d.default_pg_timeout = datetime.timedelta(seconds=seconds)
    if hasattr(distributed_c10d, "default_pg_nccl_timeout"):
        distributed_c10d.default_pg_nccl_timeout = datetime.timedelta(seconds=seconds)


def to_pipe(batches: list[dict], scale_num: int, total_tokens: int) -> list[tuple]:
    """Micro-batches in the pipeline's ((inputs), (labels)) form; see parallel/pipeline.py. On a
    GPU in pinned host memory, so that the engine copies them to the device without waiting
    (parallel/pipe_io.py)."""
    scale = torch.tensor(scale_num / max(total_tokens, 1), dtype=torch.float32)
    pin = (lambda t: t.pin_memory()) if not accelerator.on_host() else (lambda t: t)
    return [((pin(b["src"]), pin(b["tgt_in"])), (pin(b["tgt_out"]), pin(scale))) for b in batches]


class Trainer:
    def __init__(self, cfg: RunConfig, max_steps: int | None = None):
        from data.batching import BatchStream, PairDataset
        from data.prepare import load_manifest
        from parallel.layout import Layout
        from parallel.parallelize import build_engine
        from runtime.distributed import setup_distributed

        signals.install_rank_handlers(cfg.train.stop_grace_seconds)
        set_collective_timeout(cfg.train.collective_timeout_seconds)
        setup_distributed(cfg.train.collective_timeout_seconds)
        heartbeat.start(cfg.run_dir)  # names a lost or hung rank when a collective fails (launcher/worker.py)
        try:
            self.layout = Layout.build(cfg.parallel)
        except ValueError as e:  # every rank alike
            signals.refuse_together(f"error: {e}")
        self.cfg = cfg
        self.max_steps = max_steps or cfg.train.max_steps
        self.data_dir = os.path.join(cfg.run_dir, "data")
        self.started: float | None = None  # when run() began its steps (summary's wall time)
        data_manifest = load_manifest(self.data_dir)
        cfg.model.vocab_size = cfg.model.vocab_size or data_manifest["vocab_size"]
        layout = self.layout
        self.checkpoints = Checkpointer(cfg, layout)
        self.checkpoints.keep_global_batch()  # train.micro_batches for this dp (before the engine takes it)
        self.init_source = self.start_source()
        self.init_record = self.init_source and self.init_source.record()  # where this run started from
        init = self.init_source and functools.partial(load_into, source=self.init_source)
        self.engine, self.module = build_engine(layout, cfg.model, cfg.parallel, cfg.train, cfg.run_dir,
                                                load_universal=self.checkpoints.universal(), init=init)
        self.checkpoints.attach(self.engine, self.module)
        self.compiled = bool(self.engine.compiled_layers)
        if self.compiled:
            kinds = sorted(self.engine.compiled_layers.items())
            log0(f"compiling {', '.join(count(n, f'{kind} layer') for kind, n in kinds)} "
                 f"on first use (train.compile={cfg.train.compile}; the first step takes longer, one graph per layer "
                 "kind)")
        self.ckpt_dir = self.checkpoints.ckpt_dir
        self.guard = DivergenceGuard(self.engine, cfg.train, layout)
        self.engine.step_loss = self._decided_loss
        metrics.install(self.engine)
        rng.seed_dropout(cfg.train.seed, layout.stage, layout.replica)
        if layout.tp > 1:
            from parallel.tensor import seed_tensor_parallel_rng

            seed_tensor_parallel_rng(cfg.train.seed + 1_000 * layout.stage + layout.replica, layout.tp_rank)
        log0(f"pipeline partition ({count(layout.pp, 'stage')} × tensor-parallel {layout.tp} × {count(layout.dp, 'replica')}"
             f", {sum(p.numel() for p in self.module.parameters())} parameters on rank 0):\n{self.module.describe_partition()}")
        self.train_data = PairDataset(os.path.join(self.data_dir, "train"), cfg.data.directions)
        self.valid_data = PairDataset(os.path.join(self.data_dir, "dev"), cfg.data.directions)
        self.stream = BatchStream(self.train_data, cfg.data.max_tokens, cfg.data.seed,
                                  cfg.data.sampling_temperature)
        self.history: dict[str, list] = {"valid": [], "tokens_per_s": []}
        self.step = 0
        resumed = self.checkpoints.resume()
        self.restore(resumed)
        if self.stream.order_changed:  # said once (rank 0), on the console and in train.log
            note0(cfg.run_dir, self.stream.order_changed)
        if self.init_source is not None:
            s = self.init_source
            note0(cfg.run_dir, f"started from {s.path} (step {s.step}; train.init_from={s.given}): its weights only; "
                  "the optimizer, learning-rate schedule, step and data position start fresh")
        # What this launch does with the run (trainer/run_dir.py `relaunch`; ./run.sh train decides
        # the same before any rank starts): train, nothing (finished), end a stopped run where it
        # is, or refuse a max_steps below a stopped run's step. A launch that trains records itself
        # in config.json first; one that ends the run there records that (as ./run.sh train does).
        self.verdict, self.verdict_line = relaunch(cfg.run_dir, self.step if resumed else None, self.max_steps,
                                                   launched_max_steps(self.checkpoints.saved))
        self.ending_reason = (f"reached train.max_steps={self.max_steps}" if self.verdict == TRAIN
                              else self.verdict_line)
        if self.verdict == BELOW:  # refused; a SLURM job (stopped.json) is not requeued to meet it again
            self.checkpoints.stop_together(f"error: {self.verdict_line}")
        if self.verdict == TRAIN:
            self.checkpoints.record_launch(self.max_steps)
        if self.verdict == END_HERE and self.layout.rank == 0:
            self.ending_reason = ended_here(cfg.run_dir, self.checkpoints.saved, self.step)
        if self.layout.rank == 0:
            metrics.rewind(self.engine, self.step)
            for marker in (PREEMPTED_MARKER, STOPPED_MARKER):  # an earlier launch's preemption or stop, now resumed
                with contextlib.suppress(FileNotFoundError):
                    os.remove(os.path.join(cfg.run_dir, marker))
        # BranchNorm's λ_t follows the optimizer step: identical on every stage, and restored
        # with the step on resume.
        self.step_blocks = step_blocks(self.module)
        set_training_step(self.step_blocks, self.step)
        self.timeline = trainer_timeline(self)  # train.trace_steps (trainer/timeline.py); None: nothing recorded
        self.stability = None
        if cfg.train.instrument_interval > 0:
            from trainer.stability import StabilityLogger

            self.stability = StabilityLogger(self)
            self.stability.start(self.step)

    def start_source(self):
        """train.init_from's source when this run starts now (no checkpoint of its own to resume),
        found by every rank alike and checked against the model (checkpoint/init_from.py); else None."""
        if not self.cfg.train.init_from or manifest.has_checkpoints(self.checkpoints.ckpt_dir):
            return None
        from checkpoint.checkpoints import CheckpointError

        try:
            return agreed_source(self.cfg.train.init_from, self.cfg.model, log=log0)
        except CheckpointError as e:
            self.checkpoints.stop_together(f"error: train.init_from: {e}")

    def _decided_loss(self) -> float | None:
        """The loss of the step the guard just decided (None when it decided nothing this step)."""
        return self.guard.step_loss

    # ---- checkpoints (trainer/checkpointer.py) -----------------------------------------------
    def save(self) -> str:
        """Checkpoint this step (every rank); the folder written."""
        heartbeat.at(self.step, "checkpoint save")
        return self.checkpoints.save(self.step, {"data": self.stream.state_dict(), "history": self.history,
                                                 "guard": self.guard.state_dict(), "init_from": self.init_record})

    def restore(self, client: dict | None) -> None:
        """Take up the state a checkpoint's `save` recorded (nothing for a new run)."""
        if client is None:
            return
        self.step = client["step"]
        self.stream.load_state_dict(client["data"])
        self.guard.load_state_dict(client.get("guard"))
        self.history = client["history"]
        self.init_record = client.get("init_from")

    # ---- steps -------------------------------------------------------------------------------
    def train_step(self) -> dict:
        m = self.cfg.train.micro_batches
        dp, replica = self.layout.dp, self.layout.replica
        timeline = self.timeline if self.timeline is not None and self.timeline.wants(self.step + 1) else None
        if timeline is not None:
            timeline.begin(self.step + 1)
        with timeline.span("data loader", "data") if timeline is not None else contextlib.nullcontext():
            batches = self.stream.next_step(m * dp)
            total = sum(int(b["ntokens"]) for b in batches)
            mine = to_pipe(batches[replica * m:(replica + 1) * m], m * dp, total)
        set_training_step(self.step_blocks, self.step)
        heartbeat.at(self.step, "train")
        self.guard.step_loss = None
        self.engine.expect([(inputs[0].shape, inputs[1].shape) for inputs, _ in mine])
        start = time.perf_counter()
        with self.stability.gradients(self.step + 1) if self.stability else contextlib.nullcontext() as grads:
            loss = self.engine.train_batch(iter(mine))
        elapsed = time.perf_counter() - start
        if timeline is not None:
            timeline.end()  # the files are written after the last traced step (every rank takes part)
        if self.compiled and self.step == 0 and self.layout.rank == 0:
            log0(f"compiled layers: {compiled_summary()} (first step {elapsed:.1f} s)")
        self.step += 1
        heartbeat.at(self.step, "step end")
        set_training_step(self.step_blocks, self.step)
        if self.stability:
            self.stability.after_step(self.step, grads)
        norm = self.engine.get_global_grad_norm()
        if self.guard.step_loss is not None:  # read with the guard's decision, the step's one host sync
            loss = self.guard.step_loss
        return {"loss": float(loss), "lr": self.engine.get_lr()[0],
                "grad_norm": float(norm) if norm is not None else float("nan"),
                "tokens": total, "seconds": elapsed, "divergence": self.guard.after_step(self.step)}

    def preemption_requested(self) -> bool:
        """Whether any rank asked for a preemption checkpoint: the flag came with the divergence
        guard's decision of this step (no collective of its own), or, when the step decided nothing
        (an optimizer without the guard's gate), one all-reduce."""
        if self.guard.step_loss is not None:
            return self.guard.preempt
        return preemption_agreed()

    def validate(self) -> float:
        """Token-weighted label-smoothed loss over the whole dev split (replicas share the work)."""
        from data.batching import eval_batches

        heartbeat.at(self.step, "validation")
        batches = eval_batches(self.valid_data, self.cfg.data.max_tokens)
        total = sum(int(b["ntokens"]) for b in batches)
        mine = batches[self.layout.replica::self.layout.dp]
        scale_num = len(mine) * self.layout.dp
        pipe_batches = to_pipe(mine, scale_num, total)
        if not pipe_batches:  # more replicas than dev batches: contribute zero
            pipe_batches = [(batches[0]["src"], batches[0]["tgt_in"]),
                            (batches[0]["tgt_out"], torch.tensor(0.0))]
            pipe_batches = [tuple(pipe_batches)]
        self.engine.expect([(inputs[0].shape, inputs[1].shape) for inputs, _ in pipe_batches])
        loss = self.engine.eval_batch(iter(pipe_batches), num_micro_batches=len(pipe_batches))
        return float(loss)

    def run(self) -> dict:
        """Train to max_steps: progress lines every log_interval (trainer/progress.py: console and
        train.log), validation every valid_interval (and at step 0), checkpoints every
        save_interval and at the end; then the summary."""
        cfg = self.cfg.train
        monitor = self.engine.monitor
        progress = self.progress = Progress(self.cfg.run_dir, self.step, self.max_steps, enabled=self.layout.rank == 0)
        try:
            if self.step == 0:
                v = self.validate()
                self.history["valid"].append((0, v))
                progress.log(f"step 0 | valid loss {v:.4f}")
                monitor.write_events([("valid/loss", v, 0)])
            if self.verdict != TRAIN:
                progress.log(self.verdict_line)
            window_tokens, window_time, t0 = 0, 0.0, time.perf_counter()
            self.started = t0
            progress.start_steps()
            while self.step < self.max_steps:
                out = self.train_step()
                rolled_back = bool(out["divergence"]) and self.on_divergence(out["divergence"])
                progress.advance(self.step)
                if rolled_back:
                    window_tokens, window_time = 0, 0.0
                    continue  # rolled back: the step counter is the checkpoint's again
                window_tokens += out["tokens"]
                window_time += out["seconds"]
                if self.step % cfg.log_interval == 0 or self.step == self.max_steps:
                    tps = window_tokens / max(window_time, 1e-9)
                    self.history["tokens_per_s"].append(tps)
                    progress.report(self.step, out["loss"], out["lr"], out["grad_norm"], tps)
                    monitor.write_events([("train/loss", out["loss"], self.step), ("train/lr", out["lr"], self.step),
                                          ("train/grad_norm", out["grad_norm"], self.step),
                                          ("train/target_tokens_per_s", tps, self.step)])
                    window_tokens, window_time = 0, 0.0
                if self.step % cfg.valid_interval == 0 or self.step == self.max_steps:
                    v = self.validate()
                    self.history["valid"].append((self.step, v))
                    progress.log(f"step {self.step} | valid loss {v:.4f}")
                    monitor.write_events([("valid/loss", v, self.step)])
                saved = self.step % cfg.save_interval == 0 or self.step == self.max_steps
                if saved:
                    path = self.save()
                    progress.log(f"step {self.step} | saved checkpoint {path}")
                if self.step < self.max_steps and self.preemption_requested():
                    progress.close()  # its messages are plain lines
                    self.stop_preempted(already_saved=saved)
        finally:
            progress.close()
        return self.summary(time.perf_counter() - t0, "finished", self.ending_reason, 0)

    # ---- divergence (trainer/guard.py) -------------------------------------------------------
    def on_divergence(self, event: dict) -> bool:
        """Apply train.divergence_policy to a step whose update was not applied; True after a
        rollback. Every rank gets here for the same step with the same event."""
        policy = self.cfg.train.divergence_policy
        count = len(self.guard.events)
        norm = event["grad_norm"]
        norm = norm if isinstance(norm, str) or norm is None else format(norm, ".4g")
        what = f"step {self.step}: {event['reason']} (grad norm {norm}); the update was not applied"
        self.engine.monitor.write_events([("train/divergence_events", count, self.step)])
        if policy == "stop":
            newest = manifest.newest_committed(self.ckpt_dir)
            rerun = (f"rerunning resumes from {newest} with the new settings" if newest
                     else "no checkpoint was saved yet, so rerunning starts afresh")
            raise DivergenceStop(f"{what} and nothing was saved. train.divergence_policy=stop: lower train.lr, "
                                 "raise train.warmup_steps or set train.clip_norm, or choose the skip or "
                                 f"rollback policy; {rerun}")
        if count > self.cfg.train.divergence_max_events:
            raise DivergenceStop(f"{what}: divergence event {count} of this run exceeds "
                                 f"train.divergence_max_events={self.cfg.train.divergence_max_events}; stopping")
        if policy == "skip":
            log0(f"{what}: batch skipped, weights unchanged (event {count})")
            return False
        self.rollback(event)
        return True

    def rollback(self, event: dict) -> None:
        """Reload the newest intact checkpoint before this step and skip the data consumed since
        (the batches of the steps after the checkpoint up to this one)."""
        bad_step, data_after = self.step, self.stream.state_dict()
        events = list(self.guard.events)
        if not manifest.committed_tags(self.ckpt_dir):
            raise DivergenceStop(f"step {bad_step}: {event['reason']}; train.divergence_policy=rollback but no "
                                 "checkpoint has been saved yet to roll back to")
        self.restore(self.checkpoints.resume(newest_step=bad_step - 1))
        self.stream.load_state_dict(data_after)
        event["rolled_back_to"] = self.step
        self.guard.events = events
        set_training_step(self.step_blocks, self.step)
        if self.layout.rank == 0:
            metrics.rewind(self.engine, self.step)
        log0(f"step {bad_step}: {event['reason']}; rolled back to step {self.step} and skipped the data of "
             f"steps {self.step + 1}..{bad_step} (event {len(events)})")

    def stop_preempted(self, already_saved: bool) -> None:
        """Checkpoint the current step on every rank, leave the marker, exit for a requeue."""
        path = os.path.join(self.ckpt_dir, f"step{self.step}") if already_saved else self.save()
        name = signals.stop.signal_name or PREEMPT_SIGNAL.name
        if self.layout.rank == 0:
            with open(os.path.join(self.cfg.run_dir, PREEMPTED_MARKER), "w") as f:
                json.dump({"step": self.step, "checkpoint": path, "signal": name,
                           "time": time.time()}, f, indent=2)
        log0(f"step {self.step} | preempted by {name}: saved checkpoint {path}; "
             f"exiting with code {signals.PREEMPTED_EXIT_CODE} to be resumed (a SLURM job requeues itself)")
        self.summary(time.perf_counter() - (self.started or time.perf_counter()), "preempted",
                     f"{name}: checkpointed at step {self.step}, to be resumed", signals.PREEMPTED_EXIT_CODE, show=False)
        torch.distributed.barrier()
        signals.stop.saved = True
        raise SystemExit(signals.PREEMPTED_EXIT_CODE)

    def summary(self, wall: float, state: str, reason: str, code: int, show: bool = True) -> dict:
        """How this launch ended (`state`: trainer/run_dir.py STATES, `reason`, the exit
        `code`) with the run's numbers: run_dir/summary.json and an `end |` line in train.log
        (trainer/run_dir.py `record_ending`, rank 0), and (`show`) printed with train.log's
        `summary |` lines; a preempted launch's is not: it is to be resumed. Paths in the file are relative
        to the run directory, so that it stays true when the run directory is copied or moved."""
        valid = self.history["valid"]
        tps = self.history["tokens_per_s"]
        newest = manifest.newest_committed(self.ckpt_dir)
        summary = {
            "steps": self.step - (state == "diverged"),  # a divergence stop ends inside a step it did not apply
            "max_steps": self.max_steps,
            "first_valid_loss": valid[0][1] if valid else None,
            "last_valid_loss": valid[-1][1] if valid else None,
            "mean_target_tokens_per_s": sum(tps) / len(tps) if tps else None,
            "wall_seconds_this_launch": wall,
            "checkpoint": newest and os.path.relpath(os.path.join(self.ckpt_dir, newest), self.cfg.run_dir),
            "log": LOG_NAME,
            "divergence_events": len(self.guard.events),
            "divergence": self.guard.events[-20:],
            "layout": {"pipeline_stages": self.layout.pp, "tensor_parallel": self.layout.tp,
                       "data_parallel": self.layout.dp, "micro_batches": self.cfg.train.micro_batches},
            "resharded": self.checkpoints.resharded,
            "init_from": self.init_record,
        }
        if self.layout.rank == 0 and show:
            losses = " → ".join(f"{v:.4f}" for v in (summary["first_valid_loss"], summary["last_valid_loss"])
                                if v is not None) or "none"
            lines = [f"steps {summary['steps']} | valid loss {losses} | target tokens/s "
                     f"{summary['mean_target_tokens_per_s'] or 0:.0f} | {wall:.0f} s this launch",
                     f"checkpoint: {newest and os.path.join(self.ckpt_dir, newest)}"]
            if self.guard.events:
                lines.append(f"divergence events: {len(self.guard.events)} (policy {self.cfg.train.divergence_policy}; "
                             "listed in summary.json)")
            if state != "finished":
                lines.append(f"{state}: {reason}")
            print("\n== summary ==\n" + "\n".join(lines), flush=True)
            for line in lines:
                append_log(self.cfg.run_dir, f"summary | {line}")
        if self.layout.rank == 0:
            summary = record_ending(self.cfg.run_dir, state, reason, code, summary)
        return summary
