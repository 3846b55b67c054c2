"""The Layout (parallel/layout.py): rank order, this rank's coordinates, groups, device, and the
process-count check. Multi-rank layouts are exercised by every equivalence test (their trainers
build one); here one process checks what they rely on."""
import json
import os
import subprocess
import sys

from parallel.layout import topology

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_rank_order_is_tensor_fastest_then_data_then_pipeline():
    pp, tp, dp = 3, 2, 2
    topo = topology(pp, tp, dp)
    for rank in range(pp * tp * dp):
        c = topo.get_coord(rank)
        assert rank == c.pipe * (dp * tp) + c.data * tp + c.model
    assert topo.get_axis_comm_lists("model")[0] == [0, 1]
    assert topo.get_axis_comm_lists("data")[0] == [0, 2]
    assert topo.get_axis_comm_lists("pipe")[0] == [0, 4, 8]


def test_build_in_a_world_of_one_and_the_process_count_check(tmp_path):
    """One process (no launcher: runtime/distributed.py's set-up assumes a world of one): the 1×1×1
    layout, with a group on every axis; a 2-stage layout refused with the keys named."""
    code = """
import json, torch
from parallel.config import ParallelConfig
from runtime.distributed import setup_distributed
from parallel.layout import Layout
setup_distributed()
layout = Layout.build(ParallelConfig())
groups = {axis: torch.distributed.get_process_group_ranks(g) for axis, g in layout.groups.items()}
try:
    Layout.build(ParallelConfig(pipeline_stages=2))
    refused = None
except ValueError as e:
    refused = str(e)
print(json.dumps({"coords": [layout.rank, layout.stage, layout.replica, layout.tp_rank],
                  "sizes": [layout.pp, layout.tp, layout.dp, layout.world_size],
                  "ends": [layout.stage == 0, layout.last_stage], "device": str(layout.device),
                  "groups": groups, "refused": refused}))
"""
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONWARNINGS": "ignore"}
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["coords"] == [0, 0, 0, 0] and out["sizes"] == [1, 1, 1, 1] and out["ends"] == [True, True]
    assert out["device"] == "cpu"
    assert out["groups"] == {"pipe": [0], "data": [0], "tensor": [0]}
    assert out["refused"] == ("1 process was launched but parallel.pipeline_stages × tensor_parallel × "
                              "data_parallel = 2 × 1 × 1 = 2")
