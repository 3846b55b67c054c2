"""Every config key has a rule for a resumed run (trainer/run_dir.py RESUME_RULES), checked key by key.

Fixed and prepared keys: a changed value is refused before any rank starts, naming the key
(`launcher/preflight.py`, the check `./run.sh train` makes). Honoured keys: one launch of 2 ranks
(tests/dist/resume_worker.py) trains 4 steps, resumes the run with every honoured key changed and
reads what the resumed trainer uses; one test per key asserts it is the new value. A key added to
the config without a rule, or an honoured key without a test here, fails
`test_every_key_has_a_rule_and_every_honoured_key_a_test`.
"""
import dataclasses
import json
import os
import re

import pytest

from tests.conftest import run_worker, write_run_config
from tests.dist.resume_worker import CHANGED, LAYOUT_CHANGED
from trainer.config import ConfigError, RunConfig, load_config, to_dict
from trainer.run_dir import FIXED, HONOURED, PREPARED, RESHARDED, RESUME_RULES

CONFIG = {"train": {"max_steps": 4, "micro_batches": 2, "lr": 2e-3, "warmup_steps": 4, "save_interval": 2,
                    "keep_checkpoints": 3, "valid_interval": 100, "log_interval": 1},
          "data": {"max_tokens": 256}}

# Honoured keys shown by another test than this file's (the test named, and why there).
ELSEWHERE = {
    "train.compile": "tests/test_compiled.py::test_a_compiled_runs_checkpoint_resumes_in_an_eager_run "
                     "(compiling on CPU costs 10-20 s a layer kind)",
    "data.workers": "tests/test_data.py::test_prepare_is_idempotent_and_batching_settings_do_not_redo_it "
                    "(read by ./run.sh prepare only: the prepared files do not depend on it)",
    "train.trace_steps": "tests/test_timeline.py::test_a_resumed_run_traces_its_new_steps_and_notes_the_old_ones "
                         "(its traced runs are resumed there)",
}


def leaf_keys(cls=RunConfig, prefix="") -> list[str]:
    keys = []
    for f in dataclasses.fields(cls):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            keys += leaf_keys(type(default), f"{prefix}{f.name}.")
        else:
            keys.append(prefix + f.name)
    return keys


def test_every_key_has_a_rule_and_every_honoured_key_a_test():
    keys = leaf_keys()
    assert sorted(RESUME_RULES) == sorted(keys)
    honoured = {k for k, rule in RESUME_RULES.items() if rule == HONOURED}
    shown = set(CHANGED) | set(LAYOUT_CHANGED) | set(ELSEWHERE)
    assert honoured == shown, (sorted(honoured - shown), sorted(shown - honoured))
    for key in ELSEWHERE:
        if "::" in ELSEWHERE[key]:
            path, name = ELSEWHERE[key].split(" ")[0].split("::")
            with open(os.path.join(os.path.dirname(__file__), os.path.basename(path))) as f:
                assert f"def {name}(" in f.read(), ELSEWHERE[key]


# ---- fixed and prepared keys: refused before launch, naming the key ------------------------------

def _other_value(key: str, value):
    section, name = key.split(".")
    special = {"model.norm": "postln", "model.activation": "gelu", "parallel.partition_method": "uniform",
               "parallel.zero_stage": 0, "parallel.pipeline_stages": 3, "data.corpus": "gettext:/somewhere",
               "data.languages": ["de"], "data.spm_model_type": "unigram", "data.spm_normalization": "nfkc",
               "parallel.tensor_parallel": 2, "parallel.data_parallel": 2,
               "model.heads": 2, "model.d_model": 64, "model.layernorm_eps": 1e-6, "data.character_coverage": 0.99,
               "data.max_length_ratio": 3.0, "data.spm_temperature": 2.0, "train.init_from": "/runs/elsewhere",
               "data.spm_model": "/runs/elsewhere/data/spm.model"}
    if key in special:
        return special[key]
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value * 0.5
    raise AssertionError(f"no other value for {key}={value!r}")


# model.pad_id accepts one value (0): it cannot change
REFUSED = sorted(k for k, rule in RESUME_RULES.items() if rule in (FIXED, PREPARED) and k != "model.pad_id")


@pytest.fixture(scope="module")
def recorded(tiny_data, tmp_path_factory):
    """A run directory with a recorded config.json, as a launch leaves it (nothing else is read)."""
    work = tmp_path_factory.mktemp("rules")
    run_dir = str(work / "run")
    path = write_run_config(str(work / "run.yaml"), run_dir, tiny_data, **CONFIG)
    cfg = load_config(path)
    record = to_dict(cfg)
    record["model"]["vocab_size"] = 600
    with open(os.path.join(run_dir, "config.json"), "w") as f:
        json.dump(record, f)
    return path, record


@pytest.mark.parametrize("key", REFUSED)
def test_a_fixed_or_prepared_key_changed_for_a_resume_is_refused_before_launch(key, recorded):
    from launcher.preflight import check_resume

    path, record = recorded
    section, name = key.split(".")
    value = _other_value(key, record[section][name])
    cfg = load_config(path, sets=[f"{key}={json.dumps(value)}"] if key != "data.corpus" else [])
    if key == "data.corpus":  # a folder that need not exist for this check
        cfg.data.corpus = value
    with pytest.raises(ConfigError) as refused:
        check_resume(cfg, path)
    assert f"{key}: {record[section][name]!r} → {value!r}" in str(refused.value), str(refused.value)
    if RESUME_RULES[key] == FIXED:  # what can be done: a new run (from these weights)
        assert "use a new run_dir (train.init_from=" in str(refused.value), str(refused.value)


def test_the_layout_keys_are_resharded_not_refused(recorded):
    """pp, tp and dp may change: the newest checkpoint is converted before the ranks start
    (checkpoint/elastic.py; tests/test_elastic.py resumes at each and compares the losses)."""
    from launcher.preflight import check_resume

    assert sorted(k for k, rule in RESUME_RULES.items() if rule == RESHARDED) == [
        "parallel.data_parallel", "parallel.pipeline_stages", "parallel.tensor_parallel"]
    path, record = recorded
    cfg = load_config(path, sets=["parallel.pipeline_stages=1", "parallel.tensor_parallel=2", "parallel.data_parallel=2"])
    saved = check_resume(cfg, path)  # (no checkpoint yet: nothing to convert, no batch to keep)
    assert saved["parallel"] == record["parallel"] and cfg.train.micro_batches == record["train"]["micro_batches"]


# ---- honoured keys: the resumed run uses the new value --------------------------------------------

@pytest.fixture(scope="module")
def resumed(tiny_data, tmp_path_factory):
    work = tmp_path_factory.mktemp("resume")
    config = write_run_config(str(work / "run.yaml"), str(work / "run"), tiny_data, **CONFIG)
    ranks = run_worker(2, "tests.dist.resume_worker", str(work / "result.json"), ["--config", config])
    return ranks


def _each(resumed, part: str, key: str):
    return [rank[part][key] for rank in resumed]


def _steps(log: list[str], what: str) -> list[int]:
    """Steps of train.log's lines of the resumed launch (after its 'launch at step 4' line)."""
    start = max(i for i, line in enumerate(log) if "launch at step 4 of 8" in line)
    return [int(line.split("| step ")[1].split(" ")[0]) for line in log[start:] if "| step " in line and what in line]


def test_the_resume_starts_where_the_first_run_ended(resumed):
    assert _each(resumed, "first", "step") == [4, 4] and _each(resumed, "resumed", "step") == [4, 4]
    assert _each(resumed, "first", "clip_grad") == [0.0, 0.0]


def test_train_max_steps(resumed):
    assert _each(resumed, "resumed", "max_steps") == [8, 8] and _each(resumed, "ran", "step") == [8, 8]


def test_train_micro_batches(resumed):
    assert _each(resumed, "resumed", "micro_batches") == [3, 3]
    assert all(d["n"] == 3 for rank in resumed for d in rank["ran"]["draws"])


def test_train_keep_global_batch(resumed):
    """false: the config's micro_batches (3) replace the checkpoint's 2 per step, a batch changed on
    purpose (true keeps 2 at any layout: tests/test_elastic.py)."""
    assert _each(resumed, "resumed", "micro_batches") == [3, 3]
    assert all(d["n"] == 3 for rank in resumed for d in rank["ran"]["draws"])


@pytest.mark.parametrize("key", ["train.lr", "train.warmup_steps"])
def test_train_lr_and_warmup(key, resumed):
    for rank in resumed:
        r = rank["resumed"]
        assert r["base_lr"] == CHANGED["train.lr"]
        assert r["lr"] == pytest.approx(r["lr_expected"], rel=1e-12)  # 1e-3 × 5/6: the new peak and warm-up


@pytest.mark.parametrize("key,value", [("betas", [0.8, 0.95]), ("eps", 1e-6), ("weight_decay", 0.01)],
                         ids=["train.adam_betas", "train.adam_eps", "train.weight_decay"])
def test_train_adam_settings(key, value, resumed):
    assert _each(resumed, "resumed", key) == [value, value]


def test_train_clip_norm(resumed):
    """DeepSpeed restores the checkpoint's clip value (0: off); the resumed run clips at 1e-3: the
    gradients every optimizer step hands to AdamW have the global norm 1e-3 (× ‖g‖ / (‖g‖ + 1e-6))."""
    assert _each(resumed, "resumed", "clip_grad") == [1e-3, 1e-3]
    for rank in resumed:
        norms = rank["ran"]["clipped_norms"]
        assert len(norms) == 4 and all(n == pytest.approx(1e-3, rel=1e-4) for n in norms), norms


def test_train_log_valid_and_save_intervals(resumed):
    log = resumed[0]["ran"]["log"]
    assert _steps(log, "| loss ") == [6, 8]  # log_interval 2 (was 1)
    assert _steps(log, "valid loss") == [6, 8]  # valid_interval 3, and the end (was 100)
    assert _steps(log, "saved checkpoint") == [5, 8]  # save_interval 5, and the end (was 2)


def test_the_changed_settings_are_in_train_log(resumed):
    lines = [line.split(" | ", 1)[1] for line in resumed[0]["ran"]["log"] if "settings changed since" in line]
    assert len(lines) == 1 and lines[0].startswith("settings changed since the last launch (config.json): "), lines
    changes = lines[0].split(": ", 1)[1].split("; ")
    assert sorted(change.split(" ")[0] for change in changes) == sorted(CHANGED), changes
    assert "train.clip_norm 0.0 → 0.001" in changes


def test_the_new_batch_order_is_said_once_in_train_log(resumed):
    """data.max_tokens, sampling_temperature and directions changed: the stream starts a new epoch,
    which rank 0 says once, on the console and in train.log (not a warning from every rank)."""
    lines = [line.split(" | ", 1)[1] for line in resumed[0]["ran"]["log"] if "the batch order changed" in line]
    assert len(lines) == 1, lines
    assert re.fullmatch(r"the batch order changed since the checkpoint \(data\.max_tokens, data\.sampling_temperature, "
                        r"data\.directions, the training examples\): the data stream continues at the start of epoch "
                        r"\d+, not where the checkpoint left it", lines[0]), lines[0]


def test_train_keep_checkpoints(resumed):
    assert _each(resumed, "ran", "committed") == [["step8"], ["step8"]]  # keep 1 (was 3)


def test_train_instrument_interval(resumed):
    assert _each(resumed, "resumed", "instrument_due") == [[6, 8], [6, 8]]  # was 0: off


def test_train_collective_timeout_and_stop_grace(resumed):
    assert _each(resumed, "resumed", "collective_timeout") == [321.0, 321.0]
    assert _each(resumed, "resumed", "stop_grace_seconds") == [7.0, 7.0]


@pytest.mark.parametrize("key", ["train.divergence_policy", "train.divergence_spike_factor",
                                 "train.divergence_window", "train.divergence_max_events"])
def test_train_divergence_settings(key, resumed):
    assert _each(resumed, "resumed", "guard") == [["skip", 9.0, 5, 4]] * 2


def test_data_directions(resumed):
    """The resumed run trains and validates on en-de only (the first run on every direction)."""
    assert _each(resumed, "resumed", "directions") == [[["en-de"], ["en-de"]]] * 2
    assert all(d["directions"] == ["en-de"] for rank in resumed for d in rank["ran"]["draws"])


def test_data_max_tokens_and_sampling_temperature(resumed):
    assert _each(resumed, "resumed", "stream_max_tokens") == [160, 160]
    assert _each(resumed, "resumed", "stream_temperature") == [2.0, 2.0]
    assert all(d["largest"] <= 160 for rank in resumed for d in rank["ran"]["draws"])


@pytest.mark.parametrize("key,holders", [("model.dropout", ("SharedEmbedding", "PostNormResidual")),
                                         ("model.attention_dropout", ("MultiheadAttention",)),
                                         ("model.activation_dropout", ("FeedForward",))])
def test_model_dropouts(key, holders, resumed):
    """Every stage's modules drop with the new probability (the first run's were all 0)."""
    for rank in resumed:
        found = rank["resumed"]["dropouts"]
        assert all(found[name] == [CHANGED[key]] for name in holders), found


def test_model_label_smoothing(resumed):
    assert _each(resumed, "resumed", "label_smoothing") == [0.2, 0.2]


@pytest.mark.parametrize("key", sorted(k for k in LAYOUT_CHANGED if k.startswith("parallel.")))
def test_parallel_precision_schedule_and_recomputation(key, resumed):
    for rank in resumed:
        r = rank["layout"]
        assert r["step"] == 8 and r["ran_to"] == 10
        assert r["dtypes"] == ["torch.bfloat16"]
        assert r["master_equals_step8_weights"] and r["weights_are_the_rounded_master"]
        assert r["engine"] == "ScheduleEngine" and r["max_pending_w"] is None  # zb-h1 with zb_max_pending_w: -1
        assert r["activation_checkpoint_interval"] == 1
