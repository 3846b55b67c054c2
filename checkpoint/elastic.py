"""A run resumed in place at another pp × tp × dp layout: its newest checkpoint converted once,
before any rank starts, into a universal copy beside it, which the ranks of any layout load.

`prepare` runs in the process that starts the ranks (`./run.sh train` after taking the run lock,
a SLURM job's start step: launcher/elastic.py), one process, no collective:

1. The newest committed checkpoint `checkpoints/stepS` and the layout it was written at (its
   manifest's config). The same layout: nothing to do, the ranks resume it as always.
2. Another layout: its universal copy `checkpoints/universal-stepS/` serves any layout, so one
   made by an earlier start is used again. Otherwise the checkpoint is verified against its
   manifest first (a damaged one is set aside and the previous intact one taken, as the ranks do)
   and converted (checkpoint/checkpoints.py `to_universal`: DeepSpeed's ds_to_universal with this
   trainer's tensor-parallel info) into `universal-stepS.<pid>.tmp`, renamed, and committed with a
   manifest of its own. A conversion killed at any point leaves either a `.tmp` folder (removed by
   the next start, which redoes it) or a copy without its manifest (ignored and redone): the ranks
   load only a committed copy, verified against that manifest like every checkpoint.

The source `stepS` is never changed: it stays readable (consolidate, eval, init_from) and
resumable at its own layout. A copy is dropped once a newer checkpoint is committed
(trainer/checkpointer.py) or another step is converted. The global batch: a resumed run keeps the
number of micro-batches per step it had, `data_parallel × train.micro_batches`
(`kept_micro_batches`), so the data stream draws exactly the batches it would have drawn.
"""
from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass

from checkpoint import manifest
from checkpoint.checkpoints import CheckpointError, checkpoint_meta, needs_zero_shards, to_universal
from schema.fields import ConfigError
from schema.text import count

LAYOUT_KEYS = ("pipeline_stages", "tensor_parallel", "data_parallel")
COPY_PREFIX = "universal-"
"""A universal copy's folder is COPY_PREFIX + the tag it was made from (`universal-step300`)."""


def layout_of(config: dict) -> tuple[int, int, int]:
    """(pp, tp, dp) of a recorded run config (a key added since it was written: 1)."""
    parallel = config.get("parallel") or {}
    return tuple(int(parallel.get(key, 1)) for key in LAYOUT_KEYS)


def shown(layout: tuple[int, int, int]) -> str:
    return "pp{}·tp{}·dp{}".format(*layout)


def copy_dir(ckpt_dir: str, tag: str) -> str:
    return os.path.join(ckpt_dir, COPY_PREFIX + tag)


def recorded(ckpt_dir: str, tag: str) -> dict:
    """The run config checkpoint `tag` was written with: its manifest's copy, else its model states'."""
    tag_dir = os.path.join(ckpt_dir, tag)
    config = (manifest.read(tag_dir) or {}).get("config")
    return config if isinstance(config, dict) else checkpoint_meta(tag_dir)["config"]


def global_micro_batches(config: dict) -> int:
    return int((config.get("parallel") or {}).get("data_parallel", 1)) * int(config["train"]["micro_batches"])


def kept_micro_batches(dp: int, micro_batches: int, keep: bool, record: dict, step: int,
                       where: str) -> tuple[int, str]:
    """train.micro_batches for a launch at `data_parallel=dp` resuming a checkpoint of step `step`
    written with the run config `record`, and the line saying a change ('' for none). With
    train.keep_global_batch (`keep`) the run's micro-batches per step are kept whatever the layout
    (dp must divide them: else ConfigError, naming the sizes that would); without, the config's."""
    total = global_micro_batches(record)
    if not keep or dp * micro_batches == total:
        return micro_batches, ""
    was = f"data_parallel {layout_of(record)[2]} × train.micro_batches {record['train']['micro_batches']} at step {step}"
    if total % dp:
        fits = [d for d in range(1, total + 1) if total % d == 0]
        sizes = ", ".join(map(str, fits[:-1])) + (" or " if len(fits) > 1 else "") + str(fits[-1])
        raise ConfigError(f"{where}: parallel.data_parallel={dp} cannot keep the run's {count(total, 'micro-batch', 'micro-batches')} per step "
                          f"({was}): data_parallel {sizes} can; to change the batch on purpose set "
                          f"train.keep_global_batch=false ({dp} × train.micro_batches {micro_batches} = "
                          f"{dp * micro_batches} per step)")
    kept = total // dp
    return kept, (f"train.micro_batches {micro_batches} → {kept}: data_parallel {dp} × {kept} = {count(total, 'micro-batch', 'micro-batches')} "
                  f"per step, the run's ({was}; train.keep_global_batch)")


def committed_copy(ckpt_dir: str, tag: str) -> str | None:
    """The universal copy of `tag` when it is committed (its manifest written, every file there
    with its size; the ranks check the hashes), else None."""
    folder = copy_dir(ckpt_dir, tag)
    record = manifest.read(folder)
    if record is None or record.get("source") != tag:
        return None
    for name, entry in record["files"].items():
        path = os.path.join(folder, name)
        if not os.path.isfile(path) or os.path.getsize(path) != int(entry.get("size", -1)):
            return None
    return folder


def copies(ckpt_dir: str, keep: str | None = None, below: int | None = None) -> list[str]:
    """The universal copies in `ckpt_dir` (but `keep`'s; with `below`, only those of earlier steps)
    and the remains of conversions that never finished (`.tmp`)."""
    try:
        names = os.listdir(ckpt_dir)
    except OSError:
        return []
    found = []
    for name in sorted(names):
        source = name[len(COPY_PREFIX):].split(".")[0]
        if name.startswith(COPY_PREFIX) and (name.endswith(".tmp") or (
                source != keep and source.startswith("step") and source[4:].isdigit()
                and (below is None or int(source[4:]) < below))):
            found.append(name)
    return found


def drop_copies(ckpt_dir: str, keep: str | None = None, below: int | None = None) -> list[str]:
    """Remove `copies(ckpt_dir, keep, below)`; the folders removed."""
    removed = copies(ckpt_dir, keep, below)
    for name in removed:
        shutil.rmtree(os.path.join(ckpt_dir, name), ignore_errors=True)
    return removed


@dataclass(frozen=True)
class Resharded:
    """A universal copy the ranks resume from: of checkpoint `tag` (step `step`), written at
    `source`, for a launch at `target`; made now in `seconds` (`made`) or by an earlier start."""

    tag: str
    step: int
    source: tuple[int, int, int]
    target: tuple[int, int, int]
    seconds: float
    made: bool
    path: str

    def line(self) -> str:
        if self.made:
            return (f"resharded step {self.step} from {shown(self.source)} to {shown(self.target)} in "
                    f"{self.seconds:.1f} s ({self.path})")
        return (f"resharding step {self.step} from {shown(self.source)} to {shown(self.target)}: its universal copy "
                f"{self.path} (made earlier in {self.seconds:.1f} s) is used again")

    def record(self) -> dict:
        """For summary.json."""
        return {"step": self.step, "from": shown(self.source), "to": shown(self.target),
                "seconds": round(self.seconds, 2), "copy": os.path.basename(self.path)}


def prepare(run_dir: str, target: tuple[int, int, int], log: Callable[[str], None] = print,
            threads: int = 4) -> Resharded | None:
    """Before any rank starts, holding the run lock: when the run's newest committed checkpoint was
    written at another layout than `target` (pp, tp, dp), its committed universal copy (module
    docstring). None when there is nothing to convert (a new run, or the same layout). `log` gets
    the lines about damaged checkpoints set aside. A checkpoint that cannot be converted raises
    ConfigError (one line)."""
    ckpt_dir = os.path.join(run_dir, "checkpoints")
    drop_copies(ckpt_dir, below=0)  # only the remains of conversions killed half-way
    damaged: list[str] = []
    try:
        for tag in manifest.committed_tags(ckpt_dir):
            source, step = layout_of(recorded(ckpt_dir, tag)), int(tag[len("step"):])
            if source == target:
                break  # the ranks resume (and verify) it as always
            copy = committed_copy(ckpt_dir, tag)
            if copy is not None:
                drop_copies(ckpt_dir, keep=tag)
                seconds = float(manifest.read(copy).get("seconds", 0.0))
                return Resharded(tag, step, source, target, seconds, False, copy)
            tag_dir = os.path.join(ckpt_dir, tag)
            problems = manifest.verify_local(tag_dir, threads)
            if problems:
                more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
                log(f"checkpoint {tag} is damaged: {problems[0]}{more}; falling back to an older one")
                damaged.append(tag)
                manifest.set_aside(ckpt_dir, [tag])
                continue
            needs_zero_shards(tag_dir)
            copy = copy_dir(ckpt_dir, tag)
            seconds = to_universal(tag_dir, copy)
            manifest.commit_local(copy, os.path.basename(copy), step, threads=threads,
                                  extra={"source": tag, "layout": list(source), "seconds": seconds})
            drop_copies(ckpt_dir, keep=tag)
            return Resharded(tag, step, source, target, seconds, True, copy)
    except CheckpointError as e:
        raise ConfigError(str(e)) from None
    finally:
        if damaged:
            log(f"the damaged checkpoints {', '.join(damaged)} are moved to {ckpt_dir}/damaged/")
    return None
