"""Paths from anywhere: a path on the command line (and a --set path) is the caller's (relative to
the folder ./run.sh was called from), `~` and `$VARS` expand in the path keys of a config, and a
relative path inside a config is relative to the config file's folder (docs/configuration.md);
errors name the absolute path they checked and the rule. Through the real ./run.sh, called from
another folder, with HOME pointing at a scratch folder."""
from __future__ import annotations

import os
import subprocess

import pytest
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
    assert f"config cfg/mine.yaml → {data}" in proc.stdout  # as the caller can paste them

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


def test_relative_paths_inside_a_config_are_from_its_folder_and_on_the_command_line_from_the_callers(tmp_path):
    """A config kept beside its corpus, used from another folder: `run_dir: runs/x` and `corpus:
    corpus` are the config's neighbours; `--set run_dir=here` is the caller's; a bundled config is
    named alone and puts its run beside the repository's configs/ (`run_dir: ../runs/{config}`: runs/default)."""
    project, caller = tmp_path / "project", tmp_path / "caller"
    caller.mkdir()
    good_corpus(project)  # project/corpus
    cfg = base_config(tmp_path, "corpus")
    cfg["run_dir"] = "runs/x"
    cfg["data"].update(vocab_size=300, spm_sample_sentences=1000)
    (project / "mine.yaml").write_text(yaml.safe_dump(cfg))
    proc = run_sh(["slurm", "../project/mine.yaml", "--nodes", "1", "--gpus-per-node", "0"], caller, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"RUN_DIR={project}/runs/x\n" in (project / "runs" / "x" / "slurm" / "job.sbatch").read_text()
    assert f"; the run: {project}/runs/x\n" in proc.stdout
    with open(project / "runs" / "x" / "slurm" / "config.yaml") as f:
        assert yaml.safe_load(f)["data"]["corpus"] == str(project / "corpus")
    proc = run_sh(["slurm", "../project/mine.yaml", "--nodes", "1", "--gpus-per-node", "0", "--set", "run_dir=here"],
                  caller, tmp_path)
    assert proc.returncode == 0 and (caller / "here" / "slurm" / "job.sbatch").exists(), proc.stderr[-3000:]
    # a corpus the config names that is not there: its absolute path and the rule
    cfg["data"]["corpus"] = "gone"
    (project / "other.yaml").write_text(yaml.safe_dump(cfg))
    proc = run_sh(["prepare", "../project/other.yaml"], caller, tmp_path)
    assert_one_line_error(proc.returncode, proc.stdout, proc.stderr,
                          [f"data.corpus: {project}/gone does not exist", "from the config file's folder"])
    # a bundled config by its name alone, from anywhere
    proc = run_sh(["config", "default"], caller, tmp_path)
    assert proc.returncode == 0 and f"run_dir: {ROOT}/runs/default  #" in proc.stdout, proc.stderr[-3000:]


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


@pytest.mark.parametrize("key,value,command,says", [
    ("data.corpus", "gettext:gone", "prepare", "{project}/gone does not exist"),
    ("data.spm_model", "gone/spm.model", "prepare", "{project}/gone/spm.model': no such file or folder"),
    ("train.init_from", "gone-run", "train", "{project}/gone-run: no such run directory, checkpoint folder or model file"),
])
def test_every_path_key_that_is_not_there_gets_the_path_and_the_rule(key, value, command, says, tmp_path, capsys):
    """A relative path key naming nothing: one line with the absolute path it checked and the rule
    (schema/fields.py PATH_RULE), before anything is written."""
    from schema.fields import PATH_RULE

    project = tmp_path / "project"
    project.mkdir()
    cfg = base_config(tmp_path)
    section, name = key.split(".")
    cfg[section][name] = value
    (project / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    code, out, err = run_cli([command, str(project / "cfg.yaml")], capsys)
    assert_one_line_error(code, out, err, [key, says.format(project=project), PATH_RULE])


def test_a_copied_config_gets_a_run_directory_of_its_own(tmp_path, capsys, no_launch):
    """run_dir's `{config}` is the config file's name: the bundled configs say `../runs/{config}`,
    so a copy trains in runs/<its name>, not in the original's run; a config without run_dir gets
    runs/<its name> beside it. The default config keeps runs/default."""
    import shutil

    from trainer.config import load_config

    configs = tmp_path / "configs"
    configs.mkdir()
    shutil.copy(os.path.join(ROOT, "configs", "default.yaml"), configs / "mine.yaml")
    assert load_config(str(configs / "mine.yaml")).run_dir == str(tmp_path / "runs" / "mine")
    assert load_config(os.path.join(ROOT, "configs", "default.yaml")).run_dir == os.path.join(ROOT, "runs", "default")
    cfg = base_config(tmp_path, str(tmp_path / "no-corpus"))
    del cfg["run_dir"]
    (tmp_path / "exp.yaml").write_text(yaml.safe_dump(cfg))
    assert load_config(str(tmp_path / "exp.yaml")).run_dir == str(tmp_path / "runs" / "exp")
    # --set (from the caller's folder) and --run-dir name it too
    named = load_config(str(tmp_path / "exp.yaml"), sets=["run_dir=out/{config}-b"], cwd=str(tmp_path / "here"))
    assert named.run_dir == str(tmp_path / "here" / "out" / "exp-b")
    # a config without run_dir whose former default (runs/default beside it) holds a run: said before anything
    (tmp_path / "runs" / "default").mkdir(parents=True)
    (tmp_path / "runs" / "default" / "config.json").write_text("{}")
    code, out, err = run_cli(["train", str(tmp_path / "exp.yaml")], capsys)
    lines = err.splitlines()
    assert code == 2 and len(lines) == 2 and lines[1].startswith("error: data.corpus: "), err
    assert lines[0] == (f"note: {tmp_path}/exp.yaml names no run_dir, so it trains in {tmp_path}/runs/exp (runs/{{config}} "
                        f"beside it); {tmp_path}/runs/default holds the run such a config had before: set run_dir: "
                        "runs/default in it to resume that run")
