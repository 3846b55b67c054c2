"""The GPU check (bench/scripts/gpu_check.sh) rehearsed on this machine's CPU with tiny shapes:
every part runs to the end and leaves the file the GPU run hands back, with the numbers each
report is made of."""
import json
import os
import subprocess

from tests.conftest import ROOT


def test_the_gpu_check_runs_every_part_on_the_cpu(tmp_path):
    out = tmp_path / "check"
    proc = subprocess.run(["bash", os.path.join(ROOT, "bench", "scripts", "gpu_check.sh"), str(out), "--rehearse"],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = (out / "summary.md").read_text()
    for part in ("ops", "train", "costs", "replay"):
        assert f"- {part}: exit 0 in" in summary, summary
    handed_back = {p.name for p in out.iterdir() if p.is_file()}
    assert {"summary.md", "versions.txt", "ops.json", "train.json", "train.md", "costs.json", "replay.md"} <= handed_back
    assert len(handed_back) <= 8  # what a device run hands back
    ops = json.loads((out / "ops.json").read_text())
    for kind in ("embedding", "encoder", "decoder", "output"):
        assert 0 < ops["kernel_ops_per_layer"][kind]["compiled"] < ops["kernel_ops_per_layer"][kind]["eager"]
    assert ops["graph_breaks"] == 0 and ops["compilations_per_layer_kind"] == {"encoder": 2, "decoder": 2}
    train = json.loads((out / "train.json").read_text())
    assert [r["variant"] for r in train] == ["eager", "compiled"]
    for r in train:
        row = r["rows"][0]
        assert row["target_tokens_per_s"] > 0 and row["host_syncs_per_step"] == 1 and row["kernels_per_step"] > 0
    assert train[1]["rows"][0]["kernels_per_step"] < train[0]["rows"][0]["kernels_per_step"]
    costs = json.loads((out / "costs.json").read_text())
    assert costs and "| 2 |" in (out / "replay.md").read_text()
