"""Runs under the deepspeed launcher (2 ranks, pp=2): damaged checkpoints and divergence in one launch.

Part 1 (`--damage`): train 6 steps uninterrupted, saving at steps 2 and 4; keep a pristine copy of
step4. Then, for each kind of damage, restore the pristine files, damage them, build a new Trainer
(which resumes) and train two steps: record the step it resumed at and the losses.
Part 2 (`--divergence`): the real Trainer.run() under each policy, with one step's loss made
non-finite or 50× larger by scaling that step's loss weights (the labels' scale tensor), which
is how a corrupt batch or an overflow reaches the loss.
Rank 0 writes everything to `--out` (JSON).
"""
from __future__ import annotations

import copy
import csv
import json
import os
import shutil

import torch

from launcher import worker
from runtime.distributed import exit_rank
from tests.dist.common import worker_args
from trainer import trainer as train_mod
from trainer.config import load_config
from trainer.guard import DivergenceStop
from trainer.trainer import Trainer


def barrier() -> None:
    torch.distributed.barrier()


def is0() -> bool:
    return torch.distributed.get_rank() == 0


def steps(trainer: Trainer, n: int, save_at=()) -> list[float]:
    out = []
    for _ in range(n):
        out.append(trainer.train_step()["loss"])
        if trainer.step in save_at:
            trainer.save()
    return out


# ---- part 1: damaged checkpoints -------------------------------------------------------------

def _overwrite(path: str, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def _truncate(path: str) -> None:
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


DAMAGE = {
    "latest_garbage": lambda ck: open(os.path.join(ck, "latest"), "wb").write(b"\x00\xffst\x00ep"),
    "latest_missing_step": lambda ck: open(os.path.join(ck, "latest"), "w").write("step9"),
    "deleted_mp_rank_01": lambda ck: os.remove(os.path.join(ck, "step4", "mp_rank_01_model_states.pt")),
    "truncated_zero_file": lambda ck: _truncate(os.path.join(ck, "step4", "zero_pp_rank_0_mp_rank_01_optim_states.pt")),
    "random_bytes_in_layer": lambda ck: _overwrite(os.path.join(ck, "step4", "layer_02-model_00-model_states.pt"),
                                                   20_000, os.urandom(4096)),
    "deleted_rng_rank1": lambda ck: os.remove(os.path.join(ck, "step4", "rng_rank00001.pt")),
}


def damage_cases(cfg) -> dict:
    ck = os.path.join(cfg.run_dir, "checkpoints")
    first = Trainer(cfg, max_steps=6)
    result = {"uninterrupted": steps(first, 6, save_at=(2, 4))}
    pristine = cfg.run_dir + "-pristine-step4"
    if is0():
        shutil.copytree(os.path.join(ck, "step4"), pristine)
    barrier()

    # A checkpoint whose files verify but whose weights are not finite (step 5): NaN in the module
    # and in ZeRO's fp32 master copy, saved and committed like any other.
    with torch.no_grad():
        for p in first.module.parameters():
            p.fill_(float("nan"))
        for part in getattr(first.engine.optimizer, "single_partition_of_fp32_groups", []):
            part.fill_(float("nan"))
    first.step = 5
    first.save()
    del first

    def restore():
        if is0():
            shutil.rmtree(os.path.join(ck, "damaged"), ignore_errors=True)
            shutil.rmtree(os.path.join(ck, "step4"), ignore_errors=True)
            shutil.copytree(pristine, os.path.join(ck, "step4"))
            with open(os.path.join(ck, "latest"), "w") as f:
                f.write("step4")
        barrier()

    cases = {}
    t = Trainer(cfg, max_steps=6)  # newest is step5 (non-finite) → falls back to step4
    cases["nonfinite_weights"] = {"resumed": t.step, "losses": steps(t, 2)}
    del t
    for name, damage in DAMAGE.items():
        restore()
        if is0():
            damage(ck)
        barrier()
        t = Trainer(cfg, max_steps=6)
        barrier()
        with open(os.path.join(ck, "latest"), "rb") as f:
            latest = f.read().decode("utf-8", "replace")
        cases[name] = {"resumed": t.step, "latest_after_resume": latest, "losses": steps(t, 2)}
        del t
    # nothing intact: step2 and step4 both lose a file
    restore()
    if is0():
        os.remove(os.path.join(ck, "step4", "mp_rank_00_model_states.pt"))
        os.remove(os.path.join(ck, "step2", "mp_rank_00_model_states.pt"))
    barrier()
    try:
        Trainer(cfg, max_steps=6)
        cases["none_intact"] = {"code": None}
    except SystemExit as e:  # rank 0 printed the message (once, before any rank left): the test reads the log
        cases["none_intact"] = {"code": e.code}
    result["cases"] = cases
    return result


# ---- part 2: divergence ----------------------------------------------------------------------

class Poison:
    """Scales the loss weights of the batch of step `at` by `factor` (nan → non-finite loss) and
    snapshots the local weights before every step."""

    def __init__(self, at: int, factor: float):
        self.at, self.factor, self.trainer, self.fired = at, factor, None, False
        self.snapshots: dict[int, list[torch.Tensor]] = {}
        self.original = train_mod.to_pipe

    def __call__(self, batches, scale_num, total):
        t = self.trainer
        self.snapshots[t.step + 1] = [p.detach().clone() for p in t.module.parameters()]
        if t.step + 1 == self.at and not self.fired:  # one bad batch (a rollback skips it)
            self.fired = True
            return [(x, (tgt, scale * self.factor)) for x, (tgt, scale) in self.original(batches, scale_num, total)]
        return self.original(batches, scale_num, total)


def _csv(run_dir: str, name: str) -> list[list[str]]:
    with open(os.path.join(run_dir, "metrics", "train", name), newline="") as f:
        return list(csv.reader(f))


def divergence_run(cfg, policy: str, at: int, factor: float, max_steps: int) -> dict:
    cfg = copy.deepcopy(cfg)
    base, cfg.run_dir = cfg.run_dir, f"{cfg.run_dir}-{policy}"
    cfg.train.divergence_policy = policy
    if is0():
        os.makedirs(cfg.run_dir, exist_ok=True)
        os.symlink(os.path.realpath(os.path.join(base, "data")), os.path.join(cfg.run_dir, "data"))
    barrier()
    poison = Poison(at, factor)
    train_mod.to_pipe = poison
    t = Trainer(cfg, max_steps=max_steps)
    poison.trainer = t
    out = {"policy": policy}
    try:
        t.run()
        out["stopped"] = None
    except DivergenceStop as e:
        out["stopped"] = str(e)
        worker.record_divergence_stop(t, t.cfg, e)  # as launcher/worker.py's main does before exiting 3
        if is0():
            with open(os.path.join(cfg.run_dir, "summary.json")) as f:
                out["summary"] = json.load(f)
    finally:
        train_mod.to_pipe = poison.original
    snaps = poison.snapshots
    after = [p.detach().clone() for p in t.module.parameters()]
    # weights before the bad step == weights after it (stop: the weights now; skip: before the next step)
    following = snaps.get(at + 1, after)
    out["unchanged_by_bad_step"] = all(torch.equal(a, b) for a, b in zip(snaps[at], following))
    out["events"] = t.guard.events
    out["step"] = t.step
    out["latest"] = open(os.path.join(cfg.run_dir, "checkpoints", "latest")).read() if os.path.exists(
        os.path.join(cfg.run_dir, "checkpoints", "latest")) else None
    out["tags"] = sorted(d for d in os.listdir(os.path.join(cfg.run_dir, "checkpoints")) if d.startswith("step"))
    barrier()
    if is0():
        out["loss_csv"] = _csv(cfg.run_dir, "train_loss.csv")
    out["run_dir"] = cfg.run_dir
    del t
    return out


def rollback_reference(cfg, run_dir: str, from_step: int, skip: int, n: int) -> list[float]:
    """A fresh resume of `run_dir`'s checkpoint `from_step` that skips `skip` steps of data."""
    cfg = copy.deepcopy(cfg)
    cfg.run_dir = run_dir + "-reference"
    if is0():
        os.makedirs(os.path.join(cfg.run_dir, "checkpoints"))
        os.symlink(os.path.realpath(os.path.join(run_dir, "data")), os.path.join(cfg.run_dir, "data"))
        shutil.copytree(os.path.join(run_dir, "checkpoints", f"step{from_step}"),
                        os.path.join(cfg.run_dir, "checkpoints", f"step{from_step}"))
    barrier()
    t = Trainer(cfg, max_steps=from_step + n)
    assert t.step == from_step
    m = cfg.train.micro_batches * t.layout.dp
    for _ in range(skip):
        t.stream.next_step(m)
    return steps(t, n)


def divergence_cases(cfg) -> dict:
    cfg = copy.deepcopy(cfg)
    cfg.train.divergence_window = 2
    cfg.train.divergence_spike_factor = 4.0
    cfg.train.save_interval = 2
    cfg.train.valid_interval = 1000
    cfg.train.keep_checkpoints = 5
    out = {
        "stop": divergence_run(cfg, "stop", at=3, factor=float("nan"), max_steps=4),
        "skip": divergence_run(cfg, "skip", at=4, factor=50.0, max_steps=5),
        "rollback": divergence_run(cfg, "rollback", at=4, factor=float("inf"), max_steps=5),
    }
    out["rollback_reference"] = rollback_reference(cfg, out["rollback"]["run_dir"], 2, 2, 3)
    return out


def main() -> None:
    args = worker_args()
    cfg = load_config(args.config)
    result = {"damage": damage_cases(cfg), "divergence": divergence_cases(cfg)}
    if is0():
        with open(args.out, "w") as f:
            json.dump(result, f, default=str)
    barrier()


if __name__ == "__main__":
    main()
    exit_rank()
