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


def test_the_plain_step_averages_over_target_tokens_not_padding():
    """model/step.py: the loss is Σ over non-pad targets / their count, so padding rows change
    neither the loss nor the update (bench model divided by every target position, padding too)."""
    from model.step import plain_step, target_tokens
    from model.transformer import EncoderDecoder, smoothed_loss_sum

    cfg = dataclasses.replace(named_model("slurm-tiny"), dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
    tokens = torch.randint(4, cfg.vocab_size, (3, 13), generator=torch.Generator().manual_seed(0))
    batch = {"src": tokens[:, :6].contiguous(), "tgt_in": tokens[:, 6:-1].contiguous(), "tgt_out": tokens[:, 7:].contiguous()}
    padded = {k: v.clone() for k, v in batch.items()}
    padded["tgt_out"][0, 4:] = cfg.pad_id  # a shorter first target
    padded["tgt_in"][0, 5:] = cfg.pad_id
    assert target_tokens([padded], cfg.pad_id) == 3 * 6 - 2
    model = EncoderDecoder(cfg, seed=1).train()
    with torch.no_grad():
        expected = float(smoothed_loss_sum(model(padded["src"], padded["tgt_in"]), padded["tgt_out"], cfg.pad_id,
                                           cfg.label_smoothing)) / 16
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []
    done = plain_step(model, [padded], optimizer, clip_norm=float("inf"),
                      after_backward=lambda: seen.append(model.embed.weight.grad.clone()))
    assert done.loss == pytest.approx(expected, rel=1e-6) and done.lr == 0.1
    assert done.grad_norm > 0 and all(p.grad is None for p in model.parameters())
    # two micro-batches over the tokens of both: the same gradient as one batch of their rows
    again = EncoderDecoder(cfg, seed=1).train()
    halves = [{k: v[:1] for k, v in padded.items()}, {k: v[1:] for k, v in padded.items()}]
    plain_step(again, halves, torch.optim.SGD(again.parameters(), lr=0.1),
               after_backward=lambda: seen.append(again.embed.weight.grad.clone()))
    torch.testing.assert_close(seen[1], seen[0], rtol=1e-5, atol=1e-7)
