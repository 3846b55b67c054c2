"""Nothing names a device type or a communication backend outside runtime/accelerator.py.

The trainer runs on whatever accelerator DeepSpeed picked; a literal 'cpu', 'cuda', 'gloo' or
'nccl', a `torch.cuda` call or a `.cuda()` anywhere else would pin one path and leave the other
untested. Tests are exempt (they choose the accelerator they test).
"""
import os
import re

from tests.conftest import ROOT

FORBIDDEN = re.compile(r"""(['"])(cpu|cuda|gloo|nccl)(:\d+)?\1|torch\.cuda\b|\.cuda\(|=(cpu|cuda|gloo|nccl)\b""")
ALLOWED = {os.path.join("runtime", "accelerator.py")}


def offending_lines(root: str) -> list[str]:
    found = []
    for folder, dirs, files in os.walk(root):
        rel = os.path.relpath(folder, root)
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in ("tests", "runs", "__pycache__")]
        for name in files:
            path = os.path.normpath(os.path.join(rel, name))
            if not name.endswith(".py") or path in ALLOWED:
                continue
            with open(os.path.join(root, path), encoding="utf-8") as f:
                for number, line in enumerate(f, 1):
                    if FORBIDDEN.search(line):
                        found.append(f"{path}:{number}: {line.strip()}")
    return found


def test_no_source_names_a_device_or_backend_outside_the_accelerator_module():
    assert offending_lines(ROOT) == []


def test_the_grep_finds_a_planted_literal(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "ok.py").write_text("device = accelerator.device()\n")
    (tmp_path / "pkg" / "bad.py").write_text("x = y.to('cuda:0')\ndist.init_process_group(\"nccl\")\ntorch.cuda.synchronize()\n")
    assert [line.split(":")[1] for line in offending_lines(str(tmp_path))] == ["1", "2", "3"]
