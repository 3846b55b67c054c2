"""Shared fixtures: a small real corpus prepared once per test session, and launch helpers."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Workers and scripts the tests start import the project as modules (python -m …) from the root.
if ROOT not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, (ROOT, os.environ.get("PYTHONPATH"))))
if os.environ.get("DEEPNET_TEST_GPU") != "1":  # ./run.sh test-gpu leaves the accelerator to DeepSpeed
    os.environ.setdefault("DS_ACCELERATOR", "cpu")


# A small corpus from the bundled gettext catalogs: two languages, both directions.
TINY_DATA = {"languages": ["de", "fr"], "vocab_size": 600, "max_tokens": 256,
             "max_source_len": 48, "max_target_len": 48, "dev_size": 40, "test_size": 40}
TINY_MODEL = {"encoder_layers": 3, "decoder_layers": 3, "d_model": 32, "heads": 4, "ffn_dim": 64,
              "norm": "deepnorm", "dropout": 0.0}


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for the module's tests: the models are tiny, a second thread gains
    nothing, and on a loaded machine OpenMP's spinning threads made the single-process references
    5-30× slower."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> str:
    from data.config import DataConfig
    from data.prepare import prepare_data

    out = str(tmp_path_factory.mktemp("tiny") / "data")
    prepare_data(DataConfig(**TINY_DATA), out, log=lambda *_: None)
    return out


def write_run_config(path: str, run_dir: str, data_dir: str, **sections) -> str:
    """A YAML config for `run_dir` whose data/ is a link to the prepared `data_dir`."""
    os.makedirs(run_dir, exist_ok=True)
    link = os.path.join(run_dir, "data")
    if not os.path.exists(link):
        os.symlink(data_dir, link)
    cfg = {"run_dir": run_dir, "model": dict(TINY_MODEL), "data": dict(TINY_DATA),
           "parallel": {"pipeline_stages": 2}, "train": {"log_interval": 1, "warmup_steps": 2}}
    for name, values in sections.items():
        cfg.setdefault(name, {}).update(values)
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)
    return path


def run_worker(world_size: int, module: str, out: str, args: list[str]) -> dict:
    """`launch` a worker that writes its result as JSON to `out` (it gets `--out out`); its result."""
    import json

    proc = launch(world_size, module, ["--out", out, *args])
    assert proc.returncode == 0, f"{module} failed (its output is above)"
    with open(out) as f:
        return json.load(f)


def launch(world_size: int, module: str, args: list[str], timeout: int = 600) -> subprocess.CompletedProcess:
    """Run `python -m module` under the real deepspeed launcher with `world_size` local ranks."""
    from launcher.launch import deepspeed_command, launch_env

    env = launch_env(world_size)
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(deepspeed_command(world_size, module, args), env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-6000:] + proc.stderr[-6000:])
    return proc


@pytest.fixture
def no_launch(monkeypatch):
    """Fails a case that gets as far as building the ranks' launch command."""
    import launcher.commands.train as train_command

    def refuse(*args, **kwargs):
        from tests.bad_inputs import RankLaunched

        raise RankLaunched(f"ranks were about to be launched: {args}")
    monkeypatch.setattr(train_command, "deepspeed_command", refuse)


SLURM_SCRIPTS = os.path.join(ROOT, "tests", "slurm")


def _slurm_unavailable() -> str | None:
    """Why a SLURM cluster cannot be run here, or None after making sure it is installed."""
    if os.geteuid() != 0:
        return "needs root to install and run slurmctld/slurmd/munge"
    if not os.path.exists("/etc/debian_version"):
        return "needs Debian's slurmctld/slurmd/munge packages (not a Debian system)"
    proc = subprocess.run(["bash", os.path.join(SLURM_SCRIPTS, "install.sh")], capture_output=True,
                          text=True, timeout=900)
    if proc.returncode != 0:
        return proc.stderr.strip() or "tests/slurm/install.sh failed"
    return None


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """A real SLURM cluster of fake nodes on this machine (tests/slurm/start.sh), one per session
    (its start takes minutes): the environment that reaches it (SLURM_CONF)."""
    reason = _slurm_unavailable()
    if reason:
        # pytest -q hides skip reasons; this one should be seen.
        print(f"\nthe SLURM tests are skipped: {reason}", file=sys.__stderr__, flush=True)
        pytest.skip(reason)
    state = str(tmp_path_factory.mktemp("slurm"))
    env = dict(os.environ, SLURM_CONF=os.path.join(state, "slurm.conf"))
    try:
        proc = subprocess.run(["bash", os.path.join(SLURM_SCRIPTS, "start.sh"), state], capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 0, f"the SLURM cluster did not start:\n{proc.stderr}"
        yield env
    finally:
        subprocess.run(["bash", os.path.join(SLURM_SCRIPTS, "stop.sh"), state], timeout=120)
