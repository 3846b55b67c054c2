"""Every normalisation strategy: its constants, init scales, structure and BranchNorm's schedule."""
import math

import pytest
import torch
import torch.nn.functional as F

from model.config import ModelConfig
from model.decoding import IncrementalDecoder
from model.norms import (
    STRATEGIES,
    BranchNormResidual,
    PostNormResidual,
    PreNormResidual,
    branchnorm_mix,
    deepnorm_constants,
    resolve,
    set_training_step,
    subln_constants,
)
from model.transformer import EncoderDecoder

ALL = sorted(STRATEGIES)


pytestmark = pytest.mark.usefixtures("one_thread")


def small(norm: str, **kw) -> ModelConfig:
    base = dict(encoder_layers=3, decoder_layers=2, d_model=16, heads=2, ffn_dim=32, vocab_size=40,
                norm=norm, dropout=0.0, branchnorm_max_norm_step=10)
    return ModelConfig(**{**base, **kw})


def tokens(b: int, t: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, 40, (b, t), generator=g)


@pytest.mark.parametrize("n,m", [(6, 6), (18, 18), (100, 100), (12, 3)])
def test_subln_gamma_follows_the_authors_encoder_decoder_formula(n, m):
    c = subln_constants("encoder-decoder", n, m)
    assert c["encoder_gamma"] == pytest.approx(math.sqrt(math.log(3 * m) * math.log(2 * n) / 3), rel=1e-12)
    assert c["decoder_gamma"] == pytest.approx(math.sqrt(math.log(3 * m)), rel=1e-12)
    enc, dec = resolve("subln", n, m)
    assert (enc.beta, dec.beta) == (c["encoder_gamma"], c["decoder_gamma"])
    assert enc.placement == dec.placement == "pre" and enc.final_norm and dec.final_norm


def test_subln_gamma_known_values_and_single_stack_forms():
    # Hand-computed: sqrt(log 300) = 2.38826; sqrt(log 300 · log 200 / 3) = 3.17388; sqrt(log 12) = 1.57635
    c = subln_constants("encoder-decoder", 100, 100)
    assert c["encoder_gamma"] == pytest.approx(3.17388, rel=1e-5)
    assert c["decoder_gamma"] == pytest.approx(2.38826, rel=1e-5)
    assert subln_constants("encoder-only", encoder_layers=6)["encoder_gamma"] == pytest.approx(1.57635, rel=1e-5)
    assert subln_constants("decoder-only", decoder_layers=6)["decoder_gamma"] == pytest.approx(1.57635, rel=1e-5)
    with pytest.raises(ValueError, match="architecture"):
        subln_constants("encoder-encoder", 6, 6)


def test_records_of_every_strategy():
    expect = {"postln": ("post", 1.0, 1.0, False), "preln": ("pre", 1.0, 1.0, True),
              "postln-init": ("post", 1.0, 1.0, False), "branchnorm": ("branch", 1.0, 1.0, False)}
    for norm, (placement, alpha, beta, final) in expect.items():
        for stack in resolve(norm, 18, 18):
            assert (stack.placement, stack.alpha, stack.beta, stack.final_norm) == (placement, alpha, beta, final)
    c = deepnorm_constants("encoder-decoder", 18, 18)
    enc, dec = resolve("deepnorm", 18, 18)
    assert (enc.alpha, enc.beta, dec.alpha, dec.beta) == (c["encoder_alpha"], c["encoder_beta"],
                                                          c["decoder_alpha"], c["decoder_beta"])
    # Post-LN-init: layer l = 1..N gets k_l = N − l + 1, i.e. layer index i = 0..N−1 gets N − i.
    enc, dec = resolve("postln-init", 5, 3)
    assert [enc.layer(i).beta for i in range(5)] == pytest.approx([1 / 5, 1 / 4, 1 / 3, 1 / 2, 1])
    assert [dec.layer(i).beta for i in range(3)] == pytest.approx([1 / 3, 1 / 2, 1])
    assert enc.layer(0).gain("q") == enc.layer(0).gain("k") == 1.0
    assert resolve("branchnorm", 6, 6, max_norm_step=123)[0].max_norm_step == 123


def _std_ratio(weight: torch.Tensor, gain: float) -> float:
    fan_out, fan_in = weight.shape
    return weight.std().item() / (gain * math.sqrt(2.0 / (fan_in + fan_out)))


def _expected_gain(norm: str, stack: str, index: int, n: int, m: int) -> float:
    if norm == "postln-init":
        return 1.0 / ((n if stack == "encoder" else m) - index)
    if norm == "subln":
        return subln_constants("encoder-decoder", n, m)[f"{stack}_gamma"]
    if norm.startswith("deepnorm"):
        return resolve(norm, n, m)[0 if stack == "encoder" else 1].beta
    return 1.0


@pytest.mark.parametrize("norm", ALL)
def test_init_std_of_every_projection(norm):
    # d=192, ffn=768: ≥ 37k samples per matrix, the sample std is within ~1.5% of the truth.
    n, m = 4, 2
    cfg = ModelConfig(encoder_layers=n, decoder_layers=m, d_model=192, heads=4, ffn_dim=768, vocab_size=64, norm=norm)
    model = EncoderDecoder(cfg, seed=3)
    for stack, layers, attns in (("encoder", model.encoder_layers, ["self_attn"]),
                                 ("decoder", model.decoder_layers, ["self_attn", "cross_attn"])):
        for i, layer in enumerate(layers):
            gain = _expected_gain(norm, stack, i, n, m)
            for attn in (getattr(layer, a) for a in attns):
                assert _std_ratio(attn.projection("q")[0], 1.0) == pytest.approx(1.0, abs=0.03)
                assert _std_ratio(attn.projection("k")[0], 1.0) == pytest.approx(1.0, abs=0.03)
                assert _std_ratio(attn.projection("v")[0], gain) == pytest.approx(1.0, abs=0.03), (stack, i)
                assert _std_ratio(attn.out_proj.weight, gain) == pytest.approx(1.0, abs=0.03), (stack, i)
            assert _std_ratio(layer.ffn.fc1.weight, gain) == pytest.approx(1.0, abs=0.03), (stack, i)
            assert _std_ratio(layer.ffn.fc2.weight, gain) == pytest.approx(1.0, abs=0.03), (stack, i)


def test_structure_of_each_strategy():
    residual_class = {"postln": PostNormResidual, "deepnorm": PostNormResidual, "postln-init": PostNormResidual,
                      "deepnorm-xavier-1.15": PostNormResidual, "preln": PreNormResidual, "subln": PreNormResidual,
                      "branchnorm": BranchNormResidual}
    for norm in ALL:
        model = EncoderDecoder(small(norm))
        assert type(model.decoder_layers[1].cross_attn_res) is residual_class[norm]
        assert (model.encoder_norm is not None) == (norm in ("preln", "subln"))
        dec = model.decoder_layers[0]
        inner = [isinstance(x.inner_norm, torch.nn.LayerNorm) for x in (dec.self_attn, dec.cross_attn, dec.ffn)]
        # Sub-LN: inner LayerNorms in self-attention and FFN only, as in the authors' code
        assert inner == ([True, False, True] if norm == "subln" else [False, False, False])


def test_subln_inner_norms_sit_before_output_projection_and_fc2():
    # A LayerNorm between attention and W_O makes the sub-layer blind to the scale of W_V (and
    # one before fc2 to the scale of fc1): scaling them by 10 leaves the output unchanged.
    model = EncoderDecoder(small("subln"))
    layer = model.encoder_layers[1]
    x, mask = torch.randn(2, 5, 16), torch.ones(2, 1, 1, 5, dtype=torch.bool)
    attn_before, ffn_before = layer.self_attn(x, x, mask), layer.ffn(x)
    with torch.no_grad():
        layer.self_attn.projection("v")[0].mul_(10)
        layer.ffn.fc1.weight.mul_(10)
        layer.ffn.fc1.bias.mul_(10)
    torch.testing.assert_close(layer.self_attn(x, x, mask), attn_before, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(layer.ffn(x), ffn_before, rtol=1e-4, atol=1e-5)
    plain = EncoderDecoder(small("preln")).encoder_layers[1]
    before = plain.ffn(x)
    with torch.no_grad():
        plain.ffn.fc1.weight.mul_(10)
        plain.ffn.fc1.bias.mul_(10)
    assert not torch.allclose(plain.ffn(x), before)  # without the inner norm the scale shows


def test_branchnorm_schedule_at_zero_half_and_after_T():
    T = 10
    assert [branchnorm_mix(t, T) for t in (0, 5, 10, 11, 10_000)] == [0.0, 0.5, 1.0, 1.0, 1.0]
    torch.manual_seed(0)
    block = BranchNormResidual(16, dropout=0.0, eps=1e-5, max_norm_step=T)
    with torch.no_grad():
        block.norm.weight.uniform_(0.5, 1.5)
        block.norm.bias.uniform_(-0.5, 0.5)
    x, w = torch.randn(3, 4, 16), torch.randn(16, 16) * 3
    branch = lambda h: h @ w  # noqa: E731
    y = branch(x)
    ln0 = F.layer_norm(y, (16,), eps=1e-5)
    post = lambda z: F.layer_norm(x + z, (16,), block.norm.weight, block.norm.bias, eps=1e-5)  # noqa: E731
    for t, expected in ((0, post(ln0)), (5, post(0.5 * ln0 + 0.5 * y)), (T, post(y)), (3 * T, post(y))):
        block.set_step(t)
        torch.testing.assert_close(block(x, branch), expected, msg=f"t={t}")
        assert int(block.step) == t


def test_branchnorm_after_T_is_exactly_post_ln_and_differs_before():
    src, tgt = tokens(2, 7), tokens(2, 5, seed=1)
    post = EncoderDecoder(small("postln"), seed=5)
    branch = EncoderDecoder(small("branchnorm"), seed=5)  # same RNG use: identical weights
    set_training_step(branch, 10)
    assert torch.equal(branch(src, tgt), post(src, tgt))
    set_training_step(branch, 9)
    assert not torch.allclose(branch(src, tgt), post(src, tgt), atol=1e-4)


def test_branchnorm_step_travels_with_the_state_dict():
    trained = EncoderDecoder(small("branchnorm"), seed=5)
    set_training_step(trained, 4)
    fresh = EncoderDecoder(small("branchnorm"), seed=5)
    src, tgt = tokens(2, 6), tokens(2, 4, seed=1)
    assert not torch.equal(fresh(src, tgt), trained(src, tgt))
    fresh.load_state_dict(trained.state_dict())
    blocks = [m for m in fresh.modules() if isinstance(m, BranchNormResidual)]
    assert len(blocks) == 3 * 2 + 2 * 3 and all(int(b.step) == 4 for b in blocks)
    assert torch.equal(fresh(src, tgt), trained(src, tgt))


@pytest.mark.parametrize("norm", ALL)
def test_incremental_decoding_equals_full_forward(norm):
    model = EncoderDecoder(small(norm), seed=2).eval()
    set_training_step(model, 4)
    src, tgt = tokens(2, 6), tokens(2, 5, seed=1)
    with torch.no_grad():
        full = F.log_softmax(model(src, tgt), dim=-1)
        dec = IncrementalDecoder(model, src)
        steps = torch.stack([dec.step(tgt[:, t]) for t in range(tgt.size(1))], dim=1)
    torch.testing.assert_close(steps, full, rtol=1e-4, atol=1e-5)


def test_unknown_strategy_and_bad_T_are_refused():
    with pytest.raises(ValueError, match="model.norm"):
        EncoderDecoder(small("rmsnorm"))
    with pytest.raises(ValueError, match="branchnorm_max_norm_step"):
        EncoderDecoder(small("branchnorm", branchnorm_max_norm_step=0))


# ---- every strategy as a 2-stage pipeline (one deepspeed launch for all) ------------------------

PP_STEPS, PP_SAVE_AT = 4, 2
INSTRUMENTED = ["postln", "subln", "branchnorm"]  # a Post-LN, a Pre-LN style and a stepped strategy


def read_stability_csv(run_dir: str) -> list[dict]:
    """metrics/stability.csv as one dict per logged step, in the order written."""
    import csv
    import os

    logged: list[dict] = []
    with open(os.path.join(run_dir, "metrics", "stability.csv")) as f:
        for row in csv.DictReader(f):
            step = int(row["step"])
            if row["quantity"] == "delta_f":
                logged.append({"step": step, "delta_f": float(row["value"]), "ln_input": {}, "grad_norm": {}})
            else:
                logged[-1][row["quantity"]][row["layer"]] = float(row["value"])
    return logged


@pytest.fixture(scope="module")
def pp2_strategies(tiny_data, tmp_path_factory):
    import copy
    import json

    from trainer.config import load_config
    from tests.conftest import launch, write_run_config
    from tests.reference import reference_run

    work = tmp_path_factory.mktemp("strategies")
    config = write_run_config(str(work / "pp2.yaml"), str(work / "run"), tiny_data,
                              train={"micro_batches": 2, "clip_norm": 0.5, "lr": 0.002, "save_interval": 1000})
    out = str(work / "result.json")
    proc = launch(2, "tests.dist.strategies_worker",
                  ["--config", config, "--out", out, "--strategies", ",".join(ALL),
                   "--instrumented", ",".join(INSTRUMENTED), "--steps", str(PP_STEPS), "--save-at", str(PP_SAVE_AT)])
    assert proc.returncode == 0, "strategies worker failed (its output is above)"
    with open(out) as f:
        result = json.load(f)
    refs = {}
    for norm in ALL:
        cfg = copy.deepcopy(load_config(config))
        cfg.model.norm, cfg.model.branchnorm_max_norm_step = norm, 3
        refs[norm] = reference_run(cfg, PP_STEPS, instruments=True)
    logs = {norm: read_stability_csv(str(work / f"run-{norm}")) for norm in INSTRUMENTED}
    return result, refs, logs


@pytest.mark.parametrize("norm", ALL)
def test_pp2_losses_equal_single_process_for_every_strategy(pp2_strategies, norm):
    result, refs, _ = pp2_strategies
    got, ref = result[norm]["uninterrupted"], refs[norm]
    assert len(got["loss"]) == PP_STEPS
    assert got["loss"] == pytest.approx(ref["loss"], rel=1e-5)
    assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
    assert ref["grad_norm"][0] > 0.5  # clipping was active, so the norm matters


def test_strategies_really_differ(pp2_strategies):
    _, refs, _ = pp2_strategies
    first_losses = {norm: refs[norm]["loss"][0] for norm in ALL}
    # postln and branchnorm share weights; BranchNorm's normalised branch changes the first loss
    assert len({round(v, 6) for v in first_losses.values()}) == len(ALL)


@pytest.mark.parametrize("norm", INSTRUMENTED)
def test_pp2_instruments_equal_single_process(pp2_strategies, norm):
    _, refs, logs = pp2_strategies
    ref, logged = refs[norm], logs[norm][:PP_STEPS + 1]  # the uninterrupted run's rows
    assert [row["step"] for row in logged] == list(range(PP_STEPS + 1))
    assert logged[0]["delta_f"] == 0.0 and ref["delta_f"][0] == 0.0  # ‖ΔF‖ = 0 at θ_0
    assert all(row["delta_f"] > 1e-3 for row in logged[1:])  # and positive after a step
    assert [row["delta_f"] for row in logged] == pytest.approx(ref["delta_f"], rel=1e-4, abs=1e-6)
    layers = [f"encoder_layers.{i}" for i in range(3)] + [f"decoder_layers.{i}" for i in range(3)]
    for step, row in enumerate(logged):
        assert sorted(row["ln_input"]) == sorted(layers)  # both stages' layers gathered to rank 0
        assert row["ln_input"] == pytest.approx(ref["ln_input"][step], rel=1e-5)
        if step:
            assert sorted(row["grad_norm"]) == sorted(layers)
            assert row["grad_norm"] == pytest.approx(ref["layer_grad"][step], rel=1e-4)


def test_branchnorm_step_is_identical_on_every_stage_and_survives_resume(pp2_strategies):
    result, refs, logs = pp2_strategies
    run = result["branchnorm"]
    assert run["branch_steps"] == [PP_STEPS]  # every block of rank 0's stage holds t = 4
    assert run["resumed_from"] == PP_SAVE_AT and run["resumed_branch_steps"] == [PP_SAVE_AT]
    assert run["resumed"]["loss"] == pytest.approx(run["uninterrupted"]["loss"][PP_SAVE_AT:], rel=1e-6)
    # the resumed run kept measuring ‖ΔF‖ against step 0 (F(x, θ_0) was reloaded)
    resumed_rows = logs["branchnorm"][PP_STEPS + 1:]
    assert [row["step"] for row in resumed_rows] == list(range(PP_SAVE_AT + 1, PP_STEPS + 1))
    assert [row["delta_f"] for row in resumed_rows] == pytest.approx(refs["branchnorm"]["delta_f"][PP_SAVE_AT + 1:],
                                                                     rel=1e-4)
