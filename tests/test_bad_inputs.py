"""Bad configs: each stops before any rank starts with exit code 2 and one line on stderr that
names the key, without a traceback, leaving no run directory.

The table goes through the real top level (`launcher.cli.main`, as `./run.sh` calls it) in this
process; a guard on the launch call (`no_launch`) fails a case that would have started ranks.
Bad corpora and the real `./run.sh` command line: tests/test_bad_corpora.py.
"""
from __future__ import annotations

import dataclasses
import json
import os
import typing

import pytest
import yaml

from tests.bad_inputs import RankLaunched, assert_one_line_error, base_config, run_cli, with_key, write_case


def text_after(extra: str) -> callable:
    return lambda tmp_path: yaml.safe_dump(base_config(tmp_path)) + extra


def fifo(tmp_path):
    os.mkfifo(tmp_path / "cfg.yaml")


def symlink_to(target: str) -> callable:
    def make(tmp_path):
        os.symlink(target if target.startswith("/") else tmp_path / target, tmp_path / "cfg.yaml")
    return make


def loop(tmp_path):
    os.symlink(tmp_path / "b.yaml", tmp_path / "cfg.yaml")
    os.symlink(tmp_path / "cfg.yaml", tmp_path / "b.yaml")


def folder(tmp_path):
    os.mkdir(tmp_path / "cfg.yaml")


def resumed_with(change: dict, saved_text: str | None = None) -> callable:
    """A run directory trained with the good config, resumed with `change` applied."""
    def make(tmp_path):
        from trainer.config import RunConfig, from_dict, to_dict

        cfg = base_config(tmp_path)
        cfg["run_dir"] = str(tmp_path / "old")
        os.makedirs(cfg["run_dir"])
        with open(os.path.join(cfg["run_dir"], "config.json"), "w") as handle:
            handle.write(saved_text if saved_text is not None else
                         json.dumps(to_dict(from_dict(RunConfig, cfg, "saved"))))
        for section, values in change.items():
            cfg[section].update(values)
        return yaml.safe_dump(cfg)
    return make


def resumed_after_corpus_changed(tmp_path):
    """A run directory trained with the good config whose data was prepared from corpus files
    that have changed since (its manifest's fingerprint is not the corpus's now)."""
    text = resumed_with({})(tmp_path)
    data = tmp_path / "old" / "data"
    data.mkdir()
    (data / "manifest.json").write_text(json.dumps({"corpus_fingerprint": "files as they were"}))
    return text


def run_dir_is_file(tmp_path):
    (tmp_path / "taken").write_text("x")
    cfg = base_config(tmp_path)
    cfg["run_dir"] = str(tmp_path / "taken")
    return yaml.safe_dump(cfg)


# (id, content: str | bytes | callable(tmp_path) -> str | bytes | None, words the message must hold)
CONFIG_CASES = [
    ("empty-file", "", ["cfg.yaml", "empty"]),
    ("only-comments", "# nothing here\n", ["cfg.yaml", "empty"]),
    ("a-folder", folder, ["cfg.yaml", "folder"]),
    ("binary-file", bytes(range(256)) * 4, ["cfg.yaml", "line"]),
    ("latin1-bytes", b"run_dir: caf\xe9\n", ["cfg.yaml line 1", "UTF-8"]),
    ("nul-bytes", b"run_dir: runs/x\nmodel:\0\n", ["cfg.yaml line 2", "NUL"]),
    ("utf16-text", "run_dir: runs/x\n".encode("utf-16"), ["cfg.yaml"]),
    ("missing-file", None, ["cfg.yaml", "no such config file"]),
    ("dangling-symlink", symlink_to("nowhere.yaml"), ["cfg.yaml", "no such config file"]),
    ("symlink-loop", loop, ["cfg.yaml", "cannot be read"]),
    ("fifo", fifo, ["cfg.yaml", "not a regular file"]),
    ("char-device", symlink_to("/dev/zero"), ["cfg.yaml", "not a regular file"]),
    ("huge-file", "# " + "x" * (1 << 21), ["cfg.yaml", "bytes"]),
    ("bad-yaml", "model: {heads: 4\n", ["cfg.yaml line", "not valid YAML"]),
    ("tab-indent", "model:\n\theads: 4\n", ["cfg.yaml line 2", "not valid YAML"]),
    ("python-tag", "run_dir: !!python/object/apply:os.system ['true']\n", ["cfg.yaml line 1", "YAML"]),
    ("top-level-list", "- model\n- data\n", ["cfg.yaml", "mapping"]),
    ("top-level-scalar", "42\n", ["cfg.yaml", "mapping"]),
    ("duplicate-key", text_after("run_dir: elsewhere\n"), ["cfg.yaml", "run_dir", "twice"]),
    ("duplicate-nested-key", "train:\n  lr: 0.1\n  lr: 0.001\n", ["cfg.yaml line 3", "lr", "twice"]),
    ("unknown-top-key", with_key("modle", {"heads": 4}), ["modle"]),
    ("unknown-model-key", with_key("model.layers", 6),
     ["unknown key model.layers (did you mean model.encoder_layers or model.decoder_layers?)"]),
    ("usual-name-learning_rate", with_key("train.learning_rate", 1e-3), ["train.learning_rate (did you mean train.lr?)"]),
    ("usual-name-stages", with_key("parallel.stages", 2), ["parallel.stages (did you mean parallel.pipeline_stages?)"]),
    ("usual-name-top-precision", with_key("precision", "bf16"), ["unknown key precision (did you mean parallel.precision?)"]),
    ("usual-name-grad_clip", with_key("train.grad_clip", 1.0), ["train.grad_clip (did you mean train.clip_norm?)"]),
    ("key-of-another-section", with_key("model.lr", 1e-3), ["unknown key model.lr (did you mean train.lr?)"]),
    ("typo-train-key", with_key("train.max_stepz", 4), ["train.max_stepz", "(did you mean train.max_steps?)"]),
    ("typo-section", with_key("trian", {"lr": 0.1}), ["unknown key trian", "(did you mean train?)"]),
    ("non-string-key", text_after("1: 2\n"), ["unknown key 1"]),
    ("list-as-key", "? [a, b]\n: 1\n", ["cfg.yaml line 1", "key"]),
    ("lr-huge-int", with_key("train.lr", 10**400), ["train.lr", "too large"]),
    ("section-scalar", with_key("model", 5), ["model", "mapping"]),
    ("section-empty", with_key("train", None), ["train", "empty"]),
    ("heads-0", with_key("model.heads", 0), ["model.heads"]),
    ("d_model-0", with_key("model.d_model", 0), ["model.d_model"]),
    ("d_model-2", with_key("model.d_model", 2), ["model.d_model"]),
    ("ffn_dim-0", with_key("model.ffn_dim", 0), ["model.ffn_dim"]),
    ("encoder_layers-negative", with_key("model.encoder_layers", -1), ["model.encoder_layers"]),
    ("decoder_layers-0", with_key("model.decoder_layers", 0), ["model.decoder_layers"]),
    ("heads-not-dividing", with_key("model.heads", 3), ["model.heads", "model.d_model"]),
    ("heads-float", with_key("model.heads", 4.0), ["model.heads", "integer"]),
    ("heads-string", with_key("model.heads", "4"), ["model.heads", "integer"]),
    ("d_model-bool", with_key("model.d_model", True), ["model.d_model", "integer"]),
    ("heads-list", with_key("model.heads", [4]), ["model.heads"]),
    ("dropout-1.5", with_key("model.dropout", 1.5), ["model.dropout"]),
    ("dropout-negative", with_key("model.dropout", -0.1), ["model.dropout"]),
    ("dropout-1", with_key("model.dropout", 1.0), ["model.dropout"]),
    ("attention_dropout-2", with_key("model.attention_dropout", 2), ["model.attention_dropout"]),
    ("label_smoothing-1", with_key("model.label_smoothing", 1.0), ["model.label_smoothing"]),
    ("layernorm_eps-0", with_key("model.layernorm_eps", 0.0), ["model.layernorm_eps"]),
    ("norm-unknown", with_key("model.norm", "rmsnorm"), ["model.norm", "deepnorm"]),
    ("norm-case", with_key("model.norm", "DeepNorm"), ["model.norm"]),
    ("activation-unknown", with_key("model.activation", "swish"), ["model.activation", "relu"]),
    ("pad_id-5", with_key("model.pad_id", 5), ["model.pad_id"]),
    ("vocab-below-data", with_key("model.vocab_size", 100), ["model.vocab_size", "data.vocab_size"]),
    ("max_positions-short", with_key("model.max_positions", 16), ["model.max_positions"]),
    ("branchnorm-step-0", with_key("model.branchnorm_max_norm_step", 0), ["model.branchnorm_max_norm_step"]),
    ("lr-0", with_key("train.lr", 0), ["train.lr"]),
    ("lr-negative", with_key("train.lr", -0.001), ["train.lr"]),
    ("lr-nan", with_key("train.lr", float("nan")), ["train.lr", "finite"]),
    ("lr-inf", with_key("train.lr", float("inf")), ["train.lr", "finite"]),
    ("lr-word", with_key("train.lr", "fast"), ["train.lr", "number"]),
    ("lr-null", with_key("train.lr", None), ["train.lr", "no value"]),
    ("warmup-negative", with_key("train.warmup_steps", -10), ["train.warmup_steps"]),
    ("max_steps-0", with_key("train.max_steps", 0), ["train.max_steps"]),
    ("micro_batches-0", with_key("train.micro_batches", 0), ["train.micro_batches"]),
    ("log_interval-0", with_key("train.log_interval", 0), ["train.log_interval"]),
    ("save_interval-0", with_key("train.save_interval", 0), ["train.save_interval"]),
    ("valid_interval-0", with_key("train.valid_interval", 0), ["train.valid_interval"]),
    ("keep_checkpoints-0", with_key("train.keep_checkpoints", 0), ["train.keep_checkpoints"]),
    ("instrument_interval-negative", with_key("train.instrument_interval", -5), ["train.instrument_interval"]),
    ("clip_norm-negative", with_key("train.clip_norm", -1.0), ["train.clip_norm"]),
    ("weight_decay-negative", with_key("train.weight_decay", -0.1), ["train.weight_decay"]),
    ("adam_eps-0", with_key("train.adam_eps", 0), ["train.adam_eps"]),
    ("adam_betas-one", with_key("train.adam_betas", [0.9]), ["train.adam_betas", "2 values"]),
    ("adam_betas-range", with_key("train.adam_betas", [0.9, 1.5]), ["train.adam_betas"]),
    ("adam_betas-scalar", with_key("train.adam_betas", 0.9), ["train.adam_betas", "list"]),
    ("seed-negative", with_key("train.seed", -1), ["train.seed"]),
    ("seed-huge", with_key("train.seed", 2**40), ["train.seed"]),
    ("model-beyond-memory", with_key("model.d_model", 1 << 20), ["parameters", "GiB", "model.d_model"]),
    ("layers-beyond-memory", with_key("model.encoder_layers", 10**9), ["parameters", "GiB"]),
    ("precision-fp8", with_key("parallel.precision", "fp8"), ["parallel.precision", "fp16"]),
    ("partition-unknown", with_key("parallel.partition_method", "balanced"), ["parallel.partition_method", "uniform"]),
    ("partition-type-matching-nothing", with_key("parallel.partition_method", "type:Nothing"),
     ["parallel.partition_method", "matches none"]),
    ("partition-bad-regex", with_key("parallel.partition_method", "type:(["), ["parallel.partition_method"]),
    ("zero_stage-2", with_key("parallel.zero_stage", 2), ["parallel.zero_stage"]),
    ("data_parallel-0", with_key("parallel.data_parallel", 0), ["parallel.data_parallel"]),
    ("pipeline_stages-too-many", with_key("parallel.pipeline_stages", 100), ["parallel.pipeline_stages"]),
    ("tensor_parallel-not-dividing", with_key("parallel.tensor_parallel", 3), ["parallel.tensor_parallel"]),
    ("checkpoint-interval-negative", with_key("parallel.activation_checkpoint_interval", -1),
     ["parallel.activation_checkpoint_interval"]),
    ("data-vocab-tiny", with_key("data.vocab_size", 5), ["data.vocab_size"]),
    ("data-max_tokens-short", with_key("data.max_tokens", 10), ["data.max_tokens"]),
    ("data-languages-en", with_key("data.languages", ["en", "de"]), ["data.languages", "'en'"]),
    ("data-languages-form", with_key("data.languages", ["pt-BR"]), ["data.languages", "pt-BR"]),
    ("data-languages-unknown", with_key("data.languages", ["zz"]), ["data.languages", "zz"]),
    ("data-languages-twice", with_key("data.languages", ["de", "de"]), ["data.languages", "once"]),
    ("data-languages-string", with_key("data.languages", "de"), ["data.languages", "list"]),
    ("data-languages-empty-bundled", with_key("data.languages", []), ["data.languages", "bundled"]),
    ("data-languages-no-catalog", with_key("data.languages", ["ab"]), ["['ab']", "available"]),
    ("data-max_source_len-2", with_key("data.max_source_len", 2), ["data.max_source_len"]),
    ("data-vocab-float", with_key("data.vocab_size", 4000.0), ["data.vocab_size", "integer"]),
    ("norm-null", with_key("model.norm", None), ["model.norm", "no value"]),
    ("gettext-folder-missing", with_key("data.corpus", "gettext:/nonexistent/po"), ["gettext", "/nonexistent/po"]),
    ("data-spm-type", with_key("data.spm_model_type", "word"), ["data.spm_model_type"]),
    ("data-coverage-0", with_key("data.character_coverage", 0.0), ["data.character_coverage"]),
    ("data-temperature-0", with_key("data.sampling_temperature", 0), ["data.sampling_temperature"]),
    ("data-ratio-half", with_key("data.max_length_ratio", 0.5), ["data.max_length_ratio"]),
    ("data-workers-negative", with_key("data.workers", -1), ["data.workers"]),
    ("data-seed-negative", with_key("data.seed", -1), ["data.seed"]),
    ("data-corpus-empty", with_key("data.corpus", ""), ["data.corpus"]),
    ("data-corpus-bundled-typo", with_key("data.corpus", "bundled:opus"), ["data.corpus"]),
    ("run_dir-under-proc", with_key("run_dir", "/proc/deepnet-run"), ["run_dir", "/proc"]),
    ("run_dir-is-a-file", run_dir_is_file, ["run_dir", "not a folder"]),
    ("run_dir-empty", with_key("run_dir", ""), ["run_dir"]),
    ("resume-other-shape", resumed_with({"model": {"d_model": 64}}), ["model.d_model: 32 → 64", "new run_dir"]),
    # (another pp × tp × dp is resumed, resharded: tests/test_elastic.py; its own refusals there)
    ("resume-other-zero-stage", resumed_with({"parallel": {"zero_stage": 0}}), ["parallel.zero_stage: 1 → 0", "new run_dir"]),
    ("resume-damaged-config-json", resumed_with({}, "{garbage"), ["config.json", "damaged"]),
    ("resume-other-vocab", resumed_with({"data": {"vocab_size": 500}}), ["data.vocab_size", "→ 500", "tokenizer"]),
    ("resume-other-languages", resumed_with({"data": {"languages": ["fr"]}}), ["data.languages", "tokenizer"]),
    ("resume-corpus-files-changed", resumed_after_corpus_changed, ["corpus", "changed", "tokenizer", "new run_dir"]),
    ("cluster-nodes-missing", with_key("clusters", {"big": {"gpus_per_node": 2}}), ["clusters.big", "nodes is required"]),
    ("cluster-nodes-0", with_key("clusters", {"big": {"nodes": 0, "gpus_per_node": 2}}), ["clusters.big", "nodes"]),
]


@pytest.mark.parametrize("content, words", [c[1:] for c in CONFIG_CASES], ids=[c[0] for c in CONFIG_CASES])
def test_bad_config_stops_before_any_rank_with_one_line(tmp_path, capsys, no_launch, content, words):
    path = write_case(tmp_path, content)
    code, out, err = run_cli(["train", path], capsys)
    assert_one_line_error(code, out, err, words)
    assert not (tmp_path / "run").exists(), "a run directory was created for a bad config"


def test_the_good_config_passes_every_check(tmp_path):
    """The base of the table is valid, so each case fails for its one change (and 5e-4 written
    without a dot, which YAML reads as a string, is the number it spells)."""
    from trainer.config import load_config
    from launcher.preflight import check_device, check_run_dir

    path = write_case(tmp_path, yaml.safe_dump(base_config(tmp_path)).replace("train:\n", "train:\n  lr: 5e-4\n"))
    cfg = load_config(path)
    check_run_dir(cfg, path)
    check_device(cfg, path)
    assert cfg.train.lr == 5e-4 and not (tmp_path / "run").exists()


def accelerator_answer(monkeypatch, answer: str) -> bool:
    """Whether DeepSpeed's accelerator supports fp16: its own answer on this machine ("asked"), or a
    test double of that one answer ("fp16" / "no fp16": its supported_dtypes with fp16 added or
    removed; the rest of the accelerator and every check are the real ones). On DeepSpeed's CPU
    accelerator the answer depends on the processor (oneDNN's fp16 support: AVX512-FP16 or AMX-FP16)."""
    import torch
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    own = list(accelerator.supported_dtypes())
    if answer != "asked":
        dtypes = [d for d in own if d != torch.float16] + ([torch.float16] if answer == "fp16" else [])
        monkeypatch.setattr(accelerator, "supported_dtypes", lambda: list(dtypes))
    return torch.float16 in accelerator.supported_dtypes()


@pytest.mark.parametrize("answer", ["asked", "fp16", "no fp16"])
@pytest.mark.parametrize("command", [["train"], ["prepare", "--check-device"]])
def test_fp16_is_refused_exactly_where_the_accelerator_lacks_it(tmp_path, capsys, no_launch, monkeypatch, answer,
                                                                   command):
    """precision: fp16 follows the accelerator's answer: refused with one line naming the key and
    what it supports where fp16 is missing; where it is there, the config passes the device check
    and the command stops only at the next check (here a corpus that does not exist)."""
    supported = accelerator_answer(monkeypatch, answer)
    cfg = base_config(tmp_path, str(tmp_path / "no-corpus"))
    cfg["parallel"]["precision"] = "fp16"
    path = write_case(tmp_path, yaml.safe_dump(cfg))
    code, out, err = run_cli([command[0], path, *command[1:]], capsys)
    if supported:
        assert_one_line_error(code, out, err, ["data.corpus", "no-corpus", "does not exist"])
    else:
        assert_one_line_error(code, out, err, ["parallel.precision=fp16", "not supported", "use fp32, bf16"])
    assert not (tmp_path / "run").exists()


def test_prepare_refuses_a_changed_resume(tmp_path, capsys):
    path = write_case(tmp_path, resumed_with({"model": {"heads": 2}}))
    assert_one_line_error(*run_cli(["prepare", path], capsys), ["model.heads: 4 → 2"])
    assert not (tmp_path / "run").exists() and os.listdir(tmp_path / "old") == ["config.json"]


def test_norm_enumeration_matches_the_strategies():
    from model.config import Norm
    from model.norms import STRATEGIES

    assert set(typing.get_args(Norm)) == set(STRATEGIES)


def test_a_key_added_later_is_type_checked_without_new_code(tmp_path, capsys, no_launch, monkeypatch):
    """A field appended to TrainConfig (as later features do) is checked from its annotation."""
    import trainer.config as config

    extended = dataclasses.make_dataclass(
        "Extended", [("collective_timeout_s", float, dataclasses.field(default=600.0)),
                     ("divergence_policy", typing.Literal["stop", "skip", "rollback"],
                      dataclasses.field(default="stop"))],
        bases=(config.TrainConfig,), kw_only=True)
    monkeypatch.setitem(config.RunConfig.__annotations__, "train", extended)
    for key, value, words in (("collective_timeout_s", ["600"], ["train.collective_timeout_s", "number"]),
                              ("collective_timeout_s", float("nan"), ["train.collective_timeout_s", "finite"]),
                              ("divergence_policy", "ignore", ["train.divergence_policy", "stop, skip, rollback"])):
        path = write_case(tmp_path, with_key(f"train.{key}", value))
        assert_one_line_error(*run_cli(["train", path], capsys), words)


def test_the_table_fails_against_a_broken_validator(tmp_path, capsys, no_launch, monkeypatch):
    """With the field checks switched off, `d_model: 0` gets past the checks (here: into the data
    preparation, the step before the launch) and the table's assertion fails, so the table
    catches such a regression."""
    import data.prepare
    import schema.fields as fields
    import trainer.config as config

    def past_the_checks(*args, **kwargs):
        raise RankLaunched("got past the checks")

    monkeypatch.setattr(fields, "coerce", lambda annotation, value, key, build=None: value)
    monkeypatch.setattr(config.ModelConfig, "validate", lambda self: None)
    monkeypatch.setattr(data.prepare, "prepare_data", past_the_checks)
    path = write_case(tmp_path, with_key("model.d_model", 0))
    with pytest.raises(RankLaunched):
        assert_one_line_error(*run_cli(["train", path], capsys), ["model.d_model"])


def test_a_negative_eval_sentences_count_is_refused(tmp_path, capsys, no_launch):
    path = write_case(tmp_path, yaml.safe_dump(base_config(tmp_path)))
    assert_one_line_error(*run_cli(["train", path, "--eval-sentences", "-3"], capsys), ["--eval-sentences -3"])
    assert not (tmp_path / "run").exists()
