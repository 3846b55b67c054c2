"""The output layer and the label-smoothed loss in one pass over the vocabulary, chunk by chunk:
the [tokens × V] logits never exist whole.

    loss = Σ_{non-pad tokens} (1−ε)·(logZ − z_y) + (ε/V)·(V·logZ − Σ_v z_v),  z = h·Eᵀ

is torch's label-smoothed cross-entropy (sum reduction, padding ignored) of the tied output
projection, as the plain model computes it (model/transformer.py `smoothed_loss_sum` on full
logits). At the paper's 128k vocabulary those logits cost 14 bytes per token and piece (the
projection's output, its fp32 copy, the log-softmax and their gradients): 7 GiB for a 4k-token
micro-batch. Here the tokens go through in chunks of at most CHUNK_BYTES of fp32 logits; each
chunk's loss and its gradient with respect to the logits are computed in the forward, turned
into the gradients of h and E right away, and the chunk's logits are freed. Backward only scales
what forward kept (h's and E's gradients, the sizes of the inputs) by the incoming gradient.
Each chunk's logits are computed in the weights' precision and the loss in fp32, as the plain
model does, so the numbers are the same to summation order.

Why not a library: torch 2.13's `linear_cross_entropy` chunks only without label smoothing (with
it, it falls back to full logits, with a warning); Liger-Kernel's fused linear cross-entropy is
Triton, runs on GPUs only and knows nothing of a vocabulary split over tensor-parallel ranks.

The gradient of E reaches E the way a layer's would: the last pipeline layer ties E to the
decoder stream it outputs (`tie_output_weight`: the stream as it is, carrying E), and E's gradient,
computed by the loss, is handed to E by that tie's backward, after the stream's own gradient has
passed. The engine's hooks on a stage's output run before any of its parameters receive a gradient
(DeepSpeed's optimizers clear the low-precision gradients there), as with full logits.

Under tensor parallelism (`group`) each rank holds a slice of the vocabulary (parallel/tensor.py
VocabParallel): the maximum, Σ exp, z_y and Σ z are all-reduced over the group per chunk, and the
gradient of h (which every rank holds whole) is summed over it; megatron-core's vocab-parallel
cross-entropy smooths with the local vocabulary and is wrong for tp > 1 (Megatron-LM #737).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

CHUNK_BYTES = 256 * 2**20
"""fp32 logits per chunk (tokens × local vocabulary × 4 bytes): large enough that each chunk's
matrix products fill a GPU, small next to the 7 GiB of a 4k-token micro-batch at 128k pieces."""


def _all_reduce(t: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(t, op=op, group=group)
    return t


class _WeightSlot:
    """E's gradient between the loss's backward and the tie's."""

    grad: torch.Tensor | None = None


class _Tie(torch.autograd.Function):
    """The decoder stream, unchanged, tied to E: backward passes the stream's gradient on and gives
    E the gradient the loss left in the slot."""

    @staticmethod
    def forward(ctx, h, weight, slot):
        ctx.slot = slot
        return h.view_as(h)

    @staticmethod
    def backward(ctx, grad):
        weight_grad, ctx.slot.grad = ctx.slot.grad, None
        return grad, weight_grad, None


def tie_output_weight(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The last layer's output: `h` tied to the output projection's weight `weight` (E, or this
    rank's vocabulary slice of it), for `tied_output_loss_sum`."""
    slot = _WeightSlot()
    states = _Tie.apply(h, weight, slot)
    states.output_weight = (weight, slot)
    return states


class _ChunkedLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, slot, target, pad_id: int, eps: float, group, vocab: int, rows: int, scale,
                expected_grad: float):
        tp_rank = dist.get_rank(group) if group is not None else 0
        local = weight.size(0)
        start = tp_rank * local
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        grad_h = torch.empty_like(h)
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for lo in range(0, h.size(0), rows):
            hr, yr = h[lo:lo + rows], target[lo:lo + rows]
            z = F.linear(hr, weight).float()
            shift = _all_reduce(z.max(dim=-1).values, group, dist.ReduceOp.MAX)
            z -= shift[:, None]
            p = z.exp()
            total_exp = _all_reduce(p.sum(dim=-1), group)
            log_z = torch.log(total_exp)
            mine = (yr >= start) & (yr < start + local)
            index = (yr - start).clamp(0, local - 1)[:, None]
            z_y = _all_reduce(z.gather(1, index).squeeze(1) * mine, group)
            z_sum = _all_reduce(z.sum(dim=-1), group)
            keep = (yr != pad_id).float()
            total += (((1.0 - eps) * (log_z - z_y) + (eps / vocab) * (vocab * log_z - z_sum)) * keep).sum()
            # d loss / d z = softmax − (1−ε)·onehot(y) − ε/V, on real tokens
            p /= total_exp[:, None]
            p -= eps / vocab
            p.scatter_add_(1, index, -(1.0 - eps) * mine.float()[:, None])
            weight_of_row = keep if scale is None else keep * scale
            p *= weight_of_row[:, None] if expected_grad == 1.0 else (weight_of_row * expected_grad)[:, None]
            dz = p.to(h.dtype)
            grad_h[lo:lo + rows] = dz @ weight
            grad_w += (dz.t() @ hr).float()
        _all_reduce(grad_h, group)  # h is replicated: every vocabulary slice contributes
        ctx.save_for_backward(grad_h, grad_w)
        ctx.slot, ctx.weight_dtype, ctx.expected_grad = slot, weight.dtype, expected_grad
        return total if scale is None else total * scale

    @staticmethod
    def backward(ctx, grad):
        grad_h, grad_w = ctx.saved_tensors
        # What forward folded in already: 1 where the incoming gradient is the one expected (then
        # exactly, with no second rounding), in fp32.
        ratio = grad / ctx.expected_grad
        ctx.slot.grad = (grad_w * ratio).to(ctx.weight_dtype)  # for the tie's backward, next
        return ((grad_h.float() * ratio).to(grad_h.dtype), None, None, None, None, None, None, None, None, None,
                None)


def tied_output_loss_sum(states: torch.Tensor, target: torch.Tensor, pad_id: int, eps: float, group=None,
                         tp_size: int = 1, scale: torch.Tensor | None = None,
                         expected_grad: float = 1.0) -> torch.Tensor:
    """Σ over non-pad target tokens of the label-smoothed cross-entropy of the logits of `states`
    (from `tie_output_weight`) through their tied weight, fp32, without materialising them; the
    weight is this rank's vocabulary slice when `group` is the tensor-parallel group of `tp_size`
    ranks. `scale` (an fp32 tensor): the sum times it, with the logits' gradient scaled before it is
    rounded to the weights' precision, as autograd would scale it through `loss_sum * scale`.

    `expected_grad`: the gradient backward will receive (an fp32 value: DeepSpeed's backward
    divides the loss by the micro-batches per step and multiplies it by fp16's loss scale). The
    logits' gradient is computed in forward, so it is scaled by this before it is rounded, as
    autograd would scale it; backward multiplies by received / expected (exactly 1 when as
    expected). Without it, the rounding would come before the division (another rounding of every
    element in bf16) and before the loss scale (fp16's small gradients would underflow)."""
    weight, slot = states.output_weight
    h2 = states.reshape(-1, states.size(-1))
    local = weight.size(0)
    rows = max(1, min(h2.size(0), CHUNK_BYTES // (4 * local)))
    return _ChunkedLoss.apply(h2, weight.detach(), slot, target.reshape(-1), pad_id, eps, group,
                              local * tp_size, rows, scale, float(expected_grad))


def output_loss_sum(h: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, pad_id: int, eps: float,
                    group=None, tp_size: int = 1) -> torch.Tensor:
    """`tied_output_loss_sum` of `h` tied to `weight`: the loss of logits h·weightᵀ."""
    return tied_output_loss_sum(tie_output_weight(h, weight), target, pad_id, eps, group, tp_size)
