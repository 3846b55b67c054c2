"""Regional compilation: every encoder and decoder layer of a stage compiled by torch.compile
(inductor), once per layer kind for all shapes.

On GPUs a training step is bound by the host: each eager layer issues dozens of small kernels
(dropout, α·x, add and LayerNorm of every residual are four; the FFN's activation another), each
launched from Python. Compiled, each residual's dropout + α·x + add + LayerNorm is one generated
kernel, the projections stay vendor GEMMs and attention torch's SDPA; `./run.sh bench ops` counts
them (docs/benchmarks.md).

How it is compiled, and why:
- per layer (`nn.Module.compile`, which keeps the state dict's names), not the whole stage: the
  layers of a kind share one code object, so 100 decoder layers cost one compilation, and a stage
  boundary or the pipeline engine never sits inside a graph;
- `dynamic=True`: batch size and both lengths are symbolic from the first call, so varying
  micro-batch shapes reuse one graph per kind (training) and one more for evaluation (`training`
  is guarded). Two settings keep it that way: floats such as α, dropout p and ε stay constants
  (`specialize_float`: unspecialised they become 0-d tensor inputs, read back with `.item()`), and
  equal source and target lengths in a first batch do not tie the two sizes (`use_duck_shape`).
  A micro-batch of one sentence would specialise the batch size to 1 (a graph more per kind): such
  micro-batches run the layers eagerly instead (`run_layer`);
- each kind gets its own inductor backend, which counts the graphs it compiles and how long they
  took (`stats`): `./run.sh bench ops` and the trainer's start-up line read them.

Dropout inside a compiled layer draws one seed per graph from torch's default generator, which
activation checkpointing saves and restores, so recomputation draws the same masks; the masks
differ from eager ones (same distribution). Checkpoints are the same whether layers were compiled
or not.
"""
from __future__ import annotations

import time
from collections import defaultdict

import torch
from torch import nn

from model.layers import DecoderLayer, EncoderLayer

KINDS = {EncoderLayer: "encoder", DecoderLayer: "decoder"}

stats: dict[str, dict[str, float]] = defaultdict(lambda: {"graphs": 0, "seconds": 0.0})
"""Per layer kind: graphs compiled in this process and the seconds spent compiling them."""

_backends: dict[str, object] = {}


def _backend(kind: str):
    """Inductor, counting what it compiles for `kind` (one object per kind: every layer of the kind
    shares the compiled graphs)."""
    if kind not in _backends:
        from torch._inductor.compile_fx import compile_fx

        def backend(graph, example_inputs):
            start = time.perf_counter()
            compiled = compile_fx(graph, example_inputs)
            stats[kind]["graphs"] += 1
            stats[kind]["seconds"] += time.perf_counter() - start
            return compiled

        _backends[kind] = backend
    return _backends[kind]


def compile_enabled(setting: str | bool) -> bool:
    """train.compile: true | false | auto (true where a GPU runs the layers)."""
    if setting == "auto":
        from runtime import accelerator

        return not accelerator.on_host()
    return bool(setting)


def configure() -> None:
    """Dynamo settings for one graph per layer kind over all shapes (see the module docstring)."""
    torch._dynamo.config.specialize_float = True
    torch.fx.experimental._config.use_duck_shape = False


def compile_layers(module: nn.Module) -> dict[str, int]:
    """Compile every encoder and decoder layer of `module` in place; layers per kind."""
    configure()
    counts: dict[str, int] = defaultdict(int)
    for sub in module.modules():
        kind = KINDS.get(type(sub))
        if kind is not None:
            sub.compile(dynamic=True, backend=_backend(kind))
            counts[kind] += 1
    return dict(counts)


def run_layer(layer: nn.Module, x: torch.Tensor, *args):
    """`layer(x, *args)`; eagerly for a batch of one (a compiled layer would specialise to it)."""
    if x.size(0) == 1 and getattr(layer, "_compiled_call_impl", None) is not None:
        with torch.compiler.set_stance("force_eager"):
            return layer(x, *args)
    return layer(x, *args)


def summary() -> str:
    """One line: graphs and compile seconds per layer kind so far."""
    if not stats:
        return "no layer compiled yet"
    return ", ".join(f"{kind} {int(s['graphs'])} graph{'s' * (s['graphs'] != 1)} in {s['seconds']:.1f} s"
                     for kind, s in sorted(stats.items()))
