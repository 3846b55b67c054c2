"""Kernel operations per training step, the model's and the engine's (everything else).

On a GPU the trainer's step is host-bound: each operation the engine dispatches costs a launch
whatever its size, so the number of operations beyond the model is what the engine adds to a
step. `OpCounter` (a TorchDispatchMode) counts every aten operation dispatched while it is active
except views (an operation whose first output aliases an input without writing it: view, t,
expand, narrow, detach, ...), which launch nothing. Each is put in one class:

  model       forward under model/ or the pipeline's layers (parallel/pipeline.py, tensor.py,
              weight_split.py), and every backward node but AccumulateGrad
  accumulate  AccumulateGrad's own work (adding a new gradient into an existing `.grad`, or copying
              it when it cannot take it as it is)
  optimizer   under the optimizer, its clipping and the gradient reduction (parallel/optimizer.py,
              ds_engine.py, DeepSpeed's runtime/bf16_optimizer.py, runtime/utils.py, zero/, fp16/,
              torch/optim)
  engine      the rest (the pipeline engine's buffers, loss aggregation, point-to-point transfers)

"beyond the model" = accumulate + optimizer + engine. `engine_ops_per_step` measures it for a run
config in one process; docs/pipeline.md has the numbers.
"""
from __future__ import annotations

import collections
import copy
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

OPTIMIZER_FILES = ("parallel/optimizer.py", "parallel/ds_engine.py", "deepspeed/runtime/bf16_optimizer.py",
                   "deepspeed/runtime/utils.py", "deepspeed/runtime/zero/", "deepspeed/runtime/fp16/", "torch/optim/",
                   "torch/_utils.py")
REDUCTION_FUNCTIONS = ("allreduce_gradients", "_bf16_reduce_grads", "_exec_reduce_grads", "buffered_allreduce_fallback")
MODEL_FILES = ("/model/", "parallel/pipeline.py", "parallel/tensor.py", "parallel/weight_split.py")


def is_view(func) -> bool:
    returns = func._schema.returns
    if not returns:
        return False
    alias = returns[0].alias_info
    return alias is not None and not alias.is_write


class OpCounter(TorchDispatchMode):
    """Counts the operations dispatched inside `with OpCounter() as c:` by class (module doc)."""

    def __init__(self):
        super().__init__()
        self.by_class: collections.Counter = collections.Counter()
        self.by_op: collections.Counter = collections.Counter()

    def _classify(self) -> str:
        node = torch._C._current_autograd_node()
        if node is not None and "AccumulateGrad" in node.name():
            return "accumulate"
        frame, model = sys._getframe(2), False
        while frame is not None:
            name = frame.f_code.co_filename
            if any(k in name for k in OPTIMIZER_FILES) or frame.f_code.co_name in REDUCTION_FUNCTIONS:
                return "optimizer"
            model = model or any(k in name for k in MODEL_FILES)
            frame = frame.f_back
        return "model" if model or node is not None else "engine"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not is_view(func):
            kind = self._classify()
            self.by_class[kind] += 1
            self.by_op[(kind, func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))

    def summary(self) -> dict:
        total = sum(self.by_class.values())
        return {"total": total, "beyond_model": total - self.by_class["model"],
                **{k: self.by_class[k] for k in ("model", "accumulate", "optimizer", "engine")},
                "beyond_model_ops": {f"{kind}:{op}": n for (kind, op), n in self.by_op.most_common() if kind != "model"}}


def count_step(trainer) -> dict:
    """`OpCounter.summary()` of one `trainer.train_step()` on this rank."""
    with OpCounter() as counter:
        trainer.train_step()
    return counter.summary()


def engine_ops_per_step(cfg, precision: str, data_dir: str, run_dir: str, step: int = 3,
                        flat_optimizer: bool = True) -> dict:
    """Operations of training step `step` (the earlier ones warm up: the optimizer's state is made
    in the first) for run config `cfg` in `precision`, in this process (call
    parallel.engine.setup_distributed() first; pp = dp = tp = 1). `flat_optimizer=False` measures
    DeepSpeed's own optimizers instead. `run_dir` is emptied and holds a link to `data_dir`."""
    import os
    import shutil

    from parallel.optimizer import FlatOptimizer
    from trainer.trainer import Trainer

    cfg = copy.deepcopy(cfg)
    cfg.parallel.precision = precision
    cfg.run_dir = run_dir
    shutil.rmtree(run_dir, ignore_errors=True)
    os.makedirs(os.path.join(run_dir, "checkpoints"))
    os.symlink(os.path.abspath(data_dir), os.path.join(run_dir, "data"))
    enabled, FlatOptimizer.enabled = FlatOptimizer.enabled, flat_optimizer
    try:
        trainer = Trainer(cfg, max_steps=step)
    finally:
        FlatOptimizer.enabled = enabled
    for _ in range(step - 1):
        trainer.train_step()
    out = count_step(trainer)
    out["optimizer_class"] = type(trainer.engine.optimizer).__name__
    out["tensors"] = sum(1 for p in trainer.module.parameters() if p.requires_grad)
    out["micro_batches"] = cfg.train.micro_batches
    return out
