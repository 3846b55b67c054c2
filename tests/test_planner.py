"""The planner against what really happens.

* Its activation formula equals, byte for byte, what autograd saves for each pipeline layer.
* Its stage partition is the trainer's (small models) or as balanced (large models).
* Against real CPU runs (`./run.sh bench train`, three layouts, one of them 2 ranks under the
  deepspeed launcher): the predicted peak memory of every stage is within 20% of the measured
  peak RSS above the process baseline, and the predicted step times rank the measured ones.
* `./run.sh plan` on the paper's 3.2B model: a layout fits 128 V100s, pp=1 without
  checkpointing does not, and bad flags stop with a message naming them.
"""
import itertools
import json

import pytest
import torch
import yaml

from launcher.cli import main as cli_main
from model.config import ModelConfig
from model.layers import padding_mask
from planner.planner import layer_activation_bytes, named_model, stage_bounds
from tests.conftest import write_run_config


def saved_bytes(fn, params) -> int:
    """Bytes of the distinct non-parameter storages autograd saves while `fn` runs."""
    param_ptrs = {p.untyped_storage().data_ptr() for p in params}
    storages = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in param_ptrs:
            storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(storages.values())


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_activation_formula_equals_saved_tensors(dropout):
    from parallel.loss import output_loss_sum
    from parallel.pipeline import layer_specs, output_states

    cfg = ModelConfig(encoder_layers=2, decoder_layers=2, d_model=48, heads=4, ffn_dim=96, vocab_size=50,
                      dropout=dropout)
    b, s, t = 3, 7, 5
    src, tgt = torch.randint(4, 50, (b, s)), torch.randint(4, 50, (b, t))
    src[0, -2:] = 0  # source padding: the layers get a mask
    enc = torch.randn(b, s, 48, requires_grad=True)
    dec = torch.randn(b, t, 48, requires_grad=True)
    flow = (enc, dec, src, tgt, padding_mask(src, 0))  # what layers inside a stage pass on

    def formula(kind):
        return layer_activation_bytes(cfg, kind, b, s, t, element=4, mask=4)  # CPU dropout keeps a float mask

    specs = layer_specs(cfg, seed=0)  # plan order: embed, encoder × 2, decoder × 2, output
    for kind, module in (("encoder", specs[1].build()), ("decoder", specs[3].build())):
        module.train()
        assert saved_bytes(lambda m=module: m(flow), module.parameters()) == formula(kind), kind
    embed = specs[0].build().train()
    assert saved_bytes(lambda: embed((src, tgt)), embed.parameters()) == formula("embed")
    kept = {}

    def output():
        kept["states"] = output_states(embed, flow)  # the engine holds it until backward
        output_loss_sum(kept["states"], embed.embed.weight, tgt, 0, 0.1)

    saved = saved_bytes(output, embed.parameters())
    labels = tgt.nbytes + (tgt != 0).nbytes  # the labels and the padding mask the loss reads
    assert saved + kept["states"].nbytes + labels == pytest.approx(formula("output"), abs=8)


def test_partition_is_the_trainers_or_as_balanced():
    from deepspeed.runtime.utils import partition_balanced

    from model.flops import layer_costs
    from model.transformer import layer_plan

    small = ModelConfig(encoder_layers=6, decoder_layers=6, d_model=64, heads=2, ffn_dim=128, vocab_size=1000)
    costs, plan = layer_costs(small), layer_plan(small)
    # the units stages are made of: an encoder or decoder layer with the embedding, final norm or
    # output layer next to it (parallel/partition.py); DeepSpeed's partition of those units
    starts = [0] + [i for i, layer in enumerate(plan) if layer.kind in ("encoder", "decoder")][1:] + [len(plan)]
    units = [sum(costs[a:b]) for a, b in itertools.pairwise(starts)]
    for pp in (2, 3, 4):
        bounds = stage_bounds(small, pp)
        assert all(any(layer.kind in ("encoder", "decoder") for layer in plan[a:b]) for a, b in itertools.pairwise(bounds))
        theirs = [starts[i] for i in partition_balanced(units, pp)]
        heaviest = max(sum(costs[a:b]) for a, b in itertools.pairwise(bounds))
        assert heaviest <= max(sum(costs[a:b]) for a, b in itertools.pairwise(theirs)) * (1 + 1e-12)
    deep = named_model("deepnet-500-500")
    costs = layer_costs(deep)
    for pp in (16, 64):
        bounds = stage_bounds(deep, pp)
        assert bounds[0] == 0 and bounds[-1] == len(costs) and len(bounds) == pp + 1
        heaviest = max(sum(costs[a:b]) for a, b in itertools.pairwise(bounds))
        assert heaviest <= sum(costs) / pp + max(costs)  # within one layer of perfect balance


# Three layouts whose step times differ widely (about 1 : 2.5 : 10 on one core per rank).
LAYOUTS = [{"pp": 1, "dp": 1, "micro_batches": 1, "ac": 0},
           {"pp": 2, "dp": 1, "micro_batches": 4, "ac": 0},
           {"pp": 1, "dp": 1, "micro_batches": 8, "ac": 1}]


def test_planner_predicts_measured_memory_and_ranks_step_times(tiny_data, tmp_path, monkeypatch):
    from bench.layouts import main as bench_main

    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # every rank one core: layouts compare like for like
    model = {"encoder_layers": 4, "decoder_layers": 4, "d_model": 128, "heads": 4, "ffn_dim": 512, "dropout": 0.1}
    config = write_run_config(str(tmp_path / "run.yaml"), str(tmp_path / "run"), tiny_data, model=model)
    grid = tmp_path / "grid.yaml"
    grid.write_text(yaml.safe_dump({"warmup": 1, "steps": 2, "layouts": [
        {**layout, "max_tokens": 1024, "precision": "fp32"} for layout in LAYOUTS]}))
    assert bench_main([config, "--grid", str(grid), "--out", str(tmp_path / "out")]) == 0
    rows = json.loads((tmp_path / "out" / "bench.json").read_text())["rows"]

    for row in rows:
        assert len(row["stage_peak_mb"]) == row["pp"]
        for measured, predicted in zip(row["stage_peak_mb"], row["stage_predicted_mb"]):
            assert predicted == pytest.approx(measured, rel=0.2), (row["layout"], row["stage_peak_mb"],
                                                                   row["stage_predicted_mb"])
    assert rows[1]["bubble_theory"] == pytest.approx(1 / 5)
    assert 0.0 < rows[1]["bubble_measured"] < 1.0  # wall clock: its size depends on the machine's load
    assert all(row["target_tokens_per_s"] > 0 and 0 < row["mfu"] < row["hfu"] <= 1.0 for row in rows)

    # The planner's step estimate (same micro-batch shapes, one core per rank) orders them alike.
    measured = sorted(range(3), key=lambda i: rows[i]["step_s_median"])
    predicted = sorted(range(3), key=lambda i: rows[i]["planner_step_s"])
    assert measured == predicted == [0, 1, 2], [(r["step_s_median"], r["planner_step_s"]) for r in rows]


def test_plan_command_on_the_papers_3_2b_model(capsys, tmp_path):
    out = tmp_path / "plan.md"
    assert cli_main(["plan", "deepnet-100-100-1024", "--gpus", "128", "--gpu", "v100-32gb", "--flops", "5.2e21",
                     "--markdown", str(out)]) == 0
    text = capsys.readouterr().out
    assert "Best: " in text and "days" in text and out.read_text().strip() == text.strip()
    assert "3.07B parameters" in text

    best_days = float(text.split("\n| pp")[1].split("|")[-2])
    assert 9 < best_days < 36  # the paper: "up to 18 days" for 5.2 ZFLOPs on 128 V100-32GB

    from planner.devices import device
    from planner.planner import Candidate, stage_memory

    model, dev = named_model("deepnet-100-100-1024"), device("v100-32gb")
    small = Candidate(pp=1, tp=1, dp=128, micro_batches=32, sequences=32, src_len=32, tgt_len=32, precision="fp16")
    large = Candidate(pp=1, tp=1, dp=128, micro_batches=4, sequences=256, src_len=32, tgt_len=32, precision="fp16")
    # 3.07B parameters: fp16 weights + grads 11.4 GiB, ZeRO-1 states over 128 ranks 0.3 GiB; what
    # decides is the activations of 200 layers for one micro-batch.
    assert stage_memory(model, small, 0, dev)["peak"] < dev.usable_bytes() < stage_memory(model, large, 0, dev)["peak"]


def test_plan_command_rejects_bad_input(capsys):
    assert cli_main(["plan", "no-such-model", "--gpus", "8", "--gpu", "a100-80gb"]) == 2
    assert "deepnet-100-100-1024" in capsys.readouterr().err
    assert cli_main(["plan", "deepnet-48-48", "--gpus", "8", "--gpu", "a100-80gb", "--mfu", "2"]) == 2
    assert "--mfu" in capsys.readouterr().err
    assert cli_main(["plan", "deepnet-48-48", "--gpus", "8", "--gpu", "tpu-v5"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --gpu tpu-v5: ") and "known: v100-32gb (v100)" in err and err.count("\n") == 1
    base = ["plan", "deepnet-48-48", "--gpus", "16", "--gpu", "a100-80gb"]
    for flag, value in (("--seq-len", "0"), ("--inter-bw", "-5"), ("--intra-bw", "0"), ("--inter-bw", "nan"),
                        ("--global-batch-tokens", "-1"), ("--tokens", "-5"), ("--top", "0"),
                        ("--microbatch-tokens", "0,-5")):
        assert cli_main(base + [f"{flag}={value}"]) == 2, (flag, value)
        err = capsys.readouterr().err
        assert err.startswith("error: ") and flag in err and err.count("\n") == 1, err


def test_optimizer_state_follows_the_precision_record():
    """FlatOptimizer's bytes per parameter (parallel/precision.py `state_bytes`): the master copy
    (none in fp32: the master partition is the weights) and Adam's m and v are divided by dp under
    ZeRO-1 and whole at stage 0; the weights and the fp32 gradient buffer are kept whole; at the
    step only a 16-bit precision converts the buffer to its communication dtype."""
    import dataclasses

    from planner.devices import cpu_device, device
    from planner.planner import Candidate, stage_memory

    model = named_model("base-6-6")
    base = Candidate(pp=1, tp=1, dp=4, micro_batches=2, sequences=32, src_len=16, tgt_len=16, precision="fp32")
    for precision, dev, element, master in (("fp32", cpu_device(1e11, 24 * 2**30), 4, 0),
                                             ("bf16", device("h100"), 2, 4), ("fp16", device("h100"), 2, 4)):
        for dp in (4, 1):
            layout = dataclasses.replace(base, dp=dp, precision=precision)
            one = stage_memory(model, layout, 0, dev)
            none = stage_memory(model, dataclasses.replace(layout, zero=0), 0, dev)
            params = one["params"]
            assert one["optimizer"] == pytest.approx((master + 8) * params / dp)
            assert none["optimizer"] == pytest.approx((master + 8) * params)
            assert one["weights_grads"] == none["weights_grads"] == pytest.approx((element + 4 + element) * params)
            assert one["step_extra"] == none["step_extra"] == pytest.approx((element if element < 4 else 0) * params)
            assert none["activations"] == one["activations"]

