"""Training on CPUs keeps freed host memory for reuse (runtime.accelerator.keep_freed_host_memory).

Each case runs in a fresh interpreter, since glibc's malloc settings are per process and the
point is what a new rank sees: a step that allocates and frees four 40 MB tensors (above the
32 MB that glibc's adaptive mmap threshold can reach, so glibc's behaviour is deterministic)
faults every page in again under glibc's defaults, and about none once `setup_distributed` has
applied the setting. A user's own MALLOC_* variable or glibc.malloc tunable is left to win.
"""
import json
import os
import platform
import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="a glibc malloc setting")

PAGES = 4 * 40 * 1024 * 1024 // os.sysconf("SC_PAGE_SIZE")  # what a step touches

STEPS = r"""
import json, resource, sys
import torch
if sys.argv[1] == "setup":
    from runtime.distributed import setup_distributed
    setup_distributed()
faults = []
for step in range(8):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    kept = [torch.ones(10 * 1024 * 1024) for _ in range(4)]  # 4 × 40 MB, the activations of a step
    total = float(sum(t.sum() for t in kept))
    del kept
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
applied = None
if sys.argv[1] == "setup":  # after the steps: whether the setting could be applied here at all
    from runtime.accelerator import keep_freed_host_memory
    applied = keep_freed_host_memory()
print(json.dumps({{"faults": faults, "applied": applied, "total": total}}))
"""


def _steps(mode: str, **env) -> dict:
    environ = {k: v for k, v in os.environ.items()
               if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"} | {"DS_ACCELERATOR": "cpu", **env}
    out = subprocess.run([sys.executable, "-c", STEPS.format(root=ROOT), mode], env=environ,
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_ranks_on_cpus_reuse_freed_memory_instead_of_faulting_it_in_every_step():
    plain = _steps("plain")
    kept = _steps("setup")
    assert kept["total"] == plain["total"] == 4 * 10 * 1024 * 1024
    # glibc's defaults: blocks this large come from mmap and go back with munmap, every step
    assert min(plain["faults"]) > PAGES // 2, plain
    # after setup_distributed: the first step maps memory, the later ones mostly reuse it (the heap
    # may still grow by a block now and then, where a small allocation split a freed region)
    assert kept["applied"] is True
    assert kept["faults"][0] > PAGES // 2, kept
    assert sum(kept["faults"][1:]) < sum(plain["faults"][1:]) / 4, (kept, plain)
    assert min(kept["faults"][1:]) < PAGES // 50, kept


@pytest.mark.parametrize("env", [{"MALLOC_TRIM_THRESHOLD_": "131072"}, {"GLIBC_TUNABLES": "glibc.malloc.mxfast=128"}])
def test_a_users_own_malloc_settings_win(env):
    run = _steps("setup", **env)
    assert run["applied"] is False
    if "GLIBC_TUNABLES" in env:  # glibc's defaults left as they are: faults every step again
        assert min(run["faults"][-2:]) > PAGES // 2, run
