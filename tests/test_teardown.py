"""Ranks that finish cleanly end their process groups before the interpreter shuts down.

Left to interpreter shutdown, gloo's worker threads may abort a rank after its work is done
("terminate called without an active exception", SIGABRT): a finished run would report a failed
rank and a preempted one would not exit with the requeue code. `finish_distributed` (a barrier,
then `destroy_process_group`) ends them while the runtime is alive; every entry point that runs
ranks calls it on its clean ends.
"""
import os
import re
import subprocess
import sys

from tests.conftest import ROOT

RUNS_RANKS = re.compile(r"\bsetup_distributed\(|\bTrainer\(")
SKIP_DIRS = {".git", ".venv", "runs", "__pycache__", "docs"}


def entry_points_without_teardown(root: str) -> list[str]:
    """Scripts (with a __main__ block) that start ranks (setup_distributed or a Trainer) but never
    call finish_distributed."""
    missing = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.startswith(".")]
        for name in files:
            if not name.endswith(".py") or name.startswith("test_"):
                continue
            path = os.path.join(folder, name)
            with open(path, encoding="utf-8") as f:
                text = f.read()
            if '__name__ == "__main__"' in text and RUNS_RANKS.search(text) and "finish_distributed()" not in text:
                missing.append(os.path.relpath(path, root))
    return sorted(missing)


def test_every_entry_point_that_runs_ranks_ends_its_process_groups():
    assert entry_points_without_teardown(ROOT) == []


def test_the_scan_finds_a_worker_without_teardown(tmp_path):
    (tmp_path / "ok.py").write_text("setup_distributed()\nif __name__ == \"__main__\":\n    main()\n    finish_distributed()\n")
    (tmp_path / "bad.py").write_text("t = Trainer(cfg)\nif __name__ == \"__main__\":\n    main()\n")
    (tmp_path / "lib.py").write_text("t = Trainer(cfg)\n")  # no entry point
    assert entry_points_without_teardown(str(tmp_path)) == ["bad.py"]


def test_finish_distributed_destroys_every_group_and_is_idempotent():
    code = """
import torch.distributed as dist
from parallel.engine import finish_distributed, setup_distributed
setup_distributed()
sub = dist.new_group([0])
dist.all_reduce(__import__("torch").ones(1), group=sub)
finish_distributed()
assert not dist.is_initialized()
finish_distributed()  # nothing left: a no-op
setup_distributed()   # a later run in the same process starts afresh
assert dist.get_world_size() == 1
finish_distributed()
print("ended")
"""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().endswith("ended")
