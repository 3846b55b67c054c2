"""What a run directory holds besides checkpoints and metrics, read by the ranks and by the
commands that start them: the config the run was trained with (config.json, or the copy in every
checkpoint's manifest), and the markers that tell a rerun or a SLURM job script why the last launch
ended (preempted.json: requeue and resume; stopped.json: a stop a rerun would meet again)."""
from __future__ import annotations

import dataclasses
import json
import os

from model.config import ModelConfig
from trainer.config import ConfigError

PREEMPTED_MARKER = "preempted.json"  # every rank checkpointed on a signal; the job requeues itself
STOPPED_MARKER = "stopped.json"  # a stop that would recur (divergence, no room); the job is not requeued

# Keys a resumed run may not change: the checkpoint's tensors and their partition depend on them.
# Activation checkpointing, precision and everything in train/data may change between launches.
FIXED_ON_RESUME = ([("model", f.name) for f in dataclasses.fields(ModelConfig) if f.name != "vocab_size"]
                   + [("parallel", key) for key in ("pipeline_stages", "tensor_parallel", "data_parallel",
                                                     "zero_stage", "partition_method")])


def resume_differences(saved: dict, now: dict) -> list[str]:
    """`section.key: old → new` for every key of FIXED_ON_RESUME that differs."""
    return [f"{section}.{key}: {saved.get(section, {}).get(key)!r} → {now[section][key]!r}"
            for section, key in FIXED_ON_RESUME if saved.get(section, {}).get(key) != now[section][key]]


def saved_run_config(run_dir: str, log=print, restore: bool = True) -> dict | None:
    """The config a run's checkpoints were trained with: run_dir/config.json, or, when that file is
    missing or damaged, the copy every checkpoint's manifest holds (parallel/manifest.py), taken
    from the newest committed checkpoint that has one and (`restore`: only where the run lock is
    held) written back to config.json; one line says so. None for a run without either (a new run)."""
    from parallel import manifest

    saved_path = os.path.join(run_dir, "config.json")
    damage = None
    if os.path.isfile(saved_path):
        try:
            with open(saved_path, encoding="utf-8") as f:
                saved = json.load(f)
            if not isinstance(saved, dict):
                raise ValueError("not a JSON object")
            return saved
        except (ValueError, OSError) as e:
            damage = str(e)
    ckpt_dir = os.path.join(run_dir, "checkpoints")
    for tag in manifest.committed_tags(ckpt_dir):
        recorded = (manifest.read(os.path.join(ckpt_dir, tag)) or {}).get("config")
        if isinstance(recorded, dict):
            what = f"{saved_path} is {'damaged (' + damage + ')' if damage else 'missing'}"
            if not restore:
                log(f"{what}: using the config recorded in the manifest of checkpoint {tag}")
                return recorded
            try:
                manifest.write_atomic(saved_path, json.dumps(recorded, indent=2))
                log(f"{what}: restored from the manifest of checkpoint {tag}")
            except OSError as e:  # e.g. the full disk that damaged it: the recorded copy still serves
                log(f"{what}: using the config recorded in the manifest of checkpoint {tag} (could not write "
                    f"it back: {e.strerror or e})")
            return recorded
    if damage:
        raise ConfigError(f"{saved_path} is damaged ({damage}) and no checkpoint's manifest holds the config; "
                          "restore the file, or use a new run_dir")
    return None


def record_stop(run_dir: str, message: str, code: int) -> None:
    """run_dir/stopped.json: why the run stopped in a way a requeue would meet again, and the exit
    code; a SLURM job then ends with that code instead of requeueing itself (launcher/slurm.py;
    srun may report the ranks it killed instead). Best effort: the disk may be full."""
    from parallel import manifest

    try:
        manifest.write_atomic(os.path.join(run_dir, STOPPED_MARKER),
                              json.dumps({"code": code, "reason": message}) + "\n")
    except OSError:
        pass
