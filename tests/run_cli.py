"""`./run.sh train` (the CLI behind it) run in the background by tests, its output collected."""
from __future__ import annotations

import os
import re
import resource
import subprocess
import sys
import threading
import time

import psutil

from tests.conftest import ROOT


class Run:
    """`./run.sh train CONFIG` (the CLI behind it) in the background, its output collected."""

    started: list[Run] = []

    def __init__(self, config: str, *extra: str, file_size_limit: int | None = None):
        """`extra`: more arguments (e.g. --set KEY=VALUE); `file_size_limit`: bytes any file of the
        run may grow to (`ulimit -f`, for every process)."""
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        limit = None if file_size_limit is None else (
            lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (file_size_limit, file_size_limit)))
        self.proc = subprocess.Popen([sys.executable, "-m", "launcher.cli", "train", config, "--eval-sentences", "0", *extra],
                                     cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     preexec_fn=limit)
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        Run.started.append(self)

    @classmethod
    def kill_all(cls) -> None:
        """What a failed test left running (the test itself asserts that nothing is)."""
        for run in cls.started:
            try:
                procs = [psutil.Process(run.proc.pid), *run.tree()]
            except psutil.NoSuchProcess:
                continue
            for p in procs:
                try:
                    p.kill()
                except psutil.NoSuchProcess:
                    pass
        cls.started.clear()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line)

    def wait_for(self, pattern: str, timeout: float = 240) -> re.Match:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for line in list(self.lines):
                m = re.search(pattern, line)
                if m:
                    return m
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise AssertionError(f"no line matching {pattern!r}:\n{''.join(self.lines)[-4000:]}")

    def tree(self) -> list[psutil.Process]:
        return psutil.Process(self.proc.pid).children(recursive=True)

    def text(self) -> str:
        return "".join(self.lines)


def _losses(text: str) -> dict[int, float]:
    return {int(m.group(1)): float(m.group(2)) for m in re.finditer(r"step (\d+) \| loss ([\d.]+)", text)}


def _gone(procs: list[psutil.Process], timeout: float) -> float:
    start = time.monotonic()
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    assert not alive, f"still running: {[p.pid for p in alive]}"
    return time.monotonic() - start
