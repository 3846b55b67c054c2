"""./run.sh plan through the real command line (a subprocess of ./run.sh): GPU types by their short
names, a typo answered with one line listing the known ones, the config's own row taken from its
clusters: entry for the asked GPU type (scaled to the asked count, or said to be another size), and a help that says what plan
does (it writes no config)."""
from __future__ import annotations

import os
import re
import subprocess

from tests.conftest import ROOT

PAPER = "deepnet-100-100-1024"  # top level: 128 V100s; clusters: v100-32gb-x128, a100-80gb-x64, h100-80gb-x32


def plan(*args: str) -> tuple[int, str, str]:
    proc = subprocess.run([os.path.join(ROOT, "run.sh"), "plan", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    return proc.returncode, proc.stdout, proc.stderr


def own_row(out: str) -> tuple[str, str]:
    """(the heading of the config's own row, its layout)."""
    heading = re.search(r"^The config's own layout.*:$", out, re.M).group(0)
    return heading, re.search(r"^\| config: (\S+ m=\d+ \S+) ", out, re.M).group(1)


def test_gpu_aliases_and_a_typo():
    code, out, err = plan("default", "--gpu", "A100", "--top", "1", "--microbatch-tokens", "1024")
    assert code == 0, err
    assert " × A100-SXM4-80GB " in out.splitlines()[0]
    code, full, _ = plan("default", "--gpu", "a100-80gb", "--top", "1", "--microbatch-tokens", "1024")
    assert full == out  # the alias is the type
    code, out, err = plan("default", "--gpu", "a10")
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert err.startswith("error: --gpu a10: not a GPU type the planner knows; did you mean a100-80gb? known: "
                          "v100-32gb (v100), a100-80gb (a100), h100-80gb (h100), h200-141gb (h200)\n")


def test_the_own_row_is_the_configs_entry_for_the_asked_cluster():
    # 64 A100s: clusters.a100-80gb-x64 (pp2 × dp32, 16 micro-batches of 2,048 tokens), not the 128-V100 layout
    code, out, err = plan(PAPER, "--gpus", "64", "--gpu", "a100", "--top", "1", "--microbatch-tokens", "4096")
    assert code == 0, err
    assert own_row(out) == ("The config's own layout (clusters.a100-80gb-x64):", "pp2·tp1·dp32 m=16 mb=64×(32+32)")
    assert "global batch 1,048,576 target tokens." in out and "It uses" not in out
    # without --gpus: the one entry of that type, its GPU count
    code, out, err = plan(PAPER, "--gpu", "h100", "--top", "1", "--microbatch-tokens", "4096")
    assert code == 0, err
    assert " on 32 × H100-SXM5-80GB (8 per node)" in out
    assert own_row(out) == ("The config's own layout (clusters.h100-80gb-x32):", "pp2·tp1·dp16 m=32 mb=64×(32+32)")
    # no entry for 32 A100s: the A100 entry (not the 128-V100 top level), scaled to 32 GPUs with its global batch
    code, out, err = plan(PAPER, "--gpus", "32", "--gpu", "a100", "--top", "1", "--microbatch-tokens", "4096")
    assert code == 0, err
    assert own_row(out) == ("The config's own layout (clusters.a100-80gb-x64; scaled from 64 to 32 GPUs: "
                            "data_parallel 32 → 16, train.micro_batches 16 → 32, the same global batch):",
                            "pp2·tp1·dp16 m=32 mb=64×(32+32)")
    assert " on 32 × A100-SXM4-80GB (8 per node)" in out and "It uses" not in out
    # 64 H100s (the entry is for 32): that entry in bf16, not the top level's fp16 V100 layout on 128 GPUs
    code, out, err = plan("deepnet-100-100", "--gpus", "64", "--gpu", "h100", "--top", "1")
    assert code == 0, err
    assert own_row(out) == ("The config's own layout (clusters.h100-80gb-x32; scaled from 32 to 64 GPUs: "
                            "data_parallel 32 → 64, train.micro_batches 8 → 4, the same global batch):",
                            "pp1·tp1·dp64 m=4 mb=128×(32+32)")
    assert "| config: pp1·tp1·dp64 m=4 mb=128×(32+32) no-ac bf16 |" in out and "It uses" not in out
    # a type without an entry: the top level, said to be that, scaled; a count pp × tp cannot fill: compared per GPU
    code, out, err = plan(PAPER, "--gpus", "32", "--gpu", "h200", "--top", "1", "--microbatch-tokens", "4096")
    assert code == 0, err
    assert own_row(out) == ("The config's own layout (its top level; no clusters: entry for h200-141gb; scaled "
                            "from 128 to 32 GPUs: data_parallel 64 → 16, train.micro_batches 8 → 32, the same "
                            "global batch):", "pp2·tp1·dp16 m=32 mb=64×(32+32)")
    code, out, err = plan(PAPER, "--gpus", "7", "--gpu", "a100", "--top", "1", "--microbatch-tokens", "4096")
    assert code == 0, err
    assert own_row(out) == ("The config's own layout (clusters.a100-80gb-x64):", "pp2·tp1·dp32 m=16 mb=64×(32+32)")
    assert ("- It uses 64 GPUs, not the 7 planned for (its pipeline × tensor-parallel size does not divide them); "
            "compared per GPU.") in out
    assert re.search(r"^- The best layout above reaches [+-]\d+\.\d% throughput per GPU against it\.$", out, re.M)
    # --set applies over the entry's keys
    code, out, err = plan(PAPER, "--gpus", "64", "--gpu", "a100", "--top", "1", "--microbatch-tokens", "4096",
                          "--set", "train.micro_batches=8")
    assert code == 0, err
    assert own_row(out)[1] == "pp2·tp1·dp32 m=8 mb=64×(32+32)" and "global batch 524,288 target tokens." in out


def test_help_says_what_plan_does():
    code, out, _ = plan("--help")
    assert code == 0
    text = " ".join(out.split())
    assert "config.json" not in text and "plan writes no config" in text
    assert "--gpu TYPE GPU type: v100-32gb (v100), a100-80gb (a100), h100-80gb (h100), h200-141gb (h200)" in text
    assert "clusters: entry for --gpu" in text
