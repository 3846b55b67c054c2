"""The GPU suite (`./run.sh test-gpu`): every test here is marked `gpu` and needs a CUDA device.

Without one (or under the CPU suite, which sets DS_ACCELERATOR=cpu) the tests are skipped and the
session ends with one line that says why.
"""
from __future__ import annotations

import pytest

from runtime import accelerator

_skipped: list[str] = []


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA device (./run.sh test-gpu)")


def pytest_collection_modifyitems(config, items) -> None:
    reason = accelerator.why_no_gpu()
    for item in items:
        if "gpu" in item.keywords and reason:
            item.add_marker(pytest.mark.skip(reason=f"GPU suite: {reason}"))
            _skipped.append(item.nodeid)


def pytest_terminal_summary(terminalreporter) -> None:
    if _skipped:
        terminalreporter.write_line(f"GPU suite: {len(_skipped)} tests skipped: {accelerator.why_no_gpu()}")
