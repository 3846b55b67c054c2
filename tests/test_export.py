"""Export to transformers and CTranslate2 (./run.sh export), on tiny models trained here.

A 3L-3L d=32 model of every exportable strategy is trained in-process for a few dozen steps on
the tiny corpus and saved as a consolidated model file; the DeepNorm one trains longer so that
its translations are real. Checked: the exported transformers model's logits equal the project's
(≤ 1e-4, fp32), the tokenizer reproduces the project's ids, greedy and beam-5 translations of the
test sentences are the same strings from `./run.sh translate`, transformers `generate` and
CTranslate2 float32, int8's BLEU is within 0.5 of float32's, and what cannot be exported exactly
is refused with the reason.
"""
from __future__ import annotations

import os
import time

import pytest
import sacrebleu
import torch

from data.batching import eval_batches
from data.dataset import PairDataset
from data.spm import Tokenizer
from launcher.cli import main as cli
from model.config import ModelConfig
from model.transformer import EncoderDecoder, smoothed_loss_sum
from parallel.checkpoints import CONSOLIDATED_FORMAT
from tests.conftest import TINY_MODEL

EXPORTABLE = ["deepnorm", "deepnorm-torchscale", "postln", "postln-init", "branchnorm"]
T_BRANCH = 10  # BranchNorm's maximum-norm step for the tests: exportable from step 10 on


@pytest.fixture(autouse=True, scope="module")
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def train_tiny(data_dir: str, norm: str, steps: int, **model) -> EncoderDecoder:
    """A tiny model trained `steps` Adam steps on the training split (every batch in turn)."""
    tok = Tokenizer(os.path.join(data_dir, "spm.model"))
    cfg = ModelConfig(**{**TINY_MODEL, "norm": norm, "vocab_size": tok.vocab_size,
                         "branchnorm_max_norm_step": T_BRANCH, **model})
    net = EncoderDecoder(cfg, seed=3)
    batches = eval_batches(PairDataset(os.path.join(data_dir, "train")), 512)
    opt = torch.optim.Adam(net.parameters(), lr=3e-3, betas=(0.9, 0.98))
    from model.norms import set_training_step

    net.train()
    for step in range(steps):
        set_training_step(net, step)
        batch = batches[(step * 7) % len(batches)]
        loss = smoothed_loss_sum(net(batch["src"], batch["tgt_in"]), batch["tgt_out"], cfg.pad_id, 0.1)
        opt.zero_grad()
        (loss / batch["ntokens"]).backward()
        opt.step()
    set_training_step(net, steps)
    return net.eval()


def save_consolidated(net: EncoderDecoder, data_dir: str, path: str) -> str:
    """A model file as `./run.sh convert consolidate` writes it."""
    import json
    from dataclasses import asdict

    with open(os.path.join(data_dir, "manifest.json")) as f:
        manifest = json.load(f)
    with open(os.path.join(data_dir, "spm.model"), "rb") as f:
        spm_model = f.read()
    torch.save({"format": CONSOLIDATED_FORMAT, "model_config": asdict(net.cfg), "state_dict": net.state_dict(),
                "spm_model": spm_model, "languages": manifest["languages"], "directions": manifest["directions"],
                "tags": manifest["tags"], "source": {"checkpoint": "", "tag": "test", "step": 0}}, path)
    return path


@pytest.fixture(scope="module")
def deepnorm_model(tiny_data, tmp_path_factory):
    torch.set_num_threads(1)
    net = train_tiny(tiny_data, "deepnorm", 400)
    path = save_consolidated(net, tiny_data, str(tmp_path_factory.mktemp("export") / "deepnorm.pt"))
    return net, path
