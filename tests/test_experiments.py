"""The experiments' recipes and measurements (experiments/depth_1000.py, experiments/update_norms.py).

Cheap checks only (the experiments themselves take an hour): every depth-1000 run config is a
valid run config of the promised shape and recipe; the fig4 runs use exactly update-norms' part-1
recipe (the docs draw both in one figure); the seeds study's three readings of the update are what
they claim to be.
"""
import math
import os

import pytest
import torch
import yaml

from data.prepare import load_manifest
from experiments import depth_1000, update_norms
from model.transformer import layer_plan
from trainer.config import load_config


def test_every_depth_1000_run_config_is_valid_and_has_the_promised_shape(tmp_path):
    runs = depth_1000.plan(quick=False, branchnorm=True, depths=None, train_steps=None)
    assert {(r.kind, r.strategy, r.depth) for r in runs} == {
        ("fig4", s, d) for s in ("deepnorm", "postln", "branchnorm") for d in (200, 500)} | {
        ("train", s, d) for s in ("deepnorm", "postln", "branchnorm") for d in (200, 500)}
    assert {r.steps for r in runs if r.kind == "train"} == {300}
    for run in runs:
        path = tmp_path / f"{run.name}.yaml"
        path.write_text(yaml.safe_dump(run.config(str(tmp_path))))
        cfg = load_config(str(path))
        m, p, t = cfg.model, cfg.parallel, cfg.train
        assert (m.d_model, m.ffn_dim, m.heads, m.encoder_layers, m.decoder_layers) == (64, 128, 2, run.depth, run.depth)
        assert p.pipeline_stages == 2 and p.data_parallel == 1 and p.tensor_parallel == 1
        assert t.max_steps == run.steps and cfg.data.max_tokens == 256
        assert t.instrument_interval == (1 if run.kind == "fig4" else depth_1000.VALID_EVERY)
        if run.kind == "train":  # the recipe that leaves the unigram plateau at 500L (docs/depth-1000.md)
            assert (t.lr, t.warmup_steps, t.micro_batches, t.clip_norm) == (3e-4, 25, 2, 1.0)
        m.vocab_size = 100
        assert len(layer_plan(m)) == 2 * run.depth + 2


def test_fig4_runs_use_the_update_norms_part1_recipe(tmp_path):
    run = depth_1000.Run("fig4", "deepnorm", 500, depth_1000.FIG4_STEPS)
    cfg = run.config(str(tmp_path))
    spec = update_norms.specs(quick=False)[0]
    ref = update_norms.model_config("deepnorm", 500, 100)
    assert cfg["train"]["lr"] == update_norms.LR and cfg["train"]["warmup_steps"] == update_norms.PART1_WARMUP
    assert cfg["train"]["micro_batches"] == 1 and cfg["train"]["clip_norm"] == 0.0
    assert cfg["data"] == {"max_tokens": update_norms.MAX_TOKENS}  # the same prepared data
    assert cfg["train"]["seed"] == spec.seed == 1
    for key in ("d_model", "heads", "ffn_dim", "dropout"):
        assert cfg["model"][key] == getattr(ref, key)
    # the trainer's schedule at steps 1..20 is update-norms' lr_at
    from parallel.engine_config import inverse_sqrt

    factor = inverse_sqrt(cfg["train"]["warmup_steps"])
    for step in (1, 10, 20):
        assert cfg["train"]["lr"] * factor(step - 1) == pytest.approx(update_norms.lr_at(step, update_norms.PART1_WARMUP))


def test_read_run_keeps_the_last_value_of_a_repeated_step_and_the_logged_step0_dev_loss(tmp_path):
    metrics = tmp_path / "metrics" / "train"
    metrics.mkdir(parents=True)
    (metrics / "train_loss.csv").write_text("step,loss\n1,9.0\n2,8.5\n2,8.4\n")
    (metrics / "stability_delta_f.csv").write_text("step,delta_f\n0,0.0\n1,0.01\n")
    (tmp_path / "train.log").write_text("step 0 | valid loss 9.1234\nstep 2 | loss 8.4\n")
    rows = depth_1000.read_run(str(tmp_path))
    assert rows[2]["train_loss"] == 8.4 and rows[1]["delta_f"] == 0.01 and rows[0]["valid_loss"] == 9.1234


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_seed_study_readings_of_the_update(tiny_data, optimizer):
    torch.set_num_threads(1)
    spec = update_norms.Spec(3, "deepnorm", 2, 3, warmup=10, measure_at=(0, 3), seed=2, optimizer=optimizer)
    vocab = load_manifest(tiny_data)["vocab_size"]
    result = update_norms.run_one(spec, tiny_data, vocab)
    rows = {r["step"]: r for r in result["rows"]}
    assert rows[0]["delta_f"] == rows[0]["delta_enc"] == rows[0]["delta_f_total"] == 0.0
    assert rows[3]["delta_f"] > 0 and rows[3]["delta_enc"] > 0
    from data.batching import PairDataset, eval_batches

    dev = eval_batches(PairDataset(os.path.join(tiny_data, "dev")), update_norms.MAX_TOKENS)
    n = int((dev[len(dev) // 2]["tgt_out"] != 0).sum())
    assert rows[3]["delta_f_total"] == pytest.approx(rows[3]["delta_f"] * math.sqrt(n), rel=1e-9)
    peak = update_norms.SGD_LR if optimizer == "sgd" else update_norms.LR
    assert rows[3]["lr"] == pytest.approx(peak * 3 / 10)
