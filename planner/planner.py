"""Cluster planner: per-stage memory and step time of a pp × tp × dp layout, before running it.

Memory per pipeline stage, in bytes, for DeepSpeed 0.19.8 as this trainer configures it:

* Parameters, gradients and optimizer state, per parameter of the stage's shard, from the
  precision's record (parallel/precision.py `Precision.state_bytes`) for FlatOptimizer, the
  optimizer of every precision (parallel/optimizer.py): the weights and the flat fp32 gradient
  buffer all the time; autograd's gradients in the weights' dtype during a backward, until they
  are folded into the buffer (so they compete with that micro-batch's activations, which the
  backward frees as they appear: the peak is the larger, not the sum); the master copy (none in
  fp32, whose master partition is the weights) and Adam's two moments, divided by dp under ZeRO-1;
  at the step, the buffer converted to the communication dtype where that differs (bf16, fp16).
* Activations (`layer_activation_bytes`): what autograd saves per layer of this implementation,
  counted tensor by tensor (tests/test_planner.py checks the formula against saved-tensor hooks),
  times the micro-batches in flight on the stage, read from the schedule's order (1F1B:
  min(pp − stage, m); GPipe: m), plus the W tensors of the weight passes its order keeps pending
  at the same moment (planner/zb.py `order_memory`), plus the two [B, S+T, d] pipeline buffers
  DeepSpeed keeps per micro-batch in flight (received input, sent output), plus the transient of
  the backward pass (one layer's worth of gradients, a recomputed chunk under checkpointing, or
  the loss's gradients of the logits). With checkpointing a chunk keeps only its input h.
* The last stage keeps the logits [B, T, V] and the fp32 log-softmax until backward.

Step time: the pipeline phase of the layout's schedule (`Candidate.schedule`), its order simulated
with every stage at the slowest stage's compute per micro-batch (at an assumed MFU, with the
tensor-parallel all-reduces and the point-to-point send), split into F and BW (or F, B, W for a
schedule that splits its backward) in the proportions measured per layer kind on the device type
(or the FLOP model's; planner/zb.py) — 1F1B's (m + pp − 1) slots — then the data-parallel gradient
reduction and the optimizer step, which DeepSpeed does not overlap. `candidate_layouts` offers
every pipelined layout under every schedule of the registry (one with pending bounds under each),
so a search proposes the fastest schedule within memory.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import os
from collections.abc import Callable
from dataclasses import dataclass

import yaml

from model.config import ModelConfig
from model.flops import layer_forward_flops
from parallel.loss import CHUNK_BYTES
from parallel.partition import stage_bounds
from parallel.precision import precision_of
from parallel.schedules import DEFAULT_SCHEDULE, SCHEDULES
from planner.devices import Device
from planner.zb import flop_costs, measured_costs, pipeline, stage_costs, weight_flops, weight_grad_bytes  # noqa: F401 (planner/zb.py)
from runtime.accelerator import HOST

CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")

def named_shapes() -> list[str]:
    """The named model shapes: the run configs in configs/ (one registry; the paper's models,
    the CPU benchmark shapes and the bundled defaults)."""
    return sorted(name[:-len(".yaml")] for name in os.listdir(CONFIG_DIR) if name.endswith(".yaml"))


def named_model(name: str) -> ModelConfig:
    """The model section of configs/<name>.yaml, its vocabulary from the data section where the
    model section leaves it to the data."""
    path = os.path.join(CONFIG_DIR, f"{name}.yaml")
    if not os.path.isfile(path):
        raise ValueError(f"unknown model {name!r}: give a YAML config path or one of {named_shapes()}")
    with open(path) as f:
        raw = yaml.safe_load(f) or {}
    model = dict(raw.get("model") or {})
    model["vocab_size"] = model.get("vocab_size") or (raw.get("data") or {}).get("vocab_size", 0)
    return ModelConfig(**model)


@dataclass(frozen=True, kw_only=True)
class Candidate:
    """One layout the planner prices (sizes, batch shape, precision, schedule); the running
    ranks' own layout is parallel.layout.Layout."""

    pp: int
    tp: int
    dp: int
    micro_batches: int
    sequences: int
    """Sequence pairs per micro-batch."""
    src_len: int
    tgt_len: int
    checkpoint: int = 0
    """Activation checkpoint interval in layers (0 = off)."""
    precision: str = "bf16"
    schedule: str = DEFAULT_SCHEDULE
    """Pipeline schedule: a name of parallel/schedules.py's SCHEDULES."""
    zb_max_pending: int | None = 0
    """For a schedule that splits its backward: bound on the W a stage keeps waiting, as
    parallel.zb_max_pending_w (0: 1F1B's memory on every stage; None where the config says -1: no
    bound, the tuned order)."""

    @property
    def splits_backward(self) -> bool:
        return SCHEDULES[self.schedule].splits_backward

    @property
    def schedule_name(self) -> str:
        """The schedule as the config sets it, with its zb_max_pending_w where that applies."""
        if not SCHEDULES[self.schedule].pending_bounds:
            return self.schedule
        return f"{self.schedule}(w={-1 if self.zb_max_pending is None else self.zb_max_pending})"
    zero: int = 1
    """parallel.zero_stage: 1 (ZeRO-1) or 0 (the client optimizer on the weights)."""

    @property
    def world(self) -> int:
        return self.pp * self.tp * self.dp

    def describe(self) -> str:
        ac = f"ac{self.checkpoint}" if self.checkpoint else "no-ac"
        zb = f" {self.schedule_name}" if self.schedule != DEFAULT_SCHEDULE else ""
        return (f"pp{self.pp}·tp{self.tp}·dp{self.dp} m={self.micro_batches} "
                f"mb={self.sequences}×({self.src_len}+{self.tgt_len}) {ac} {self.precision}{zb}")




def stage_kinds(cfg: ModelConfig, pp: int) -> list[list[str]]:
    """The plan-layer kinds of each stage (cached: the planner asks for every stage of every layout)."""
    return _stage_kinds(tuple(sorted(dataclasses.asdict(cfg).items())), pp)


@functools.lru_cache(maxsize=4096)
def _stage_kinds(key: tuple, pp: int) -> list[list[str]]:
    from model.transformer import layer_plan  # torch: `run.sh plan` starts without it

    cfg = ModelConfig(**dict(key))
    kinds = [layer.kind for layer in layer_plan(cfg)]
    bounds = stage_bounds(cfg, pp)
    return [kinds[bounds[s]:bounds[s + 1]] for s in range(pp)]


def layer_params(cfg: ModelConfig, kind: str, tp: int = 1) -> float:
    """Parameters of one plan layer on one tensor-parallel rank (LayerNorms replicated)."""
    d, f, v = cfg.d_model, cfg.ffn_dim, cfg.vocab_size
    attention = 4 * d * d / tp + 3 * d / tp + d  # Q, K, V column-parallel; O row-parallel (bias whole)
    ffn = 2 * d * f / tp + f / tp + d
    if kind == "encoder":
        return attention + ffn + 2 * 2 * d
    if kind == "decoder":
        return 2 * attention + ffn + 3 * 2 * d
    if kind in ("embed", "output"):
        return v * d / tp  # the tied embedding: on the first and on the last stage
    return 2 * d  # final LayerNorm


def layer_activation_bytes(cfg: ModelConfig, kind: str, sequences: int, src_len: int, tgt_len: int,
                           element: int, mask: int, tp: int = 1) -> float:
    """Bytes autograd saves for one plan layer and one micro-batch (pipeline wrappers included).

    Encoder layer, per source token: the layer input (one contiguous stream, shared by the Q, K
    and V projections), Q, K, V and the attention output, the attention's log-sum-exp (H floats),
    the two LayerNorm inputs and the FFN input, the ReLU output (f), LayerNorm mean and rstd
    (4 floats) and the float padding mask (1; none when a micro-batch has no padding):
    e·(8d + f) + 4·(H + 5). A decoder layer, per target token e·(12d + f) + 4·(2H + 6), and per
    source token e·3d + 4 (the encoder output read by the cross-attention K/V projections, and
    their outputs). Dropout adds one mask per residual branch (and per FFN activation) of `mask`
    bytes per element: torch's on GPUs keeps a bool mask (1), on CPUs a mask of the activations'
    dtype (its scaled Bernoulli draws).
    Tensors inside a tensor-parallel region (Q, K, V, attention output, ReLU output) are split.
    """
    d, f, h, v = cfg.d_model, cfg.ffn_dim, cfg.heads, cfg.vocab_size
    ns, nt = sequences * src_len, sequences * tgt_len
    res_mask = mask if cfg.dropout > 0 else 0
    act_mask = mask * f / tp if cfg.activation_dropout > 0 else 0
    if kind == "encoder":
        per = element * (4 * d + (4 * d + f) / tp) + 4 * (5 + h / tp) + 2 * d * res_mask + act_mask
        return ns * per
    if kind == "decoder":
        per_t = element * (6 * d + (6 * d + f) / tp) + 4 * (6 + 2 * h / tp) + 3 * d * res_mask + act_mask
        per_s = element * (d + 2 * d / tp) + 4
        return nt * per_t + ns * per_s
    if kind == "embed":
        return (ns + nt) * (8 + d * res_mask)
    if kind == "output":
        # the decoder stream (kept by the engine until backward), its gradient and the fp32
        # gradient of this rank's vocabulary rows, which the chunked loss computes in its forward
        # (parallel/loss.py), and the labels; no logits
        return nt * (2 * element * d + 9) + v / tp * d * 4
    return (ns if kind == "encoder_norm" else nt) * (element * d + 8)


def stage_memory(cfg: ModelConfig, layout: Candidate, stage: int, dev: Device, held: dict | None = None) -> dict[str, float]:
    """Peak bytes of one stage, by component, at whichever moment is larger (see module doc).
    `held`: what the schedule's orders hold (planner/zb.py `order_memory`; default: the order this
    layout's schedule runs, `pipeline_phase`)."""
    kinds = stage_kinds(cfg, layout.pp)[stage]
    params = sum(layer_params(cfg, k, layout.tp) for k in kinds)
    precision = precision_of(layout.precision)
    per = precision.state_bytes()  # FlatOptimizer's bytes per parameter, every precision's optimizer
    kept, grads, step = per["kept"], per["grads"], per["step"]
    # ZeRO-1 divides the master copy and Adam's moments over the replicas; stage 0 keeps them whole.
    kept_dp, unsharded = (per["kept_dp"], 0) if layout.zero else (0, per["kept_dp"])
    if precision.low and dev.kind == HOST:
        raise ValueError("the planner models 16-bit precisions for GPUs only")
    e = precision.element_bytes
    mask = e if dev.kind == HOST else 1  # dropout's kept mask: the activations' dtype on CPUs, bool on GPUs
    b, s, t = layout.sequences, layout.src_len, layout.tgt_len
    acts = [layer_activation_bytes(cfg, k, b, s, t, e, mask, layout.tp) for k in kinds]
    h_bytes = b * (s + t) * cfg.d_model * e  # one [B, S+T, d] tensor
    held = held or pipeline_phase(cfg, layout, dev)
    states = held["held"][stage]  # (micro-batches in flight, pending W) that can peak
    in_flight = max(a for a, _ in states)
    buffers = (stage > 0) * h_bytes + (stage < layout.pp - 1) * h_bytes
    layered = [a for a, k in zip(acts, kinds) if k in ("encoder", "decoder")]
    other = sum(a for a, k in zip(acts, kinds) if k not in ("encoder", "decoder"))
    # Backward scratch: a layer's gradients mirror what it saved. The loss's forward holds one
    # chunk of fp32 logits, their exponentials and the chunk's gradient in the weights' precision.
    scratch = max(layered, default=0.0)
    chunk_tokens = min(b * t, max(1, CHUNK_BYTES // (4 * cfg.vocab_size / layout.tp)))
    loss_scratch = chunk_tokens * cfg.vocab_size / layout.tp * (8 + e) if "output" in kinds else 0.0
    if layout.checkpoint and layered:
        k = layout.checkpoint
        per_mb = math.ceil(len(layered) / k) * h_bytes + other  # a chunk keeps only its input h
        recompute = max(sum(layered[i:i + k]) for i in range(0, len(layered), k))
        transient = max(recompute + scratch, loss_scratch)
    else:
        per_mb = sum(layered) + other
        transient = max(scratch, loss_scratch)
    # A pending W keeps its micro-batch's W tensors (each linear's input and output gradient; with
    # checkpointing recomputed ones): the micro-batch going through B turns its activations into
    # them. Measured (bench, pp = 2, default model, ZB-H1's paper order): the last stage's live
    # tensors peak 1 micro-batch's W tensors above 1F1B's. The first stage may defer a share only.
    w_bytes = sum(weight_grad_bytes(cfg, k, b, s, t, e) for k in kinds) * (held["first_share"] if stage == 0 else 1.0)
    activations = max(a * per_mb + w * w_bytes for a, w in states)
    # The schedule engine frees a micro-batch's buffers after its backward (parallel/schedule_engine.py):
    # no slot keeps an earlier micro-batch's output or input.
    comm = in_flight * buffers + 2 * h_bytes  # + the gradient being received and the one sent
    state = params * (kept + unsharded + kept_dp / layout.dp)
    # Autograd's gradients appear as a backward frees its micro-batch's activations, layer by layer,
    # and are folded into the kept buffer and freed when it ends: the peak is the larger of the
    # two, not their sum.
    fwd_bwd = state + max(activations + transient, params * grads + activations * (in_flight - 1) / in_flight) + comm
    # The reduction converts the flat buffer to the communication dtype where they differ (the
    # fused AdamW steps the master partition without temporaries).
    step_extra = params * step
    at_step = state + step_extra
    return {"params": params, "weights_grads": params * (kept + grads), "optimizer": params * (unsharded + kept_dp / layout.dp),
            "activations": activations + transient, "buffers": comm, "step_extra": step_extra,
            "peak": max(fwd_bwd, at_step), "peak_phase": "forward/backward" if fwd_bwd >= at_step else "optimizer step"}


def _allreduce_seconds(nbytes: float, ranks: int, gbs: float) -> float:
    """Ring all-reduce: each rank moves 2·(n−1)/n of the buffer; 20 µs latency per hop pair."""
    if ranks <= 1:
        return 0.0
    return 2 * (ranks - 1) / ranks * nbytes / (gbs * 1e9) + 2 * (ranks - 1) * 20e-6


def _stage_comm(cfg: ModelConfig, layout: Candidate, dev: Device) -> tuple[list[float], float]:
    """Per stage the tensor-parallel all-reduce seconds of a micro-batch, and the point-to-point send's."""
    e = precision_of(layout.precision).element_bytes
    b, s, t = layout.sequences, layout.src_len, layout.tgt_len
    tp_comm = []
    for kinds in stage_kinds(cfg, layout.pp):
        # Megatron TP: 2 all-reduces of [B·len, d] per attention/FFN block, forward and backward.
        blocks = sum(2 * s if k == "encoder" else 3 * t if k == "decoder" else 0 for k in kinds)
        tp_comm.append(2 * _allreduce_seconds(b * blocks * cfg.d_model * e, layout.tp, dev.intra_gbs))
    # Stages on different nodes talk over the network; each GPU gets its share of the node's link.
    ranks_per_stage = layout.tp * layout.dp
    p2p_gbs = dev.intra_gbs if ranks_per_stage * layout.pp <= dev.gpus_per_node else dev.inter_node_gbs / dev.gpus_per_node
    p2p = 2 * b * (s + t) * cfg.d_model * e / (p2p_gbs * 1e9) if layout.pp > 1 else 0.0
    return tp_comm, p2p


Efficiency = float | Callable[["Candidate"], float]
"""The fraction of peak the kernels reach: one number, or one per layout (planner/devices.py's
kernel_efficiency at the layout's target tokens per micro-batch: small micro-batches run smaller,
less efficient kernels)."""


def efficiency_of(mfu: Efficiency, layout: Candidate) -> float:
    return mfu(layout) if callable(mfu) else mfu


def _layer_seconds(cfg: ModelConfig, layout: Candidate, dev: Device, mfu: Efficiency) -> dict[str, float]:
    """Forward + backward seconds of one layer of each kind for a micro-batch (3 forwards' FLOPs)."""
    peak = dev.peak_tflops[precision_of(layout.precision).math] * 1e12 * efficiency_of(mfu, layout)
    b, s, t = layout.sequences, layout.src_len, layout.tgt_len
    return {k: 3 * b * layer_forward_flops(cfg, k, s, t) / layout.tp / peak for k in ("encoder", "decoder", "output")}


def step_time(cfg: ModelConfig, layout: Candidate, dev: Device, mfu: Efficiency, zb_costs: dict | None = None) -> dict:
    """Estimated seconds per optimizer step and its parts (see module doc); "pipeline" is
    pipeline_phase's answer (the order's memory, for stage_memory)."""
    seconds = _layer_seconds(cfg, layout, dev, mfu)
    recompute = {k: v / 3 if layout.checkpoint and k in ("encoder", "decoder") else 0.0 for k, v in seconds.items()}
    tp_comms, p2p = _stage_comm(cfg, layout, dev)
    per_stage = [(sum(seconds.get(k, 0.0) + recompute.get(k, 0.0) for k in kinds), comm)
                 for kinds, comm in zip(stage_kinds(cfg, layout.pp), tp_comms)]
    _, tp_comm = max(per_stage, key=lambda x: x[0] + x[1])
    pipe = pipeline_phase(cfg, layout, dev, mfu, zb_costs)
    pipeline, bubble_fraction = pipe["seconds"], pipe["bubble_fraction"]
    bubble = bubble_fraction * pipeline
    compute = sum(pipe["cost"].values()) - tp_comm - p2p  # the slowest stage's, with a split's own cost
    # Data parallel: the accumulated gradients all-reduced in the weights' dtype (FlatOptimizer's
    # flat buffer, converted to DeepSpeed's communication dtype) + ZeRO-1's all-gather of the weights.
    e = precision_of(layout.precision).element_bytes
    ranks_per_stage = layout.tp * layout.dp
    params = max(sum(layer_params(cfg, k, layout.tp) for k in kinds) for kinds in stage_kinds(cfg, layout.pp))
    dp_gbs = dev.intra_gbs if ranks_per_stage <= dev.gpus_per_node else dev.inter_node_gbs / dev.gpus_per_node
    dp_comm = _allreduce_seconds(params * e, layout.dp, dp_gbs) \
        + _allreduce_seconds(params * e, layout.dp, dp_gbs) / 2 * (layout.zero > 0)  # all-reduce + all-gather
    optimizer = params / layout.dp * 32 / (dev.hbm_gbs * 1e9)  # master, m, v, grad read+written
    total = pipeline + dp_comm + optimizer
    return {"total": total, "compute": (layout.micro_batches) * compute, "bubble": bubble,
            "tp_comm": layout.micro_batches * tp_comm, "pp_comm": layout.micro_batches * p2p,
            "dp_comm": dp_comm, "optimizer": optimizer,
            "bubble_fraction": bubble_fraction, "pipeline": pipe}


def pipeline_phase(cfg: ModelConfig, layout: Candidate, dev: Device, mfu: Efficiency | None = None,
                   zb_costs: dict | None = None) -> dict:
    """The pipeline phase of a planner Candidate under its schedule (planner/zb.py `pipeline`): each
    stage's compute (3 forwards' FLOPs at the efficiency) split into F, B, W or F, BW by the per-kind
    costs (`zb_costs`; default: those measured on this device type, else the FLOP model's), its
    communication half in F, half in the backward. Without an mfu (memory's default) the order is
    chosen at compute-only proportions."""
    schedule = SCHEDULES[layout.schedule]
    measured, source = (zb_costs, "given") if zb_costs else measured_costs(dev.name, cfg.d_model)
    kind_costs = measured or flop_costs(cfg, layout.src_len, layout.tgt_len)
    seconds = _layer_seconds(cfg, layout, dev, mfu or 1.0)
    tp_comm, p2p = _stage_comm(cfg, layout, dev) if mfu else ([0.0] * layout.pp, 0.0)
    split = schedule.splits_backward
    per_stage = []
    for kinds, comm in zip(stage_kinds(cfg, layout.pp), tp_comm):
        cost = stage_costs(kinds, kind_costs, seconds, bool(layout.checkpoint), split)
        cost["F"] += (comm + p2p) / 2
        cost["B" if split else "BW"] += (comm + p2p) / 2
        per_stage.append(cost)
    return {**pipeline(layout.schedule, layout.pp, layout.micro_batches, per_stage, layout.zb_max_pending),
            "source": source}


@dataclass(frozen=True)
class Plan:
    layout: Candidate
    memory: list[dict]
    time: dict
    target_tokens_per_step: int
    model_flops_per_step: float

    @property
    def peak_bytes(self) -> float:
        return max(m["peak"] for m in self.memory)

    @property
    def tokens_per_s(self) -> float:
        return self.target_tokens_per_step / self.time["total"]

    def mfu(self, dev: Device) -> float:
        return self.model_flops_per_step / self.time["total"] / (dev.peak_tflops[precision_of(self.layout.precision).math] * 1e12
                                                                  * self.layout.world)


def plan(cfg: ModelConfig, layout: Candidate, dev: Device, mfu: Efficiency) -> Plan:
    from model.flops import training_flops

    time = step_time(cfg, layout, dev, mfu)
    stages = [stage_memory(cfg, layout, s, dev, time["pipeline"]) for s in range(layout.pp)]
    pairs = layout.sequences * layout.micro_batches * layout.dp
    return Plan(layout, stages, time, pairs * layout.tgt_len,
                pairs * training_flops(cfg, layout.src_len, layout.tgt_len))




def candidate_layouts(cfg: ModelConfig, gpus: int, dev: Device, *, global_tokens: int, seq_len: int,
                      microbatch_tokens: tuple[int, ...], precision: str, max_tp: int | None = None,
                      schedules: tuple[str, ...] | None = None) -> list[Candidate]:
    """Every pp × tp × dp = gpus with tp inside a node dividing heads, FFN and vocabulary, every
    micro-batch size, and checkpointing off/every layer; pipelined ones under each of `schedules`
    (parallel/schedules.py, all of them when None: those registered now, after import too; one with
    pending bounds under each bound it offers), unpipelined ones under the default. m follows from
    the global batch."""
    schedules = tuple(SCHEDULES) if schedules is None else schedules
    n_layers = cfg.encoder_layers + cfg.decoder_layers + 2
    out = []
    for tp in (1, 2, 4, 8):
        if tp > min(dev.gpus_per_node, max_tp or tp) or gpus % tp or any(x % tp for x in (cfg.heads, cfg.ffn_dim, cfg.vocab_size)):
            continue
        for pp in range(1, min(gpus // tp, n_layers) + 1):
            if (gpus // tp) % pp:
                continue
            dp = gpus // tp // pp
            for tokens in microbatch_tokens:
                sequences = max(1, tokens // seq_len)
                m = max(1, math.ceil(global_tokens / (dp * sequences * seq_len)))
                for ckpt in (0, 1):
                    base = Candidate(pp=pp, tp=tp, dp=dp, micro_batches=m, sequences=sequences, src_len=seq_len,
                                     tgt_len=seq_len, checkpoint=ckpt, precision=precision)
                    for name in (schedules if pp > 1 else (DEFAULT_SCHEDULE,)):
                        out += [dataclasses.replace(base, schedule=name, zb_max_pending=bound)
                                for bound in SCHEDULES[name].pending_bounds or (0,)]
    return out


def search(cfg: ModelConfig, gpus: int, dev: Device, mfu: Efficiency, **kwargs) -> tuple[list[Plan], list[Plan]]:
    """All candidate plans, split into (fitting, sorted fastest first) and (not fitting)."""
    plans = [plan(cfg, layout, dev, mfu) for layout in candidate_layouts(cfg, gpus, dev, **kwargs)]
    # fastest first; of equal speed (GPipe's step is 1F1B's), the one holding less memory
    fits = sorted((p for p in plans if p.peak_bytes <= dev.usable_bytes()),
                  key=lambda p: (-float(f"{p.tokens_per_s:.9g}"), p.peak_bytes))
    return fits, [p for p in plans if p.peak_bytes > dev.usable_bytes()]
