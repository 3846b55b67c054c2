"""Runs under the deepspeed launcher with 2 ranks, tensor_parallel=2, one pipeline stage.

Checks, written by rank 0 to `--out` (JSON):
  vocab_loss:  the vocabulary-parallel smoothed loss and its gradient against torch's
               F.cross_entropy(label_smoothing) on the full logits;
  gradients:   one forward/backward of the tp=2 model against the plain model built from the same
               seed: loss and every gradient (shards compared with the full gradient's slice);
               again for Sub-LN (inner LayerNorms over sharded features) as subln_gradients;
  sharded_init: the tp=2 parameters equal the slices of the plain model's at initialisation;
  training:    the trainer with tp=2 (clipping on) for a few steps (compared with the
               single-process reference by the test);
  resume:      dropout 0.1 with activation checkpointing, checkpoint, resume in a fresh run
               directory (the model-parallel RNG state must be restored);
  dropout_no_checkpointing: the same dropout run without checkpointing (same losses and norms).
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from model.layers import split_fused_projections
from model.transformer import EncoderDecoder, smoothed_loss_sum
from parallel.pipeline import plain_state_dict
from parallel.tensor import shard_dim
from runtime.distributed import exit_rank
from tests.dist.common import record_steps, train_and_resume, variant, with_dropout, write_result
from trainer.config import load_config
from trainer.trainer import Trainer


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def check_vocab_loss(tp) -> dict:
    """parallel/loss.py under tensor parallelism: this rank's vocabulary slice of the tied weight
    against the full logits' label-smoothed cross-entropy (loss, and the gradients of h and of
    this rank's rows), in chunks of a few tokens so that several chunks run."""
    from parallel import loss as chunked

    gen = torch.Generator().manual_seed(5)
    vocab, n, d = 64, 40, 16
    h = torch.randn(n, d, generator=gen).requires_grad_()
    weight = (torch.randn(vocab, d, generator=gen)).requires_grad_()
    target = torch.randint(1, vocab, (n,), generator=gen)
    target[::7] = 0  # padding
    ref = F.cross_entropy(h @ weight.t(), target, ignore_index=0, label_smoothing=0.1, reduction="sum")
    ref.backward()
    local = weight.detach().chunk(tp.size, dim=0)[tp.rank].clone().requires_grad_()
    mine = h.detach().clone().requires_grad_()
    saved, chunked.CHUNK_BYTES = chunked.CHUNK_BYTES, 4 * 7 * local.size(0)  # 7 tokens a chunk
    try:
        got = chunked.output_loss_sum(mine, local, target, 0, 0.1, tp.group, tp.size)
    finally:
        chunked.CHUNK_BYTES = saved
    got.backward()
    return {"loss": float(got), "ref": float(ref), "grad_rel": rel(local.grad, weight.grad.chunk(tp.size, dim=0)[tp.rank]),
            "grad_h_rel": rel(mine.grad, h.grad)}


def local_slice(name: str, full: torch.Tensor, tp) -> torch.Tensor:
    dim = shard_dim(name)
    return full if dim is None else full.chunk(tp.size, dim=dim)[tp.rank]


def check_gradients(trainer: Trainer) -> dict:
    """The tp=2 module against the plain model on a real batch: loss and every gradient."""
    cfg, module, tp = trainer.cfg, trainer.module, trainer.module.tp
    plain = EncoderDecoder(cfg.model, seed=cfg.train.seed)
    from data.batching import eval_batches

    b = eval_batches(trainer.train_data, cfg.data.max_tokens)[0]
    init = {name: rel(value, local_slice(name, plain.state_dict()[name], tp))
            for name, value in plain_state_dict(cfg.model, module.state_dict()).items()}

    logits = module((b["src"], b["tgt_in"]))
    loss = module.loss_fn(logits, (b["tgt_out"], torch.tensor(1.0)))
    loss.backward()
    ref = smoothed_loss_sum(plain(b["src"], b["tgt_in"]), b["tgt_out"], 0, cfg.model.label_smoothing)
    ref.backward()
    grads = {name: p.grad for name, p in module.named_parameters()}
    grads = split_fused_projections(plain_state_dict(cfg.model, grads))  # the standard q/k/v names
    plain_grads = split_fused_projections({name: p.grad for name, p in plain.named_parameters()})
    grad_rel = {name: rel(g, local_slice(name, plain_grads[name], tp)) for name, g in grads.items()}
    grad_abs = {name: float((g - local_slice(name, plain_grads[name], tp)).abs().max()) for name, g in grads.items()}
    grad_max = max(float(g.abs().max()) for g in plain_grads.values())
    module.zero_grad()
    return {"loss": float(loss), "ref": float(ref), "grad_rel": grad_rel, "grad_abs": grad_abs,
            "grad_max": grad_max, "init_rel": init,
            "n_params": len(grads), "n_plain": len(plain_grads)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--local_rank", type=int)
    args = parser.parse_args()

    cfg = load_config(args.config)
    # The gradient check runs a forward/backward outside the engine: give it its own trainer so the
    # engine that trains below starts untouched.
    probe = Trainer(cfg, max_steps=args.steps)
    results = {"vocab_loss": check_vocab_loss(probe.module.tp), "gradients": check_gradients(probe)}
    results["training"] = record_steps(Trainer(cfg, max_steps=args.steps), args.steps)

    # Sub-LN's inner LayerNorms sit on sharded features: their statistics are all-reduced.
    subln = variant(cfg, "subln")
    subln.model.norm = "subln"
    results["subln_gradients"] = check_gradients(Trainer(subln, max_steps=args.steps))

    results["resume"] = train_and_resume(with_dropout(cfg, "dropout"), args.steps, 2)
    # The same dropout run without activation checkpointing: recomputation under checkpointing must
    # replay the same dropout masks (default and model-parallel RNG), or the gradients would differ.
    no_ckpt = with_dropout(cfg, "dropout-nockpt", checkpoint_interval=0)
    results["dropout_no_checkpointing"] = record_steps(Trainer(no_ckpt, max_steps=args.steps), args.steps)
    write_result(args.out, results)

if __name__ == "__main__":
    main()
    exit_rank()
