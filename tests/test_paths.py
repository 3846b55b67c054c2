"""Paths from anywhere: a path on the command line is the caller's (relative to the folder ./run.sh
was called from), `~` and `$VARS` expand in the path keys of a config, and a relative path inside
a config is relative to the repository root (docs/configuration.md). Through the real ./run.sh,
called from another folder, with HOME pointing at a scratch folder."""
from __future__ import annotations

import os
import shutil
import subprocess
import uuid

import yaml

from tests.bad_inputs import assert_one_line_error, base_config, good_corpus, run_cli, write_case
from tests.conftest import ROOT


def run_sh(args: list[str], cwd, home, **env) -> subprocess.CompletedProcess:
    environment = {**os.environ, "HOME": str(home), "OMP_NUM_THREADS": "1", **env}
    environment.pop("DEEPNET_CALLER_CWD", None)
    return subprocess.run([os.path.join(ROOT, "run.sh"), *args], cwd=cwd, env=environment, capture_output=True,
                          text=True, timeout=600)


def test_prepare_from_another_folder_with_home_and_variable_paths(tmp_path):
    home, caller = tmp_path / "home", tmp_path / "work"
    (caller / "cfg").mkdir(parents=True)
    good_corpus(home)  # ~/corpus
    cfg = base_config(tmp_path, "~/corpus")
    cfg["run_dir"] = "$RUNS_ROOT/mine"
    cfg["data"].update(vocab_size=300, spm_sample_sentences=1000)
    (caller / "cfg" / "mine.yaml").write_text(yaml.safe_dump(cfg))
    proc = run_sh(["prepare", "cfg/mine.yaml", "--set", "data.max_tokens=512"], caller, home,
                  RUNS_ROOT=str(home / "runs"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = home / "runs" / "mine" / "data"
    assert (data / "manifest.json").exists() and (data / "spm.model").exists()
    assert f"config {caller}/cfg/mine.yaml → {data}" in proc.stdout

    # --out is the caller's too; a config path that is not there is named as the caller means it
    proc = run_sh(["prepare", "cfg/mine.yaml", "--out", "prepared"], caller, home, RUNS_ROOT=str(home / "runs"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (caller / "prepared" / "manifest.json").exists()
    proc = run_sh(["prepare", "cfg/nope.yaml"], caller, home)
    assert_one_line_error(proc.returncode, proc.stdout, proc.stderr, [f"{caller}/cfg/nope.yaml", "no such config file"])

    # an unset variable and a missing corpus are named as expanded, before anything is written
    proc = run_sh(["prepare", "cfg/mine.yaml"], caller, home)
    assert_one_line_error(proc.returncode, proc.stdout, proc.stderr, ["run_dir", "RUNS_ROOT is not set"])
    proc = run_sh(["slurm", "cfg/mine.yaml", "--nodes", "1", "--gpus-per-node", "0", "--set",
                   "data.corpus=~/gone", "--set", "run_dir=~/runs/job"], caller, home)
    assert_one_line_error(proc.returncode, proc.stdout, proc.stderr, ["data.corpus", f"{home}/gone", "does not exist"])
    assert not (home / "runs" / "job").exists()


def test_relative_paths_inside_a_config_are_relative_to_the_repository(tmp_path):
    """Called from another folder, `run_dir: runs/<name>` is the repository's runs/<name> (the rule
    the bundled configs rely on: runs/default, and corpus paths such as corpora/opus-100)."""
    name = f"test-paths-{uuid.uuid4().hex[:8]}"
    cfg = base_config(tmp_path)
    cfg["run_dir"] = f"runs/{name}"
    (tmp_path / "mine.yaml").write_text(yaml.safe_dump(cfg))
    try:
        proc = run_sh(["slurm", "mine.yaml", "--nodes", "1", "--gpus-per-node", "0"], tmp_path, tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert f"RUN_DIR={ROOT}/runs/{name}\n" in proc.stdout
        assert os.path.exists(os.path.join(ROOT, "runs", name, "slurm", "job.sbatch"))
        assert not (tmp_path / "runs").exists()
    finally:
        shutil.rmtree(os.path.join(ROOT, "runs", name), ignore_errors=True)


def test_command_line_paths_in_process_follow_the_callers_folder(tmp_path, capsys, monkeypatch):
    """What ./run.sh passes (DEEPNET_CALLER_CWD) decides; the commands then run from the root."""
    from launcher.options import caller_cwd

    write_case(tmp_path, yaml.safe_dump({**base_config(tmp_path), "run_dir": str(tmp_path / "run")}))
    monkeypatch.setenv("DEEPNET_CALLER_CWD", str(tmp_path))
    monkeypatch.chdir(ROOT)
    code, out, err = run_cli(["slurm", "cfg.yaml", "--nodes", "1", "--gpus-per-node", "0", "--run-dir", "elsewhere"],
                             capsys)
    assert code == 0, err
    assert os.path.exists(tmp_path / "elsewhere" / "slurm" / "job.sbatch") and not (tmp_path / "run").exists()
    assert caller_cwd() == str(tmp_path) and os.getcwd() == ROOT and "DEEPNET_CALLER_CWD" not in os.environ
    monkeypatch.setenv("DEEPNET_CALLER_CWD", str(tmp_path))
    assert_one_line_error(*run_cli(["translate", "no-model", "--to", "de"], capsys), [f"{tmp_path}/no-model"])
