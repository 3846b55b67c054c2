"""How DeepSpeed's universal checkpoint merges and splits the pipeline's parameters across
tensor-parallel ranks: the `UNIVERSAL_CHECKPOINT_INFO` of deepspeed/checkpoint/constants.py,
derived from parallel/tensor.py's plan.

`deepspeed.checkpoint.ds_to_universal` stores every parameter whole, by name. To merge the
slices of a tensor-parallel checkpoint it matches each name against the info's regex categories,
and it writes into the universal file how the whole tensor is to be cut again (its `cat_dim`, or
the sub-parameters of a fused projection), which the engine's universal load then applies for the
new tensor-parallel degree. Without the info every parameter counts as split along dimension 0:
a row-parallel weight, a fused q/k/v projection and every replicated LayerNorm would be cut
wrongly at another degree, without an error. So every parameter gets its category here:

  replicated (no style, or a style that leaves it whole)  tp_replicated_parameter_patterns
  split along dimension 1 (row-parallel weights)          parameter_with_row_parallelism_patterns
  stacked projections (fused q/k/v, k/v), dimension 0     parameter_with_sub_params (+ widths)
  split along dimension 0 (column, vocabulary, norms)     none: DeepSpeed's default

and the tied embedding, held by the first and the last stage, is read from the first only
(pipeline_replicated_parameter_patterns). Patterns are the pipeline's parameter names with the
plan index generalised (`^\\d+\\.layer\\.ffn\\.fc2\\.weight$`), so there are a few dozen for any
depth. parallel/parallelize.py sets the info on every stage module (DeepSpeed writes a module's
`universal_checkpoint_info` into each checkpoint's model states); checkpoint/to_universal.py
supplies it for checkpoints written before it was set.
"""
from __future__ import annotations

import re
from collections.abc import Iterable

TIED_PREFIX = "tied_modules.embed.embed"
"""The tied embedding's module path in every stage that holds it (parallel/pipeline.py)."""
VERSION = 0.4
"""deepspeed.checkpoint.constants.UNIVERSAL_CHECKPOINT_VERSION_VALUE in 0.19.8: sub-parameters
carry their per-rank widths (`sub_param_shard_widths`)."""


def style_path(name: str) -> tuple[str, str]:
    """(module path the tensor-parallel plan matches, parameter) of a pipeline parameter name: the
    tied embedding is the plain model's `embed`; a layer's modules keep their path below the
    wrapper (`3.layer.self_attn.qkv_proj.weight` → `self_attn.qkv_proj`), which the plan's
    `*`-patterns match as they match the plain model's names."""
    path, _, param = name.rpartition(".")
    if path == TIED_PREFIX or path.startswith(TIED_PREFIX + "."):
        return "embed" + path[len(TIED_PREFIX):], param
    index, _, rest = path.partition(".")
    _, _, rest = rest.partition(".")  # past the wrapper attribute (layer, norm)
    return (rest if index.isdigit() else path), param


def pattern(name: str) -> str:
    """The anchored regex of `name` with its plan index generalised."""
    head, dot, tail = name.partition(".")
    if head.isdigit():
        return r"^\d+\." + re.escape(tail) + "$"
    return "^" + re.escape(name) + "$"


def universal_info(names: Iterable[str], d_model: int, tp: int) -> dict:
    """The universal checkpoint info for the pipeline parameters `names` (of any stages) of a
    model of width `d_model` checkpointed at tensor-parallel degree `tp` (the widths of a fused
    projection's parts, whole: d_model each, `tp` equal slices)."""
    from deepspeed.checkpoint import constants as c

    from parallel.tensor import shard_dim, style_of

    replicated, rows, sub_params, widths = set(), set(), {}, {}
    for name in names:
        path, param = style_path(name)
        dim = shard_dim(f"{path}.{param}")
        key = pattern(name)
        if dim is None:
            replicated.add(key)
        elif dim == 1:
            rows.add(key)
        elif getattr(style_of(path), "parts", 1) > 1:
            parts = style_of(path).parts
            sub_params[key] = {"patterns": [key], "partition_dim": 0,
                               "shape": ((d_model,) * parts, -1) if param == "weight" else ((d_model,) * parts,)}
            widths[key] = [[d_model // tp] * tp for _ in range(parts)]
    return {
        c.UNIVERSAL_CHECKPOINT_VERSION_KEY: VERSION,
        c.PIPELINE_REPLICATED_PARAMETER_PATTERNS: [r"^tied_modules\."],
        c.TP_REPLICATED_PARAMETER_PATTERNS: sorted(replicated),
        c.PARAMETER_WITH_ROW_PARALLELISM_PATTERNS: sorted(rows),
        c.PARAMETER_WITH_SUB_PARAMS: [sub_params[k] for k in sorted(sub_params)],
        c.SUB_PARAM_SHARD_WIDTHS: widths,
    }


def model_names(cfg) -> list[str]:
    """The pipeline parameter names of one layer of every kind of the model `cfg` (all the info's
    patterns need: they generalise the plan index), built on the meta device."""
    import torch

    from model.transformer import build_layer, layer_plan

    names, seen = [], set()
    with torch.random.fork_rng(devices=[]), torch.device("meta"):
        for index, layer in enumerate(layer_plan(cfg)):
            if layer.kind in seen or layer.kind == "output":  # the output layer is the tied embedding
                continue
            seen.add(layer.kind)
            prefix = (TIED_PREFIX if layer.kind == "embed" else
                      f"{index}.norm" if layer.kind.endswith("_norm") else f"{index}.layer")
            names += [f"{prefix}.{name}" for name, _ in build_layer(cfg, layer.kind, layer.index or 0).named_parameters()]
    return names


def module_info(module) -> dict:
    """The info of a built stage: the whole model's (every stage writes the same), at its tp."""
    tp = module.tp.size if getattr(module, "tp", None) is not None else 1
    return universal_info(model_names(module._cfg), module._cfg.d_model, tp)
