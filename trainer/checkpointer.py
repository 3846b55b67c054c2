"""The checkpoints of a training run, as one object the Trainer holds: save and commit (with room
made on a full filesystem), resume the newest intact one (verified against its manifest, falling
back past damaged ones, which are set aside; a checkpoint written at another pp × tp × dp layout
through its universal copy, made before the ranks started: checkpoint/elastic.py), resume a
universal checkpoint written by `./run.sh convert reshard`, and refuse a changed model.

What a checkpoint carries for the trainer (step, data position, history, guard state) is the
trainer's: `save` takes it as `client` and `resume` returns it.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import shutil
import sys
import time

import torch

from checkpoint import elastic, manifest
from checkpoint.checkpoints import UNIVERSAL_LATEST, kept_loss_scale
from runtime import rng, safe_load
from trainer.config import ConfigError, RunConfig, to_dict
from trainer.progress import append_log, log0, note0
from trainer.room import (  # noqa: F401 (NoRoomStop, room_to_make and write_failure are imported from here)
    ROOM_MARGIN,
    ROOM_WAITS,
    UNKNOWN,
    NoRoomStop,
    _agreed_room,
    tree_bytes,
    room_to_make,
    write_failure,
)
from trainer.run_dir import record_stop, refusal_hint, resume_differences, saved_run_config, setting_changes
from trainer.signals import NO_ROOM_EXIT_CODE, refuse_together


class Checkpointer:
    """The checkpoints of one run in `<run_dir>/checkpoints`, for the engine and module of this rank."""

    def __init__(self, cfg: RunConfig, layout, engine=None, module: torch.nn.Module | None = None):
        """`engine` and `module` may come later (`attach`): whether the engine must be built to
        load a universal checkpoint (`universal`) is asked before it exists."""
        self.cfg, self.layout, self.engine, self.module = cfg, layout, engine, module
        self.ckpt_dir = os.path.join(cfg.run_dir, "checkpoints")
        self.resumed_dir: str | None = None  # the checkpoint folder this run resumed from
        self.saved: dict | None = None  # the config of the run's last launch (config.json), as resume found it
        self.max_steps = cfg.train.max_steps  # what this launch trains to (config.json records it)
        self.resharded: dict | None = None  # resumed from a universal copy: from and to which layout (summary.json)

    def attach(self, engine, module: torch.nn.Module) -> None:
        """The engine and the module whose checkpoints these are."""
        self.engine, self.module = engine, module

    def keep_global_batch(self) -> None:
        """train.micro_batches for this launch's data_parallel, keeping the micro-batches per step of
        the newest checkpoint (checkpoint/elastic.py `kept_micro_batches`; ./run.sh train and the
        SLURM job's start have set it already, so this says nothing there)."""
        tags = manifest.committed_tags(self.ckpt_dir)
        if not tags:
            return
        t = self.cfg.train
        try:
            t.micro_batches, line = elastic.kept_micro_batches(self.layout.dp, t.micro_batches, t.keep_global_batch,
                                                               elastic.recorded(self.ckpt_dir, tags[0]),
                                                               int(tags[0][4:]), self.cfg.run_dir)
        except ConfigError as e:
            self.stop_together(f"error: {e}", code=2)
        if line:
            note0(self.cfg.run_dir, line)

    def universal(self) -> bool:
        """A run directory made by `./run.sh convert reshard` holds a universal checkpoint of another
        layout (checkpoint/checkpoints.py) and none of this trainer's; the engine must be built to
        load it. Once this run saves its own checkpoints, those take over."""
        return (not manifest.committed_tags(self.ckpt_dir)
                and os.path.exists(os.path.join(self.ckpt_dir, UNIVERSAL_LATEST)))

    def resume(self, newest_step: int | None = None) -> dict | None:
        """The trainer's state (`client` of `save`) from the newest checkpoint (at most `newest_step`)
        that verifies against its manifest and holds finite weights, loaded into the engine; say
        which ones were skipped and why; stop if none is left. None for a run with nothing to resume."""
        if self.universal():
            return self.resume_universal()
        if not manifest.committed_tags(self.ckpt_dir) and not manifest.read_latest(self.ckpt_dir)[1]:
            for tag in manifest.uncommitted_tags(self.ckpt_dir):
                log0(f"ignoring {os.path.join(self.ckpt_dir, tag)}: its save never completed")
            return None
        self.check_compatible()
        tag_named, why = manifest.read_latest(self.ckpt_dir)
        if why:
            log0(f"warning: {why}; looking for the newest intact checkpoint instead")
        for tag in manifest.uncommitted_tags(self.ckpt_dir):
            log0(f"ignoring {os.path.join(self.ckpt_dir, tag)}: its save never completed (no manifest)")
        tags = [t for t in manifest.committed_tags(self.ckpt_dir) if newest_step is None or int(t[4:]) <= newest_step]
        damaged = []
        for tag in tags:
            tag_dir = os.path.join(self.ckpt_dir, tag)
            found = self.source_of(tag)
            if found is None:  # written at another layout, and no copy: the launch's start makes it
                if damaged:  # (so that the next start, finding this one the newest, converts it)
                    self.set_aside(damaged)
                self.stop_together(f"error: {tag_dir} was written at {elastic.shown(self.written(tag))} and this launch "
                                   f"runs {elastic.shown(self.mine())}, but its universal copy "
                                   f"{elastic.copy_dir(self.ckpt_dir, tag)} is not there: start the run with ./run.sh "
                                   "train (or its SLURM job), which makes it before the ranks start")
            folder, universal = found
            problems = manifest.verify(folder)
            if not problems:
                self.refuse_unsafe(folder)  # a hash proves a file unchanged, not who made it
                path, client = self._load(os.path.basename(folder), universal)
                if path is None:
                    problems = [f"DeepSpeed could not load {folder}"]
                elif not self.weights_finite():
                    problems = [f"{folder} holds non-finite weights"]
            if problems and universal:  # the copy, not the checkpoint: make it again
                if self.layout.rank == 0:
                    shutil.rmtree(folder, ignore_errors=True)
                self.stop_together(f"error: {folder}, the universal copy of {tag}, is damaged: {problems[0]}; it is "
                                   f"removed: run the same command again to convert {tag} anew")
            if problems:
                more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
                note0(self.cfg.run_dir, f"checkpoint {tag} is damaged: {problems[0]}{more}; falling back to an older one")
                damaged.append(tag)
                continue
            self.restored(client, folder, universal)
            through = f", resharded through {folder}" if universal else ""
            if damaged:
                note0(self.cfg.run_dir, f"resumed from the intact checkpoint {tag} (step {client['step']}{through}) "
                      f"instead of {', '.join(damaged)}; the damaged ones are moved to {self.ckpt_dir}/damaged/")
                self.set_aside(damaged)
            else:
                note0(self.cfg.run_dir, f"resumed from {tag_dir} at step {client['step']} (verified){through}")
                if why and self.layout.rank == 0:  # `latest` named nothing usable: name the one resumed
                    manifest.write_atomic(os.path.join(self.ckpt_dir, manifest.LATEST), tag)
            return client
        listed = ", ".join(tags) or "none"
        self.stop_together(f"error: no intact checkpoint in {self.ckpt_dir} (checked: {listed}); "
                           "restore one, or train afresh in another run_dir (or after removing checkpoints/)")

    def refuse_unsafe(self, tag_dir: str) -> None:
        """Stop every rank, before any loads a file of `tag_dir`, when one of its files needs
        more than tensors, plain values and DeepSpeed's few types to load (runtime/safe_load.py):
        rank 0 checks them (memory-mapped: only the pickles are read) and names the file and type."""
        refusal = manifest.broadcast(safe_load.check_folder(tag_dir) if self.layout.rank == 0 else None)
        if refusal:
            self.stop_together(f"error: {refusal}")

    def mine(self) -> tuple[int, int, int]:
        return self.layout.pp, self.layout.tp, self.layout.dp

    def written(self, tag: str) -> tuple[int, int, int]:
        """The layout the committed checkpoint `tag` was written at."""
        return elastic.layout_of(elastic.recorded(self.ckpt_dir, tag))

    def source_of(self, tag: str) -> tuple[str, bool] | None:
        """(folder to load, whether it is a universal checkpoint) for the committed checkpoint `tag`:
        itself when it was written at this launch's layout, else its universal copy, which the
        launch's start made before the ranks (checkpoint/elastic.py); None when there is none."""
        if self.written(tag) == self.mine():
            return os.path.join(self.ckpt_dir, tag), False
        copy = elastic.committed_copy(self.ckpt_dir, tag)
        return None if copy is None else (copy, True)

    def _load(self, tag: str | None, universal: bool = False):
        """DeepSpeed's load_checkpoint of `tag` (None: what `latest_universal` names), as a universal
        checkpoint or not (the engine's config flag read only by its load); what it prints on the
        way (BF16_Optimizer's "_load_legacy_checkpoint …" on every rank) is dropped. Every file is
        read weights-only: through the engine's safe checkpoint engine (parallel/engine.py), and
        what DeepSpeed reads with torch.load itself (a universal checkpoint's files) is forced to be.
        A file refused here (changed since `refuse_unsafe`) stops this rank with one line."""
        folder = os.path.join(self.ckpt_dir, tag or self.universal_tag())
        config = self.engine._config
        config.load_universal_checkpoint = universal
        try:
            with contextlib.redirect_stdout(io.StringIO()), safe_load.forced(safe_load.allowed_for(folder)):
                return self.engine.load_checkpoint(self.ckpt_dir, tag=tag)
        except (safe_load.UnsafeFile, safe_load.UnreadableFile) as e:
            refusal = str(e)
        except pickle.UnpicklingError as e:  # refused by `forced`, which cannot name the file
            name = safe_load.refused_global(str(e)) or "a pickle that is not a PyTorch file's"
            refusal = safe_load.check_folder(folder) or f"{folder}: a file DeepSpeed read holds {name}, which is not loaded"
        finally:
            config.load_universal_checkpoint = False
        print(f"error: {refusal}", file=sys.stderr, flush=True)
        raise SystemExit(2)

    def universal_tag(self) -> str:
        """The tag `latest_universal` names (a universal checkpoint of `./run.sh convert reshard`)."""
        with open(os.path.join(self.ckpt_dir, UNIVERSAL_LATEST), errors="replace") as f:
            return f.read().strip()

    def stop_together(self, message: str) -> None:
        """All ranks refuse the launch on the same finding (trainer/signals.py `refuse_together`):
        rank 0 prints `message` before any rank exits; raises Refused (exit 2, recorded as refused)."""
        refuse_together(message)

    def record_launch(self, max_steps: int) -> None:
        """config.json: this launch's config (train.max_steps as this launch trains to), written by
        rank 0 before the first step: the record a later launch compares with and reads the run's
        state from (trainer/run_dir.py `relaunch`); train.log gets the settings changed since the last."""
        self.max_steps = max_steps
        if self.layout.rank != 0:
            return
        record = self.launch_config()
        changes = setting_changes(self.saved, record) if self.saved else []
        if changes:  # ./run.sh train printed them before the ranks started; the run's log keeps them
            append_log(self.cfg.run_dir, f"settings changed since the last launch (config.json): {'; '.join(changes)}")
        try:
            manifest.write_atomic(os.path.join(self.cfg.run_dir, "config.json"), json.dumps(record, indent=2))
        except OSError as e:
            log0(f"warning: could not write {self.cfg.run_dir}/config.json ({e.strerror or e}); the next "
                 "checkpoint's manifest records the config")

    def resume_universal(self) -> dict:
        """The universal checkpoint of `./run.sh convert reshard`, verified against its manifest
        where it has one (made before this version: not verified)."""
        self.check_compatible()
        with open(os.path.join(self.ckpt_dir, "latest_universal"), errors="replace") as f:
            folder = os.path.join(self.ckpt_dir, f.read().strip())
        problems = manifest.verify(folder) if manifest.read(folder) is not None else []
        if problems:
            self.stop_together(f"error: {folder} is damaged: {problems[0]}; convert the source checkpoint again "
                               "(./run.sh convert reshard) into a new run_dir")
        self.refuse_unsafe(folder)
        path, client = self._load(None, universal=True)
        if path is None:
            raise SystemExit(f"error: {self.ckpt_dir}: the checkpoint latest_universal cannot be "
                             "loaded; train afresh in another run_dir")
        if not self.weights_finite():
            raise SystemExit(f"error: {path} holds non-finite weights; it cannot be resumed")
        self.restored(client, path, universal=True)
        verified = "verified" if manifest.read(folder) is not None else "a universal checkpoint: not verified"
        note0(self.cfg.run_dir, f"resumed from {path} at step {client['step']} ({verified})")
        return client

    def restored(self, client: dict, path: str, universal: bool = False) -> None:
        """After the engine loaded a checkpoint: this rank's RNG streams, fp16's loss scale where
        the universal format could not carry it, and the config's optimizer settings."""
        tag_dir = path if os.path.isdir(path) else os.path.dirname(path)
        self.resumed_dir = os.path.realpath(tag_dir)
        rank = self.layout.rank
        if not rng.load(tag_dir, rank):  # a universal checkpoint of another layout has none
            print(f"rank {rank}: {rng.path(tag_dir, rank)} does not exist (a checkpoint of another layout): "
                  "this rank's dropout masks start afresh", flush=True)
        scaler = getattr(self.engine.optimizer, "loss_scaler", None)
        kept = kept_loss_scale(tag_dir) if universal else None
        if scaler is not None and kept:  # fp16: the scale the source run had reached (checkpoint/checkpoints.py)
            for key, value in kept.items():
                setattr(scaler, key, value)
        if universal:
            record = manifest.read(tag_dir) or {}
            source = record.get("layout")
            self.resharded = {"step": client["step"], "from": elastic.shown(tuple(source)) if source else None,
                              "to": elastic.shown(self.mine()),
                              "seconds": record.get("seconds"), "copy": os.path.basename(tag_dir)}
        self.apply_optimizer_config()

    def apply_optimizer_config(self) -> None:
        """The config's AdamW settings and clipping over the ones the checkpoint restored. DeepSpeed
        reloads the optimizer's param_groups, the scheduler's base_lrs and the optimizer's clip value
        (BF16_Optimizer's `clip_grad`) with the checkpoint, so a train.lr, weight_decay, adam_betas,
        adam_eps or clip_norm changed for the resume (e.g. after a divergence stop, as its message
        advises) would otherwise be ignored without a word. The schedule's shape (warm-up)
        comes from the config already; its position (the step) from the checkpoint."""
        t = self.cfg.train
        scheduler, groups = self.engine.lr_scheduler, self.engine.optimizer.param_groups
        wanted = {"weight_decay": ("weight_decay", t.weight_decay), "betas": ("adam_betas", tuple(t.adam_betas)),
                  "eps": ("adam_eps", t.adam_eps)}  # param_group key: (train.* key, value)
        changed = []
        if isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR) and any(b != t.lr for b in scheduler.base_lrs):
            changed.append(f"train.lr {scheduler.base_lrs[0]:g} → {t.lr:g}")
            scheduler.base_lrs = [t.lr] * len(scheduler.base_lrs)
            lrs = [base * fn(scheduler.last_epoch) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
            for group, lr in zip(groups, lrs):  # what LambdaLR's step would have set at this step
                group["lr"] = lr
            scheduler._last_lr = lrs
        for key, (name, value) in wanted.items():
            old = groups[0].get(key)
            if old is not None and (tuple(old) if key == "betas" else old) != value:
                changed.append(f"train.{name} {old} → {value}")
                for group in groups:
                    group[key] = value
        optimizer = self.engine.optimizer
        if getattr(optimizer, "clip_grad", t.clip_norm) != t.clip_norm:  # DeepSpeed restores it with the state
            changed.append(f"train.clip_norm {optimizer.clip_grad:g} → {t.clip_norm:g}")
            optimizer.clip_grad = t.clip_norm
        if changed:
            note0(self.cfg.run_dir, f"resumed with the config's {', '.join(changed)} (the checkpoint had the old values)")

    def launch_config(self) -> dict:
        """The run config as this launch trains it (its max_steps included)."""
        record = to_dict(self.cfg)
        record["train"]["max_steps"] = self.max_steps
        return record

    def weights_finite(self) -> bool:
        """All ranks agree whether every loaded parameter is finite."""
        bad = any(not bool(torch.isfinite(p).all()) for p in self.module.parameters())
        flag = torch.tensor([int(bad)], dtype=torch.int32, device=self.layout.device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return not bool(flag.item())

    def set_aside(self, tags: list[str]) -> None:
        torch.distributed.barrier()
        if self.layout.rank == 0:
            manifest.set_aside(self.ckpt_dir, tags)
        torch.distributed.barrier()

    def check_compatible(self) -> None:
        """Refuse, with the differing keys named, to resume a run whose model or layout changed."""
        saved = None
        if self.layout.rank == 0:
            try:
                saved = saved_run_config(self.cfg.run_dir, log=log0)
            except ConfigError as e:  # damaged, and no manifest holds a copy (./run.sh says so first)
                saved = {"refused": str(e)}
        saved = manifest.broadcast(saved)  # rank 0 read (and, if need be, restored) config.json
        if saved is None:
            return
        self.saved = saved if "refused" not in saved else None
        if "refused" in saved:
            self.stop_together(f"error: {saved['refused']}")
        # Activation checkpointing and precision may change between launches; the model and the
        # layout may not (the same rule as ./run.sh's check before launching).
        diffs = resume_differences(saved, to_dict(self.cfg))
        if diffs:
            self.stop_together(f"error: {self.ckpt_dir} was trained with another model or layout "
                               f"({'; '.join(diffs)}); {refusal_hint(diffs, self.cfg.run_dir)}")

    def save(self, step: int, client: dict) -> str:
        """Every rank writes its files, then the manifest commits them (checkpoint/manifest.py): only
        then does `latest` name this checkpoint. A folder of the same tag left by an earlier,
        interrupted or damaged save is removed first; so is, when the filesystem is short of room,
        what rotation would remove after this save anyway (`make_room`). A write that fails (a full
        disk, a quota, a file-size limit) stops the run with one line per rank naming the checkpoint
        and the reason; the previous checkpoints stay intact and the incomplete one is ignored."""
        tag = f"step{step}"
        tag_dir = os.path.join(self.ckpt_dir, tag)
        client = dict(client, step=step, config=self.launch_config())
        if self.layout.rank == 0:
            shutil.rmtree(tag_dir, ignore_errors=True)
        torch.distributed.barrier()
        self.make_room(step)
        try:
            rng.save(tag_dir, self.layout.rank)
            self.engine.save_checkpoint(self.ckpt_dir, tag=tag, client_state=client, save_latest=False)
        except (OSError, RuntimeError) as error:
            reason = write_failure(error, self.ckpt_dir)
            if reason is None:  # not a write (e.g. the other ranks are gone): the caller's handling
                raise
            # Its partial files stay until the next save of that step removes them: the other
            # ranks may still be writing into the folder.
            message = (f"error: rank {self.layout.rank}: could not write checkpoint {tag} to {self.ckpt_dir} "
                       f"({reason}); the incomplete {tag} is ignored. {self._kept_text()}")
            record_stop(self.cfg.run_dir, message, 1)
            raise SystemExit(message) from None
        manifest.commit(self.ckpt_dir, tag, step, extra={"config": self.launch_config()})
        if self.layout.rank == 0:
            try:  # the manifest holds the config too (preflight.saved_run_config): a failure here loses nothing
                manifest.write_atomic(os.path.join(self.cfg.run_dir, "config.json"),
                                      json.dumps(self.launch_config(), indent=2))
            except OSError as e:
                log0(f"warning: could not write {self.cfg.run_dir}/config.json ({e.strerror or e}); the manifest of "
                     f"{tag} records the config")
            tags = manifest.committed_tags(self.ckpt_dir)  # newest first
            for old in tags[self.cfg.train.keep_checkpoints:]:
                shutil.rmtree(os.path.join(self.ckpt_dir, old), ignore_errors=True)
            for old in manifest.uncommitted_tags(self.ckpt_dir):
                if int(old[4:]) < step:
                    shutil.rmtree(os.path.join(self.ckpt_dir, old), ignore_errors=True)
            # A universal copy served the resume of an earlier step at this layout; a later resume
            # takes this checkpoint, so the copy (a checkpoint's size) is no longer needed.
            elastic.drop_copies(self.ckpt_dir, below=step)
        return tag_dir

    def _kept_text(self) -> str:
        newest = manifest.newest_committed(self.ckpt_dir)
        if newest:
            return (f"The newest intact checkpoint, {newest}, is kept: make room (or move run_dir to a larger "
                    f"filesystem) and rerun to resume from it")
        return "No checkpoint was saved yet: make room and rerun (it starts afresh)"

    def make_room(self, step: int) -> None:
        """Before writing `tag`: it needs about as much room as the newest committed checkpoint
        (unknown, so not checked, when that one was saved in another precision). When any rank's
        filesystem has less free (plus 5%) and deleting what this save would delete anyway
        (incomplete saves of earlier steps, committed checkpoints past train.keep_checkpoints;
        never the newest committed one, nor the checkpoint this run resumed from) makes enough,
        rank 0 deletes them; otherwise, or if the room does not appear, every rank stops before
        writing anything, and nothing was deleted for nothing. All ranks decide on the same
        all-reduced numbers."""
        tag = f"step{step}"
        committed = manifest.committed_tags(self.ckpt_dir)
        removable, need = [], 0
        if self.layout.rank == 0 and committed:
            recorded = (manifest.read(os.path.join(self.ckpt_dir, committed[0])) or {}).get("config") or {}
            if recorded.get("parallel", {}).get("precision", self.cfg.parallel.precision) == self.cfg.parallel.precision:
                need = tree_bytes(os.path.join(self.ckpt_dir, committed[0]))
            removable = room_to_make(committed, self.cfg.train.keep_checkpoints)
            removable += [t for t in manifest.uncommitted_tags(self.ckpt_dir)
                          if int(t[4:]) < step and os.path.realpath(os.path.join(self.ckpt_dir, t)) != self.resumed_dir]
            removable += elastic.copies(self.ckpt_dir, below=step)  # (loaded already; dropped after this save)
        freed = sum(tree_bytes(os.path.join(self.ckpt_dir, t)) for t in removable)
        need, free, freed = _agreed_room(need, self.ckpt_dir, self.layout.device, freed)
        if not need or free >= need * ROOM_MARGIN:
            return
        if free + freed >= need * ROOM_MARGIN:
            if self.layout.rank == 0:
                for old in removable:
                    shutil.rmtree(os.path.join(self.ckpt_dir, old), ignore_errors=True)
                log0(f"making room for checkpoint {tag} (about {need / 2**20:.0f} MB, {free / 2**20:.0f} MB free): "
                     f"removed {', '.join(removable)}, which this save would have removed after it "
                     f"(train.keep_checkpoints={self.cfg.train.keep_checkpoints})")
            torch.distributed.barrier()  # rank 0 has deleted them
            for _ in range(ROOM_WAITS):  # some filesystems (ZFS, Lustre) free the space a little later
                need, free, _ = _agreed_room(need, self.ckpt_dir, self.layout.device)
                if free >= need * ROOM_MARGIN:
                    return
                time.sleep(1.0)
        shown = "an unknown amount" if free == UNKNOWN else f"{free / 2**20:.0f} MB"
        message = (f"error: not enough room for checkpoint {tag} in {self.ckpt_dir}: about {need / 2**20:.0f} MB "
                   f"needed (the size of {committed[0]}), {shown} free; nothing was written. {self._kept_text()}")
        if self.layout.rank == 0:
            record_stop(self.cfg.run_dir, message, NO_ROOM_EXIT_CODE)
        raise NoRoomStop(message)
