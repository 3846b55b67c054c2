"""Bad configs and bad corpora: each stops before any rank starts with exit code 2 and one line
on stderr that names the key, file or line, without a traceback, leaving no run directory.

The tables go through the real top level (`launcher.cli.main`, as `./run.sh` calls it) in this
process; a guard on the launch call fails a case that would have started ranks. A representative
subset runs the real `./run.sh train` / `./run.sh prepare` as separate processes.
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import typing

import pytest
import yaml

from tests.conftest import ROOT, TINY_DATA, TINY_MODEL

LANGS = ("de", "fr")


def base_config(tmp_path, corpus: str = "bundled:django") -> dict:
    return {"run_dir": str(tmp_path / "run"), "model": dict(TINY_MODEL),
            "data": {**TINY_DATA, "corpus": corpus, "languages": [] if corpus != "bundled:django" else ["de"],
                     "workers": 1},
            "parallel": {"pipeline_stages": 2},
            "train": {"max_steps": 2, "log_interval": 1, "warmup_steps": 2}}


def with_key(path: str, value) -> callable:
    """A case that sets `section.key` (path "model.heads") of the good config to `value`."""
    def make(tmp_path):
        cfg = base_config(tmp_path)
        *sections, key = path.split(".")
        target = cfg
        for section in sections:
            target = target.setdefault(section, {})
        target[key] = value
        return yaml.safe_dump(cfg)
    return make


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
        from launcher.config import RunConfig, from_dict, to_dict

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
    ("unknown-model-key", with_key("model.layers", 6), ["model.layers"]),
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
    ("precision-fp16-unsupported", with_key("parallel.precision", "fp16"), ["parallel.precision=fp16", "not supported"]),
    ("partition-unknown", with_key("parallel.partition_method", "balanced"), ["parallel.partition_method", "uniform"]),
    ("partition-type-matching-nothing", with_key("parallel.partition_method", "type:Nothing"),
     ["parallel.partition_method", "matches none"]),
    ("partition-bad-regex", with_key("parallel.partition_method", "type:(["), ["parallel.partition_method"]),
    ("zero_stage-2", with_key("parallel.zero_stage", 2), ["parallel.zero_stage"]),
    ("zero0-pp2-tp2-clipped", lambda tmp_path: yaml.safe_dump(
        {**base_config(tmp_path), "parallel": {"pipeline_stages": 2, "tensor_parallel": 2, "zero_stage": 0},
         "train": {"max_steps": 2, "clip_norm": 1.0}}), ["parallel.zero_stage=0", "tensor_parallel > 1", "zero_stage: 1"]),
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
    ("resume-other-layout", resumed_with({"parallel": {"pipeline_stages": 3}}), ["parallel.pipeline_stages: 2 → 3"]),
    ("resume-damaged-config-json", resumed_with({}, "{garbage"), ["config.json", "damaged"]),
    ("cluster-nodes-missing", with_key("clusters", {"big": {"gpus_per_node": 2}}), ["clusters.big", "nodes is required"]),
    ("cluster-nodes-0", with_key("clusters", {"big": {"nodes": 0, "gpus_per_node": 2}}), ["clusters.big", "nodes"]),
]


class RankLaunched(Exception):
    pass


@pytest.fixture
def no_launch(monkeypatch):
    """Fails a case that gets as far as building the ranks' launch command."""
    import launcher.commands.train as train_command

    def refuse(*args, **kwargs):
        raise RankLaunched(f"ranks were about to be launched: {args}")
    monkeypatch.setattr(train_command, "deepspeed_command", refuse)


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    from launcher.cli import main

    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code: int, out: str, err: str, words: list[str]) -> None:
    assert "Traceback" not in out + err, out + err
    lines = err.strip().splitlines()
    assert code == 2, (code, out, err)
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for word in words:
        assert word in lines[0], f"{word!r} not in: {lines[0]}"


def written_files(run_dir) -> list[str]:
    """What a failed command left in `run_dir`: every file except a run lock's (a trainer holds
    the run directory while it prepares the data, so a corpus error may leave its lock file)."""
    if not os.path.exists(run_dir):
        return []
    return [os.path.join(folder, name) for folder, _, names in os.walk(run_dir) for name in names
            if not name.startswith(".trainer.lock")]


def write_case(tmp_path, content) -> str:
    path = tmp_path / "cfg.yaml"
    if callable(content):
        content = content(tmp_path)
    if isinstance(content, str):
        path.write_text(content, encoding="utf-8")
    elif isinstance(content, bytes):
        path.write_bytes(content)
    return str(path)


@pytest.mark.parametrize("content, words", [c[1:] for c in CONFIG_CASES], ids=[c[0] for c in CONFIG_CASES])
def test_bad_config_stops_before_any_rank_with_one_line(tmp_path, capsys, no_launch, content, words):
    path = write_case(tmp_path, content)
    code, out, err = run_cli(["train", path], capsys)
    assert_one_line_error(code, out, err, words)
    assert not (tmp_path / "run").exists(), "a run directory was created for a bad config"


def test_the_good_config_passes_every_check(tmp_path):
    """The base of the table is valid, so each case fails for its one change (and 5e-4 written
    without a dot, which YAML reads as a string, is the number it spells)."""
    from launcher.config import load_config
    from launcher.preflight import check_device, check_run_dir

    path = write_case(tmp_path, yaml.safe_dump(base_config(tmp_path)).replace("train:\n", "train:\n  lr: 5e-4\n"))
    cfg = load_config(path)
    check_run_dir(cfg, path)
    check_device(cfg, path)
    assert cfg.train.lr == 5e-4 and not (tmp_path / "run").exists()


def test_prepare_checks_the_device_when_asked_and_refuses_a_changed_resume(tmp_path, capsys):
    path = write_case(tmp_path, with_key("parallel.precision", "fp16"))
    assert_one_line_error(*run_cli(["prepare", path, "--check-device"], capsys), ["parallel.precision=fp16"])
    path = write_case(tmp_path, resumed_with({"model": {"heads": 2}}))
    assert_one_line_error(*run_cli(["prepare", path], capsys), ["model.heads: 4 → 2"])
    assert not (tmp_path / "run").exists() and os.listdir(tmp_path / "old") == ["config.json"]


def test_norm_enumeration_matches_the_strategies():
    from model.config import Norm
    from model.norms import RENAMED, STRATEGIES

    assert set(typing.get_args(Norm)) == set(STRATEGIES) | set(RENAMED)


def test_a_key_added_later_is_type_checked_without_new_code(tmp_path, capsys, no_launch, monkeypatch):
    """A field appended to TrainConfig (as later features do) is checked from its annotation."""
    import launcher.config as config

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
    import launcher.config as config

    def past_the_checks(*args, **kwargs):
        raise RankLaunched("got past the checks")

    monkeypatch.setattr(config, "check_fields", lambda obj, section: None)
    monkeypatch.setattr(config.ModelConfig, "validate", lambda self: None)
    monkeypatch.setattr(data.prepare, "prepare_data", past_the_checks)
    path = write_case(tmp_path, with_key("model.d_model", 0))
    with pytest.raises(RankLaunched):
        assert_one_line_error(*run_cli(["train", path], capsys), ["model.d_model"])


# ---- corpora -----------------------------------------------------------------------------------

def write_lines(path, lines, encoding="utf-8", newline="\n"):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as handle:
        handle.write("".join(x + newline for x in lines).encode(encoding))


def good_corpus(root) -> str:
    corpus = os.path.join(root, "corpus")
    for lang in LANGS:
        for split, n in (("train", 30), ("dev", 8), ("test", 8)):
            prefix = os.path.join(corpus, f"en-{lang}", f"opus.en-{lang}-{split}")
            write_lines(f"{prefix}.en", [f"This is {split} sentence number {k}." for k in range(n)])
            write_lines(f"{prefix}.{lang}", [f"Satz {k} aus {split} ({lang})." for k in range(n)])
    return corpus


def f(corpus, split="dev", side="fr", lang="fr"):
    return os.path.join(corpus, f"en-{lang}", f"opus.en-{lang}-{split}.{side}")


def remove_dev(c):
    os.remove(f(c, side="en"))
    os.remove(f(c))


def empty_dev(c):
    open(f(c, side="en"), "w").close()
    open(f(c), "w").close()


def relink(path, target):
    os.remove(path)
    os.symlink(target, path)


def dangling(c):
    relink(f(c), f(c) + ".gone")


def file_loop(c):
    os.remove(f(c))
    os.symlink(f(c) + ".b", f(c))
    os.symlink(f(c), f(c) + ".b")


def folder_loop(c):
    os.symlink(os.path.join(c, "en-fr"), os.path.join(c, "en-fr", "again"))


def sibling_loop(c):
    os.symlink(os.path.join(c, "en-fr"), os.path.join(c, "en-de", "x"))
    os.symlink(os.path.join(c, "en-de"), os.path.join(c, "en-fr", "y"))


def same_file_both_sides(c):
    relink(f(c), f(c, side="en"))


def dev_is_train(c):
    relink(f(c), f(c, split="train"))
    relink(f(c, side="en"), f(c, split="train", side="en"))


def encoded(encoding, bom=b""):
    def make(c):
        lines = [f"Satz {k} (fr)." for k in range(8)]
        with open(f(c), "wb") as handle:
            handle.write(bom + "".join(x + "\n" for x in lines).encode(encoding))
    return make


def nul_in_line_3(c):
    with open(f(c), "rb") as handle:
        lines = handle.read().split(b"\n")
    lines[2] = lines[2] + b"\0"
    with open(f(c), "wb") as handle:
        handle.write(b"\n".join(lines))


def cr_line_endings(c):
    with open(f(c, split="train"), "rb") as handle:
        text = handle.read()
    with open(f(c, split="train"), "wb") as handle:
        handle.write(text.replace(b"\n", b"\r"))


def latin1_train(c):
    write_lines(f(c, split="train"), [f"Phrase numéro {k}, déjà vu." for k in range(30)], encoding="latin-1")


def dev_all_too_long(c):
    write_lines(f(c), ["mot " * 600] * 8)


def unknown_code(c):
    os.rename(os.path.join(c, "en-fr"), os.path.join(c, "en-zz"))
    for name in os.listdir(os.path.join(c, "en-zz")):
        os.rename(os.path.join(c, "en-zz", name), os.path.join(c, "en-zz", name.replace("fr", "zz")))


def upper_code(c):
    os.rename(f(c), f(c).replace("-dev.fr", "-dev.FR"))


def counts_differ(c):
    write_lines(f(c), [f"Satz {k}" for k in range(7)])


def empty_train_side(c):
    open(f(c, split="train"), "w").close()


def folder_named_like_file(c):
    os.remove(f(c, split="test"))
    os.mkdir(f(c, split="test"))


def fifo_named_like_file(c):
    os.remove(f(c, split="test"))
    os.mkfifo(f(c, split="test"))


def tsv_without_tab(c):
    for side in ("en", "de"):
        os.remove(f(c, split="train", side=side, lang="de"))
    write_lines(os.path.join(c, "en-de", "opus.en-de-train.tsv"), ["Hello\tHallo"] * 3 + ["no tab"] + ["Yes\tJa"])


def split_given_twice(c):
    write_lines(os.path.join(c, "en-fr", "dev.en-fr.fr"), ["x"] * 8)


def opus_typo(c):
    path = f(c, split="test")
    os.rename(path, os.path.join(os.path.dirname(path), "opus.en-fr.test.fr"))


def only_test(c):
    for lang in LANGS:
        for split in ("train", "dev"):
            for side in ("en", lang):
                os.remove(f(c, split=split, side=side, lang=lang))


def corpus_missing(c):
    import shutil

    shutil.rmtree(c)


def corpus_is_file(c):
    import shutil

    shutil.rmtree(c)
    open(c, "w").close()


# (id, mutation of the good corpus, data overrides, words of the message)
CORPUS_CASES = [
    ("no-dev-split", remove_dev, {}, ["en-fr", "no dev split"]),
    ("empty-dev-files", empty_dev, {}, ["opus.en-fr-dev", "empty file"]),
    ("dev-all-dropped", dev_all_too_long, {}, ["opus.en-fr-dev", "none of the 8", "too_long_chars"]),
    ("dangling-symlink", dangling, {}, ["opus.en-fr-dev.fr", "dangling"]),
    ("file-symlink-loop", file_loop, {}, ["opus.en-fr-dev.fr", "loop"]),
    ("folder-symlink-loop", folder_loop, {}, ["again", "already read"]),
    ("sibling-symlink-loop", sibling_loop, {}, ["symbolic link", "already read"]),
    ("same-file-both-sides", same_file_both_sides, {}, ["opus.en-fr-dev.fr", "same file"]),
    ("dev-is-train", dev_is_train, {}, ["opus.en-fr-dev", "same file"]),
    ("utf16-bom", encoded("utf-16"), {}, ["opus.en-fr-dev.fr", "UTF-16"]),
    ("utf16-no-bom", encoded("utf-16-le"), {}, ["opus.en-fr-dev.fr", "line 1", "NUL", "UTF-16"]),
    ("utf32-bom", encoded("utf-32"), {}, ["opus.en-fr-dev.fr", "UTF-32"]),
    ("utf8-bom", encoded("utf-8", b"\xef\xbb\xbf"), {}, ["opus.en-fr-dev.fr", "byte-order mark"]),
    ("nul-byte", nul_in_line_3, {}, ["opus.en-fr-dev.fr line 3", "NUL"]),
    ("cr-line-endings", cr_line_endings, {}, ["opus.en-fr-train.fr", "CR only"]),
    ("latin1-file", latin1_train, {}, ["opus.en-fr-train.fr", "not UTF-8"]),
    ("unknown-language", unknown_code, {}, ["opus.en-zz", "'zz'"]),
    ("language-not-lower-case", upper_code, {}, ["opus.en-fr-dev.FR"]),
    ("line-counts-differ", counts_differ, {}, ["opus.en-fr-dev.en has 8 lines", "opus.en-fr-dev.fr has 7"]),
    ("empty-train-side", empty_train_side, {}, ["opus.en-fr-train.fr", "empty file"]),
    ("folder-named-like-file", folder_named_like_file, {}, ["opus.en-fr-test.fr", "folder"]),
    ("fifo-named-like-file", fifo_named_like_file, {}, ["opus.en-fr-test.fr", "regular file"]),
    ("tsv-line-without-tab", tsv_without_tab, {}, ["opus.en-de-train.tsv line 4", "tabs"]),
    ("split-given-twice", split_given_twice, {}, ["dev.en-fr.fr", "split dev"]),
    ("opus-name-typo", opus_typo, {}, ["opus.en-fr.test.fr", "OPUS-100"]),
    ("only-test-splits", only_test, {}, ["train split"]),
    ("language-not-in-corpus", lambda c: None, {"languages": ["it"]}, ["['it']", "available"]),
    ("one-language-twice", lambda c: os.makedirs(os.path.join(c, "x")) or write_lines(
        os.path.join(c, "x", "train.en-en.en"), ["a"]), {}, ["train.en-en.en", "two different languages"]),
    ("pair-in-both-orders", lambda c: write_lines(os.path.join(c, "dev.fr-en.tsv"), ["a\tb"]), {},
     ["dev.fr-en.tsv", "keep one order"]),
    ("extension-of-a-third-language", lambda c: write_lines(os.path.join(c, "en-fr", "opus.en-fr-dev.it"), ["x"]), {},
     ["opus.en-fr-dev.it", "extension"]),
    ("corpus-missing", corpus_missing, {}, ["data.corpus", "does not exist"]),
    ("corpus-is-a-file", corpus_is_file, {}, ["data.corpus", "not a folder"]),
]


@pytest.mark.parametrize("mutate, data, words", [c[1:] for c in CORPUS_CASES], ids=[c[0] for c in CORPUS_CASES])
def test_bad_corpus_stops_before_any_rank_with_one_line(tmp_path, capsys, no_launch, mutate, data, words):
    corpus = good_corpus(tmp_path)
    mutate(corpus)
    cfg = base_config(tmp_path, corpus)
    cfg["data"].update(data)
    path = write_case(tmp_path, yaml.safe_dump(cfg))
    code, out, err = run_cli(["train", path], capsys)
    assert_one_line_error(code, out, err, words)
    assert written_files(tmp_path / "run") == [], "the failed preparation left files behind"


def test_the_good_corpus_passes_the_checks(tmp_path):
    from data.config import DataConfig
    from data.corpus import list_pairs
    from data.prepare import check_corpus

    corpus = good_corpus(tmp_path)
    check_corpus(DataConfig(corpus=corpus, languages=[]))
    assert [p.name for p in list_pairs(corpus)] == ["en-de", "en-fr"]
    # A pair folder that is a symbolic link to text kept elsewhere is read, not skipped.
    os.rename(os.path.join(corpus, "en-fr"), tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", os.path.join(corpus, "en-fr"))
    assert [p.name for p in list_pairs(corpus)] == ["en-de", "en-fr"]


# ---- the real command line, a representative subset -------------------------------------------

def test_real_cli_refuses_bad_inputs_without_starting_ranks(tmp_path):
    """`./run.sh train` and `./run.sh prepare` as a user runs them, two at a time."""
    corpus = good_corpus(tmp_path)
    remove_dev(corpus)
    utf16 = good_corpus(tmp_path / "u")
    encoded("utf-16")(utf16)
    cases = []
    for name, content, command, words in [
        ("empty", "", "train", ["empty"]),
        ("heads", with_key("model.heads", 0), "train", ["model.heads"]),
        ("fp16", with_key("parallel.precision", "fp16"), "train", ["parallel.precision=fp16"]),
        ("proc", with_key("run_dir", "/proc/deepnet-run"), "prepare", ["run_dir", "/proc"]),
        ("nodev", yaml.safe_dump(base_config(tmp_path / "nodev", corpus)), "prepare", ["no dev split"]),
        ("utf16", yaml.safe_dump(base_config(tmp_path / "utf16", utf16)), "train", ["UTF-16"]),
    ]:
        folder_ = tmp_path / name
        folder_.mkdir(exist_ok=True)
        cases.append((write_case(folder_, content), command, words, folder_))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # conftest chose the accelerator (DS_ACCELERATOR)
    for batch in (cases[i:i + 2] for i in range(0, len(cases), 2)):
        procs = [(subprocess.Popen([os.path.join(ROOT, "run.sh"), command, path], cwd=ROOT, env=env,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True), words, folder_)
                 for path, command, words, folder_ in batch]
        for proc, words, folder_ in procs:
            out, err = proc.communicate(timeout=300)
            assert_one_line_error(proc.returncode, out, err, words)
            assert "launching" not in out and written_files(folder_ / "run") == []



def test_the_good_corpus_reaches_the_launch(tmp_path, capsys, no_launch):
    """Positive control of the corpus table: unchanged, the same corpus and config are prepared
    and get as far as the launch guard, so the table's refusals come from the checks."""
    cfg = base_config(tmp_path, good_corpus(tmp_path))
    cfg["data"].update(vocab_size=300, spm_sample_sentences=1000)
    path = write_case(tmp_path, yaml.safe_dump(cfg))
    with pytest.raises(RankLaunched):
        run_cli(["train", path], capsys)
    assert os.path.exists(tmp_path / "run" / "data" / "manifest.json")
