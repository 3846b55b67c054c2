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
