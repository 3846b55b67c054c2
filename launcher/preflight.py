"""Checks of the machine and the run directory before any rank starts: the accelerator can train
the config (precision, memory), the run directory is writable, and an existing run directory is
resumed with the model and layout it was trained with, and a finished run is recognised without
starting a rank. (`trainer/config.py` checks the config itself.)"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import tempfile

from trainer.config import ConfigError, RunConfig, to_dict
from trainer.run_dir import (
    SUMMARY_NAME,
    TRAIN,
    ended_here,
    launched_max_steps,
    record_ending,
    refusal_hint,
    relaunch,
    resume_differences,
    saved_run_config,
    setting_changes,
)


def parameters(cfg: RunConfig) -> int:
    """Weights of the model (matrices and the shared embedding; biases and norms are negligible)."""
    from model.flops import layer_matmul_params

    m = cfg.model
    per = layer_matmul_params(m)
    return (m.encoder_layers * per["encoder"] + m.decoder_layers * (per["decoder_target"] + per["decoder_source"])
            + (m.vocab_size or cfg.data.vocab_size) * m.d_model)


def check_device(cfg: RunConfig, where: str) -> None:
    """Refuse what the accelerator the ranks will use cannot do: a precision it lacks (fp16 on a CPU
    without AVX512-FP16, bf16 on a GPU without it), or a model whose training state alone cannot fit in one
    device's memory. The accelerator is asked, not guessed from names."""
    from deepspeed.accelerator import get_accelerator

    from parallel.precision import PRECISIONS, precision_of

    accelerator = get_accelerator()
    p, precision = cfg.parallel, precision_of(cfg.parallel.precision)
    # A lower bound: the weights and the gradient buffer, the master copy and Adam's two moments
    # sharded over the replicas by ZeRO-1 (the precision's bytes per parameter), an even split over
    # stages and tensor-parallel ranks; activations not counted.
    state = precision.state_bytes()
    need = parameters(cfg) * (state["kept"] + state["kept_dp"] / p.data_parallel) / (p.pipeline_stages * p.tensor_parallel)
    have = accelerator.total_memory()
    if need > have:
        raise ConfigError(f"{where}: the model has {parameters(cfg):,} parameters, at least {need / 2**30:,.1f} GiB "
                          f"of training state per rank, more than the {have / 2**30:,.1f} GiB of this "
                          f"{accelerator.device_name()} accelerator; make it smaller (model.d_model, "
                          "model.*_layers, data.vocab_size) or raise parallel.pipeline_stages / tensor_parallel")
    if precision.dtype not in accelerator.supported_dtypes():
        usable = ", ".join(name for name, p in PRECISIONS.items() if p.dtype in accelerator.supported_dtypes())
        raise ConfigError(f"{where}: parallel.precision={cfg.parallel.precision} is not supported by this "
                          f"{accelerator.device_name()} accelerator; use {usable}")


def check_writable_folder(path: str, key: str) -> None:
    """`path` is, or can be created as, a folder this process can write (an existing one is
    probed with a temporary file; a missing one through its nearest existing parent); nothing is
    left behind."""
    probe = os.path.abspath(path)
    while not os.path.lexists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        what = "exists and is not a folder" if probe == os.path.abspath(path) else f"lies under {probe}, which is not a folder"
        raise ConfigError(f"{key}={path!r} {what}; choose another path")
    try:
        tempfile.TemporaryFile(dir=probe).close()
    except OSError as e:
        raise ConfigError(f"{key}={path!r}: cannot write in {probe} ({e.strerror}); choose a writable path") from None


def check_run_dir(cfg: RunConfig, where: str) -> None:
    """The run directory and the folders the trainer keeps in it must be writable folders."""
    check_writable_folder(cfg.run_dir, f"{where}: run_dir")
    for name in ("data", "checkpoints", "metrics", "tensorboard"):
        sub = os.path.join(cfg.run_dir, name)
        if os.path.lexists(sub) and not os.path.isdir(sub):
            raise ConfigError(f"{where}: run_dir: {sub} exists and is not a folder; move it away")


def check_trace_steps(cfg: RunConfig, where: str) -> None:
    """train.trace_steps of this launch: steps of a resumed run up to the step it resumes from ran
    already, so they can be traced no more (those whose timeline the run directory holds are passed
    over: the same config resumes); one rank gets a note: one track, no pipeline bubble.
    (Steps beyond train.max_steps are refused with the config, trainer/config.py.)"""
    from trainer.timeline import traced_steps

    steps = sorted(set(cfg.train.trace_steps))
    if not steps:
        return
    done = newest_step(cfg)
    if done is not None:
        early = [s for s in steps if s <= done and s not in traced_steps(cfg.run_dir)]
        if early:
            raise ConfigError(f"{where}: train.trace_steps={steps} names step {early[0]}, which ran before the step this "
                              f"run resumes from ({done}); choose steps within {done + 1}..{cfg.train.max_steps}")
    if cfg.world_size == 1:
        print("note: train.trace_steps on a layout of one rank: its timeline has one track and no pipeline bubble "
              "(nothing waits for another stage)", flush=True)


def check_resume(cfg: RunConfig, where: str, batch: bool = True) -> dict | None:
    """An existing run directory is resumed: refuse a config whose model differs from the one its
    checkpoints were trained with (`saved_run_config`), naming the keys (the keys
    trainer/run_dir.py's RESUME_RULES fixes), and (`batch`) set train.micro_batches to keep the
    run's global batch at the config's data_parallel (`keep_global_batch`). Returns the recorded
    config (None for a new run)."""
    from launcher.options import shown_path

    saved = saved_run_config(cfg.run_dir, restore=False)  # the ranks restore it, holding the run lock
    if saved is None:
        return None
    diffs = resume_differences(saved, to_dict(cfg))
    if diffs:
        raise ConfigError(f"{where}: run_dir {cfg.run_dir} was trained with another model or layout "
                          f"({'; '.join(diffs)}); {refusal_hint(diffs, shown_path(cfg.run_dir))}")
    check_resume_data(cfg, saved, where)
    if batch:
        keep_global_batch(cfg, where)
    return saved


def check_checkpoint_files(cfg: RunConfig, where: str) -> None:
    """Every checkpoint the ranks may resume (the committed ones, else the universal one of
    `./run.sh convert reshard`) holds only what loads without running code (runtime/safe_load.py):
    a file that needs another type is refused here, naming it and the type, before any rank starts
    and before anything is written. The ranks check the one they load again."""
    from checkpoint import manifest
    from checkpoint.checkpoints import UNIVERSAL_LATEST
    from runtime import safe_load

    ckpt_dir = os.path.join(cfg.run_dir, "checkpoints")
    folders = [os.path.join(ckpt_dir, tag) for tag in manifest.committed_tags(ckpt_dir)]
    if not folders and os.path.isfile(os.path.join(ckpt_dir, UNIVERSAL_LATEST)):
        with open(os.path.join(ckpt_dir, UNIVERSAL_LATEST), errors="replace") as f:
            folders.append(os.path.join(ckpt_dir, f.read().strip()))
    for folder in folders:
        refusal = safe_load.check_folder(folder)
        if refusal:
            raise ConfigError(f"{where}: {refusal}")


def keep_global_batch(cfg: RunConfig, where: str) -> None:
    """train.micro_batches for the config's data_parallel, keeping the micro-batches per step of
    the run's newest checkpoint (checkpoint/elastic.py `kept_micro_batches`): set in `cfg` and
    said in one line, or refused naming the sizes that would keep them."""
    from checkpoint import elastic, manifest

    ckpt_dir = os.path.join(cfg.run_dir, "checkpoints")
    tags = manifest.committed_tags(ckpt_dir)
    if not tags:
        return
    t = cfg.train
    t.micro_batches, line = elastic.kept_micro_batches(cfg.parallel.data_parallel, t.micro_batches, t.keep_global_batch,
                                                       elastic.recorded(ckpt_dir, tags[0]), int(tags[0][4:]), where)
    if line:
        print(line, flush=True)


def reshard(cfg: RunConfig, where: str):
    """Holding the run lock, before any rank starts: the universal copy of the newest checkpoint
    when it was written at another layout (checkpoint/elastic.py `prepare`), said on the console and
    in train.log; None when the ranks resume (or start) as they are."""
    from checkpoint import elastic
    from trainer.progress import append_log

    def say(line: str) -> None:
        print(line, flush=True)
        append_log(cfg.run_dir, line)

    p = cfg.parallel
    target = (p.pipeline_stages, p.tensor_parallel, p.data_parallel)
    try:
        done = elastic.prepare(cfg.run_dir, target, log=say)
    except ConfigError as e:
        raise ConfigError(f"{where}: cannot resume {cfg.run_dir} at {elastic.shown(target)}: {e}") from None
    if done is not None:
        say(done.line())
    return done


def check_relaunch(cfg: RunConfig, saved: dict | None) -> tuple[str, str]:
    """What this launch does with the run directory (trainer/run_dir.py `relaunch`): TRAIN,
    FINISHED, END_HERE or BELOW, and the line that says so. TRAIN on a resumed run prints the
    settings that differ from the run's recorded config.json, before any rank starts."""
    from launcher.options import shown_path

    verdict, line = relaunch(shown_path(cfg.run_dir), newest_step(cfg), cfg.train.max_steps, launched_max_steps(saved))
    if verdict == TRAIN and saved is not None:
        changes = setting_changes(saved, to_dict(cfg))
        if changes:
            print(f"resuming {shown_path(cfg.run_dir)} with settings changed since its last launch (config.json): "
                  f"{'; '.join(changes)}", flush=True)
    return verdict, line


def end_run_here(cfg: RunConfig, saved: dict, line: str) -> None:
    """END_HERE: record the run as finished at its newest checkpoint (config.json's max_steps, and
    summary.json and train.log with the reason; trainer/run_dir.py `ended_here`, which the ranks
    use under SLURM). The caller holds the run lock."""
    import json

    step = newest_step(cfg)
    reason = ended_here(cfg.run_dir, saved, step)
    summary = None  # the numbers of the launch that stopped at this step, where its summary is still there
    with contextlib.suppress(OSError, ValueError):
        with open(os.path.join(cfg.run_dir, SUMMARY_NAME), encoding="utf-8") as f:
            before = json.load(f)
        if isinstance(before, dict) and before.get("steps") == step and before.get("checkpoint"):
            summary = dict(before, max_steps=step)
    record_ending(cfg.run_dir, "finished", reason, 0, summary)


def check_resume_data(cfg: RunConfig, saved: dict, where: str) -> None:
    """Refuse to resume when the run's data would be prepared again: its checkpoints were trained
    with the SentencePiece model in run_dir/data, and preparing again (another data key of
    DataConfig.preparation_key, or corpus files whose names, sizes or modification times changed)
    replaces it, so the checkpoints would go on with another tokenizer (and vocabulary size)."""
    from data.errors import DataError
    from data.prepare import load_manifest, same_input

    now = cfg.data.preparation_key()
    before = saved.get("data", {})
    diffs = [f"data.{key}: {before.get(key)!r} → {value!r}" for key, value in now.items()
             if key in before and before[key] != value]
    if diffs:
        raise ConfigError(f"{where}: run_dir {cfg.run_dir} was trained on data prepared with other settings "
                          f"({'; '.join(diffs)}); preparing it again would give its checkpoints another "
                          f"tokenizer: restore those settings, or use a new run_dir")
    data_dir = os.path.join(cfg.run_dir, "data")
    try:
        prepared = load_manifest(data_dir).get("corpus_fingerprint")
        changed = prepared is not None and not same_input(prepared, cfg.data)
    except (DataError, OSError, ValueError):
        return  # no usable preparation, or an unreadable corpus: `prepare` reports it
    if changed:
        raise ConfigError(f"{where}: the corpus {cfg.data.corpus} changed since {data_dir} was prepared for this "
                          f"run's checkpoints (file names, sizes or modification times differ); preparing it again "
                          f"would give them another tokenizer: restore the files (copies keep their times with "
                          f"cp -p or rsync -a), or use a new run_dir")


def newest_step(cfg: RunConfig) -> int | None:
    """The step of the run directory's newest committed checkpoint, if its files are all there
    with the sizes its manifest records (None otherwise, and for a new run). The ranks check the
    hashes when they resume; a damaged newest checkpoint is set aside by them and an older one
    resumed."""
    from checkpoint import manifest

    ckpt_dir = os.path.join(cfg.run_dir, "checkpoints")
    for tag in manifest.committed_tags(ckpt_dir)[:1]:
        tag_dir = os.path.join(ckpt_dir, tag)
        record = manifest.read(tag_dir)
        if record is None:
            return None
        for name, entry in record["files"].items():
            path = os.path.join(tag_dir, name)
            if not os.path.isfile(path) or os.path.getsize(path) != int(entry.get("size", -1)):
                return None
        return int(record.get("step", tag[len("step"):]))
    return None



def check_init_from(cfg: RunConfig, where: str) -> None:
    """train.init_from of a run that starts now (none of its own checkpoints yet): the source is a
    run directory with a checkpoint, a checkpoint folder or a model file; its SentencePiece model
    has the pieces of the one the data is encoded with (data.spm_model); its model has this
    config's parameter shapes and computes the same function (checkpoint/init_from.py `compare`)."""
    from checkpoint import manifest
    from checkpoint.checkpoints import CheckpointError
    from checkpoint.init_from import compare, resolve
    from data.errors import DataError
    from data.spm_source import read_spm, tokenizer, vocabulary_difference

    ckpt_dir = os.path.join(cfg.run_dir, "checkpoints")
    if not cfg.train.init_from or manifest.has_checkpoints(ckpt_dir):
        return
    key = f"{where}: train.init_from={cfg.train.init_from}"
    try:
        source = resolve(cfg.train.init_from)
        theirs = read_spm(cfg.train.init_from)  # data.spm_model is the source's unless set otherwise
        ours = theirs if cfg.data.spm_model == cfg.train.init_from else read_spm(cfg.data.spm_model)
    except (CheckpointError, DataError) as e:
        raise ConfigError(f"{where}: train.init_from: {e}") from None
    difference = vocabulary_difference(theirs, ours)
    if difference:
        raise ConfigError(f"{key}: its SentencePiece model is not data.spm_model={cfg.data.spm_model}'s ({difference}), so "
                          "token ids would mean other pieces; leave data.spm_model empty to use the source's")
    vocab = tokenizer(ours, cfg.data.spm_model).vocab_size
    problem = compare(source.model, dataclasses.replace(cfg.model, vocab_size=cfg.model.vocab_size or vocab))
    if problem:
        raise ConfigError(f"{key}: its model ({source.path}) does not fit this config's: {problem}")


def check_directions(cfg: RunConfig, prepared: dict, where: str) -> None:
    """data.directions against the prepared data (its manifest): each is there, with training text."""
    chosen = cfg.data.directions
    unknown = [d for d in chosen if d not in prepared["directions"]]
    if unknown:
        raise ConfigError(f"{where}: data.directions lists {', '.join(unknown)}, which the data does not have "
                          f"(it has {', '.join(prepared['directions'])})")
    if chosen and not sum(prepared["counts"]["train"].get(d, 0) for d in chosen):
        raise ConfigError(f"{where}: data.directions ({', '.join(chosen)}) have no training examples; choose others")
