"""Counting what predicts a GPU step's host time on any device: kernel launches and host syncs.

A kernel operation is one launch of device work. Counted, with one rule for eager and compiled
code alike:
- every aten operation that reaches the dispatcher (a TorchDispatchMode sees them), except those
  that launch nothing: allocations (`empty`, `empty_strided`, `new_empty*`, `empty_like`) and
  operations that write nothing in place and return only tensors sharing storage with an input
  (view, t, transpose, expand, detach, alias, _unsafe_view, …; checked on the returned tensors);
- every launch of a kernel inductor generated (`cpp_fused_*` on CPUs, `triton_*` on GPUs), which
  never reaches the dispatcher: each one in the modules inductor has loaded is wrapped to count.
Compiled code's vendor calls (matrix products, SDPA, the dropout seed) are aten operations and
count by the first rule. `dispatched` counts every operation that is not a view by its schema,
with no other exception: what a plain dispatch-mode count gives.

A host sync is either of two things, each of which makes the host wait for the device on a GPU:
- a read of a tensor's value on the host (`.item()`, `bool()`, `nonzero`, … as dispatched, and
  `.tolist()`, which reads without a dispatch on a CPU);
- a blocking copy from host memory to the device: a tensor made on the device from host values
  (`torch.tensor`, `torch.as_tensor` or `torch.asarray` of Python numbers, lists or arrays with a
  `device=` of the accelerator; `Tensor.new_tensor` on a device tensor), or a host tensor moved to the
  device by `.to`, `copy_` or the GPU method without `non_blocking=True` (from pinned memory,
  non-blocking, the copy queues behind the device's work instead). On a GPU CUDA copies such
  data from pageable memory and waits for the stream (CUDA's sync debug mode flags it).
  On a CPU the same rule counts what the GPU's path would copy: a `device=` naming the
  accelerator, or a move of a tensor made on the host (`torch.tensor`, `as_tensor`, `asarray`,
  `from_numpy` without a device, or pinned) without `non_blocking`; the host is the accelerator
  there, so no copy happens, but the count is the GPU's.
Making a tensor on the device from a constant (`torch.full`, `zeros`, `ones`) launches a fill
kernel with the value as its argument: no copy, no sync. On GPUs the sync debug mode
(runtime/accelerator.py `warn_on_sync`) sees every kind, copies to pageable host memory too.
"""
from __future__ import annotations

import collections
import contextlib
import sys

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

ALLOCATIONS = {"empty.memory_format", "empty_strided.default", "new_empty.default", "new_empty_strided.default",
               "empty_like.default"}
HOST_READS = {"_local_scalar_dense.default", "is_nonzero.default", "equal.default", "nonzero.default",
              "masked_select.default", "_unique2.default", "unique_dim.default", "allclose.default",
              "item.default"}


# Where a step's operations come from, by the code that issues them (`KernelCounter(classify=True)`):
#   model       forward under model/ or the pipeline's layers, and every backward node but AccumulateGrad
#   accumulate  AccumulateGrad's own work (adding a new gradient into an existing `.grad`)
#   optimizer   the optimizer, its clipping and the gradient reduction
#   engine      the rest (the pipeline engine's buffers, loss aggregation, point-to-point transfers)
# "Beyond the model" is accumulate + optimizer + engine.
OPTIMIZER_FILES = ("parallel/optimizer.py", "deepspeed/runtime/bf16_optimizer.py",
                   "deepspeed/runtime/utils.py", "deepspeed/runtime/zero/", "deepspeed/runtime/fp16/", "torch/optim/",
                   "torch/_utils.py")
REDUCTION_FUNCTIONS = ("allreduce_gradients", "_bf16_reduce_grads", "_exec_reduce_grads", "buffered_allreduce_fallback")
MODEL_FILES = ("/model/", "parallel/pipeline.py", "parallel/tensor.py", "parallel/weight_split.py", "parallel/loss.py")


def classify() -> str:
    """The class (above) of the operation being dispatched, from the autograd node and the Python
    frames that issued it."""
    node = torch._C._current_autograd_node()
    if node is not None and "AccumulateGrad" in node.name():
        return "accumulate"
    frame = sys._getframe(2)
    while frame is not None:  # the innermost frame of either kind decides
        name = frame.f_code.co_filename
        if any(k in name for k in OPTIMIZER_FILES) or frame.f_code.co_name in REDUCTION_FUNCTIONS:
            return "optimizer"
        if any(k in name for k in MODEL_FILES):
            return "model"
        frame = frame.f_back
    return "model" if node is not None else "engine"


def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _tensors(y)


def _writes(func) -> bool:
    return any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments)


def _schema_view(func) -> bool:
    returns = func._schema.returns
    return bool(returns) and returns[0].alias_info is not None and not returns[0].alias_info.is_write


class KernelCounter(TorchDispatchMode):
    """`with KernelCounter() as k:` … → k.kernels, k.dispatched, k.syncs, k.by_op (see module doc).

    Compiled code runs compiled inside it (`ignore_compile_internals`: the mode is off while
    Dynamo compiles and on while the compiled code runs, so its vendor calls are seen)."""

    _active: list["KernelCounter"] = []

    def __init__(self, classify: bool = False):
        super().__init__()
        self.kernels = self.dispatched = self.syncs = self.generated = 0
        self.host_copies = 0
        """Of `syncs`, the blocking copies from host memory to the device (module docstring)."""
        self.by_op: collections.Counter = collections.Counter()
        self.classify = classify
        self.by_class: collections.Counter = collections.Counter()
        """Kernels by where they come from (`classify`), with `classify=True`."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __enter__(self):
        _wrap_generated()
        KernelCounter._active.append(self)
        if len(KernelCounter._active) == 1:
            _host_syncs.install()
        return super().__enter__()

    def __exit__(self, *exc):
        KernelCounter._active.remove(self)
        if not KernelCounter._active:
            _host_syncs.remove()
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = f"{func.overloadpacket.__name__}.{func._overloadname}"
        if not _schema_view(func):
            self.dispatched += 1
        if name in HOST_READS:
            self.syncs += 1
        if self._launches(func, name, args, kwargs, out):
            self.kernels += 1
            if self.classify:
                kind = classify()
                self.by_class[kind] += 1
                self.by_op[f"{kind}:{func.overloadpacket.__name__}"] += 1
            else:
                self.by_op[func.overloadpacket.__name__] += 1
        return out

    def beyond_model(self) -> dict:
        """With `classify=True`: the kernels beyond the model (and each class, and the operations)."""
        return {"total": self.kernels, "beyond_model": self.kernels - self.by_class["model"],
                **{k: self.by_class[k] for k in ("model", "accumulate", "optimizer", "engine")},
                "beyond_model_ops": {op: n for op, n in self.by_op.most_common() if not op.startswith("model:")}}

    @staticmethod
    def _launches(func, name: str, args, kwargs, out) -> bool:
        if name in ALLOCATIONS:
            return False
        outs = list(_tensors(out))
        if not outs:  # in-place operations returning nothing (_foreach_*_, _fused_adamw_) and reads
            return _writes(func) or name in HOST_READS
        if _writes(func):
            return True
        inputs = {t.untyped_storage().data_ptr() for t in _tensors((args, kwargs))}
        return not all(o.untyped_storage().data_ptr() in inputs for o in outs)

    def generated_launch(self, name: str) -> None:
        self.kernels += 1
        self.generated += 1
        self.by_op["(generated)"] += 1


def _count_sync(copy: bool = False) -> None:
    for counter in KernelCounter._active:
        counter.syncs += 1
        counter.host_copies += copy


class _HostSyncs:
    """What reads or copies outside the dispatcher, counted while a KernelCounter is active: the
    functions below are replaced on torch while any counter is active (module docstring's rule)."""

    FACTORIES = ("tensor", "as_tensor", "asarray")

    def __init__(self):
        self.saved: dict = {}
        self.host_made = None  # tensors made on the host from host data, by id (weakly)

    @staticmethod
    def _on_host() -> bool:
        from runtime import accelerator

        return accelerator.on_host()

    def _accelerator(self, device) -> bool:
        """Whether a device argument names the accelerator's device (on the host: any device)."""
        if device is None:
            return False
        from runtime.accelerator import HOST

        return self.host or torch.device(device).type != HOST

    def _from_host(self, tensor) -> bool:
        """Whether `tensor` lives in host memory on the GPU's path."""
        if not isinstance(tensor, torch.Tensor):
            return False
        from runtime.accelerator import HOST

        return tensor in self.host_made if self.host else tensor.device.type == HOST

    def _made(self, out, device) -> None:
        if device is None and isinstance(out, torch.Tensor):
            self.host_made[out] = True

    def install(self) -> None:
        from torch.utils.weak import WeakIdKeyDictionary

        from runtime.accelerator import GPU

        self.host, self.host_made = self._on_host(), WeakIdKeyDictionary()
        for name in (*self.FACTORIES, "from_numpy"):
            self.saved[(torch, name)] = getattr(torch, name)
        for name in ("tolist", "to", "copy_", "new_tensor", "pin_memory", GPU):
            self.saved[(torch.Tensor, name)] = getattr(torch.Tensor, name)
        saved = {name: fn for (_, name), fn in self.saved.items()}

        def factory(name):
            def make(data, *args, **kwargs):
                device = kwargs.get("device")
                if self._accelerator(device) and (not isinstance(data, torch.Tensor) or self._from_host(data)):
                    _count_sync(copy=True)
                out = saved[name](data, *args, **kwargs)
                self._made(out, device)
                return out
            return make

        def from_numpy(array):
            out = saved["from_numpy"](array)
            self._made(out, None)
            return out

        def tolist(tensor, *args, **kwargs):  # reads the values without a dispatch on a CPU
            _count_sync()
            return saved["tolist"](tensor, *args, **kwargs)

        def to(tensor, *args, **kwargs):
            parsed = {k: v for k, v in kwargs.items() if k != "copy"}  # _parse_to takes no copy=
            device, _, non_blocking, _ = torch._C._nn._parse_to(*args, **parsed)
            self._move(tensor, device, non_blocking)
            return saved["to"](tensor, *args, **kwargs)

        def copy_(tensor, src, non_blocking=False):
            self._move(src, tensor.device if not self.host or tensor not in self.host_made else None, non_blocking)
            return saved["copy_"](tensor, src, non_blocking)

        def new_tensor(tensor, data, *args, **kwargs):
            if not self._from_host(tensor) and kwargs.get("device") is None:
                _count_sync(copy=True)
            return saved["new_tensor"](tensor, data, *args, **kwargs)

        def pin_memory(tensor, *args, **kwargs):
            out = saved["pin_memory"](tensor, *args, **kwargs)
            self.host_made[out] = True
            return out

        def gpu(tensor, device=None, non_blocking=False, **kwargs):
            self._move(tensor, device if device is not None else GPU, non_blocking)
            return saved[GPU](tensor, device, non_blocking, **kwargs)

        for name in self.FACTORIES:
            setattr(torch, name, factory(name))
        torch.from_numpy = from_numpy
        for name, fn in (("tolist", tolist), ("to", to), ("copy_", copy_), ("new_tensor", new_tensor),
                         ("pin_memory", pin_memory), (GPU, gpu)):
            setattr(torch.Tensor, name, fn)

    def _move(self, tensor, device, non_blocking: bool) -> None:
        if not non_blocking and self._accelerator(device) and self._from_host(tensor):
            _count_sync(copy=True)

    def remove(self) -> None:
        for (owner, name), fn in self.saved.items():
            setattr(owner, name, fn)
        self.saved.clear()
        self.host_made = None


_host_syncs = _HostSyncs()


def _count_generated(name: str) -> None:
    for counter in KernelCounter._active:
        counter.generated_launch(name)


def _wrap_generated() -> None:
    """Wrap every generated kernel of the modules inductor has loaded (once each)."""
    from torch._inductor.codecache import PyCodeCache

    modules = list(PyCodeCache.modules) + list(getattr(PyCodeCache, "modules_no_attr", {}).values())
    for module in modules:
        for name in list(vars(module)):
            if not name.startswith(("cpp_fused", "triton_", "cpp_kernel")):
                continue
            kernel = getattr(module, name)
            if getattr(kernel, "_deepnet_counted", False):
                continue
            if name.startswith("triton_") and hasattr(kernel, "run"):
                run = kernel.run

                def counted_run(*a, _run=run, _name=name, **k):
                    _count_generated(_name)
                    return _run(*a, **k)

                kernel.run = counted_run
                kernel._deepnet_counted = True
            elif callable(kernel):
                def counted(*a, _kernel=kernel, _name=name, **k):
                    _count_generated(_name)
                    return _kernel(*a, **k)

                counted._deepnet_counted = True
                setattr(module, name, counted)


@contextlib.contextmanager
def fused_dropout():
    """Dropout as on a GPU: torch's fused `native_dropout` (one kernel forward, one backward),
    which torch takes only for CUDA tensors; on a CPU F.dropout otherwise draws, divides and
    multiplies in separate kernels. For counting the GPU's path on a CPU."""
    original = F.dropout

    def dropout(input, p=0.5, training=True, inplace=False):
        if not training or p == 0.0:
            return input
        return torch.native_dropout(input, p, True)[0]

    F.dropout = dropout
    try:
        yield
    finally:
        F.dropout = original
