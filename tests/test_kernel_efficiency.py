"""The planner's kernel efficiency per GPU type: one estimate for every type until its GPU check is
committed, then the measurement of the nearest width and micro-batch size."""
import json

import pytest

from planner.devices import DEVICES, E_MAX, estimated_efficiency, kernel_efficiency


def test_unmeasured_types_share_one_estimate_that_grows_with_tokens_and_width(tmp_path):
    for key in DEVICES:
        value, source = kernel_efficiency(key, 1024, 4096, root=str(tmp_path))
        assert value == pytest.approx(0.6 * 4096 / (4096 + 1500) * 1024 / (1024 + 256)) and "estimated" in source
    assert [round(estimated_efficiency(1024, t), 3) for t in (2048, 4096, 8192)] == [0.277, 0.351, 0.406]
    assert estimated_efficiency(512, 8192) < estimated_efficiency(1024, 8192) < E_MAX


def test_a_committed_gpu_check_overrides_the_estimate_for_its_type_only(tmp_path):
    rows = [{"target_tokens_per_micro_batch": t, "kernel_efficiency": e} for t, e in ((2048, 0.21), (8192, 0.38))]
    results = [{"variant": "compiled", "model": [6, 6, 1024, 16, 4096, 8192], "rows": rows},
               {"variant": "eager", "model": [6, 6, 1024, 16, 4096, 8192],
                "rows": [{"target_tokens_per_micro_batch": 2048, "kernel_efficiency": 0.05}]}]
    (tmp_path / "docs" / "bench" / "gpu-h100").mkdir(parents=True)
    (tmp_path / "docs" / "bench" / "gpu-h100" / "train.json").write_text(json.dumps(results))
    value, source = kernel_efficiency("h100-80gb", 1024, 2048, root=str(tmp_path))
    assert value == 0.21 and "measured" in source  # the compiled variant where both were measured
    assert kernel_efficiency("h100-80gb", 900, 7000, root=str(tmp_path))[0] == 0.38  # nearest width and size
    assert kernel_efficiency("a100-80gb", 1024, 2048, root=str(tmp_path))[0] == pytest.approx(
        estimated_efficiency(1024, 2048))


def test_the_planner_prices_each_micro_batch_size_at_its_own_efficiency(capsys):
    import dataclasses

    from launcher.cli import main as cli_main
    from planner.devices import device
    from planner.planner import Candidate, named_model, step_time

    model, dev = named_model("deepnet-100-100-1024"), device("h100-80gb")
    small = Candidate(pp=1, tp=1, dp=1, micro_batches=4, sequences=64, src_len=32, tgt_len=32)
    large = dataclasses.replace(small, micro_batches=1, sequences=256)
    by_tokens = lambda lay: estimated_efficiency(1024, lay.sequences * lay.tgt_len)  # noqa: E731
    # Same tokens per step: compute scales with 1 / efficiency of each size's kernels.
    ratio = step_time(model, small, dev, by_tokens)["compute"] / step_time(model, large, dev, by_tokens)["compute"]
    assert ratio == pytest.approx(estimated_efficiency(1024, 8192) / estimated_efficiency(1024, 2048), rel=1e-9)
    assert step_time(model, small, dev, 0.3)["compute"] == pytest.approx(step_time(model, large, dev, 0.3)["compute"])
    # The command line uses it unless --mfu is given, and says so.
    assert cli_main(["plan", "deepnet-100-100-1024", "--gpus", "8", "--gpu", "h100-80gb", "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert "kernel MFU by target tokens per micro-batch 27.7% at 2k, 35.1% at 4k, 40.6% at 8k" in out
    assert cli_main(["plan", "deepnet-100-100-1024", "--gpus", "8", "--gpu", "h100-80gb", "--mfu", "0.3",
                     "--top", "1"]) == 0
    assert "kernel MFU 30.0% (given with --mfu)" in capsys.readouterr().out
