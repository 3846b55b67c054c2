"""`./run.sh plan CONFIG`: the config's own layout priced as a row of the same table, the candidates
sized to the config's own batch, and the best layout as config keys that load back as that layout."""
from __future__ import annotations

import os
import re

import yaml

from tests.bad_inputs import run_cli
from tests.conftest import ROOT

DEFAULT = os.path.join(ROOT, "configs", "default.yaml")


def test_plan_prices_the_configs_own_layout_and_prints_the_best_as_keys(capsys, tmp_path):
    from launcher.commands.plan import load_run_config
    from planner.devices import device, kernel_efficiency
    from planner.planner import plan
    from planner.report import config_layout
    from trainer.config import load_config

    code, out, err = run_cli(["plan", DEFAULT, "--gpu", "a100-80gb"], capsys)
    assert code == 0, err
    cfg = load_config(DEFAULT)
    # no --gpus: the config's pp × tp × dp; no --global-batch-tokens: its own batch,
    # data_parallel 1 × micro_batches 4 × (max_tokens 1024 // 32) sentences × 32 target tokens
    assert " on 2 × A100-SXM4-80GB " in out and "global batch 4,096 target tokens." in out

    own = config_layout(cfg.parallel, cfg.train, cfg.data.max_tokens, 32, cfg.parallel.precision)
    assert own.describe() == "pp2·tp1·dp1 m=4 mb=32×(32+32) no-ac fp32"
    model = load_run_config(DEFAULT, []).model
    # priced at the kernel efficiency of its own micro-batch size (32 × 32 target tokens)
    priced = plan(model, own, device("a100-80gb"), kernel_efficiency("a100-80gb", model.d_model, 1024)[0])
    row = next(line for line in out.splitlines() if line.startswith("| config: "))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[0] == f"config: {own.describe()}"
    assert cells[1] == f"{priced.peak_bytes / 2**30:.1f}" and cells[4] == f"{priced.tokens_per_s:,.0f}"

    # the snippet: valid YAML whose keys, set on the config, give the best layout of the table
    snippet = yaml.safe_load(out.split("```yaml\n")[1].split("```")[0])
    best = re.search(r"^Best: (.+?) — ", out, re.M).group(1)
    flags = re.search(r"^or on the command line: (.+)$", out, re.M).group(1).split()
    sets = flags[1::2]
    assert flags[0::2] == ["--set"] * len(sets)
    assert sorted(sets) == sorted(f"{s}.{k}={v}" for s, keys in snippet.items() for k, v in keys.items())
    laid_out = load_config(DEFAULT, sets=sets)
    again = config_layout(laid_out.parallel, laid_out.train, laid_out.data.max_tokens, 32, laid_out.parallel.precision)
    assert again.describe() == best

    # --set reaches the own row
    code, out, err = run_cli(["plan", DEFAULT, "--gpu", "a100-80gb", "--gpus", "8", "--set",
                              "parallel.pipeline_stages=1", "--set", "parallel.data_parallel=4"], capsys)
    assert code == 0, err
    # ... and a layout of 4 GPUs is scaled to the 8 planned for, keeping its global batch
    assert "| config: pp1·tp1·dp8 m=2 " in out and "It uses" not in out
    assert ("The config's own layout (scaled from 4 to 8 GPUs: data_parallel 4 → 8, train.micro_batches 4 → 2, the "
            "same global batch):") in out


def test_the_plan_explains_its_layout_notation_under_the_table(capsys):
    from planner.report import LEGEND

    code, out, err = run_cli(["plan", DEFAULT, "--gpu", "a100-80gb", "--top", "2"], capsys)
    assert code == 0, err
    lines = out.splitlines()
    rows = [i for i, line in enumerate(lines) if line.startswith("| pp")]
    assert len(rows) == 2 and lines[rows[-1] + 1:rows[-1] + 3] == ["", LEGEND]
    assert LEGEND.startswith("Layout: ppP·tpT·dpD = P pipeline stages × T-way tensor parallelism × D replicas; "
                             "m = micro-batches per step; mb=B×(S+T) = B sentence pairs of S source + T target "
                             "tokens per micro-batch; acK = recompute every K layers (no-ac: none)")
    # no layout fits: the leanest is named in the same notation, and explained the same way
    code, out, err = run_cli(["plan", DEFAULT, "--gpu", "v100", "--set", "model.d_model=16384",
                              "--set", "model.ffn_dim=65536", "--set", "model.heads=64"], capsys)
    assert code == 1 and "No layout fits: the leanest (pp" in out and f"\n{LEGEND}\n" in out, out
