"""Freed host memory kept for reuse against glibc trimming it, steps alternated in one process.

    SHAPE=tiny-100-100 N=10 .venv/bin/python -m bench.scripts.paired_steps

The plain model of configs/SHAPE.yaml, 32 × (32 + 32) tokens, fp32, 1 thread, the step of
`./run.sh bench model` (forward, loss, backward, clipping, fused AdamW). Each of N rounds runs
one step under each setting, in alternating order: M_TRIM_THRESHOLD 128 KiB (glibc's default
trimming; the mmap threshold frozen where glibc's adaptive one stands after warm-up) and 1 GiB
(what runtime.accelerator.keep_freed_host_memory sets); per setting a settling step, then a
timed one (CPU seconds) and its minor page faults.
"""
import ctypes
import os
import resource
import statistics
import time

import torch
import yaml

from bench.model import _step
from model.config import ModelConfig
from model.transformer import EncoderDecoder

M_TRIM_THRESHOLD = -1
SETTINGS = {"trim 128 KiB": 128 * 1024, "keep 1 GiB": 1 << 30}


def main() -> None:
    libc = ctypes.CDLL(None)
    torch.set_num_threads(1)
    shape = os.environ.get("SHAPE", "tiny-100-100")
    with open(f"configs/{shape}.yaml") as f:
        cfg = ModelConfig(**yaml.safe_load(f)["model"], vocab_size=4000)
    torch.manual_seed(0)
    model = EncoderDecoder(cfg, seed=1).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    g = torch.Generator().manual_seed(0)
    batch = {key: torch.randint(4, 4000, (32, 32), generator=g) for key in ("src", "tgt_in", "tgt_out")}
    for _ in range(3):
        _step(model, optimizer, batch)
    seconds = {name: [] for name in SETTINGS}
    faults = {name: [] for name in SETTINGS}
    for i in range(int(os.environ.get("N", "8"))):
        for name in (list(SETTINGS) if i % 2 == 0 else list(reversed(SETTINGS))):
            libc.mallopt(M_TRIM_THRESHOLD, ctypes.c_int(SETTINGS[name]))
            _step(model, optimizer, batch)
            before, start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.process_time()
            _step(model, optimizer, batch)
            seconds[name].append(time.process_time() - start)
            faults[name].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    for name in SETTINGS:
        print(f"{shape} {name}: CPU s per step median {statistics.median(seconds[name]):.3f} "
              f"mean {statistics.mean(seconds[name]):.3f}, minor faults per step {int(statistics.median(faults[name]))}, "
              f"steps {[round(x, 3) for x in seconds[name]]}")
    wins = sum(k < t for k, t in zip(seconds["keep 1 GiB"], seconds["trim 128 KiB"]))
    print(f"keep faster in {wins} of {len(seconds['keep 1 GiB'])} rounds")


if __name__ == "__main__":
    main()
