"""`--set KEY=VALUE`: one implementation (trainer/config.py apply_sets) for train, prepare, slurm,
plan and bench; values typed and checked by the code that checks the YAML file, errors that name
`--set KEY`, and the result recorded where the run's config is (the ranks' config, slurm's frozen
copy). In-process through the real top level (launcher.cli.main), no ranks started."""
from __future__ import annotations

import os

import pytest
import yaml

from tests.bad_inputs import assert_one_line_error, base_config, run_cli, write_case


@pytest.fixture
def config(tmp_path) -> str:
    return write_case(tmp_path, yaml.safe_dump(base_config(tmp_path)))


def test_set_changes_keys_with_the_types_yaml_gives(config):
    from trainer.config import load_config

    plain = load_config(config)
    cfg = load_config(config, sets=["train.max_steps=400", "train.lr=2e-4", "model.dropout=0.25",
                                    "data.languages=[de, fr]", "parallel.precision=bf16",
                                    "train.max_steps=401"])  # the later of two wins
    assert (cfg.train.max_steps, cfg.train.lr, cfg.model.dropout) == (401, 2e-4, 0.25)
    assert cfg.data.languages == ["de", "fr"] and cfg.parallel.precision == "bf16"
    assert (plain.train.max_steps, plain.train.lr, plain.data.languages) == (2, 5e-4, ["de"])  # TrainConfig.lr
    # a key the file does not have is added to its section, like a key written in the file
    assert load_config(config, sets=["train.clip_norm=0.5"]).train.clip_norm == 0.5


@pytest.mark.parametrize("item, words", [
    ("train.max_stepz=400", ["--set train.max_stepz", "unknown key", "did you mean train.max_steps?"]),
    ("trian.max_steps=400", ["--set trian.max_steps", "unknown key trian", "did you mean train?"]),
    ("train.learning_rate=1e-3", ["--set train.learning_rate: unknown key train.learning_rate (did you mean train.lr?)"]),
    ("model.layers=12", ["unknown key model.layers (did you mean model.encoder_layers or model.decoder_layers?)"]),
    ("parallel.stages=2", ["unknown key parallel.stages (did you mean parallel.pipeline_stages?)"]),
    ("precision=bf16", ["--set precision: unknown key precision (did you mean parallel.precision?)"]),
    ("tp=2", ["unknown key tp (did you mean parallel.tensor_parallel?)"]),
    ("train.batch_size=4096", ["unknown key train.batch_size (did you mean data.max_tokens?)"]),
    ("max_step=4", ["unknown key max_step (did you mean train.max_steps?)"]),
    ("train.max_steps=many", ["--set train.max_steps='many'", "integer"]),
    ("train.max_steps=4.5", ["--set train.max_steps=4.5", "integer"]),
    ("train.max_steps=0", ["--set train.max_steps=0", ">= 1"]),
    ("train.lr=fast", ["--set train.lr='fast'", "number"]),
    ("train.lr=.inf", ["--set train.lr=inf", "finite"]),
    ("model.norm=rmsnorm", ["--set model.norm='rmsnorm'", "deepnorm"]),
    ("data.languages=de", ["--set data.languages='de'", "list"]),
    ("train.max_steps=", ["--set train.max_steps", "no value"]),
    ("train.max_steps", ["--set train.max_steps", "KEY=VALUE"]),
    ("=3", ["--set =3", "KEY=VALUE"]),
    ("train=3", ["--set train", "is a section", "train.max_steps=VALUE"]),
    ("train.lr.x=1", ["--set train.lr.x", "single value"]),
    ("train.lr=[1, 2", ["--set train.lr=[1, 2", "not valid YAML"]),
    ("model.heads=3", ["with --set model.heads=3", "model.heads=3 must divide model.d_model"]),
    ("run_dir=$DEEPNET_NOT_SET_ANYWHERE/x", ["--set run_dir", "DEEPNET_NOT_SET_ANYWHERE is not set"]),
])
@pytest.mark.parametrize("command", ["train", "prepare"])
def test_a_bad_set_stops_with_one_line_naming_it(tmp_path, capsys, no_launch, config, command, item, words):
    assert_one_line_error(*run_cli([command, config, "--set", item], capsys), words)
    assert not (tmp_path / "run").exists()


def test_slurm_freezes_the_overrides_and_plan_prices_them(tmp_path, capsys):
    from trainer.config import load_config

    config = write_case(tmp_path, yaml.safe_dump({**base_config(tmp_path), "parallel": {"pipeline_stages": 2}}))
    code, out, err = run_cli(["slurm", config, "--nodes", "1", "--gpus-per-node", "0", "--set", "train.max_steps=7",
                              "--set", "model.dropout=0.2"], capsys)
    assert code == 0, err
    frozen = os.path.join(tmp_path, "run", "slurm", "config.yaml")
    job = load_config(frozen)
    assert (job.train.max_steps, job.model.dropout) == (7, 0.2)
    text = open(frozen, encoding="utf-8").read()
    assert "with --set train.max_steps=7 model.dropout=0.2" in text.splitlines()[0]
    assert "--set train.max_steps=7 --set model.dropout=0.2" in open(os.path.join(tmp_path, "run", "slurm", "job.sbatch")).read()
    # a refused --set writes nothing
    other = str(tmp_path / "other")
    assert_one_line_error(*run_cli(["slurm", config, "--nodes", "1", "--gpus-per-node", "0", "--run-dir", other,
                                    "--set", "train.max_steps=-1"], capsys), ["--set train.max_steps=-1"])
    assert not os.path.exists(other)

    # plan: the parameter count in its title follows a --set of the model's width
    def planned(*sets: str) -> str:
        code, out, err = run_cli(["plan", config, "--gpu", "a100-80gb", "--gpus", "8", *sets], capsys)
        assert code == 0, err
        return out.splitlines()[0]

    # d 512, FFN 2048: 3 encoder layers of 4·d² + 2·d·FFN = 3.15M, 3 decoder layers of 8·d² + 2·d·FFN
    # = 4.19M and a 600 × 512 embedding: 22.3M
    assert "(0.00B parameters" in planned() and "(0.02B parameters" in planned("--set", "model.d_model=512",
                                                                               "--set", "model.ffn_dim=2048")
    assert_one_line_error(*run_cli(["plan", config, "--gpu", "a100-80gb", "--set", "model.widht=3"], capsys),
                          ["--set model.widht"])


def test_bench_takes_set_for_the_config_it_reads_and_checks_it_first(tmp_path, capsys, config):
    out = tmp_path / "bench-out"
    assert_one_line_error(*run_cli(["bench", "data", "--config", config, "--out", str(out), "--set",
                                    "data.max_tokens=zero"], capsys), ["--set data.max_tokens='zero'"])
    assert_one_line_error(*run_cli(["bench", "train", config, "--out", str(out), "--set",
                                    "train.micro_batches=0"], capsys), ["--set train.micro_batches=0"])
    assert_one_line_error(*run_cli(["bench", "model", "--set", "train.lr=1"], capsys), ["--set", "bench.model"])
    # bench train starts ranks on the config's data: the checks of ./run.sh train come first
    missing = write_case(tmp_path, yaml.safe_dump(base_config(tmp_path, str(tmp_path / "no-corpus"))))
    assert_one_line_error(*run_cli(["bench", "train", missing, "--out", str(out)], capsys),
                          ["data.corpus", "no-corpus", "does not exist"])
    assert not out.exists()


def test_the_ranks_read_the_resolved_config(tmp_path, config):
    """./run.sh train hands its ranks the config it checked, every key explicit, --set applied: what
    they load (and record in config.json) is that config."""
    from launcher.commands.train import resolved_config
    from trainer.config import load_config, to_dict

    cfg = load_config(config, {"run_dir": str(tmp_path / "elsewhere")}, sets=["train.max_steps=9", "train.lr=2e-4"])
    with resolved_config(cfg, config) as path:
        assert to_dict(load_config(path)) == to_dict(cfg)
        assert os.path.basename(path) == "cfg.yaml" and open(path).readline().startswith(f"# {config}")
    assert not os.path.exists(path)
    assert load_config(config).train.max_steps == 2  # the file itself is unchanged


def test_the_usual_names_point_at_keys_the_config_has():
    """Every word of the hint table (trainer/key_aliases.py) names keys that exist and is no key's own
    name (that one is found without the table), and the hints of a few reach the same key from
    --set and from a YAML file."""
    from schema.fields import did_you_mean, leaf_keys
    from trainer.config import RunConfig
    from trainer.key_aliases import KEY_ALIASES

    keys = leaf_keys(RunConfig)
    names = {key.rpartition(".")[2] for key in keys}
    assert len(KEY_ALIASES) >= 60 and not set(KEY_ALIASES) & names
    assert all(target in keys for targets in KEY_ALIASES.values() for target in targets)
    for word, want in (("learning_rate", "train.lr"), ("warmup", "train.warmup_steps"), ("pp", "parallel.pipeline_stages"),
                       ("hidden_size", "model.d_model"), ("num_layers", "model.encoder_layers or model.decoder_layers"),
                       ("clip_grad", "train.clip_norm"), ("dp", "parallel.data_parallel"),
                       ("max_update", "train.max_steps"), ("Learning-Rate", "train.lr")):
        assert did_you_mean(word, "train.", [], RunConfig, KEY_ALIASES) == f" (did you mean {want}?)", word
