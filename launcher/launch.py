"""Where the project lives and how this node starts its ranks: shared by the commands, the
benchmark drivers and the experiments (no torch at import)."""
from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_CONFIG = os.path.join(ROOT, "configs", "default.yaml")
DEFAULT_RUN = os.path.join(ROOT, "runs", "default")  # DEFAULT_CONFIG's run_dir (../runs/{config})


def launch_env(world_size: int) -> dict:
    """Environment of the ranks: the repo on PYTHONPATH; on CPU, cores split evenly over ranks
    (the deepspeed launcher leaves OMP_NUM_THREADS alone, and oversubscribed ranks ran 6× slower)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // world_size)))
    env.setdefault("PYTHONWARNINGS", "ignore")
    return env


def deepspeed_command(world_size: int, module: str, module_args: list[str]) -> list[str]:
    """`deepspeed --num_gpus N --module MODULE ARGS` on this node (no hostfile → local ranks only);
    the ranks run `python -m MODULE` with the repository on PYTHONPATH (`launch_env`). Its own log
    only at `critical`: it reports every rank that exits non-zero at `error` ("… exits with return
    code = 75" after a clean preemption), which the supervisor says itself (launcher/procs.py)."""
    from runtime.distributed import free_port

    launcher = os.path.join(os.path.dirname(sys.executable), "deepspeed")
    return [launcher, "--num_gpus", str(world_size), "--master_port", str(free_port()),
            "--log_level", "critical", "--module", module, *module_args]
