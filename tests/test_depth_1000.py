"""A 1,000-layer model (500L-500L, tiny width) as a 2-stage pipeline equals the single-process model.

What only depth exposes: plan indices and per-layer init seeds over 1,002 plan layers, the
partition bounds of a plan that long, and DeepNorm's α/β at N = M = 500. One deepspeed launch
trains 2 clipped steps of 2 micro-batches; the single-process reference (tests/reference.py)
trains the same steps. Asserted: equal losses and clipped global gradient norms (≤ 1e-5
relative), equal parameters afterwards, a partition that covers every plan layer exactly once
and is balanced, α of every residual block on every stage and the init scale of each stack
against the paper's formulas.
"""
import json
import math

import pytest
import torch

from trainer.config import load_config
from model.config import ModelConfig
from model.norms import PostNormResidual
from model.transformer import EncoderDecoder, layer_plan
from tests.conftest import launch, write_run_config
from tests.reference import assert_parameters_equal, load_params, reference_run

N = M = 500
STEPS = 2
SHAPE = {"encoder_layers": N, "decoder_layers": M, "d_model": 8, "heads": 2, "ffn_dim": 16,
         "norm": "deepnorm", "dropout": 0.0}
ENC_ALPHA = 0.81 * (N**4 * M) ** (1 / 16)
ENC_BETA = 0.87 * (N**4 * M) ** (-1 / 16)
DEC_ALPHA = (3 * M) ** (1 / 4)
DEC_BETA = (12 * M) ** (-1 / 4)


@pytest.fixture(scope="module")
def deep_run(tiny_data, tmp_path_factory):
    work = tmp_path_factory.mktemp("depth1000")
    # clip_norm far below the gradient norm, so both steps are clipped; 2 micro-batches per step.
    config = write_run_config(str(work / "deep.yaml"), str(work / "run"), tiny_data, model=SHAPE,
                              data={"max_tokens": 128},
                              train={"micro_batches": 2, "clip_norm": 0.05, "lr": 0.001, "warmup_steps": 2,
                                     "save_interval": 1000})
    out = str(work / "result.json")
    proc = launch(2, "tests.dist.depth_worker", ["--config", config, "--out", out, "--steps", str(STEPS)])
    assert proc.returncode == 0, "depth worker failed (its output is above)"
    with open(out) as f:
        result = json.load(f)
    params = load_params(f"{out}.params")
    torch.set_num_threads(1)
    reference = reference_run(load_config(config), STEPS)
    return load_config(config), result, params, reference


def test_1000_layer_pipeline_losses_and_clipped_norms_equal_single_process(deep_run):
    _, result, _, ref = deep_run
    assert len(result["loss"]) == STEPS
    for step, (a, b) in enumerate(zip(result["loss"], ref["loss"])):
        assert a == pytest.approx(b, rel=1e-5), f"step {step + 1}: pipeline loss {a} vs reference {b}"
    for step, (a, b) in enumerate(zip(result["grad_norm"], ref["grad_norm"])):
        assert b > 0.05  # clipping was active
        assert a == pytest.approx(b, rel=1e-5), f"step {step + 1}: pipeline norm {a} vs reference {b}"


def test_1000_layer_pipeline_parameters_equal_single_process(deep_run):
    _, _, params, ref = deep_run
    assert set(params) == set(ref["params"])
    assert sum(1 for k in params if k.endswith("ffn.fc2.weight")) == N + M
    assert_parameters_equal(params, ref, atol=1e-6)


def test_1000_layer_partition_covers_every_plan_layer_once_and_is_balanced(deep_run):
    from model.flops import layer_costs

    cfg, result, _, _ = deep_run
    plan = layer_plan(cfg.model)
    assert len(plan) == N + M + 2
    parts = result["parts"]
    assert parts[0] == 0 and parts[-1] == len(plan) and 0 < parts[1] < len(plan)
    # Plan layers are children named by their index, except the tied embedding/output layer
    # (index 0 on the first stage, the last index on the last), which both stages hold.
    held = [s["indices"] for s in result["stages"]]
    assert held[0] == list(range(1, parts[1])) and held[1] == list(range(parts[1], parts[2] - 1))
    assert result["stages"][0]["has_tied_embedding"] and result["stages"][1]["has_tied_embedding"]
    costs = layer_costs(cfg.model)
    stage_costs = [sum(costs[parts[s]:parts[s + 1]]) for s in range(2)]
    assert max(stage_costs) <= sum(costs) / 2 + max(costs)  # no better cut exists


def test_alpha_of_every_residual_block_on_every_stage_is_the_paper_formula(deep_run):
    _, result, _, _ = deep_run
    seen = {}
    for stage in result["stages"]:
        seen.update(stage["alphas"])
    assert len(seen) == N + M
    for i in range(N):
        assert seen[f"encoder_layers.{i}"] == [pytest.approx(ENC_ALPHA, rel=1e-12)] * 2
    for i in range(M):
        assert seen[f"decoder_layers.{i}"] == [pytest.approx(DEC_ALPHA, rel=1e-12)] * 3


def _pooled_std_ratio(weights: list[torch.Tensor], gain: float) -> float:
    fan_out, fan_in = weights[0].shape
    return torch.cat([w.flatten() for w in weights]).std().item() / (gain * math.sqrt(2.0 / (fan_in + fan_out)))


def test_init_scale_of_each_stack_at_n_m_500_is_the_paper_beta():
    # Pooled over the 500 layers of a stack (32k–64k weights per projection), the std is within
    # ~1% of the truth: β_enc = 0.87·(N⁴M)^(−1/16) = 0.1248, β_dec = (12M)^(−1/4) = 0.1136.
    torch.set_num_threads(1)
    model = EncoderDecoder(ModelConfig(**SHAPE, vocab_size=40), seed=1)
    for layers, beta, attns in ((model.encoder_layers, ENC_BETA, ["self_attn"]),
                                (model.decoder_layers, DEC_BETA, ["self_attn", "cross_attn"])):
        for attn in attns:
            for proj, gain in (("q", 1.0), ("k", 1.0), ("v", beta), ("o", beta)):
                ws = [getattr(layer, attn).projection(proj)[0] for layer in layers]
                assert _pooled_std_ratio(ws, gain) == pytest.approx(1.0, abs=0.02), (attn, proj)
        for fc in ("fc1", "fc2"):
            assert _pooled_std_ratio([getattr(layer.ffn, fc).weight for layer in layers], beta) == \
                pytest.approx(1.0, abs=0.02), fc
        assert all(isinstance(layer.ffn_res, PostNormResidual) for layer in layers)
    # every layer drew its own weights (per-layer seeds): no two layers are equal
    firsts = {tuple(layer.ffn.fc1.weight[0].tolist()) for layer in [*model.encoder_layers, *model.decoder_layers]}
    assert len(firsts) == N + M
