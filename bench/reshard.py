"""What resuming at another layout costs: a real checkpoint of a model of `--d-model` ×
`--layers`L-`--layers`L (about 176M parameters at the defaults) converted for another layout.

    ./run.sh bench reshard [--d-model 1024] [--layers 6] [--out DIR] [--json FILE]

1. The bundled gettext corpus is prepared into DIR/data (de, fr: its 600-piece vocabulary keeps the
   model's parameters in its layers) and `./run.sh train` trains one step of the model at pp = 2,
   fp32, ZeRO-1, and checkpoints it (checkpoints/step1).
2. checkpoint/elastic.py `prepare` converts it for pp1·tp2·dp1 as `./run.sh train` would before its
   ranks start: the checkpoint verified, DeepSpeed's universal conversion, the copy committed. A
   thread samples the size of checkpoints/ every 0.1 s: the extra disk at its peak (the universal
   copy plus DeepSpeed's per-fragment files, removed at the end) and what stays (the copy).
3. `./run.sh train` at pp1·tp2·dp1 resumes it for one more step; its log says how long the ranks
   took to load the copy.
Printed: parameters, the checkpoint's bytes, the conversion's seconds and bytes per second, the
peak and lasting extra disk; `--json` writes them. docs/operations.md projects them.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

BENCH = dict(name="reshard", help="the time and disk of resuming at another layout (a ~176M-parameter checkpoint)",
             paths=("--out", "--json"))


def train(config: str, *sets: str) -> str:
    from launcher.launch import ROOT

    cmd = [sys.executable, "-m", "launcher.cli", "train", config, "--eval-sentences", "0",
           *[a for s in sets for a in ("--set", s)]]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"error: {' '.join(cmd)} failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    return proc.stdout


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="./run.sh bench reshard", description=__doc__.split("\n\n")[0])
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=6, help="encoder layers, and as many decoder layers")
    parser.add_argument("--out", default="runs/bench-reshard", help="work folder (its run/ is replaced)")
    parser.add_argument("--json", help="also write the numbers to this file")
    args = parser.parse_args(argv)
    import shutil

    import yaml

    from checkpoint import elastic, manifest
    from data.config import DataConfig
    from data.prepare import prepare_data
    from trainer.room import tree_bytes

    data = {"languages": ["de", "fr"], "vocab_size": 600, "max_tokens": 256, "max_source_len": 48,
            "max_target_len": 48, "dev_size": 40, "test_size": 40}
    run_dir = os.path.abspath(os.path.join(args.out, "run"))
    shutil.rmtree(run_dir, ignore_errors=True)
    os.makedirs(run_dir)
    prepare_data(DataConfig(**data), os.path.join(args.out, "data"), log=lambda *_: None)
    os.symlink(os.path.abspath(os.path.join(args.out, "data")), os.path.join(run_dir, "data"))
    d = args.d_model
    config = os.path.join(args.out, "reshard.yaml")
    with open(config, "w") as f:
        yaml.safe_dump({"run_dir": run_dir, "data": data,
                        "model": {"encoder_layers": args.layers, "decoder_layers": args.layers, "d_model": d,
                                  "heads": d // 64, "ffn_dim": 4 * d, "norm": "deepnorm", "dropout": 0.0},
                        "parallel": {"pipeline_stages": 2},
                        "train": {"max_steps": 1, "save_interval": 1, "valid_interval": 1000, "warmup_steps": 1}}, f)
    start = time.perf_counter()
    train(config)
    trained = time.perf_counter() - start
    ckpt = os.path.join(run_dir, "checkpoints")
    source = os.path.join(ckpt, manifest.newest_committed(ckpt))
    before, peak, stop = tree_bytes(ckpt), [0], threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], tree_bytes(ckpt))
            time.sleep(0.1)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.perf_counter()
    done = elastic.prepare(run_dir, (1, 2, 1), log=print)
    seconds = time.perf_counter() - start
    stop.set()
    sampler.join()
    copy = tree_bytes(done.path)
    params = sum(int(entry["size"]) for name, entry in manifest.read(done.path)["files"].items()
                 if name.endswith("/fp32.pt")) // 4  # fp32 copies of every parameter (a few hundred bytes of header each)
    resumed = train(config, "parallel.pipeline_stages=1", "parallel.tensor_parallel=2", "train.max_steps=2")
    result = {"parameters": params, "checkpoint_bytes": tree_bytes(source), "checkpoints_before": before,
              "convert_seconds": round(done.seconds, 1), "prepare_seconds": round(seconds, 1),
              "verify_and_commit_seconds": round(seconds - done.seconds, 1),
              "universal_bytes": copy, "peak_extra_bytes": peak[0] - before,
              "convert_bytes_per_s": round(copy / done.seconds), "train_one_step_seconds": round(trained, 1),
              "resumed": "resharded through" in resumed}
    gib = 2**30
    print(f"{params / 1e6:.0f}M parameters; checkpoint {result['checkpoint_bytes'] / gib:.2f} GiB; converted for "
          f"pp1·tp2·dp1 in {done.seconds:.1f} s ({copy / done.seconds / 2**20:.0f} MiB/s of universal copy; "
          f"{seconds - done.seconds:.1f} s more to verify the source and commit the copy); extra disk "
          f"{result['peak_extra_bytes'] / gib:.2f} GiB at the peak, {copy / gib:.2f} GiB kept until the resumed "
          f"run commits a checkpoint; resumed there: {result['resumed']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
