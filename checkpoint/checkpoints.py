"""Pipeline checkpoints → one consolidated model file, and resharding to another layout.

A DeepSpeed pipeline checkpoint (`<run_dir>/checkpoints/<tag>/`) holds one
`layer_XX[-model_YY]-model_states.pt` per layer of the plan (written by the data-parallel rank 0
of the stage owning it; the tied output layer has no file of its own), `mp_rank_XX_model_states.pt`
per stage (engine state plus the trainer's client state, including the run config) and the ZeRO
optimizer shards. Everything here is read by runtime/safe_load.py: weights-only, with the few
DeepSpeed types each file needs, after every file of the folder was checked that way; a
checkpoint or model file from elsewhere cannot run code when loaded.

Consolidated file (`torch.save` of a dict, read back with weights_only=True):
    format        CONSOLIDATED_FORMAT
    model_config  ModelConfig fields
    state_dict    the plain `EncoderDecoder`'s parameters (float32)
    spm_model     bytes of the joint SentencePiece model
    languages, directions, tags    from the data manifest
    source        checkpoint path, tag, step and layout it came from (an average: also `averaged`,
                  each checkpoint and step; checkpoint/average.py)
    init_from     where the run started from (train.init_from), or None

Resharding goes through DeepSpeed's universal checkpoint (`deepspeed.checkpoint.ds_to_universal`),
which stores every parameter and its Adam moments whole, by parameter name; the engine of any
other pp × tp × dp layout then loads it with `"checkpoint": {"load_universal": true}`. Parameter
names of the pipeline module carry the layer's plan index, not its stage, so they do not change
with pp; how each is split across tensor-parallel ranks is parallel/universal.py's info. The
conversion is `to_universal`, for `./run.sh convert reshard` (a new run directory) and for a run
resumed in place at another layout (checkpoint/elastic.py).
"""
from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields

import torch

from checkpoint import manifest
from checkpoint.manifest import replacing
from model.config import ModelConfig
from model.layers import split_fused_projections
from model.transformer import EncoderDecoder, layer_plan
from parallel.pipeline import plain_state_dict
from runtime import safe_load
from schema.text import count

CONSOLIDATED_FORMAT = "deepnet-consolidated-1"
UNIVERSAL_LATEST = "latest_universal"  # the file DeepSpeed reads when load_universal is set


class CheckpointError(ValueError):
    """A checkpoint or model file that cannot be used; the message says what to do."""


@dataclass
class LoadedModel:
    model: EncoderDecoder
    spm_model: bytes
    meta: dict
    """Everything of the consolidated dict except the weights and the SentencePiece bytes."""


# ---- locating a checkpoint --------------------------------------------------------------------

def locate(path: str, tag: str | None = None) -> tuple[str, str, str]:
    """(run_dir, tag_dir, tag) for a run directory, its checkpoints/ folder or one tag folder."""
    path = os.path.abspath(path)
    if os.path.exists(os.path.join(path, "mp_rank_00_model_states.pt")):
        return os.path.dirname(os.path.dirname(path)), path, os.path.basename(path)
    ckpt_dir = path if os.path.basename(path) == "checkpoints" else os.path.join(path, "checkpoints")
    if tag is None:
        # The newest checkpoint with a manifest (checkpoint/manifest.py) wins over what `latest` says;
        # without any, `latest` (an older version's checkpoint) or a universal checkpoint.
        from checkpoint.manifest import newest_committed, read_latest

        tag = newest_committed(ckpt_dir) or read_latest(ckpt_dir)[0]
        if tag is None and os.path.exists(os.path.join(ckpt_dir, UNIVERSAL_LATEST)):
            with open(os.path.join(ckpt_dir, UNIVERSAL_LATEST), errors="replace") as f:
                tag = f.read().strip()
        if tag is None:
            raise CheckpointError(f"{path}: no checkpoint found in {ckpt_dir}; "
                                  "train first or pass a checkpoint folder")
    tag_dir = os.path.join(ckpt_dir, tag)
    if not os.path.exists(os.path.join(tag_dir, "mp_rank_00_model_states.pt")):
        raise CheckpointError(f"{tag_dir} is not a DeepSpeed checkpoint (mp_rank_00_model_states.pt missing)")
    return os.path.dirname(ckpt_dir), tag_dir, tag


MODEL_EXPECTED = "a consolidated model file (./run.sh convert consolidate RUN_DIR) or a run directory"


def load_file(path: str, expected: str = "a checkpoint file written by this trainer", *, mmap: bool = False) -> dict:
    """A PyTorch file loaded without running code (runtime/safe_load.py: tensors, plain values
    and the types its name allows); `mmap`: tensors are read when touched. A file that is not one
    raises CheckpointError: one line naming it and why (and for an unreadable or foreign file, what
    was `expected`), never torch's advice to load it unsafely."""
    try:
        return safe_load.load(path, mmap=mmap)
    except safe_load.UnsafeFile as e:
        raise CheckpointError(str(e)) from None
    except safe_load.UnreadableFile as e:
        raise CheckpointError(f"{e}; expected {expected}") from None


def checkpoint_meta(tag_dir: str) -> dict:
    """Engine and client state of stage 0: step, run config, layout. First every file of
    the folder is checked to load without running code (`safe_load.check_folder`): a folder with
    one that does not is refused before any of it is used."""
    refusal = safe_load.check_folder(tag_dir)
    if refusal:
        raise CheckpointError(refusal)
    state = load_file(os.path.join(tag_dir, "mp_rank_00_model_states.pt"))
    if state.get("config") is None:
        raise CheckpointError(f"{tag_dir}: no run config in the checkpoint's client state; it was not "
                              "written by this trainer")
    return state


def model_config(values: dict, where: str) -> ModelConfig:
    known = {f.name for f in fields(ModelConfig)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise CheckpointError(f"{where}: model config has keys {unknown} this version does not know")
    return ModelConfig(**values)


# ---- consolidation ----------------------------------------------------------------------------

_LAYER_FILE = re.compile(r"^layer_(\d+)(-model_(\d+))?-model_states\.pt$")


def pipeline_state(tag_dir: str, cfg: ModelConfig, wanted: set[str] | None = None) -> dict[str, torch.Tensor]:
    """The plain model's parameters from a checkpoint's per-layer files (or, for a universal
    checkpoint, from its zero/<name>/fp32.pt files); with `wanted` (plain names), only the files
    of the layers that hold them are read."""
    if os.path.isdir(os.path.join(tag_dir, "zero")) and not glob.glob(os.path.join(tag_dir, "layer_*")):
        return _universal_state(tag_dir, cfg)
    files: dict[tuple[int, int], str] = {}  # (plan index, tensor-parallel rank) → file
    for name in sorted(os.listdir(tag_dir)):
        match = _LAYER_FILE.match(name)
        if match:
            files[int(match.group(1)), int(match.group(3) or 0)] = os.path.join(tag_dir, name)
    tp = 1 + max((rank for _, rank in files), default=0)
    plan = layer_plan(cfg)
    owners = None if wanted is None else {".".join(n.split(".")[:k]) for n in wanted for k in (1, 2)}
    per_rank: list[dict[str, torch.Tensor]] = []
    for rank in range(tp):
        pipe: dict[str, torch.Tensor] = {}
        for index, layer in enumerate(plan):
            if layer.kind == "output" or (owners is not None and layer.name not in owners):
                continue  # the output layer is tied to the embedding, saved with layer 0
            if (index, rank) not in files:
                raise CheckpointError(f"{tag_dir}: no file for layer {index} (tensor-parallel rank {rank}) of "
                                      f"the model's {count(len(plan), 'plan layer')}; the checkpoint is incomplete")
            prefix = "tied_modules.embed." if layer.kind == "embed" else f"{index}."
            pipe.update({prefix + key: value for key, value in load_file(files[index, rank]).items()})
        per_rank.append(plain_state_dict(cfg, pipe))
    if tp == 1:
        return per_rank[0]
    from parallel.tensor import merge_shards  # knows which dimension each parameter is split on

    return merge_shards(per_rank)


def _universal_state(tag_dir: str, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    pipe = {}
    for fp32 in sorted(glob.glob(os.path.join(tag_dir, "zero", "*", "fp32.pt"))):  # fused parts: SubparamShape
        pipe[os.path.basename(os.path.dirname(fp32))] = load_file(fp32)["param"]
    # The optimizer's names are the modules' own (fused projections); a model file has the standard ones.
    return split_fused_projections(plain_state_dict(cfg, pipe))


def _data_files(run_dir: str) -> tuple[bytes, dict]:
    data_dir = os.path.join(run_dir, "data")
    manifest_path = os.path.join(data_dir, "manifest.json")
    if not os.path.exists(manifest_path):
        raise CheckpointError(f"{data_dir}: manifest.json missing; the SentencePiece model of the run "
                              "cannot be found")
    with open(manifest_path, encoding="utf-8") as f:
        manifest = json.load(f)
    with open(os.path.join(data_dir, manifest.get("spm_model", "spm.model")), "rb") as f:
        return f.read(), manifest


def consolidated_dict(source: str, tag: str | None = None) -> dict:
    """The consolidated model of a run directory / checkpoint folder, as a dict (see module doc)."""
    run_dir, tag_dir, tag = locate(source, tag)
    meta = checkpoint_meta(tag_dir)
    cfg = model_config(meta["config"]["model"], tag_dir)
    state = {k: v.float() if v.is_floating_point() else v for k, v in pipeline_state(tag_dir, cfg).items()}
    spm_bytes, manifest = _data_files(run_dir)
    if manifest["vocab_size"] != cfg.vocab_size:
        raise CheckpointError(f"{run_dir}/data has a vocabulary of {manifest['vocab_size']} but the checkpoint "
                              f"was trained with {cfg.vocab_size}; the data was prepared again since")
    parallel = meta["config"].get("parallel", {})
    return {
        "format": CONSOLIDATED_FORMAT,
        "model_config": asdict(cfg),
        "state_dict": state,
        "spm_model": spm_bytes,
        "languages": manifest["languages"],
        "directions": manifest["directions"],
        "tags": manifest["tags"],
        "source": {"checkpoint": tag_dir, "tag": tag, "step": int(meta.get("step", meta.get("global_steps", 0))),
                   "pipeline_stages": parallel.get("pipeline_stages"), "data_parallel": parallel.get("data_parallel")},
        "init_from": meta.get("init_from"),  # where a fine-tuned run started (checkpoint/init_from.py)
    }


def consolidate(source: str, out_path: str, tag: str | None = None) -> dict:
    """Write the consolidated model file atomically; returns its `source` record."""
    package = consolidated_dict(source, tag)
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    with replacing(out_path) as tmp:
        torch.save(package, tmp)
    return package["source"]


def _build(package: dict, where: str) -> LoadedModel:
    if package.get("format") != CONSOLIDATED_FORMAT:
        raise CheckpointError(f"{where}: not a consolidated model file (format {package.get('format')!r}); "
                              "make one with ./run.sh convert consolidate RUN_DIR")
    cfg = model_config(package["model_config"], where)
    model = EncoderDecoder(cfg)
    missing, unexpected = model.load_state_dict(package["state_dict"], strict=False)
    if missing or unexpected:
        raise CheckpointError(f"{where}: weights do not fit the model config (missing {missing[:5]}, "
                              f"unexpected {unexpected[:5]})")
    model.eval()
    meta = {k: v for k, v in package.items() if k not in ("state_dict", "spm_model")}
    return LoadedModel(model, package["spm_model"], meta)


def load_model(source: str, tag: str | None = None) -> LoadedModel:
    """A consolidated file, or the latest (or `tag`) checkpoint of a run directory consolidated
    in memory."""
    if os.path.isfile(source):
        package = load_file(source, MODEL_EXPECTED)
        if not isinstance(package, dict):
            raise CheckpointError(f"{source}: a PyTorch file of a {type(package).__name__}, not a model; "
                                  f"expected {MODEL_EXPECTED}")
        return _build(package, source)
    if not os.path.isdir(source):
        raise CheckpointError(f"{source}: no such model file or run directory")
    if not (os.path.basename(os.path.abspath(source)) == "checkpoints" or
            any(os.path.exists(os.path.join(source, name)) for name in ("checkpoints", "mp_rank_00_model_states.pt"))):
        raise CheckpointError(f"{source}: a folder without checkpoints/; expected {MODEL_EXPECTED}")
    return _build(consolidated_dict(source, tag), source)


# ---- resharding -------------------------------------------------------------------------------

LOSS_SCALE_FILE = "loss_scale.json"


def keep_loss_scale(tag_dir: str, universal_dir: str) -> None:
    """fp16's dynamic loss scale (the scaler's scale, iteration and last overflow: FlatOptimizer's
    `loss_scaler_state`) of the checkpoint at `tag_dir`, written beside its universal copy; the
    universal format has no place for it (DeepSpeed's load passes no scaler state), and without it
    a resharded run would start again at 2^16 and overflow its way back down. Every rank's shard
    holds the same state (an overflow is decided globally); none for fp32 and bf16."""
    for path in sorted(glob.glob(os.path.join(tag_dir, "*optim_states.pt")))[:1]:
        shard = load_file(path, mmap=True)  # the scaler's few numbers, not the moments
        state = (shard.get("optimizer_state_dict") or {}).get("loss_scaler_state")
        if state:
            with open(os.path.join(universal_dir, LOSS_SCALE_FILE), "w", encoding="utf-8") as f:
                json.dump(state, f)


def kept_loss_scale(universal_dir: str) -> dict | None:
    """What `keep_loss_scale` wrote beside a universal checkpoint (None: nothing)."""
    try:
        with open(os.path.join(universal_dir, LOSS_SCALE_FILE), encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def needs_zero_shards(tag_dir: str) -> None:
    """Refuse a checkpoint without ZeRO optimizer shards (parallel.zero_stage: 0 keeps the optimizer
    whole in the model states, which the universal conversion does not read; in bf16 DeepSpeed
    writes shard files at stage 0 too, so the run's config decides)."""
    zero_stage = (checkpoint_meta(tag_dir)["config"].get("parallel") or {}).get("zero_stage", 1)
    if zero_stage == 0 or not glob.glob(os.path.join(tag_dir, "*optim_states.pt")):
        what = "was trained with parallel.zero_stage: 0" if zero_stage == 0 else "has no ZeRO optimizer shards"
        raise CheckpointError(f"{tag_dir} {what}; resharding needs a checkpoint trained with parallel.zero_stage: 1")


def to_universal(tag_dir: str, out_dir: str) -> float:
    """Convert the checkpoint `tag_dir` (ZeRO-1) into the universal checkpoint `out_dir`, which a
    run of any pp × tp × dp layout loads (`"checkpoint": {"load_universal": true}`): DeepSpeed's
    ds_to_universal (checkpoint/to_universal.py), fp16's loss scale kept beside it. Written into
    `<out_dir>.<pid>.tmp` and renamed: `out_dir` is whole or absent, also when this process is
    killed (its converter dies with it). Returns the seconds it took."""
    import time

    start = time.perf_counter()
    needs_zero_shards(tag_dir)
    refusal = safe_load.check_folder(tag_dir)  # nothing the conversion reads may run code
    if refusal:
        raise CheckpointError(refusal)
    work = f"{out_dir}.{os.getpid()}.tmp"
    shutil.rmtree(work, ignore_errors=True)
    # Workers: one per core up to 8 (each extracts one ZeRO shard file, or merges one parameter, in memory)
    workers = str(max(2, min(8, len(os.sched_getaffinity(0)))))
    try:
        # every torch.load of the conversion weights-only too (DeepSpeed's asks for weights_only=False),
        # in case a file changed since the check
        proc = safe_load.run_process("checkpoint.to_universal", [
            "--input_folder", tag_dir, "--output_folder", work, "--inject_missing_state", "--num_extract_workers",
            workers, "--num_merge_workers", workers], env={**os.environ, "PYTHONWARNINGS": "ignore"})
        if proc.returncode != 0:
            raise CheckpointError(f"deepspeed.checkpoint.ds_to_universal failed on {tag_dir}:\n"
                                  f"{(proc.stdout + proc.stderr)[-3000:]}")
        # ds_to_universal writes `latest_universal` beside its output folder: not ours to keep
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(os.path.dirname(work), UNIVERSAL_LATEST))
        keep_loss_scale(tag_dir, work)
        shutil.rmtree(out_dir, ignore_errors=True)
        os.replace(work, out_dir)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return time.perf_counter() - start


def reshard(source: str, out_run_dir: str, pipeline_stages: int, data_parallel: int,
            tag: str | None = None, max_steps: int | None = None, *,
            check_config: Callable[[dict], None], tensor_parallel: int | None = None) -> str:
    """Convert a checkpoint to a universal one in a new run directory laid out as
    `pipeline_stages` × `tensor_parallel` (default: the checkpoint's) × `data_parallel`; returns
    the config to resume it with (`./run.sh train <out_run_dir>/config.yaml`).

    The global batch is kept (micro_batches × data_parallel), so the resumed run draws the same
    batches as the original would have. The data folder is linked, not copied. `max_steps`
    replaces train.max_steps (a finished run needs a higher one to continue). `check_config`
    receives the new run config (a dict) before anything is written and raises ValueError, naming
    the key, when it cannot be trained (the launcher passes its config validation).
    """
    run_dir, tag_dir, tag = locate(source, tag)
    meta = checkpoint_meta(tag_dir)
    needs_zero_shards(tag_dir)
    run_cfg = json.loads(json.dumps(meta["config"]))  # tuples → lists, a private copy
    old = dict(run_cfg["parallel"])
    old.setdefault("tensor_parallel", 1)
    tensor_parallel = tensor_parallel or old["tensor_parallel"]
    global_micro = run_cfg["train"]["micro_batches"] * old["data_parallel"]
    if global_micro % data_parallel:
        raise CheckpointError(f"the global batch has {count(global_micro, 'micro-batch', 'micro-batches')} "
                              "(train.micro_batches × "
                              f"data_parallel = {run_cfg['train']['micro_batches']} × {old['data_parallel']}); "
                              f"data_parallel={data_parallel} must divide it")
    out_run_dir = os.path.abspath(out_run_dir)
    run_cfg["run_dir"] = out_run_dir
    run_cfg["parallel"].update(pipeline_stages=pipeline_stages, tensor_parallel=tensor_parallel,
                               data_parallel=data_parallel)
    run_cfg["train"]["micro_batches"] = global_micro // data_parallel
    if max_steps is not None:
        run_cfg["train"]["max_steps"] = max_steps
    try:
        check_config(run_cfg)
    except ValueError as e:
        raise CheckpointError(str(e)) from None

    ckpt_dir = os.path.join(out_run_dir, "checkpoints")
    if os.path.exists(ckpt_dir) and os.listdir(ckpt_dir):
        raise CheckpointError(f"{ckpt_dir} already holds checkpoints; choose a new output run directory")
    os.makedirs(ckpt_dir, exist_ok=True)
    universal_tag = f"universal-{tag}"  # not 'step*': the trainer's clean-up of old tags skips it
    seconds = to_universal(tag_dir, os.path.join(ckpt_dir, universal_tag))
    layout = [old["pipeline_stages"], old["tensor_parallel"], old["data_parallel"]]
    manifest.commit_local(os.path.join(ckpt_dir, universal_tag), universal_tag,
                          int(meta.get("step", meta.get("global_steps", 0))),
                          extra={"source": tag, "layout": layout, "seconds": seconds})

    data_link = os.path.join(out_run_dir, "data")
    if not os.path.exists(data_link):
        os.symlink(os.path.join(run_dir, "data"), data_link)
    import yaml

    config_path = os.path.join(out_run_dir, "config.yaml")
    with open(config_path, "w", encoding="utf-8") as f:
        f.write(f"# resharded from {tag_dir} ({count(old['pipeline_stages'], 'stage')} × tp {old['tensor_parallel']} × "
                f"{count(old['data_parallel'], 'replica')}) to {pipeline_stages} × {tensor_parallel} × {data_parallel}\n")
        yaml.safe_dump(run_cfg, f, sort_keys=False)
    with open(os.path.join(out_run_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(run_cfg, f, indent=2)
    # Written last: its presence makes the trainer resume from the universal checkpoint.
    with open(os.path.join(ckpt_dir, UNIVERSAL_LATEST), "w") as f:
        f.write(universal_tag)
    return config_path
