"""Running the per-shard steps in worker processes, with a progress bar.

Workers are forked, so they share the parent's already-imported modules (megatron-core alone
costs seconds to import) instead of paying for them again. Each worker asks the kernel to kill
it when the parent dies: a preparation killed with SIGKILL must not leave orphans that keep
writing into the output folder while a rerun resumes there.
"""

import ctypes
import multiprocessing
import os
import signal
import sys
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_EXCEPTION, ProcessPoolExecutor, wait
from typing import Any

from tqdm import tqdm

_PR_SET_PDEATHSIG = 1
_STATE: dict[str, Any] = {}


def worker_count(requested: int) -> int:
    """``requested`` workers, or one per core this process may run on when it is 0 (a SLURM job
    or container may be given fewer cores than the machine has)."""
    if requested > 0:
        return requested
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _die_with_parent(parent: int) -> None:
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def _init(parent: int, setup: Callable[[], dict] | None) -> None:
    _die_with_parent(parent)
    # Ctrl-C reaches the whole process group; only the parent should react to it and stop the
    # pool, or every worker prints its own traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _STATE.clear()
    if setup is not None:
        _STATE.update(setup())


def worker_state() -> dict[str, Any]:
    """What the ``setup`` callable of :func:`run_tasks` returned, in this worker."""
    return _STATE


def run_tasks(
    fn: Callable[[Any], Any],
    tasks: list[Any],
    workers: int,
    desc: str,
    weight: Callable[[Any], int] = lambda _: 1,
    unit: str = "pairs",
    setup: Callable[[], dict] | None = None,
    progress: bool = True,
) -> Iterator[tuple[Any, Any]]:
    """Yield ``(task, fn(task))`` as tasks finish, on ``workers`` processes (in this process when
    1). The bar advances by ``weight(task)``. The first failure cancels what has not started and
    is re-raised here; Ctrl-C does the same."""
    total = sum(weight(task) for task in tasks)
    bar = tqdm(total=total, desc=desc, unit=unit, unit_scale=True, disable=not progress or not tasks,
               dynamic_ncols=True, mininterval=0.5, file=sys.stderr)
    try:
        if workers <= 1 or len(tasks) <= 1:
            _STATE.clear()
            if setup is not None:
                _STATE.update(setup())
            for task in tasks:
                result = fn(task)
                bar.update(weight(task))
                yield task, result
            return
        pool = ProcessPoolExecutor(
            max_workers=min(workers, len(tasks)),
            mp_context=multiprocessing.get_context("fork"),
            initializer=_init,
            initargs=(os.getpid(), setup),
        )
        pending = {pool.submit(fn, task): task for task in tasks}
        try:
            while pending:
                done, _ = wait(pending, return_when=FIRST_EXCEPTION)
                for future in done:
                    task = pending.pop(future)
                    result = future.result()  # re-raises a worker's exception
                    bar.update(weight(task))
                    yield task, result
        except BaseException:
            # Stop at once rather than finish the running shards: every output is written under
            # a temporary name and renamed when complete, so a killed worker leaves nothing half
            # done that a rerun would trust.
            for future in pending:
                future.cancel()
            for process in list((getattr(pool, "_processes", None) or {}).values()):
                process.terminate()
            pool.shutdown(wait=True, cancel_futures=True)
            raise
        pool.shutdown(wait=True)
    finally:
        bar.close()


def ordered(results: Iterable[tuple[Any, Any]], tasks: list[Any]) -> list[Any]:
    """Results of :func:`run_tasks` in the order of ``tasks`` (they arrive as they finish)."""
    by_id = {id(task): result for task, result in results}
    return [by_id[id(task)] for task in tasks]
