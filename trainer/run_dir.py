"""What a run directory holds besides checkpoints and metrics, read by the ranks and by the
commands that start them: the config the run was trained with (config.json, or the copy in every
checkpoint's manifest), and the markers that tell a rerun or a SLURM job script why the last launch
ended (preempted.json: requeue and resume; stopped.json: a stop a rerun would meet again)."""
from __future__ import annotations

import dataclasses
import json
import os

from model.config import TRAINING_ONLY, ModelConfig
from trainer.config import ConfigError

PREEMPTED_MARKER = "preempted.json"  # every rank checkpointed on a signal; the job requeues itself
STOPPED_MARKER = "stopped.json"  # a stop that would recur (divergence, no room); the job is not requeued

# ---- what a resumed run may change --------------------------------------------------------------
# Every key of a run config has one rule for a launch that resumes a run directory (a test checks
# that every key has one, and for every honoured key that a resumed run uses the new value):
FIXED = "fixed"  # refused before any rank starts, naming the key: the checkpoint's tensors, their
#                  partition over the ranks, or the streams seeded from it depend on the value
PREPARED = "prepared"  # refused while run_dir/data was prepared with another value: preparing again
#                        would give the checkpoints another tokenizer (launcher/preflight.py)
HONOURED = "honoured"  # the resumed run uses the new value (the optimizer's settings too, which
#                        the checkpoint restores and trainer/checkpointer.py sets again)
RESHARDED = "resharded"  # the layout: the newest checkpoint, written at another one, is converted
#                          before the ranks start and resumed at the new one (checkpoint/elastic.py)
NOT_A_SETTING = "not a setting"  # run_dir names the run itself; clusters is read by ./run.sh slurm only

_HONOURED_DATA = ("max_tokens", "sampling_temperature", "workers", "directions")
_FIXED_PARALLEL = ("zero_stage", "partition_method")
_RESHARDED_PARALLEL = ("pipeline_stages", "tensor_parallel", "data_parallel")  # checkpoint/elastic.py LAYOUT_KEYS


def _resume_rules() -> dict[str, str]:
    from data.config import DataConfig
    from parallel.config import ParallelConfig
    from trainer.train_config import TrainConfig

    rules = {"run_dir": NOT_A_SETTING, "clusters": NOT_A_SETTING}
    for f in dataclasses.fields(ModelConfig):
        rules[f"model.{f.name}"] = HONOURED if f.name in TRAINING_ONLY else FIXED
    for f in dataclasses.fields(DataConfig):
        rules[f"data.{f.name}"] = HONOURED if f.name in _HONOURED_DATA else PREPARED
    for f in dataclasses.fields(ParallelConfig):
        rules[f"parallel.{f.name}"] = (FIXED if f.name in _FIXED_PARALLEL else
                                       RESHARDED if f.name in _RESHARDED_PARALLEL else HONOURED)
    for f in dataclasses.fields(TrainConfig):
        # seed: the weights' initialisation and every rank's RNG streams were seeded from it; a
        # resumed run continues those streams from the checkpoint, so a new seed could not take
        # effect. init_from: the weights a run started from; a resumed run has its own
        rules[f"train.{f.name}"] = FIXED if f.name in ("seed", "init_from") else HONOURED
    return rules


RESUME_RULES = _resume_rules()
FIXED_ON_RESUME = [tuple(key.split(".")) for key, rule in RESUME_RULES.items() if rule == FIXED]


def resume_differences(saved: dict, now: dict) -> list[str]:
    """`section.key: old → new` for every key of FIXED_ON_RESUME that differs. model.vocab_size 0
    means "the data's", which the recorded value is (the data's own keys are fixed)."""
    def differs(section: str, key: str) -> bool:
        old, new = recorded(saved, section, key), now[section][key]
        return old != new and not (section == "model" and key == "vocab_size" and new == 0)

    return [f"{section}.{key}: {recorded(saved, section, key)!r} → {now[section][key]!r}"
            for section, key in FIXED_ON_RESUME if differs(section, key)]


def refusal_hint(differences: list[str], run_dir: str) -> str:
    """What a user can do about a resume refused for `differences` (resume_differences' lines)."""
    return (f"use a new run_dir (train.init_from={run_dir} starts it from this run's weights where the model's "
            "shapes allow)")


def recorded(saved: dict, section: str, key: str):
    """The recorded value of `section.key`; for a key added since the record was written, its
    default (what the run had then)."""
    if key in saved.get(section, {}):
        return saved[section][key]
    from trainer.config import RunConfig

    fields = {f.name: f for f in dataclasses.fields(type(getattr(RunConfig(), section)))}
    f = fields.get(key)
    if f is None:
        return None
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def setting_changes(saved: dict, now: dict) -> list[str]:
    """`section.key old → new` for every honoured key whose value differs from the recorded
    config's (the settings a resuming launch changes)."""
    changes = []
    for key, rule in RESUME_RULES.items():
        if rule != HONOURED:
            continue
        section, name = key.split(".")
        if name not in saved.get(section, {}):
            continue
        old, new = saved[section][name], now[section][name]
        if _plain(old) != _plain(new):
            changes.append(f"{key} {_shown(old)} → {_shown(new)}")
    return changes


def _plain(value):
    return list(value) if isinstance(value, tuple) else value


def _shown(value) -> str:
    value = _plain(value)
    return "[" + ", ".join(map(str, value)) + "]" if isinstance(value, list) else str(value)


def saved_run_config(run_dir: str, log=print, restore: bool = True) -> dict | None:
    """The config a run's checkpoints were trained with: run_dir/config.json, or, when that file is
    missing or damaged, the copy every checkpoint's manifest holds (checkpoint/manifest.py), taken
    from the newest committed checkpoint that has one and (`restore`: only where the run lock is
    held) written back to config.json; one line says so. None for a run without either (a new run)."""
    from checkpoint import manifest

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
    from checkpoint import manifest

    try:
        manifest.write_atomic(os.path.join(run_dir, STOPPED_MARKER),
                              json.dumps({"code": code, "reason": message}) + "\n")
    except OSError:
        pass


# ---- run states --------------------------------------------------------------------------------
# A run directory's state comes from two records: the step of its newest committed checkpoint and
# the train.max_steps of the launch that last trained it (config.json, written by every launch
# that trains before its first step). A run is finished only when it reached that max_steps.
TRAIN, FINISHED, END_HERE, BELOW = "train", "finished", "end here", "below"


def launched_max_steps(saved: dict | None) -> int | None:
    """train.max_steps of the last launch, from its recorded config (None: nothing recorded)."""
    value = ((saved or {}).get("train") or {}).get("max_steps")
    return value if isinstance(value, int) else None


def relaunch(run_dir: str, step: int | None, max_steps: int, launched: int | None) -> tuple[str, str]:
    """What a launch asking for `max_steps` does with a run whose newest checkpoint is at `step`
    and whose last launch asked for `launched`: (TRAIN | FINISHED | END_HERE | BELOW, one line).
    TRAIN: resume (or start) and train to max_steps. FINISHED: the run reached the max_steps it was
    last launched with, and this launch asks for no more: nothing to do (exit 0). END_HERE: the
    run stopped short of its last launch's max_steps and this launch asks for exactly the step it
    stopped at: the run ends there (recorded as finished, exit 0). BELOW: this launch asks for
    fewer steps than the stopped run already has: refused (exit 2), saying how to continue or end."""
    if step is None or step < max_steps:
        return TRAIN, ""
    if launched is None or step >= launched:
        return FINISHED, (f"{run_dir} is finished: its newest checkpoint is step {step}, and it was launched "
                          f"with train.max_steps={launched if launched is not None else max_steps}; to train "
                          f"on, raise it (e.g. --set train.max_steps={step + max(step, 1)})")
    if step == max_steps:
        return END_HERE, (f"{run_dir} stopped at step {step} of the train.max_steps={launched} it was launched "
                          f"with; this launch's train.max_steps={max_steps} ends it there (recorded as finished)")
    return BELOW, (f"{run_dir} is not finished: it stopped at step {step} of the train.max_steps={launched} it was "
                   f"last launched with (its config.json), and this launch's train.max_steps={max_steps} is below "
                   f"step {step}. To continue it: --set train.max_steps={launched} (or more); to end it at step "
                   f"{step}: --set train.max_steps={step}")


# ---- endings -----------------------------------------------------------------------------------
SUMMARY_NAME = "summary.json"
STATES = ("finished", "preempted", "stopped", "diverged", "failed", "refused")
"""summary.json's `state`: reached max_steps (or ended where it stopped); checkpointed on SIGTERM or
SIGUSR1, to be resumed; stopped on a signal without a checkpoint; a divergence stop; failed (a rank
failed or died, no room for a checkpoint); refused by the ranks at start (no intact checkpoint, an
unusable train.init_from, a model or layout the run was not trained with, a max_steps below the step)."""
SUMMARY_KEYS = ("state", "reason", "exit_code", "steps", "max_steps", "checkpoint", "log", "first_valid_loss",
                "last_valid_loss", "mean_target_tokens_per_s", "wall_seconds_this_launch", "divergence_events",
                "divergence", "layout", "resharded", "init_from")
"""The keys of every summary.json, whatever the ending; null where that ending does not know the value
(the trainer's numbers when the ranks were stopped at once, failed or refused before their steps)."""


def launch_facts(cfg) -> dict:
    """What summary.json says of a launch from its config alone (a RunConfig, its micro-batches
    those the launch trains with: after the preflight keeps the global batch): max_steps and layout."""
    p = cfg.parallel
    return {"max_steps": cfg.train.max_steps, "layout": {"pipeline_stages": p.pipeline_stages,
                                                         "tensor_parallel": p.tensor_parallel,
                                                         "data_parallel": p.data_parallel,
                                                         "micro_batches": cfg.train.micro_batches}}


def _recorded_facts(run_dir: str) -> dict:
    """launch_facts from config.json (the last launch that trained), for a caller without the config."""
    try:
        with open(os.path.join(run_dir, "config.json"), encoding="utf-8") as f:
            saved = json.load(f)
        p = saved["parallel"]
        return {"max_steps": launched_max_steps(saved),
                "layout": {**{key: p[key] for key in ("pipeline_stages", "tensor_parallel", "data_parallel")},
                           "micro_batches": saved["train"].get("micro_batches")}}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def record_ending(run_dir: str, state: str, reason: str, code: int, summary: dict | None = None,
                  known: dict | None = None) -> dict:
    """summary.json for an ending of a launch: `state` (one of STATES), its `reason` and the exit
    code, over `summary` (the trainer's numbers, where it could write them) or, for an ending the
    ranks could not record with their numbers (a signal that ends them at once, a failed rank, a
    refusal at start), the newest committed checkpoint and what the caller `known`s of the launch
    (launch_facts; else config.json's); every key of SUMMARY_KEYS, null where not known. And one
    `end | …` line in train.log. Best effort: the disk may be full. Returns what was written."""
    from checkpoint import manifest
    from trainer.progress import append_log

    record = dict.fromkeys(SUMMARY_KEYS)
    if summary is None:
        ckpt_dir = os.path.join(run_dir, "checkpoints")
        newest = manifest.newest_committed(ckpt_dir)
        record.update(steps=int(newest[len("step"):]) if newest else 0,
                      checkpoint=os.path.join("checkpoints", newest) if newest else None, log="train.log")
        record.update(known or _recorded_facts(run_dir))
    record.update(summary or {})
    record.update(state=state, reason=reason, exit_code=code)
    try:
        manifest.write_atomic(os.path.join(run_dir, SUMMARY_NAME), json.dumps(record, indent=2) + "\n")
    except OSError:
        pass
    kept = f"; newest checkpoint {record['checkpoint']}" if record.get("checkpoint") else "; no checkpoint yet"
    append_log(run_dir, f"end | {state}: {reason} (exit code {code}){kept}")
    return record


def ended_here(run_dir: str, saved: dict, step: int) -> str:
    """A stopped run ended at its newest checkpoint `step` by a launch asking for exactly that
    (END_HERE): config.json records max_steps = step, so that a later launch finds it finished, and
    the markers of the stop are removed (a finished run is neither requeued nor stopped). The
    caller holds the run lock (rank 0 does, under SLURM). Returns the reason summary.json gives."""
    import contextlib

    from checkpoint import manifest

    record = dict(saved, train=dict(saved.get("train", {}), max_steps=step))
    manifest.write_atomic(os.path.join(run_dir, "config.json"), json.dumps(record, indent=2))
    for marker in (PREEMPTED_MARKER, STOPPED_MARKER):
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(run_dir, marker))
    return f"ended at step {step} by a launch with train.max_steps={step} (it had been launched with " \
           f"{launched_max_steps(saved)})"
