"""Precision is one record (parallel/precision.py): an entry added to PRECISIONS alone is taken by
the config, DeepSpeed's flags, the module's cast, the optimizer (its loss scaler and master copy),
the stage messages and the planner, with no name compared anywhere.

Two entries no code knows by name are added in a fresh process and trained for three steps beside
the entries they mirror: `bf16-twin` (bf16 under another name) must train bit for bit as bf16, and
`fp32-scaled` (fp32 with dynamic loss scaling, which no built-in entry has) must hold a loss scaler
at 2^16 and still train bit for bit as fp32 — scaling by a power of two is exact, so only a
precision that ignored its record's fields would differ."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = r"""
import json, torch
from parallel import precision as precisions
from parallel.precision import Precision
precisions.PRECISIONS["bf16-twin"] = Precision("bf16-twin", "bf16", False)
precisions.PRECISIONS["fp32-scaled"] = Precision("fp32-scaled", "fp32", True)

from bench.gpu import synthetic_batches
from model.config import ModelConfig
from parallel.config import ParallelConfig
from parallel.layout import Layout
from parallel.parallelize import build_engine
from planner.devices import device
from planner.planner import Candidate, stage_memory
from runtime.distributed import setup_distributed
from trainer.train_config import TrainConfig
from schema.fields import from_dict

setup_distributed()
model = ModelConfig(encoder_layers=2, decoder_layers=2, d_model=32, heads=2, ffn_dim=64, vocab_size=97,
                    dropout=0.0, max_positions=16)
layout = Layout.build(ParallelConfig())
out = {}
for name in ("fp32", "fp32-scaled", "bf16", "bf16-twin"):
    p = from_dict(ParallelConfig, {"precision": name}, "parallel")  # the config's own check takes it
    t = TrainConfig(micro_batches=4, warmup_steps=2, clip_norm=0.5, seed=3, compile=False)
    engine, stage = build_engine(layout, model, p, t, "/tmp/deepnet-precision-test")
    generator = torch.Generator().manual_seed(0)
    losses, norms = [], []
    for _ in range(3):
        batches = synthetic_batches(model.vocab_size, 2, 8, generator)
        engine.expect([(inputs[0].shape, inputs[1].shape) for inputs, _ in batches])
        losses.append(engine.train_batch(iter(batches)).item())
        norms.append(float(engine.get_global_grad_norm()))
    scaler = engine.optimizer.loss_scaler
    layout_msg = stage.message_layout(torch.Size([2, 8]), torch.Size([2, 8]))
    dev = device("h100") if engine.precision.low else None
    planned = None
    if dev is not None:
        c = Candidate(pp=1, tp=1, dp=8, micro_batches=4, sequences=64, src_len=32, tgt_len=32, precision=name)
        planned = stage_memory(model, c, 0, dev)
    out[name] = {"module": str({q.dtype for q in stage.parameters()}), "optimizer_dtype": str(engine.optimizer.bf16_groups[0][0].dtype),
                 "scale": None if scaler is None else float(scaler.cur_scale), "fp16_flag": engine.fp16_enabled(),
                 "bf16_flag": engine.bfloat16_enabled(), "message": str(layout_msg[0][1]), "losses": losses,
                 "norms": norms, "planned": planned, "ds": engine.precision.deepspeed_config()}
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def trained():
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def test_a_twin_entry_trains_as_the_entry_it_mirrors(trained):
    twin, bf16 = trained["bf16-twin"], trained["bf16"]
    assert twin["module"] == "{torch.bfloat16}" and twin["optimizer_dtype"] == "torch.bfloat16"
    assert twin["message"] == "torch.bfloat16" and twin["bf16_flag"] and not twin["fp16_flag"]
    assert twin["scale"] is None
    assert twin["losses"] == bf16["losses"] and twin["norms"] == bf16["norms"]
    assert twin["planned"] == bf16["planned"] and twin["ds"] == bf16["ds"]


def test_loss_scaling_is_the_records_not_the_dtypes(trained):
    scaled, fp32 = trained["fp32-scaled"], trained["fp32"]
    assert scaled["module"] == fp32["module"] == "{torch.float32}" and scaled["message"] == "torch.float32"
    assert scaled["scale"] == 2.0 ** 16 and fp32["scale"] is None
    assert not scaled["fp16_flag"] and not scaled["bf16_flag"]
    assert scaled["losses"] == fp32["losses"] and scaled["norms"] == fp32["norms"]  # a power of two: exact
    assert len(set(fp32["losses"])) == 3  # three different steps, not one repeated


def test_the_planner_reads_the_record():
    from parallel.precision import PRECISIONS

    for name, p in PRECISIONS.items():
        state = p.state_bytes()
        assert state["kept"] == p.element_bytes + 4 and state["grads"] == p.element_bytes
        assert state["kept_dp"] == (12 if p.low else 8)  # fp32's master is the weights themselves
