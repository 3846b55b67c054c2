"""`./run.sh bench model --against REV`: the model package of another commit trained next to today's."""
from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess

import pytest
import torch

from bench.model import BenchError, compare, main, model_at
from planner.planner import named_model

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _git(repo, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                          check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    """A repository whose second commit holds today's model/ package (the first has none)."""
    root = tmp_path_factory.mktemp("repo")
    _git(root, "init", "-q")
    (root / "README").write_text("no model here\n")
    _git(root, "add", "README")
    _git(root, "commit", "-qm", "without model")
    shutil.copytree(os.path.join(REPO, "model"), root / "model",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    _git(root, "add", "model")
    _git(root, "commit", "-qm", "model")
    return root


def test_against_a_commit_trains_its_model_with_the_same_losses(repo):
    commit, old = model_at("HEAD", str(repo))
    assert commit == _git(repo, "rev-parse", "HEAD")[:10]
    assert old.__name__ == f"model_at_{commit}.transformer"
    assert os.path.dirname(old.__file__) != os.path.join(REPO, "model")
    import model.config
    import model.layers

    # its own imports point at its own package, not at today's
    assert old.ModelConfig is not model.config.ModelConfig and old.EncoderLayer is not model.layers.EncoderLayer
    cfg = dataclasses.replace(named_model("slurm-tiny"), dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
    tokens = torch.randint(4, cfg.vocab_size, (4, 13), generator=torch.Generator().manual_seed(0))
    batch = {"src": tokens[:, :6].contiguous(), "tgt_in": tokens[:, 6:-1].contiguous(), "tgt_out": tokens[:, 7:].contiguous()}
    result = compare(cfg, batch, warmup=0, steps=2, against=(commit, old))
    assert set(result) == {"eager", "compiled", commit}
    # the same code, weights and batch: the same losses, step after step (the optimizer moves them);
    # compiled layers (fused kernels: another summation order) to rounding
    assert result[commit]["losses"] == result["eager"]["losses"]
    assert result["compiled"]["losses"] == pytest.approx(result["eager"]["losses"], rel=1e-6)
    assert result[commit]["losses"][0] != result[commit]["losses"][1]
    assert all(s > 0 for s in result[commit]["cpu_s"])


def test_against_a_bad_revision_says_what_to_do(repo, tmp_path, capsys):
    with pytest.raises(BenchError, match=r"--against nosuch: not a commit of the git repository .*`git log`"):
        model_at("nosuch", str(repo))
    with pytest.raises(BenchError, match=r"has no model/ package"):
        model_at("HEAD~1", str(repo))
    assert main(["--model", "slurm-tiny", "--against", "no-such-revision", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "error: --against no-such-revision: not a commit" in err and "Traceback" not in err
    assert not os.listdir(tmp_path)
