"""The single-process reference the parallel runs are compared with.

It applies exactly the trainer's recipe with plain PyTorch: the same batch stream, the
token-weighted label-smoothed loss over the global batch, AdamW, inverse-sqrt LR and global-norm
clipping by torch.nn.utils.clip_grad_norm_.
"""
from __future__ import annotations

import os

import torch

from data.batching import BatchStream, PairDataset
from data.prepare import load_manifest
from launcher.config import RunConfig
from model.transformer import EncoderDecoder, smoothed_loss_sum
from parallel.engine import inverse_sqrt


def reference_run(cfg: RunConfig, steps: int) -> dict:
    data_dir = os.path.join(cfg.run_dir, "data")
    cfg.model.vocab_size = cfg.model.vocab_size or load_manifest(data_dir)["vocab_size"]
    model = EncoderDecoder(cfg.model, seed=cfg.train.seed)
    t = cfg.train
    opt = torch.optim.AdamW(model.parameters(), lr=t.lr, betas=t.adam_betas, eps=t.adam_eps,
                            weight_decay=t.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, inverse_sqrt(t.warmup_steps))
    stream = BatchStream(PairDataset(os.path.join(data_dir, "train")), cfg.data.max_tokens,
                         cfg.data.seed, cfg.data.sampling_temperature)
    m = t.micro_batches * cfg.parallel.data_parallel
    out = {"loss": [], "grad_norm": [], "lr": []}
    for _ in range(steps):
        batches = stream.next_step(m)
        total = sum(int(b["ntokens"]) for b in batches)
        step_loss = 0.0
        for b in batches:
            loss = smoothed_loss_sum(model(b["src"], b["tgt_in"]), b["tgt_out"], cfg.model.pad_id,
                                     cfg.model.label_smoothing) / total
            loss.backward()
            step_loss += loss.item()
        clip = t.clip_norm if t.clip_norm > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        out["lr"].append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
        opt.zero_grad()
        out["loss"].append(step_loss)
        out["grad_norm"].append(norm.item())
    out["params"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return out
