"""A resume applies the config's optimizer settings, not the checkpoint's.

DeepSpeed's load_checkpoint restores the optimizer's param_groups (lr, betas, eps, weight decay)
and the LR scheduler's state (its base_lrs) from the checkpoint; a lower train.lr given for the
resume after a divergence stop (as the stop message advises) used to be ignored without a word.
Here the real AdamW and LambdaLR go through the same save and load_state_dict calls, then
Checkpointer.apply_optimizer_config, as Checkpointer.restored calls it.
"""
import types

import pytest
import torch

from parallel.engine_config import adamw, inverse_sqrt
from trainer.checkpointer import Checkpointer
from trainer.train_config import TrainConfig


def _trained(train: TrainConfig, steps: int):
    weight = torch.nn.Parameter(torch.ones(4))
    optimizer = adamw([weight], train)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, inverse_sqrt(train.warmup_steps))
    for _ in range(steps):
        weight.grad = torch.full_like(weight, 0.5)
        optimizer.step()
        scheduler.step()
    return weight, optimizer, scheduler


@pytest.fixture
def single_rank(monkeypatch):
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: 0)


def test_resumed_run_uses_the_configs_lr_and_adam_settings(single_rank, capsys, tmp_path):
    before = TrainConfig(lr=2e-3, warmup_steps=4)
    _, optimizer, scheduler = _trained(before, 10)
    saved = optimizer.state_dict(), scheduler.state_dict()
    after = TrainConfig(lr=1e-4, warmup_steps=4, weight_decay=0.01, adam_betas=(0.9, 0.99), adam_eps=1e-6)
    weight, optimizer, scheduler = _trained(after, 0)
    optimizer.load_state_dict(saved[0])  # what DeepSpeed's load_checkpoint does with the client's
    scheduler.load_state_dict(saved[1])
    assert optimizer.param_groups[0]["lr"] == pytest.approx(2e-3 * (4 / 11) ** 0.5)  # the old run's, until now
    owner = types.SimpleNamespace(cfg=types.SimpleNamespace(train=after, run_dir=str(tmp_path)),
                                  engine=types.SimpleNamespace(lr_scheduler=scheduler, optimizer=optimizer))
    Checkpointer.apply_optimizer_config(owner)
    group = optimizer.param_groups[0]
    assert group["lr"] == pytest.approx(1e-4 * (4 / 11) ** 0.5) and scheduler.get_last_lr() == [group["lr"]]
    assert (group["weight_decay"], tuple(group["betas"]), group["eps"]) == (0.01, (0.9, 0.99), 1e-6)
    out = capsys.readouterr().out
    assert "train.lr 0.002 → 0.0001" in out and "train.weight_decay 0.0 → 0.01" in out and "adam_eps" in out
    assert "train.lr 0.002 → 0.0001" in (tmp_path / "train.log").read_text()  # the resume's record
    weight.grad = torch.full_like(weight, 0.5)
    optimizer.step()
    scheduler.step()  # the schedule goes on from the checkpoint's step with the new peak
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-4 * (4 / 12) ** 0.5)
    assert optimizer.state[weight]["step"] == 11  # Adam's moments and step count are the checkpoint's


def test_an_unchanged_config_changes_nothing_and_says_nothing(single_rank, capsys):
    train = TrainConfig(lr=2e-3, warmup_steps=4)
    _, optimizer, scheduler = _trained(train, 6)
    lr = optimizer.param_groups[0]["lr"]
    owner = types.SimpleNamespace(cfg=types.SimpleNamespace(train=train),
                                  engine=types.SimpleNamespace(lr_scheduler=scheduler, optimizer=optimizer))
    Checkpointer.apply_optimizer_config(owner)
    assert optimizer.param_groups[0]["lr"] == lr and capsys.readouterr().out == ""
