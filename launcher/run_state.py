"""The checkpoint lifecycle of a training run: resume (verified against the manifest, falling back
past damaged checkpoints), resume a checkpoint without a manifest (an older version's, or a
universal one from `./run.sh convert reshard`), save and commit, set damaged ones aside, and refuse
a changed model or layout. A mixin of launcher/train.py's Trainer, which holds the state it uses:
cfg, layout, engine, module, stream, guard, history, step and ckpt_dir.
"""
from __future__ import annotations

import json
import os
import shutil

import torch

from launcher.config import to_dict
from launcher.preflight import resume_differences
from parallel import manifest, rng


def log0(*args) -> None:
    if torch.distributed.get_rank() == 0:
        print(*args, flush=True)


class CheckpointLifecycle:
    """Checkpoints of the Trainer (launcher/train.py): its resume, save and their checks."""

    def resume(self, newest_step: int | None = None) -> None:
        """Load the newest checkpoint (at most `newest_step`) that verifies against its manifest and
        holds finite weights; say which ones were skipped and why; stop if none is left."""
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
            problems = manifest.verify(tag_dir)
            if not problems:
                path, client = self.engine.load_checkpoint(self.ckpt_dir, tag=tag)
                if path is None:
                    problems = [f"DeepSpeed could not load {tag_dir}"]
                elif not self.weights_finite():
                    problems = [f"{tag_dir} holds non-finite weights"]
            if problems:
                more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
                log0(f"checkpoint {tag} is damaged: {problems[0]}{more}; falling back to an older one")
                damaged.append(tag)
                continue
            self.restore_client(client, tag_dir)
            if damaged:
                log0(f"resumed from the intact checkpoint {tag} (step {self.step}) instead of "
                     f"{', '.join(damaged)}; the damaged ones are moved to {self.ckpt_dir}/damaged/")
                self.set_aside(damaged)
            else:
                log0(f"resumed from {tag_dir} at step {self.step} (verified)")
                if why and self.layout.rank == 0:  # `latest` named nothing usable: name the one resumed
                    manifest.write_atomic(os.path.join(self.ckpt_dir, manifest.LATEST), tag)
            return
        listed = ", ".join(tags) or "none"
        raise SystemExit(f"error: no intact checkpoint in {self.ckpt_dir} (checked: {listed}); "
                         "restore one, or train afresh in another run_dir (or after removing checkpoints/)")

    def resume_unverified(self, tag: str | None) -> None:
        """A checkpoint without a manifest: an older version's, or a universal one (reshard)."""
        self.check_compatible()
        path, client = self.engine.load_checkpoint(self.ckpt_dir, tag=tag)
        if path is None:
            raise SystemExit(f"error: {self.ckpt_dir}: the checkpoint {tag or 'latest_universal'} cannot be "
                             "loaded; train afresh in another run_dir")
        if not self.weights_finite():
            raise SystemExit(f"error: {path} holds non-finite weights; it cannot be resumed")
        self.restore_client(client, path)
        log0(f"resumed from {path} at step {self.step} (written without a manifest: not verified)")

    def restore_client(self, client: dict, path: str) -> None:
        self.step = client["step"]
        self.stream.load_state_dict(client["data"])
        self.guard.load_state_dict(client.get("guard"))
        tag_dir = path if os.path.isdir(path) else os.path.dirname(path)
        rank = self.layout.rank
        if not rng.load(tag_dir, rank):  # only unverified checkpoints get here without one
            print(f"rank {rank}: {rng.path(tag_dir, rank)} does not exist (a checkpoint of another layout "
                  "or an older version): this rank's dropout masks start afresh", flush=True)
        self.history = client["history"]
        self.apply_optimizer_config()

    def apply_optimizer_config(self) -> None:
        """The config's AdamW settings over the ones the checkpoint restored. DeepSpeed reloads the
        optimizer's param_groups and the scheduler's base_lrs with the checkpoint, so a train.lr,
        weight_decay, adam_betas or adam_eps changed for the resume (e.g. a lower lr after a
        divergence stop) would otherwise be ignored without a word. The schedule's shape (warm-up)
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
        if changed:
            log0(f"resumed with the config's {', '.join(changed)} (the checkpoint had the old values)")

    def weights_finite(self) -> bool:
        """All ranks agree whether every loaded parameter is finite."""
        bad = any(not bool(torch.isfinite(p).all()) for p in self.module.parameters())
        flag = torch.tensor([int(bad)], dtype=torch.int32, device=self.layout.device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return not bool(flag.item())

    def set_aside(self, tags: list[str]) -> None:
        torch.distributed.barrier()
        if self.layout.rank == 0:
            aside = os.path.join(self.ckpt_dir, "damaged")
            os.makedirs(aside, exist_ok=True)
            for tag in tags:  # an earlier damaged copy of the same step is kept: the new one gets a suffix
                name, n = tag, 1
                while os.path.lexists(os.path.join(aside, name)):
                    name, n = f"{tag}.{n}", n + 1
                os.replace(os.path.join(self.ckpt_dir, tag), os.path.join(aside, name))
            good = manifest.newest_committed(self.ckpt_dir)
            if good:
                manifest.write_atomic(os.path.join(self.ckpt_dir, manifest.LATEST), good)
        torch.distributed.barrier()

    def check_compatible(self) -> None:
        """Refuse, with the differing keys named, to resume a run whose model or layout changed."""
        saved_cfg = os.path.join(self.cfg.run_dir, "config.json")
        if not os.path.exists(saved_cfg):
            return
        with open(saved_cfg) as f:
            saved = json.load(f)
        # Activation checkpointing and precision may change between launches; the model and the
        # layout may not (the same rule as ./run.sh's check before launching).
        diffs = resume_differences(saved, to_dict(self.cfg))
        if diffs:
            raise SystemExit(f"error: {self.ckpt_dir} was trained with another model or layout "
                             f"({'; '.join(diffs)}). Use a new run_dir, or convert the checkpoint.")

    def save(self) -> str:
        """Every rank writes its files, then the manifest commits them (parallel/manifest.py): only
        then does `latest` name this checkpoint. A folder of the same tag left by an earlier,
        interrupted or damaged save is removed first."""
        tag = f"step{self.step}"
        tag_dir = os.path.join(self.ckpt_dir, tag)
        client = {"step": self.step, "data": self.stream.state_dict(), "history": self.history,
                  "guard": self.guard.state_dict(), "config": to_dict(self.cfg)}
        if self.layout.rank == 0:
            shutil.rmtree(tag_dir, ignore_errors=True)
        torch.distributed.barrier()
        rng.save(tag_dir, self.layout.rank)
        self.engine.save_checkpoint(self.ckpt_dir, tag=tag, client_state=client, save_latest=False)
        manifest.commit(self.ckpt_dir, tag, self.step)
        if self.layout.rank == 0:
            with open(os.path.join(self.cfg.run_dir, "config.json"), "w") as f:
                json.dump(to_dict(self.cfg), f, indent=2)
            tags = manifest.committed_tags(self.ckpt_dir)  # newest first
            for old in tags[self.cfg.train.keep_checkpoints:]:
                shutil.rmtree(os.path.join(self.ckpt_dir, old), ignore_errors=True)
            for old in manifest.uncommitted_tags(self.ckpt_dir):
                if int(old[4:]) < self.step:
                    shutil.rmtree(os.path.join(self.ckpt_dir, old), ignore_errors=True)
        return tag_dir
