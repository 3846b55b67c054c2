"""`./run.sh config`: every key of the resolved config with what the schema says of it, as YAML
that loads back as the same config; `--keys`; and docs/configuration.md's key reference equal to
what the schema generates (`--markdown`)."""
from __future__ import annotations

import os
import re
import subprocess


from launcher.commands.config import MARKERS, keys, markdown
from tests.conftest import ROOT
from tests.test_resume_rules import leaf_keys
from trainer.config import load_config, to_dict


def run_sh(*args: str, cwd=ROOT) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "DEEPNET_CALLER_CWD"}
    return subprocess.run([os.path.join(ROOT, "run.sh"), *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300, env=env)


def test_the_printed_config_is_every_key_and_loads_back_as_the_same_config(tmp_path):
    proc = run_sh("config", "configs/default.yaml", "--set", "train.max_steps=77", "--set", "parallel.precision=bf16")
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    text = proc.stdout
    (tmp_path / "printed.yaml").write_text(text)
    want = load_config(os.path.join(ROOT, "configs", "default.yaml"), sets=["train.max_steps=77",
                                                                             "parallel.precision=bf16"])
    assert to_dict(load_config(str(tmp_path / "printed.yaml"))) == to_dict(want)
    lines = {m.group(1): m.group(2) for m in re.finditer(r"^\s*(\w+): .*?  # (.*)$", text, re.M)}
    assert {k.rpartition(".")[2] for k in leaf_keys()} - {"clusters"} <= set(lines)
    assert lines["max_steps"].startswith("* an integer, >= 1 | default 1000 | may change on resume | Optimizer steps")
    assert lines["d_model"].startswith("* an integer, >= 4 | default 512 | fixed on resume | Width of the residual")
    assert lines["encoder_layers"].startswith("an integer, >= 1 | default 6 | fixed on resume")  # = the default
    assert lines["precision"].startswith("* a string, one of fp32, bf16, fp16 (parallel/precision.py) | default fp32 | "
                                         "may change on resume")
    changed = sum(line.startswith("* ") for line in lines.values())
    assert f"{changed} differ from the defaults" in text.splitlines()[0]


def test_keys_lists_every_key_with_what_it_accepts():
    proc = run_sh("config", "--keys")
    assert proc.returncode == 0, proc.stderr
    listed = [line.split(":", 1)[0] for line in proc.stdout.splitlines()]
    assert listed == leaf_keys()
    assert "train.clip_norm: a number, >= 0; default 0.0; may change on resume. Clip the global gradient norm" \
        in proc.stdout


def test_every_key_has_a_one_line_doc_and_the_docs_reference_is_the_schemas():
    assert all(k.doc for k in keys()), [k.name for k in keys() if not k.doc]
    with open(os.path.join(ROOT, "docs", "configuration.md"), encoding="utf-8") as f:
        doc = f.read()
    start, end = doc.index(MARKERS[0]), doc.index(MARKERS[1]) + len(MARKERS[1])
    assert doc[start:end] == markdown(), "docs/configuration.md's key reference is stale: replace it with " \
                                         "the output of ./run.sh config --markdown"
    assert len(markdown().splitlines()) == len(leaf_keys()) + 4


def test_tensorboard_of_a_folder_without_events_is_one_line(tmp_path):
    proc = run_sh("tensorboard", "somewhere", cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr == (f"error: {tmp_path}/somewhere/tensorboard: no TensorBoard events "
                                                    "there; give a run directory that has trained (its tensorboard/ "
                                                    "folder holds them)\n")


def test_a_bundled_config_is_named_alone_from_any_folder(tmp_path):
    proc = run_sh("config", "base-6-6", cwd=tmp_path)
    assert proc.returncode == 0 and proc.stdout.startswith(f"# {ROOT}/configs/base-6-6.yaml, resolved"), proc.stderr
    missing = run_sh("config", "nope", cwd=tmp_path)
    assert missing.returncode == 2 and missing.stderr == (
        f"error: {tmp_path}/nope: no such config file (a relative path on the command line is from your folder; "
        "a bundled config may be named alone, e.g. default)\n")
