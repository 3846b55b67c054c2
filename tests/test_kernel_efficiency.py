"""The planner's default kernel efficiency per GPU type is the committed GPU measurement."""
import json
import os

import pytest

from planner.devices import KERNEL_EFFICIENCY, kernel_efficiency
from tests.conftest import ROOT


def test_h100_defaults_are_the_committed_bench_measurements():
    with open(os.path.join(ROOT, "docs", "bench", "gpu-h100", "results.json")) as f:
        measured = {r["model"][2]: r["kernel_efficiency"] for r in json.load(f) if r["shape"] in (
            "100L-100L-d64", "18L-18L-d512", "100L-100L-d1024-slice12")}
    for width, value, source in KERNEL_EFFICIENCY["h100-80gb"]:
        assert value == pytest.approx(measured[width], rel=0.01), source
        assert "docs/bench/gpu-h100/results.json" in source


def test_a_model_takes_the_nearest_measured_width():
    assert kernel_efficiency("h100-80gb", 512)[0] == pytest.approx(0.0224)
    assert kernel_efficiency("h100-80gb", 700)[0] == pytest.approx(0.0224)  # log2 distances 0.45 and 0.55
    assert kernel_efficiency("h100-80gb", 2048)[0] == pytest.approx(0.119)
    assert kernel_efficiency("a100-80gb", 1024) == (0.35, "assumed (no measurement on this GPU type)")
