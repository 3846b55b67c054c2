"""No file that any command reads can run code (runtime/safe_load.py).

A payload file (a pickle whose loading would call `os.system("touch MARKER")`), with the folder's
manifest rewritten to match it as anyone shipping the folder can, is put in each place each command
reads: the ZeRO optimizer shards, model states, layer and RNG files of a checkpoint that
`./run.sh train` resumes, a universal checkpoint's files, the checkpoint `convert reshard`,
`consolidate` and `average` read, a `train.init_from` source, a `data.spm_model` file, the model
translate, eval and export read. Each command refuses it with one exact line naming the file and
the type, exit 2; the marker does not exist afterwards and nothing was written. The ranks' own
defences (tests/dist/safe_load_worker.py) and the weights-only universal conversion are tested
without the checks before them.

Real checkpoints (fp32 at ZeRO stage 1, bf16 at stage 0, fp16 at stage 1 where DeepSpeed's
accelerator takes fp16, and a universal one) hold exactly the DeepSpeed types the allowlist names,
read from their pickles without loading them.
"""
from __future__ import annotations

import glob
import hashlib
import json
import os
import pickletools
import shutil
import subprocess
import sys
import zipfile

import pytest
import torch

from runtime import safe_load
from tests.bad_inputs import RankLaunched, run_cli
from tests.conftest import ROOT, TINY_DATA, run_worker, write_run_config
from tests.test_flat_optimizer import fp16_unsupported

PLAIN = "tensors and plain values"
DEEPSPEED = "tensors, plain values and fragment_address"
UNIVERSAL = "tensors, plain values and SubparamShape"  # a universal checkpoint's zero/<parameter>/ files
FRAGMENT = "deepspeed.utils.tensor_fragment.fragment_address"
SUBPARAM = "deepspeed.checkpoint.universal_checkpoint.SubparamShape"


class Payload:
    """Unpickling this runs `touch marker` (what a hostile checkpoint file does)."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def refusal(path, allowed: str = PLAIN) -> str:
    return f"{path}: holds posix.system, which is not loaded: only {allowed} are (anything else could run code)"


def plant(path, marker, as_dict: bool = True) -> str:
    """Replace `path` by a payload and rewrite the manifest of its checkpoint to match it."""
    path = str(path)
    torch.save({"optimizer_state_dict": Payload(str(marker))} if as_dict else Payload(str(marker)), path)
    folder = os.path.dirname(path)
    while folder != os.path.dirname(folder) and not os.path.exists(os.path.join(folder, "manifest.json")):
        folder = os.path.dirname(folder)
    manifest = os.path.join(folder, "manifest.json")
    if os.path.exists(manifest):
        with open(manifest) as f:
            record = json.load(f)
        with open(path, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
        record["files"][os.path.relpath(path, folder)] = {"size": os.path.getsize(path), "sha256": digest}
        with open(manifest, "w") as f:
            json.dump(record, f)
    return path


def snapshot(folder) -> dict:
    """Every file under `folder` (links not followed) with its size and modification time."""
    out = {}
    for root, dirs, names in os.walk(folder):
        for name in names + [d for d in dirs if os.path.islink(os.path.join(root, d))]:
            stat = os.lstat(os.path.join(root, name))
            out[os.path.relpath(os.path.join(root, name), folder)] = (stat.st_size, stat.st_mtime_ns)
    return out


def train_run(work, tiny_data, name: str, **parallel) -> str:
    """A run of 2 steps at pp = 2 through the real command line; its run directory."""
    config = write_run_config(str(work / f"{name}.yaml"), str(work / name), tiny_data, parallel=parallel,
                              train={"micro_batches": 2, "max_steps": 2, "save_interval": 1000, "valid_interval": 1000})
    proc = subprocess.run([sys.executable, "-m", "launcher.cli", "train", config, "--eval-sentences", "0"], cwd=ROOT,
                          env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return str(work / name)


@pytest.fixture(scope="module")
def runs(tiny_data, tmp_path_factory):
    """A trained fp32 ZeRO-1 run, its universal copy (pp = 1 × dp = 2) and its model file."""
    from launcher.cli import main

    work = tmp_path_factory.mktemp("safe")
    run_dir = train_run(work, tiny_data, "run", pipeline_stages=2, precision="fp32", zero_stage=1)
    assert main(["convert", "reshard", run_dir, str(work / "universal"), "--pipeline-stages", "1",
                 "--data-parallel", "2", "--max-steps", "4"]) == 0
    assert main(["convert", "consolidate", run_dir, "--out", str(work / "model.pt")]) == 0
    return {"work": work, "run": run_dir, "universal": str(work / "universal"), "model": str(work / "model.pt")}


@pytest.fixture(scope="module", params=[("bf16", 0), ("fp16", 1)], ids=["bf16-zero0", "fp16-zero1"])
def other_run(request, tiny_data, tmp_path_factory):
    precision, stage = request.param
    if precision == "fp16" and fp16_unsupported():
        pytest.skip(fp16_unsupported())
    work = tmp_path_factory.mktemp(f"safe-{precision}")
    return train_run(work, tiny_data, "run", pipeline_stages=2, precision=precision, zero_stage=stage), stage


def copy_run(runs, tmp_path, name: str = "run", dest: str | None = None) -> tuple[str, str]:
    """A copy (in `dest`) of the trained run or its universal copy (data linked), and a config
    that resumes it."""
    dest = dest or name
    run_dir = str(tmp_path / dest)
    shutil.copytree(runs[name], run_dir, symlinks=True)
    config = write_run_config(str(tmp_path / f"{dest}.yaml"), run_dir, os.path.realpath(os.path.join(run_dir, "data")),
                              train={"micro_batches": 2, "max_steps": 4, "save_interval": 1000})
    if name == "universal":  # the layout and batch of the resharded config
        with open(os.path.join(run_dir, "config.yaml")) as f:
            text = f.read()
        with open(config, "w") as f:
            f.write(text.replace(runs["universal"], run_dir))
    return run_dir, config


# ---- what DeepSpeed writes -------------------------------------------------------------------

def pickled_globals(path: str) -> set[str]:
    """The globals a PyTorch file's pickle names, read with pickletools (nothing is loaded)."""
    with zipfile.ZipFile(path) as archive:
        data = archive.read(next(n for n in archive.namelist() if n.endswith("data.pkl")))
    found, strings = set(), []
    for op, arg, _ in pickletools.genops(data):
        if op.name in ("GLOBAL", "INST"):
            found.add(arg.replace(" ", "."))
        elif "UNICODE" in op.name:
            strings.append(arg)
        elif op.name == "STACK_GLOBAL":
            found.add(".".join(strings[-2:]))
    return found


def beyond_torch(path: str) -> set[str]:
    """The globals of a PyTorch file that torch's weights-only unpickler does not allow by itself."""
    from torch._weights_only_unpickler import _get_allowed_globals

    return pickled_globals(path) - set(_get_allowed_globals())


def deepspeed_globals(folder: str) -> dict[str, set[str]]:
    """`beyond_torch` of every `.pt` file under `folder`."""
    return {os.path.relpath(path, folder): beyond_torch(path)
            for path in glob.glob(os.path.join(folder, "**", "*.pt"), recursive=True)}


def expected_globals(name: str, zero_stage: int) -> set[str]:
    """What a file of this name may hold beyond torch's own types (a universal checkpoint's file of a
    fused parameter holds how its parts are cut; the others hold nothing)."""
    base = os.path.basename(name)
    if base.endswith("optim_states.pt") or (zero_stage == 0 and base.startswith("mp_rank_") and "/" not in name):
        return {FRAGMENT}
    if name.split("/")[0] == "zero":
        return {SUBPARAM}
    return set()


def check_written_types(folder: str, zero_stage: int) -> None:
    found = deepspeed_globals(folder)
    assert found, folder
    assert {name: g for name, g in found.items() if not g <= expected_globals(name, zero_stage)} == {}
    assert all(g == expected_globals(name, zero_stage) for name, g in found.items() if name.split("/")[0] != "zero")
    for name in found:  # the allowlist of each file is what it needs, no more
        assert {f"{t.__module__}.{t.__qualname__}" for t in safe_load.allowed_for(name)} >= found[name]
    assert safe_load.check_folder(folder) is None


def test_fp32_zero1_and_universal_checkpoints_hold_only_the_allowed_deepspeed_types(runs):
    check_written_types(os.path.join(runs["run"], "checkpoints", "step2"), zero_stage=1)
    universal = os.path.join(runs["universal"], "checkpoints", "universal-step2")
    assert len(glob.glob(os.path.join(universal, "zero", "*", "fp32.pt"))) > 10
    check_written_types(universal, zero_stage=1)
    assert beyond_torch(runs["model"]) == set() and safe_load.check_folder(os.path.dirname(runs["model"])) is None


def test_other_precisions_and_zero_stages_hold_only_the_allowed_deepspeed_types(other_run, tmp_path, capsys):
    from checkpoint.checkpoints import load_model

    run_dir, stage = other_run
    tag_dir = os.path.join(run_dir, "checkpoints", "step2")
    check_written_types(tag_dir, zero_stage=stage)
    assert load_model(run_dir).meta["source"]["step"] == 2  # its model states load (ZeRO-0: fragment_address)
    if stage == 0:  # DeepSpeed's universal conversion takes ZeRO-1 checkpoints only: said in one line
        assert run_cli(["convert", "reshard", run_dir, str(tmp_path / "out"), "--pipeline-stages", "1",
                        "--data-parallel", "2"], capsys) == (2, "", f"error: {tag_dir} was trained with "
                                                             "parallel.zero_stage: 0; resharding needs a checkpoint "
                                                             "trained with parallel.zero_stage: 1\n")


# ---- ./run.sh train: the checks before any rank starts ---------------------------------------

@pytest.mark.parametrize("name,allowed", [
    ("zero_pp_rank_0_mp_rank_01_optim_states.pt", DEEPSPEED), ("mp_rank_01_model_states.pt", DEEPSPEED),
    ("layer_03-model_00-model_states.pt", PLAIN), ("rng_rank00001.pt", PLAIN)])
def test_train_refuses_to_resume_a_checkpoint_with_a_payload_before_any_rank(runs, tmp_path, capsys, no_launch,
                                                                           name, allowed):
    run_dir, config = copy_run(runs, tmp_path)
    path = plant(os.path.join(run_dir, "checkpoints", "step2", name), tmp_path / "marker")
    before = snapshot(run_dir)
    assert run_cli(["train", config], capsys) == (2, "", f"error: {config}: {refusal(path, allowed)}\n")
    assert not (tmp_path / "marker").exists() and snapshot(run_dir) == before


@pytest.mark.parametrize("name", ["zero/optimizer_state.pt", "fp32", "exp_avg", "exp_avg_sq",
                                  "mp_rank_00_model_states.pt"])
def test_train_refuses_a_universal_checkpoint_with_a_payload(runs, tmp_path, capsys, no_launch, name):
    run_dir, config = copy_run(runs, tmp_path, "universal")
    tag_dir = os.path.join(run_dir, "checkpoints", "universal-step2")
    if not name.endswith(".pt"):  # one parameter's file
        name = os.path.join("zero", sorted(os.listdir(os.path.join(tag_dir, "zero")))[0], f"{name}.pt")
    path = plant(os.path.join(tag_dir, name), tmp_path / "marker")
    allowed = DEEPSPEED if name.startswith("mp_rank") else UNIVERSAL if name.count(os.sep) == 2 else PLAIN
    before = snapshot(run_dir)
    assert run_cli(["train", config], capsys) == (2, "", f"error: {config}: {refusal(path, allowed)}\n")
    assert not (tmp_path / "marker").exists() and snapshot(run_dir) == before


def test_a_clean_run_passes_the_checks_and_reaches_the_launch(runs, tmp_path, capsys, no_launch):
    _, config = copy_run(runs, tmp_path)
    with pytest.raises(RankLaunched):
        run_cli(["train", config], capsys)


# ---- convert ---------------------------------------------------------------------------------

def test_reshard_refuses_a_payload_before_converting_and_writes_nothing(runs, tmp_path, capsys):
    run_dir, _ = copy_run(runs, tmp_path)
    path = plant(os.path.join(run_dir, "checkpoints", "step2", "zero_pp_rank_0_mp_rank_00_optim_states.pt"),
                 tmp_path / "marker")
    out = tmp_path / "out"
    assert run_cli(["convert", "reshard", run_dir, str(out), "--pipeline-stages", "1", "--data-parallel", "2"],
                   capsys) == (2, "", f"error: {refusal(path, DEEPSPEED)}\n")
    assert not (tmp_path / "marker").exists() and not out.exists()


def test_the_universal_conversion_itself_loads_weights_only(runs, tmp_path):
    """Past the check (a file changed after it): DeepSpeed's ds_to_universal, which asks for
    weights_only=False, still unpickles nothing unsafe under runtime/safe_load.py's wrapper."""
    run_dir, _ = copy_run(runs, tmp_path)
    tag_dir = os.path.join(run_dir, "checkpoints", "step2")
    plant(os.path.join(tag_dir, "zero_pp_rank_0_mp_rank_01_optim_states.pt"), tmp_path / "marker")
    proc = safe_load.run_process("deepspeed.checkpoint.ds_to_universal", [
        "--input_folder", tag_dir, "--output_folder", str(tmp_path / "out"), "--inject_missing_state", "--num_extract_workers", "2"])
    assert proc.returncode != 0 and "GLOBAL posix.system" in proc.stdout + proc.stderr
    assert not (tmp_path / "marker").exists()
    clean = safe_load.run_process("deepspeed.checkpoint.ds_to_universal", [  # the same wrapper converts a clean one
        "--input_folder", os.path.join(runs["run"], "checkpoints", "step2"), "--output_folder", str(tmp_path / "ok"),
        "--inject_missing_state", "--num_extract_workers", "2"])
    assert clean.returncode == 0, clean.stdout[-2000:] + clean.stderr[-2000:]
    assert len(glob.glob(str(tmp_path / "ok" / "zero" / "*" / "fp32.pt"))) > 10


@pytest.mark.parametrize("where", ["layer_00-model_00-model_states.pt", "universal"])
def test_consolidate_refuses_a_payload_and_writes_nothing(runs, tmp_path, capsys, where):
    run_dir, _ = copy_run(runs, tmp_path, "universal" if where == "universal" else "run")
    tag_dir = glob.glob(os.path.join(run_dir, "checkpoints", "*step2"))[0]
    name = os.path.join("zero", sorted(os.listdir(os.path.join(tag_dir, "zero")))[-1], "fp32.pt") if where == "universal" else where
    path = plant(os.path.join(tag_dir, name), tmp_path / "marker")
    out = tmp_path / "model.pt"
    allowed = UNIVERSAL if where == "universal" else PLAIN
    assert run_cli(["convert", "consolidate", run_dir, "--out", str(out)], capsys) == (
        2, "", f"error: {refusal(path, allowed)}\n")
    assert not (tmp_path / "marker").exists() and not out.exists()


def test_average_refuses_a_payload_among_its_sources_and_writes_nothing(runs, tmp_path, capsys):
    run_dir, _ = copy_run(runs, tmp_path)
    path = plant(os.path.join(run_dir, "checkpoints", "step2", "mp_rank_00_model_states.pt"), tmp_path / "marker")
    out = tmp_path / "average.pt"
    assert run_cli(["convert", "average", runs["model"], os.path.join(run_dir, "checkpoints", "step2"),
                    "--out", str(out)], capsys) == (2, "", f"error: {refusal(path, DEEPSPEED)}\n")
    evil = plant(tmp_path / "evil.pt", tmp_path / "marker", as_dict=False)
    assert run_cli(["convert", "average", runs["model"], evil, "--out", str(out)], capsys) == (
        2, "", f"error: {refusal(evil)}\n")
    assert not (tmp_path / "marker").exists() and not out.exists()


# ---- train.init_from, data.spm_model ---------------------------------------------------------

@pytest.mark.parametrize("source", ["run directory", "model file"])
def test_init_from_refuses_a_source_with_a_payload_before_any_rank(runs, tmp_path, capsys, no_launch, source):
    if source == "run directory":
        given, _ = copy_run(runs, tmp_path, "run")
        path = plant(os.path.join(given, "checkpoints", "step2", "layer_01-model_00-model_states.pt"), tmp_path / "marker")
    else:
        given = path = plant(tmp_path / "model.pt", tmp_path / "marker")
    config = write_run_config(str(tmp_path / "tune.yaml"), str(tmp_path / "tune"), os.path.realpath(
        os.path.join(runs["run"], "data")), train={"init_from": given})
    before = snapshot(tmp_path / "tune")
    assert run_cli(["train", config], capsys) == (2, "", f"error: {config}: train.init_from: {refusal(path)}\n")
    assert not (tmp_path / "marker").exists() and snapshot(tmp_path / "tune") == before


def test_spm_model_refuses_a_model_file_with_a_payload(tmp_path, capsys):
    evil = plant(tmp_path / "model.pt", tmp_path / "marker")
    config = tmp_path / "prepare.yaml"
    config.write_text(json.dumps({"run_dir": str(tmp_path / "run"), "data": {**TINY_DATA, "spm_model": evil}}))
    out = tmp_path / "data"
    code, _, err = run_cli(["prepare", str(config), "--out", str(out)], capsys)
    assert (code, err) == (2, f"error: data.spm_model={evil!r}: {refusal(evil).split(': ', 1)[1]}\n")
    assert not (tmp_path / "marker").exists() and not out.exists()


# ---- translate, eval, export -----------------------------------------------------------------

@pytest.mark.parametrize("command", ["translate", "eval", "export"])
def test_translate_eval_and_export_refuse_a_payload(runs, tmp_path, capsys, command):
    run_dir, _ = copy_run(runs, tmp_path)
    layer = plant(os.path.join(run_dir, "checkpoints", "step2", "layer_02-model_00-model_states.pt"), tmp_path / "marker")
    evil = plant(tmp_path / "evil.pt", tmp_path / "marker")
    threads = torch.get_num_threads()
    for model, path in ((evil, evil), (run_dir, layer)):
        args = {"translate": ["translate", model, "--to", "de", "--threads", str(threads)],
                "eval": (["eval", model] if model == run_dir else ["eval", runs["run"], "--model", model])
                + ["--out-dir", str(tmp_path / "eval")],
                "export": ["export", model, "--to", "hf", str(tmp_path / "hf")]}[command]
        assert run_cli(args, capsys) == (2, "", f"error: {refusal(path)}\n"), model
    torch.set_num_threads(threads)
    assert not (tmp_path / "marker").exists()
    assert not (tmp_path / "eval").exists() and not (tmp_path / "hf").exists()


# ---- the ranks' own defences -----------------------------------------------------------------

def test_the_ranks_refuse_a_payload_themselves(runs, tmp_path):
    """Without ./run.sh train's checks (a SLURM job's requeue, a file changed after them): the
    ranks' check before loading, and with it skipped DeepSpeed's loads through the project's
    checkpoint engine and the forced weights-only loads of a universal checkpoint."""
    _, clean_config = copy_run(runs, tmp_path, "run", "clean")
    evil, evil_config = copy_run(runs, tmp_path, "run", "evil")
    shards = [plant(os.path.join(evil, "checkpoints", "step2", f"zero_pp_rank_0_mp_rank_0{s}_optim_states.pt"),
                    tmp_path / "marker") for s in (0, 1)]
    universal, universal_config = copy_run(runs, tmp_path, "universal")
    state = plant(os.path.join(universal, "checkpoints", "universal-step2", "zero", "optimizer_state.pt"),
                  tmp_path / "marker")
    result = run_worker(2, "tests.dist.safe_load_worker", str(tmp_path / "result.json"),
                        ["--clean", clean_config, "--evil", evil_config, "--universal", universal_config])
    assert result["clean"] == {"step": [2, 2], "engine": ["SafeCheckpointEngine"] * 2}
    assert result["checked"] == {"codes": [2, 2], "said": [f"error: {refusal(shards[0], DEEPSPEED)}", None]}
    assert result["engine"] == {"codes": [2, 2], "said": [f"error: {refusal(p, DEEPSPEED)}" for p in shards]}
    assert result["forced"] == {"codes": [2, 2], "said": [f"error: {refusal(state)}"] * 2}
    assert not (tmp_path / "marker").exists()


# ---- the loader itself -----------------------------------------------------------------------

def test_forced_makes_every_torch_load_weights_only_and_restores_the_environment(tmp_path, monkeypatch):
    evil = plant(tmp_path / "evil.pt", tmp_path / "marker")
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    with safe_load.forced():
        with pytest.raises(Exception, match="posix.system"):
            torch.load(evil, weights_only=False)  # what DeepSpeed asks for
    assert not (tmp_path / "marker").exists()
    assert os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD") is None and os.environ["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"] == "1"


def test_nested_allowlists_leave_the_outer_one_as_it_was(tmp_path):
    from deepspeed.utils.tensor_fragment import fragment_address

    path = str(tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    torch.save({"mapping": fragment_address(numel=4, start=0)}, path)
    before = set(torch.serialization.get_safe_globals())  # what libraries registered (DTensor, …)
    with safe_load.allowing(()):
        assert safe_load.load(path)["mapping"] == fragment_address(4, 0)  # allows it itself, then restores
        assert torch.serialization.get_safe_globals() == []
    assert set(torch.serialization.get_safe_globals()) == before
    renamed = shutil.copy(path, tmp_path / "layer_00-model_00-model_states.pt")  # a file that may not hold it
    with pytest.raises(safe_load.UnsafeFile) as refused:
        safe_load.load(renamed)
    assert str(refused.value) == (f"{renamed}: holds {FRAGMENT}, which is not loaded: only {PLAIN} are (anything "
                                  "else could run code)")


def test_the_checkpoint_engine_and_the_rng_files_load_weights_only(tmp_path):
    from runtime import rng

    evil = plant(tmp_path / "mp_rank_00_model_states.pt", tmp_path / "marker")
    with pytest.raises(safe_load.UnsafeFile, match="posix.system"):
        safe_load.SafeCheckpointEngine().load(evil, map_location=lambda storage, _: storage)
    plant(rng.path(str(tmp_path), 0), tmp_path / "marker")
    with pytest.raises(safe_load.UnsafeFile, match="posix.system"):
        rng.load(str(tmp_path), 0)
    assert not (tmp_path / "marker").exists()


@pytest.mark.parametrize("content,why", [(b"", "an empty file"), (b"127.0.0.1 localhost\n", "not a PyTorch file")])
def test_a_foreign_or_empty_file_is_unreadable_not_unsafe(tmp_path, content, why):
    path = tmp_path / "rng_rank00000.pt"
    path.write_bytes(content)
    with pytest.raises(safe_load.UnreadableFile) as refused:
        safe_load.load(str(path))
    assert str(refused.value) == f"{path}: {why}"
    assert safe_load.check_folder(str(tmp_path)) is None  # damage is the manifest's business
