"""Checkpoint averaging: one consolidated model whose weights are the element-wise mean of several
checkpoints' (fairseq's scripts/average_checkpoints.py; NMT practice averages the last few
checkpoints before evaluation). Each checkpoint is consolidated in turn (any pp × tp × dp layout;
checkpoint/checkpoints.py) and added into one fp32 sum, so memory holds two models whatever their
number. Checkpoints of different models (any model key but the dropouts and label smoothing) or
with different SentencePiece models are refused, naming the first difference."""
from __future__ import annotations

import os
import re

import torch

from checkpoint import manifest
from checkpoint.checkpoints import CheckpointError, consolidated_dict
from checkpoint.init_from import open_model_file
from checkpoint.manifest import replacing
from model.config import TRAINING_ONLY
from schema.text import count

_STEP_TAG = re.compile(r"^step(\d+)$")
_UNIVERSAL_TAG = re.compile(r"^universal-step(\d+)$")  # ./run.sh convert reshard's (checkpoint/checkpoints.py)
STATES = "mp_rank_00_model_states.pt"  # what every DeepSpeed checkpoint folder holds (checkpoint/checkpoints.py locate)


def run_checkpoints(ckpt_dir: str) -> list[tuple[int, str]]:
    """(step, tag) of every checkpoint of a run that `./run.sh convert consolidate`, `translate` and
    `train` find, newest first: the committed `stepN` ones, the universal checkpoint of `./run.sh
    convert reshard` (`universal-stepN`, which a resharded run keeps beside its own), and without
    any committed one the tag `latest` names (an older version's checkpoint)."""
    found = {int(tag[4:]): tag for tag in manifest.committed_tags(ckpt_dir)}
    if not found:
        tag = manifest.read_latest(ckpt_dir)[0]
        if tag and _STEP_TAG.match(tag) and os.path.isfile(os.path.join(ckpt_dir, tag, STATES)):
            found[int(tag[4:])] = tag
    try:
        names = os.listdir(ckpt_dir)
    except OSError:
        names = []
    for name in names:
        match = _UNIVERSAL_TAG.match(name)
        if match and os.path.isfile(os.path.join(ckpt_dir, name, STATES)):
            found.setdefault(int(match.group(1)), name)  # a step's own checkpoint wins over its conversion
    return sorted(found.items(), reverse=True)


def select(run_dir: str, last: int | None = None, steps: list[int] | None = None) -> list[str]:
    """The checkpoint folders of a run directory to average (`run_checkpoints`): its `last` newest,
    or those of `steps`; each committed one verified against its manifest."""
    ckpt_dir = os.path.join(run_dir, "checkpoints")
    if not os.path.isdir(ckpt_dir):
        raise CheckpointError(f"{run_dir} is not a run directory (no checkpoints/ in it); name the checkpoints "
                              "or model files to average instead of --last/--steps")
    tags = run_checkpoints(ckpt_dir)  # newest first
    have = ", ".join(tag for _, tag in reversed(tags)) or "none"
    if steps:
        by_step = dict(tags)
        missing = [s for s in steps if s not in by_step]
        if missing:
            raise CheckpointError(f"{run_dir} has no checkpoint of step {', '.join(map(str, missing))} (it has: {have})")
        chosen = [by_step[s] for s in sorted(set(steps))]
    else:
        if last is None or last < 1:
            raise CheckpointError("give --last N (N ≥ 1) or --steps S [S ...]")
        if len(tags) < last:
            raise CheckpointError(f"{run_dir} keeps {count(len(tags), 'checkpoint')} ({have}); --last {last} needs {last}: "
                                  "average fewer, or keep more (train.keep_checkpoints)")
        chosen = [tag for _, tag in reversed(tags[:last])]
    committed = set(manifest.committed_tags(ckpt_dir))  # the others have no manifest to verify against
    for tag in chosen:
        problems = manifest.verify(os.path.join(ckpt_dir, tag)) if tag in committed else []
        if problems:
            raise CheckpointError(f"checkpoint {tag} is damaged: {problems[0]}; leave it out (--steps)")
    return [os.path.join(ckpt_dir, tag) for tag in chosen]


def _package(source: str) -> dict:
    if os.path.isfile(source):
        package = open_model_file(source)
        recorded = package.get("source") or {}
        package["source"] = dict(recorded, checkpoint=recorded.get("checkpoint", source))
        return package
    return consolidated_dict(source)


def _same_model(first: dict, other: dict, names: tuple[str, str]) -> None:
    a, b = first["model_config"], other["model_config"]
    for key in a:
        if key not in TRAINING_ONLY and a[key] != b.get(key):
            raise CheckpointError(f"{names[1]} is another model than {names[0]} (model.{key}: {b.get(key)!r} there, "
                                  f"{a[key]!r} in the first); only checkpoints of one model can be averaged")
    if first["spm_model"] != other["spm_model"]:
        raise CheckpointError(f"{names[1]} has another SentencePiece model (vocabulary) than {names[0]}; its token "
                              "ids mean other pieces: only checkpoints of one vocabulary can be averaged")


def average(sources: list[str], out_path: str) -> dict:
    """Write the consolidated model (atomically) whose weights are the mean of `sources`'
    (checkpoint folders or consolidated model files), summed in fp32; returns its `source` record:
    the newest source's checkpoint and step, and every averaged one."""
    if not sources:
        raise CheckpointError("nothing to average")
    first, total = None, {}
    averaged = []
    for source in sources:
        package = _package(source)
        if first is None:
            first = {key: value for key, value in package.items() if key != "state_dict"}
            total = {name: value.float().clone() for name, value in package["state_dict"].items()}
        else:
            _same_model(first, package, (sources[0], source))
            for name, value in package["state_dict"].items():
                total[name] += value.float()
        averaged.append({"checkpoint": package["source"].get("checkpoint", source),
                         "step": package["source"].get("step")})
        del package
    newest = max(averaged, key=lambda a: a["step"] or 0)
    result = dict(first)
    result["state_dict"] = {name: value / len(sources) for name, value in total.items()}
    result["source"] = dict(first["source"], checkpoint=newest["checkpoint"], step=newest["step"],
                            tag=f"average of {len(sources)}", averaged=averaged)
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    with replacing(out_path) as tmp:
        torch.save(result, tmp)
    return result["source"]
