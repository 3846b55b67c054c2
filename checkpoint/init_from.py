"""A run that starts from another run's weights (`train.init_from`): weights only, any layout.

The source is a run directory (its newest intact checkpoint), one checkpoint folder, or a
consolidated model file (`./run.sh convert consolidate|average`), trained at any pp × tp × dp. A
run that has no checkpoint of its own yet loads it into every rank's plain stage before
parallelism is applied (parallel/parallelize.py `build_engine`): tensor parallelism then shards
the loaded weights, the tied output layer is the loaded embedding, and the optimizer's fp32 master
weights are made from them, while Adam's moments, the learning-rate schedule, the step and the
data position start fresh. Each rank reads only its stage's tensors: the per-layer files of its
plan layers (merged over tensor-parallel shards), or its tensors of a memory-mapped model file (a
universal checkpoint, made by `convert reshard`, is read whole). A
run that resumes its own checkpoint never reads the source again.

The source's model must have this run's parameter names and shapes, and compute the same
function with them (`compare`); dropouts and label smoothing may differ.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from checkpoint import manifest
from checkpoint.checkpoints import (
    CONSOLIDATED_FORMAT,
    MODEL_EXPECTED,
    CheckpointError,
    checkpoint_meta,
    load_file,
    locate,
    model_config,
    pipeline_state,
)
from model.config import ModelConfig
from model.transformer import EncoderDecoder
from parallel.pipeline import plain_name
from schema.fields import PATH_RULE

FUNCTION_KEYS = ("norm", "activation", "heads", "layernorm_eps")
"""Model keys under which the same weights compute another function."""
SHAPE_KEYS = ("encoder_layers", "decoder_layers", "d_model", "ffn_dim", "vocab_size", "norm")
"""Model keys the parameters' names and shapes follow from."""


@dataclass
class Source:
    given: str
    """train.init_from as the config names it."""
    path: str
    """The checkpoint folder or model file read."""
    model: ModelConfig
    step: int

    def record(self) -> dict:
        """Where a run started from, as config.json's key, summary.json and checkpoints record it."""
        return {"init_from": self.given, "checkpoint": self.path, "step": self.step}


def open_model_file(path: str) -> dict:
    """A consolidated model file, memory-mapped (its tensors are read when touched)."""
    package = load_file(path, MODEL_EXPECTED, mmap=True)
    if not isinstance(package, dict) or package.get("format") != CONSOLIDATED_FORMAT:
        raise CheckpointError(f"{path}: not a consolidated model file; make one with ./run.sh convert "
                              "consolidate (or average) RUN_DIR")
    return package


def _is_checkpoint(path: str) -> bool:
    return (os.path.exists(os.path.join(path, "mp_rank_00_model_states.pt"))
            or os.path.isdir(os.path.join(path, "zero")))


def resolve(given: str, verify: bool = False, log=print) -> Source:
    """The source `given` names. A run directory gives its newest committed checkpoint, or with
    `verify` (a collective call on the ranks) its newest one whose files match their manifest,
    saying which ones it passed over."""
    path = os.path.abspath(given)
    if os.path.isfile(path):
        package = open_model_file(path)
        return Source(given, path, model_config(package["model_config"], path),
                      int((package.get("source") or {}).get("step") or 0))
    if not os.path.isdir(path):
        raise CheckpointError(f"{given}: no such run directory, checkpoint folder or model file ({PATH_RULE})")
    tag_dir = path if _is_checkpoint(path) else None
    if tag_dir is None:
        ckpt_dir = path if os.path.basename(path) == "checkpoints" else os.path.join(path, "checkpoints")
        tags = manifest.committed_tags(ckpt_dir)
        for tag in tags:
            problems = manifest.verify(os.path.join(ckpt_dir, tag)) if verify else []
            if not problems:
                tag_dir = os.path.join(ckpt_dir, tag)
                break
            log(f"train.init_from: checkpoint {tag} of {given} is damaged ({problems[0]}); trying an older one")
        if tag_dir is None and tags:
            raise CheckpointError(f"{given}: no intact checkpoint in {ckpt_dir} (checked: {', '.join(tags)})")
        if tag_dir is None:
            tag_dir = locate(path)[1]  # a universal checkpoint (./run.sh convert reshard), or says none
    meta = checkpoint_meta(tag_dir)
    return Source(given, tag_dir, model_config(meta["config"]["model"], tag_dir),
                  int(meta.get("step", meta.get("global_steps", 0))))


def _shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):  # shapes without memory or initialisation work
        return {name: tuple(value.shape) for name, value in EncoderDecoder(cfg).state_dict().items()}


def compare(source: ModelConfig, target: ModelConfig) -> str | None:
    """Why weights of the model `source` cannot start the model `target` (None: they can): the
    first differing parameter and both shapes, or a key under which they compute another function."""
    for key in FUNCTION_KEYS:
        there, here = getattr(source, key), getattr(target, key)
        if there != here:
            return f"model.{key} is {there!r} there and {here!r} here: the same weights would compute another function"
    differing = [k for k in SHAPE_KEYS if getattr(source, k) != getattr(target, k)]
    if not differing:
        return None
    hint = " (" + "; ".join(f"model.{k}: {getattr(source, k)} there, {getattr(target, k)} here" for k in differing) + ")"
    theirs, ours = _shapes(source), _shapes(target)
    for name, shape in ours.items():
        if name not in theirs:
            return f"this model's {name} {list(shape)} is not in the source{hint}"
        if theirs[name] != shape:
            return f"{name} is {list(theirs[name])} there and {list(shape)} here{hint}"
    extra = next(name for name in theirs if name not in ours)
    return f"the source's {extra} {list(theirs[extra])} has no place in this model{hint}"


def read_tensors(source: Source, wanted: set[str]) -> dict[str, torch.Tensor]:
    """The plain-named tensors `wanted` of the source (those it has)."""
    if os.path.isfile(source.path):
        state = open_model_file(source.path)["state_dict"]
        return {name: state[name] for name in wanted if name in state}
    return pipeline_state(source.path, source.model, wanted)


def load_into(stage: torch.nn.Module, source: Source) -> None:
    """Copy the source's weights into this rank's plain pipeline stage (before parallelism)."""
    names = {key: plain_name(stage._plan, key) for key in stage.state_dict()}  # a plain stage: every key has one
    tensors = read_tensors(source, set(names.values()))
    missing = sorted(name for name in names.values() if name not in tensors)
    if missing:
        raise CheckpointError(f"{source.path} has no weight {missing[0]} (and {len(missing) - 1} more missing)")
    stage.load_state_dict({key: tensors[name] for key, name in names.items()}, strict=True)


def agreed_source(given: str, target: ModelConfig, log=print) -> Source:
    """On every rank (collective): the source, its intact checkpoint found by verifying hashes, and
    its model checked against this run's (`target`, vocabulary resolved)."""
    source = resolve(given, verify=True, log=log)
    problem = compare(source.model, target)
    if problem:
        raise CheckpointError(f"{source.path}: {problem}")
    return source
