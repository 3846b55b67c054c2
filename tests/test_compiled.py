"""Compiled layers (parallel/compiled.py, train.compile) and the counts `./run.sh bench ops` reports.

In one process, on the small model of the suite: the kernel operations of a forward + backward
per layer kind, eager and compiled, stay at or under what the project reached (a regression guard
on counts, not a timing; bench/counting.py has the counting rule); micro-batches of varying shapes,
one of a single sentence and evaluation compile no more than one training and one evaluation graph
per layer kind, with no graph break; compiled layers give eager's outputs and gradients to float32
rounding.

One launch of 2 ranks (tests/dist/compiled_worker.py), pp = 2: the compiled trainer's losses,
clipped norms and parameters equal the single-process eager reference's; its checkpoint resumes in
an eager run with the same losses; with dropout, activation checkpointing recomputes the masks it
drew (losses bit-equal to the same run without checkpointing); no host sync inside micro-batches.
"""
import dataclasses

import pytest
import torch

from bench.ops import compilations, count_layers
from model.config import ModelConfig
from model.layers import padding_mask
from model.transformer import build_layer
from parallel.compiled import compile_layers
from tests.conftest import TINY_MODEL, run_worker, write_run_config
from tests.reference import assert_parameters_equal, assert_steps_equal, load_params, reference_run
from trainer.config import load_config

MODEL = ModelConfig(**{**TINY_MODEL, "dropout": 0.1}, vocab_size=600)
# Reached on the suite's model (deepnorm, residual dropout 0.1; fused Q/K/V; an additive mask):
# the guard fails when a change adds kernels. Eager is what a GPU runs without train.compile.
REACHED = {"embedding": (18, 5), "encoder": (37, 25), "decoder": (60, 41), "output": (20, 5)}
STEPS = 4


@pytest.fixture(scope="module")
def counted(one_thread):
    return count_layers(MODEL, 8, 12, 10, compiled=True), compilations(MODEL)


@pytest.mark.parametrize("kind", sorted(REACHED))
def test_kernel_operations_per_layer_stay_at_or_under_what_was_reached(counted, kind):
    eager, compiled = REACHED[kind]
    got = counted[0][kind]
    assert got["eager"] <= eager and got["compiled"] <= compiled, got
    assert got["compiled"] < got["eager"]  # the compiler fuses: if not, it is not running


def test_varying_shapes_compile_one_graph_per_kind_for_training_and_one_for_evaluation(counted):
    result = counted[1]
    assert result["graph_breaks"] == 0
    # 5 training shapes, a batch of one (run eagerly), 2 evaluation shapes
    assert result["compilations_per_layer_kind"] == {"encoder": 2, "decoder": 2}


def test_compiled_layers_give_eager_outputs_and_gradients(one_thread):
    cfg = dataclasses.replace(MODEL, dropout=0.0)
    src = torch.randint(4, 600, (6, 11))
    src[::2, 8:] = cfg.pad_id
    mask = padding_mask(src, cfg.pad_id)
    for kind in ("encoder", "decoder"):
        torch.manual_seed(3)
        eager, compiled = build_layer(cfg, kind), build_layer(cfg, kind)
        compiled.load_state_dict(eager.state_dict())
        compile_layers(compiled)
        assert compiled.state_dict().keys() == eager.state_dict().keys()  # checkpoints keep their names
        torch.manual_seed(4)
        x, enc = torch.randn(6, 11 if kind == "encoder" else 9, cfg.d_model), torch.randn(6, 11, cfg.d_model)
        outs = []
        for layer in (eager, compiled):
            xs = x.clone().requires_grad_()
            out = layer(xs, mask) if kind == "encoder" else layer(xs, enc, mask)
            out.square().sum().backward()
            outs.append((out.detach(), xs.grad, {n: p.grad for n, p in layer.named_parameters()}))
        (a, ga, pa), (b, gb, pb) = outs
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)  # fused kernels sum in another order
        torch.testing.assert_close(gb, ga, rtol=1e-4, atol=1e-5)
        for name in pa:
            torch.testing.assert_close(pb[name], pa[name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.fixture(scope="module")
def pp2_compiled(tiny_data, tmp_path_factory):
    work = tmp_path_factory.mktemp("compiled")
    config = write_run_config(str(work / "cfg.yaml"), str(work / "run"), tiny_data,
                              train={"micro_batches": 3, "clip_norm": 0.05, "lr": 0.001, "save_interval": 1000})
    out = str(work / "result.json")
    result = run_worker(2, "tests.dist.compiled_worker", out, ["--config", config, "--steps", str(STEPS)])
    return result, load_params(f"{out}.compiled"), reference_run(load_config(config), STEPS)


def test_compiled_pipeline_equals_the_eager_single_process(pp2_compiled):
    result, params, ref = pp2_compiled
    assert_steps_equal(result["compiled"], ref, clipped_at=0.05)
    assert_parameters_equal(params, ref)
    # each rank compiled one training graph per layer kind it holds, for every run of the launch
    assert result["graphs"] and all(1 <= n <= 2 for n in result["graphs"].values()), result["graphs"]


def test_a_compiled_runs_checkpoint_resumes_in_an_eager_run(pp2_compiled):
    result, _, ref = pp2_compiled
    resumed = result["eager_resume"]
    assert resumed["from"] == STEPS // 2 and result["eager_compiled_layers"] == 0
    assert resumed["loss"] == pytest.approx(result["compiled"]["loss"][STEPS // 2:], rel=1e-5)
    assert resumed["loss"] == pytest.approx(ref["loss"][STEPS // 2:], rel=1e-5)


def test_recomputation_draws_the_compiled_layers_dropout_masks_again(pp2_compiled):
    result = pp2_compiled[0]
    assert result["dropout_ac"]["loss"] == result["dropout"]["loss"]  # bit for bit
    assert result["dropout"]["loss"] != result["compiled"]["loss"]  # dropout was on


def test_no_host_sync_inside_micro_batches_with_compiled_layers(pp2_compiled):
    syncs = pp2_compiled[0]["syncs"]
    assert syncs["per_microbatch"] == 0, syncs
