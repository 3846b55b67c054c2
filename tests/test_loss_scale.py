"""fp16's dynamic loss scale survives a resume and `./run.sh convert reshard`.

The universal checkpoint a reshard makes has no place for the scaler's state and DeepSpeed's load
passes none, so a resharded run used to start again at 2^16 and overflow its way back down;
checkpoint/checkpoints.py keeps the state beside the universal checkpoint and the trainer restores
it (tests/dist/loss_scale_worker.py: 2 ranks, pp = 2 → pp = 1 × dp = 2). Only where DeepSpeed's
accelerator takes fp16 (on CPUs: AVX512-FP16 or AMX).
"""
import math

import pytest

from tests.conftest import run_worker, write_run_config
from tests.test_flat_optimizer import fp16_unsupported


@pytest.fixture(scope="module")
def scales(tiny_data, tmp_path_factory):
    reason = fp16_unsupported()
    if reason:
        pytest.skip(reason)
    work = tmp_path_factory.mktemp("scale")
    config = write_run_config(str(work / "run.yaml"), str(work / "run"), tiny_data,
                              parallel={"pipeline_stages": 2, "precision": "fp16"},
                              train={"micro_batches": 2, "save_interval": 1000, "valid_interval": 1000})
    return run_worker(2, "tests.dist.loss_scale_worker", str(work / "result.json"), ["--config", config])


def test_a_resumed_fp16_run_keeps_its_loss_scale(scales):
    saved = scales["saved"]
    assert saved["cur_scale"] == 2.0**9 and saved["cur_scale"] != scales["initial"]
    assert scales["resumed"] == {"step": 3, **saved}


def test_a_resharded_fp16_run_keeps_its_loss_scale_and_trains_on(scales):
    assert scales["resharded"] == {"step": 3, "layout": [1, 2], **scales["saved"]}
    assert len(scales["resharded_trains"]) == 1 and math.isfinite(scales["resharded_trains"][0])
