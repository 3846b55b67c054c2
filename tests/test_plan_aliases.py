"""./run.sh plan through the real command line (a subprocess of ./run.sh): GPU types by their short
names, a typo answered with one line listing the known ones, the config's own row taken from its
clusters: entry for the asked cluster (same GPU type and count), and a help that says what plan
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
    # no entry for 32 A100s: the config's top-level layout, said to use other GPUs
    code, out, err = plan(PAPER, "--gpus", "32", "--gpu", "a100", "--top", "1", "--microbatch-tokens", "4096")
    assert code == 0, err
    assert own_row(out) == ("The config's own layout:", "pp2·tp1·dp64 m=8 mb=64×(32+32)")
    assert "- It uses 128 GPUs, not the 32 planned for." in out
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
