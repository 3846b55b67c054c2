"""Runs under the deepspeed launcher on one GPU: the GPU suite's training checks in one launch.

For each precision (fp32, bf16, fp16) the real Trainer trains `--steps` steps, saving a
checkpoint after `--save-at`, then a fresh Trainer resumes from it (tests/dist/pipeline_worker.py).
Recorded per scenario: losses, clipped gradient norms, learning rates, the devices of every
tensor that entered any module's forward and of every parameter and optimizer-state tensor
(any host tensor there is a silent CPU fallback), and, for fp16, the loss scale, overflow and
parameter checksum of every step. fp16 starts from a loss scale of 2^24 so that the first steps
overflow: those must be skipped (parameters unchanged, learning-rate schedule not advanced) and
counted by DeepSpeed. Rank 0 writes everything to `--out` (JSON).
"""
from __future__ import annotations

import argparse
import copy
import json
import os

import torch

from parallel.pipeline import plain_state_dict
from runtime import accelerator
from runtime.distributed import exit_rank, setup_distributed
from tests.dist.common import fresh_run_dir, record_steps
from trainer.config import load_config
from trainer.trainer import Trainer

FP16_START_SCALE = 2.0**24
FP16_STEPS = 20


class DeviceSpy:
    """Device types of every tensor passed into any module's forward while active."""

    def __init__(self) -> None:
        self.seen: dict[str, int] = {}
        self.handle = torch.nn.modules.module.register_module_forward_pre_hook(self.hook)

    def hook(self, module, args) -> None:
        stack = list(args)
        while stack:
            x = stack.pop()
            if torch.is_tensor(x):
                self.seen[x.device.type] = self.seen.get(x.device.type, 0) + 1
            elif isinstance(x, (tuple, list)):
                stack.extend(x)

    def close(self) -> dict:
        self.handle.remove()
        return self.seen


def state_devices(trainer: Trainer) -> dict[str, int]:
    """Device types of the parameters, DeepSpeed's master weights and the Adam state."""
    found: dict[str, int] = {}

    def add(t) -> None:
        if torch.is_tensor(t) and t.numel() > 1:  # Adam's step counter is a host scalar by design
            found[t.device.type] = found.get(t.device.type, 0) + 1

    for p in trainer.module.parameters():
        add(p)
    opt = trainer.engine.optimizer
    inner = getattr(opt, "optimizer", opt)
    for state in inner.state.values():
        for t in state.values():
            add(t)
    for group in inner.param_groups:  # the fp32 master copies under bf16/fp16
        for p in group["params"]:
            add(p)
    return found


def checksum(trainer: Trainer) -> float:
    return float(sum(p.detach().double().abs().sum() for p in trainer.module.parameters()))


def record_fp16(trainer: Trainer, steps: int) -> dict:
    """Train `steps` steps recording the loss scale, overflow and parameter checksum per step."""
    opt = trainer.engine.optimizer
    opt.loss_scaler.cur_scale = FP16_START_SCALE
    out = {"loss": [], "lr": [], "scale": [], "overflow": [], "checksum": [checksum(trainer)]}
    while trainer.step < steps:
        out["scale"].append(float(opt.loss_scaler.cur_scale))
        r = trainer.train_step()
        out["loss"].append(r["loss"])
        out["lr"].append(r["lr"])
        out["overflow"].append(bool(opt.overflow))
        out["checksum"].append(checksum(trainer))
    out["skipped_steps"] = int(trainer.engine.skipped_steps)
    return out


def scenario(cfg, precision: str, steps: int, save_at: int, dump: str) -> dict:
    run = copy.deepcopy(cfg)
    run.parallel.precision = precision
    run.run_dir = f"{cfg.run_dir}-{precision}"
    fresh_run_dir(run.run_dir, os.path.join(cfg.run_dir, "data"))
    spy = DeviceSpy()
    if precision == "fp16":  # long enough for the scaler to back off (hysteresis 2, then halving)
        steps = FP16_STEPS
    first = Trainer(run, max_steps=steps)
    if precision == "fp16":
        result = {"uninterrupted": record_fp16(first, steps)}
    else:
        result = {"uninterrupted": record_steps(first, save_at, None)}
        first.save()
        more = record_steps(first, steps, None)
        for key in ("loss", "grad_norm", "lr"):
            result["uninterrupted"][key] += more[key]
    result["input_devices"] = spy.close()
    result["state_devices"] = state_devices(first)
    result["engine_device"] = str(first.engine.device)
    result["backend"] = torch.distributed.get_backend()
    state = {k: v.detach().float().cpu() for k, v in first.module.state_dict().items() if torch.is_tensor(v)}
    torch.save(plain_state_dict(run.model, state), f"{dump}.{precision}.pt")
    if precision != "fp16":
        resumed = copy.deepcopy(run)
        resumed.run_dir = run.run_dir + "-resumed"
        fresh_run_dir(resumed.run_dir, os.path.join(cfg.run_dir, "data"), run.run_dir, f"step{save_at}")
        second = Trainer(resumed, max_steps=steps)
        result["resumed_from"] = second.step
        result["resumed"] = record_steps(second, steps, None)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--save-at", type=int, default=2)
    parser.add_argument("--precisions", default="fp32,bf16,fp16")
    parser.add_argument("--local_rank", type=int)
    args = parser.parse_args()

    setup_distributed()
    cfg = load_config(args.config)
    results = {"versions": accelerator.versions()}
    for precision in args.precisions.split(","):
        results[precision] = scenario(cfg, precision, args.steps, args.save_at, args.out)
    if torch.distributed.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
    exit_rank()
