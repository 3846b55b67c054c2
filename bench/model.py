"""`./run.sh bench model`: the plain model's training step, eager and with compiled layers, steps
interleaved in one process.

    ./run.sh bench model [--model tiny-100-100,base-6-6] [--batch 32 --src 32 --tgt 32]
                         [--warmup 2] [--steps 8] [--threads 1] [--against REV] [--out DIR]

Per named shape (configs/<name>.yaml's model, its dropout as configured): the plain `EncoderDecoder`
trained on one fixed synthetic batch of `--batch` × (`--src` + `--tgt`) tokens (model/step.py:
forward, label-smoothed loss over the target tokens, backward, global-norm clipping at 1, fused
AdamW), fp32 on `--threads` threads. Two models with the same weights, "eager" and "compiled" (every
encoder and decoder layer compiled as train.compile does, parallel/compiled.py; the compilation
happens in the warm-up steps), take steps in turn (A, B, A, B, ...), so both see the same load; CPU
seconds per step (`time.process_time`, steadier than wall time on a shared machine), median over the
measured steps, target tokens per CPU-second and the ratio. Then the same at dropout 0 (the variants
differ only in the compiler's summation order, so their losses agree to rounding), with the largest
relative difference of their losses.

`--against REV` adds a third variant: the `model` package as of git revision REV of this
repository (`git archive`, imported as its own package next to today's), with the same initial
weights where its parameters are the same, taking its turn in the same interleaved loop: a
before/after measurement of everything that changed in the model since REV, losses included
(at dropout 0 they must agree with today's to rounding). Writes OUT/model.{md,json} (default
runs/bench-model).
"""
from __future__ import annotations

import argparse
import atexit
import dataclasses
import importlib
import importlib.util
import io
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time

from schema.text import count

BENCH = dict(name="model", help="the plain model's training step, eager against compiled, or against another "
             "commit's model, steps interleaved", paths=("--out",))
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

VARIANTS = ("eager", "compiled")


class BenchError(Exception):
    """A bad option: the message says which and what to do."""


def model_at(rev: str, repo: str = REPO):
    """(short commit, its `model.transformer` module) for git revision `rev` of `repo`: the
    `model` package extracted with `git archive` into a temporary directory as package
    `model_at_<commit>`, its own `model` imports pointed at that name."""
    found = subprocess.run(["git", "-C", repo, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"],
                           capture_output=True, text=True)
    if found.returncode:
        raise BenchError(f"--against {rev}: not a commit of the git repository {repo} (try a hash from `git log`)")
    commit = found.stdout.strip()[:10]
    archive = subprocess.run(["git", "-C", repo, "archive", commit, "model"], capture_output=True)
    if archive.returncode:
        raise BenchError(f"--against {rev}: commit {commit} has no model/ package to compare with")
    name = f"model_at_{commit}"
    root = tempfile.mkdtemp(prefix="bench-model-")
    atexit.register(shutil.rmtree, root, True)  # read until the end (an old package may load files lazily)
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:  # our own repository's files
        tar.extractall(root, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    package = os.path.join(root, name)
    os.rename(os.path.join(root, "model"), package)
    imports = re.compile(r"^(\s*)(from|import) model(?=[.\s])", re.MULTILINE)
    for directory, _, files in os.walk(package):
        for file in files:
            if file.endswith(".py"):
                path = os.path.join(directory, file)
                with open(path) as f:
                    text = f.read()
                with open(path, "w") as f:
                    f.write(imports.sub(rf"\1\2 {name}", text))
    try:  # the package is imported from its folder, under its own name
        spec = importlib.util.spec_from_file_location(name, os.path.join(package, "__init__.py"),
                                                      submodule_search_locations=[package])
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
        return commit, importlib.import_module(f"{name}.transformer")
    except Exception as error:  # code of another era: say which commit and why
        raise BenchError(f"--against {rev}: the model package of {commit} does not import here "
                         f"({type(error).__name__}: {error})") from None


def _old_config(transformer, cfg):
    """`cfg` as the old package's ModelConfig (the fields it has; the others must be at the
    defaults it implied, or the two models would differ)."""
    old = importlib.import_module(transformer.__name__.rsplit(".", 1)[0] + ".config").ModelConfig
    fields = {f.name for f in dataclasses.fields(old)}
    values, defaults = dataclasses.asdict(cfg), dataclasses.asdict(type(cfg)())
    dropped = sorted(k for k, v in values.items() if k not in fields and v != defaults[k])
    if dropped:
        raise BenchError(f"--against: that commit's ModelConfig has no {dropped}, which this shape sets")
    return old(**{k: v for k, v in values.items() if k in fields})


def _step(model, optimizer, batch, loss_sum=None) -> float:
    """One plain training step (model/step.py) on `batch`, clipped at 1; its loss. `loss_sum`: the
    model package's own loss (another commit's)."""
    from model.step import plain_step
    from model.transformer import smoothed_loss_sum

    return plain_step(model, [batch], optimizer, clip_norm=1.0, loss_sum=loss_sum or smoothed_loss_sum).loss


def compare(cfg, batch: dict, warmup: int, steps: int, against=None) -> dict:
    """The variants' interleaved steps on `cfg` (plus `against`'s model: (commit, its
    transformer module)): CPU seconds and losses per measured step."""
    import torch

    from model.transformer import EncoderDecoder
    from parallel.compiled import compile_layers

    variants = {name: (EncoderDecoder, cfg, None) for name in VARIANTS}
    if against is not None:
        commit, old = against
        variants[commit] = (old.EncoderDecoder, _old_config(old, cfg), old.smoothed_loss_sum)
    runs = {}
    for name, (build, config, loss_sum) in variants.items():
        torch.manual_seed(0)  # the same dropout seed stream for all
        model = build(config, seed=1).train()
        if name == "compiled":
            compile_layers(model)
        runs[name] = {"model": model, "cfg": config, "loss_sum": loss_sum,
                      "optimizer": torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True),
                      "rng": torch.get_rng_state(), "cpu_s": [], "losses": []}
    for i in range(warmup + steps):
        for name, run in runs.items():
            torch.set_rng_state(run["rng"])
            start = time.process_time()
            loss = _step(run["model"], run["optimizer"], batch, run["loss_sum"])
            seconds = time.process_time() - start
            run["rng"] = torch.get_rng_state()
            if i >= warmup:
                run["cpu_s"].append(seconds)
                run["losses"].append(loss)
    return {name: {"cpu_s": run["cpu_s"], "losses": run["losses"]} for name, run in runs.items()}


def _max_rel_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(x) for x, y in zip(a, b))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="./run.sh bench model", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-100-100,base-6-6", help="named shapes, comma-separated")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--src", type=int, default=32)
    parser.add_argument("--tgt", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--against", metavar="REV", help="also train the model package of this git revision")
    parser.add_argument("--out", default="runs/bench-model")
    args = parser.parse_args(argv)
    if min(args.batch, args.src, args.tgt, args.steps, args.threads) < 1 or args.warmup < 0:
        print("error: --batch, --src, --tgt, --steps and --threads must be >= 1, --warmup >= 0", file=sys.stderr)
        return 2

    import torch

    from planner.planner import named_model
    from runtime.accelerator import keep_freed_host_memory

    try:
        shapes = {name: named_model(name) for name in args.model.split(",")}
        against = model_at(args.against) if args.against else None
    except (ValueError, BenchError) as e:
        print(f"error: {e}" if isinstance(e, BenchError) else f"error: --model: {e}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    kept = keep_freed_host_memory()  # as every training rank does (runtime.distributed.setup_distributed)
    load_before = os.getloadavg()
    names = list(VARIANTS) + ([against[0]] if against else [])
    rows = []
    for name, cfg in shapes.items():
        generator = torch.Generator().manual_seed(123)
        tokens = torch.randint(4, cfg.vocab_size, (args.batch, args.src + args.tgt + 1), generator=generator)
        batch = {"src": tokens[:, :args.src].contiguous(), "tgt_in": tokens[:, args.src:-1].contiguous(),
                 "tgt_out": tokens[:, args.src + 1:].contiguous()}
        for dropout in (cfg.dropout, 0.0):
            shape = cfg if dropout else dataclasses.replace(cfg, dropout=0.0, attention_dropout=0.0,
                                                            activation_dropout=0.0)
            try:
                result = compare(shape, batch, args.warmup, args.steps, against)
            except BenchError as e:
                print(f"error: {e}", file=sys.stderr)
                return 2
            median = {v: statistics.median(result[v]["cpu_s"]) for v in names}
            target = args.batch * args.tgt
            row = {"model": name, "dropout": dropout, "layers": f"{cfg.encoder_layers}L-{cfg.decoder_layers}L",
                   "d_model": cfg.d_model, **{f"{v}_cpu_s": median[v] for v in VARIANTS},
                   **{f"{v}_tokens_per_cpu_s": target / median[v] for v in VARIANTS},
                   "speedup": median["eager"] / median["compiled"], "steps": result,
                   "max_rel_loss_diff": _max_rel_diff(result["eager"]["losses"], result["compiled"]["losses"])}
            line = (f"{name} dropout {dropout}: eager {median['eager']:.3f} CPU-s/step ({row['eager_tokens_per_cpu_s']:.0f} "
                    f"tgt tok/CPU-s), compiled {median['compiled']:.3f} ({row['compiled_tokens_per_cpu_s']:.0f}): "
                    f"{row['speedup']:.3f}x; losses differ by ≤ {row['max_rel_loss_diff']:.1e} (relative)")
            if against:
                commit = against[0]
                row["against"] = {"commit": commit, "cpu_s": median[commit], "tokens_per_cpu_s": target / median[commit],
                                  "speedup": median[commit] / median["eager"],
                                  "max_rel_loss_diff": _max_rel_diff(result[commit]["losses"], result["eager"]["losses"])}
                line += (f"; {commit} {median[commit]:.3f} ({row['against']['tokens_per_cpu_s']:.0f}): today eager "
                         f"{row['against']['speedup']:.3f}x, losses differ by ≤ {row['against']['max_rel_loss_diff']:.1e}")
            rows.append(row)
            print(line, flush=True)
    os.makedirs(args.out, exist_ok=True)
    lines = [f"Plain model, {args.batch} × ({args.src} + {args.tgt}) tokens, fp32, {count(args.threads, 'thread')}, "
             f"{args.warmup} warm-up + {count(args.steps, 'measured step')} per variant, interleaved; CPU seconds per step "
             f"(median); load average before {' '.join(f'{x:.1f}' for x in load_before)}, after "
             f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}; freed host memory "
             f"{'kept for reuse' if kept else 'returned to the system (glibc defaults)'}.", ""]
    header = ("| model | dropout | eager CPU s | compiled CPU s | eager tgt tok/CPU-s | compiled tgt tok/CPU-s | speed-up "
              "| max relative loss difference |")
    if against:
        commit = against[0]
        header += (f" {commit} CPU s | {commit} tgt tok/CPU-s | today's eager over {commit} "
                   f"| max relative loss difference to {commit} |")
    lines += [header, "|---" * (12 if against else 8) + "|"]
    for r in rows:
        line = (f"| {r['model']} ({r['layers']} d={r['d_model']}) | {r['dropout']} | {r['eager_cpu_s']:.3f} "
                f"| {r['compiled_cpu_s']:.3f} | {r['eager_tokens_per_cpu_s']:.0f} | {r['compiled_tokens_per_cpu_s']:.0f} "
                f"| {r['speedup']:.3f} | {r['max_rel_loss_diff']:.1e} |")
        if against:
            a = r["against"]
            line += f" {a['cpu_s']:.3f} | {a['tokens_per_cpu_s']:.0f} | {a['speedup']:.3f} | {a['max_rel_loss_diff']:.1e} |"
        lines.append(line)
    with open(os.path.join(args.out, "model.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(args.out, "model.json"), "w") as f:
        json.dump({"args": vars(args), "load_before": load_before, "rows": rows}, f, indent=1)
    print(f"wrote {args.out}/model.md, {args.out}/model.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
