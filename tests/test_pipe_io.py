"""The stage-message contract of parallel/pipe_io.py: a stage sends what was announced, or says so.

Receivers allocate the (shape, dtype) list announced for each micro-batch (`engine.expect` and the
module's `message_layout`); the sender compares what it holds with it before sending. In this
process: the check on real tensors reaches no operation of the device (none dispatched, no host
read), and each kind of mismatch gives one line naming the micro-batch, the announced and the sent
layout. Three launches of 2 ranks (pp = 2, tests/dist/message_worker.py): the trainer's host syncs
stay 0 per micro-batch and 1 per step on both stages with the check in place; a caller that
announces micro-batch 1 one target token longer than it is ends the launch with the sender's
error naming it; so does a stage whose float message is bfloat16 while its parameters are float32.
"""
import json

import pytest
import torch

from bench.counting import KernelCounter
from parallel.pipe_io import check_message
from tests.conftest import launch, write_run_config

D_MODEL = 32  # tests/conftest.py TINY_MODEL


def layout(b: int, s: int, t: int, dtype=torch.float32) -> list:
    """The message's (shape, dtype) list, as parallel/pipeline.py message_layout gives it."""
    return [((b, s + t, D_MODEL), dtype), ((b, s), torch.int64), ((b, t), torch.int64)]


def tensors(b: int, s: int, t: int, dtype=torch.float32) -> tuple:
    return tuple(torch.zeros(shape, dtype=d) for shape, d in layout(b, s, t, dtype))


def describe(b: int, s: int, t: int, dtype: str = "float32") -> str:
    return f"[({b}, {s + t}, {D_MODEL}) {dtype}, ({b}, {s}) int64, ({b}, {t}) int64]"


def error_line(stage: int, index: int, sent: str, announced: str) -> str:
    return (f"ValueError: pipeline stage {stage} sends micro-batch {index} as {sent}, but {announced} was "
            "announced (engine.expect and the module's message_layout); the next stage receives into the "
            "announced shapes and dtypes")


def test_a_matching_message_passes_without_device_work():
    announced = [layout(2, 5, 7), layout(3, 4, 6)]
    message = tensors(3, 4, 6)
    with KernelCounter() as counter:
        check_message(announced, 1, message, stage=0)
    assert (counter.dispatched, counter.kernels, counter.syncs) == (0, 0, 0)


@pytest.mark.parametrize("case", ["shape", "dtype", "count", "beyond"])
def test_a_mismatch_is_one_error_naming_micro_batch_announced_and_sent(case):
    announced = [layout(2, 5, 7), layout(3, 4, 6)]
    message, index, expected = tensors(3, 4, 6), 1, describe(3, 4, 6)
    if case == "shape":
        message, sent = tensors(3, 4, 5), describe(3, 4, 5)
    elif case == "dtype":
        message, sent = tensors(3, 4, 6, torch.bfloat16), describe(3, 4, 6, "bfloat16")
    elif case == "count":
        message, sent = message[:2], f"[(3, 10, {D_MODEL}) float32, (3, 4) int64]"
    else:
        index, sent, expected = 2, describe(3, 4, 6), "nothing (2 micro-batches)"
    with pytest.raises(ValueError) as raised:
        check_message(announced, index, message, stage=1)
    assert f"{raised.typename}: {raised.value}" == error_line(1, index, sent, expected)


@pytest.fixture(scope="module")
def config(tiny_data, tmp_path_factory):
    work = tmp_path_factory.mktemp("messages")
    return work, write_run_config(str(work / "run.yaml"), str(work / "run"), tiny_data,
                                  parallel={"pipeline_stages": 2}, train={"micro_batches": 4, "save_interval": 1000})


def run_case(config, case: str):
    work, path = config
    out = str(work / f"{case}.json")
    proc = launch(2, "tests.dist.message_worker", ["--config", path, "--out", out, "--case", case], timeout=300)
    with open(out) as f:
        return proc, json.load(f)


def test_the_check_adds_no_host_sync(config):
    proc, result = run_case(config, "syncs")
    assert proc.returncode == 0
    assert [(r["per_microbatch"], r["per_step"]) for r in result["syncs"]] == [(0.0, 1.0), (0.0, 1.0)], result


@pytest.mark.parametrize("case", ["shape", "dtype"])
def test_a_wrong_message_ends_the_launch_with_the_senders_error(config, case):
    proc, result = run_case(config, case)
    assert proc.returncode != 0
    assert result["param_dtype"] == "torch.float32"
    if case == "shape":  # micro-batch 1 announced one target token longer
        (b, s), (_, t) = result["shapes"][1]
        line = error_line(0, 1, describe(b, s, t), describe(b, s, t + 1))
    else:  # the first micro-batch's message is bfloat16 already
        (b, s), (_, t) = result["shapes"][0]
        line = error_line(0, 0, describe(b, s, t, "bfloat16"), describe(b, s, t))
    output = (proc.stdout + proc.stderr).splitlines()
    assert any(line in row for row in output), f"{line!r} not in the launch's output"
