"""Host syncs on CUDA's terms (bench/counting.py): a read of a value, or a blocking copy from host
memory to the device, counted on a CPU by the rule the GPU's path follows. A step of the trainer
has one: the divergence guard's read. Its flags and the optimizer's non-finite mask copy nothing
from the host (they were two `torch.tensor(x, device=…)` per step: 3 syncs, not 1)."""
import json
import math
import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from bench.counting import KernelCounter
from parallel.optimizer import FlatOptimizer
from runtime import accelerator
from tests.conftest import ROOT, TINY_MODEL, write_run_config
from trainer.guard import DivergenceGuard

DEVICE = accelerator.device()


def counted(fn) -> tuple[int, int]:
    """(host syncs, of which blocking host-to-device copies) of fn()."""
    with KernelCounter() as counter:
        fn()
    return counter.syncs, counter.host_copies


def test_the_rule_counts_reads_and_blocking_copies_to_the_device():
    on_device = torch.ones(3, device=DEVICE)
    cases = {
        "torch.tensor of a float, on the device": (lambda: torch.tensor(-1.0, device=DEVICE), (1, 1)),
        "torch.as_tensor of a list, on the device": (lambda: torch.as_tensor([1.0, 2.0], device=DEVICE), (1, 1)),
        "torch.tensor on the host": (lambda: torch.tensor([1.0]), (0, 0)),
        "a host tensor moved to the device": (lambda: torch.tensor([1.0]).to(DEVICE), (1, 1)),
        "the same, non-blocking": (lambda: torch.tensor([1.0]).to(DEVICE, non_blocking=True), (0, 0)),
        "a numpy array copied into a device tensor": (lambda: on_device.copy_(torch.from_numpy(np.ones(3, np.float32))),
                                                      (1, 1)),
        "new_tensor on a device tensor": (lambda: on_device.new_tensor([2.0]), (1, 1)),
        "a device tensor .to(device)": (lambda: on_device.to(DEVICE), (0, 0)),
        "a dtype conversion": (lambda: torch.tensor([1.0]).to(torch.float64), (0, 0)),
        "a fill kernel (torch.full on the device)": (lambda: torch.full((1,), 2.0, device=DEVICE), (0, 0)),
        "a scalar operand": (lambda: on_device * 2.5 + 1.0, (0, 0)),
        ".item()": (lambda: on_device.sum().item(), (1, 0)),
        ".tolist()": (lambda: on_device.tolist(), (1, 0)),
    }
    got = {name: counted(fn) for name, (fn, _) in cases.items()}
    assert got == {name: expected for name, (_, expected) in cases.items()}
    assert torch.tensor is torch._C._VariableFunctions.tensor  # the counter put torch back


def test_deepspeeds_non_finite_mask_is_a_copy_and_flat_optimizers_is_not():
    from deepspeed.runtime.utils import mask_nan_or_inf_with_val_inplace

    opt = SimpleNamespace(_norm_group=None, fp32_groups_gradients_flat=[torch.zeros(1, device=DEVICE)])
    for value in (3.0, float("inf"), float("nan")):
        grads = [torch.full((4,), value, device=DEVICE), torch.ones(3, device=DEVICE)]
        reference = torch.stack(torch._foreach_norm(grads, 2.0)).pow(2.0).sum().pow(0.5)
        assert counted(lambda: mask_nan_or_inf_with_val_inplace(reference.clone(), device=DEVICE)) == (1, 1)
        mask_nan_or_inf_with_val_inplace(reference, device=DEVICE)
        norms = []
        assert counted(lambda: norms.append(FlatOptimizer._global_norm(opt, grads))) == (0, 0)
        assert norms[0].dtype == reference.dtype and norms[0].item() == reference.item()
        assert norms[0].item() == (-1.0 if not math.isfinite(value) else pytest.approx(math.sqrt(4 * 9 + 3), rel=1e-6))


@pytest.mark.parametrize("last_stage", [True, False])
def test_the_guards_flags_copy_nothing_from_the_host(last_stage, monkeypatch):
    from trainer import signals

    guard = DivergenceGuard.__new__(DivergenceGuard)
    guard.engine = SimpleNamespace(total_loss=torch.tensor(6.5, device=DEVICE))
    guard.layout = SimpleNamespace(last_stage=last_stage, tp_rank=0, device=DEVICE)
    guard._constants = {}
    for preempt in (False, True, False):
        monkeypatch.setattr(signals.stop, "checkpoint", preempt)
        flags = []
        assert counted(lambda: flags.append(guard._flags())) == (0, 0)
        assert flags[0].dtype == torch.float64
        assert flags[0].tolist() == [6.5 if last_stage else 0.0, float(preempt)]
    assert sorted(guard._constants) == [0.0, 1.0]  # made once each, reused


def test_a_training_step_has_one_host_sync(tiny_data, tmp_path):
    """The real trainer at pp = 1 in fp32 and bf16: 0 syncs per micro-batch, 1 per step, and no
    blocking copy to the device (tests/dist/ops_worker.py --syncs; pp = 2: tests/test_pipe_io.py)."""
    config = write_run_config(str(tmp_path / "run.yaml"), str(tmp_path / "run"), tiny_data,
                              model={**TINY_MODEL, "encoder_layers": 2, "decoder_layers": 2},
                              parallel={"pipeline_stages": 1}, train={"micro_batches": 2, "save_interval": 1000})
    out = str(tmp_path / "syncs.json")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-m", "tests.dist.ops_worker", "--config", config, "--out", out,
                           "--syncs", "fp32,bf16"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(out) as f:
        result = json.load(f)
    for precision in ("fp32", "bf16"):
        counts = result[precision]
        assert (counts["per_microbatch"], counts["per_step"], counts["host_copies_per_step"]) == (0.0, 1.0, 0.0), counts
