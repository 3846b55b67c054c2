"""Loading PyTorch files without running code: no file any command reads can run code.

A `.pt` file is a pickle, and unpickling calls whatever function the pickle names (`os.system`
too). Every PyTorch file this trainer reads (checkpoints, universal checkpoints, model files, RNG
states) is read with torch's weights-only unpickler (`torch.load(weights_only=True)`): tensors,
containers and plain values only, plus the types of `allowed_for` a file of that name needs. A
file that needs anything else is refused in one line naming the file and the type (`UnsafeFile`);
nothing in it runs. What DeepSpeed 0.19.8 writes, checked by writing real checkpoints (fp32, bf16
and fp16; ZeRO stage 0 and 1; tensor-parallel; universal ones; tests/test_safe_load.py keeps it
true):

    *optim_states.pt (ZeRO shards)      deepspeed.utils.tensor_fragment.fragment_address (the
                                        optimizer's parameter slice mappings), in every precision
    mp_rank_XX_model_states.pt          the same at ZeRO stage 0 (the optimizer state is kept
                                        there); torch.Size, which torch allows anyway
    a universal checkpoint's zero/*/*.pt deepspeed.checkpoint.universal_checkpoint.SubparamShape
                                        (how a fused parameter's parts are cut: the stages
                                        declare it, parallel/universal.py)
    layer files, rng_rank*.pt, consolidated model files:
                                        nothing else (fp16's loss scale is plain numbers)

Three lines of defence, because DeepSpeed reads its own files with `weights_only=False`:
1. `check_folder`: before a checkpoint folder is used (./run.sh train's checks before any rank
   starts, and the ranks again before they load one; convert, train.init_from, translate, eval
   and export of a run directory), every file in it is loaded this way, memory-mapped (only the
   pickles are read), and the first one that needs another type is refused before anything is
   written.
2. `SafeCheckpointEngine`: DeepSpeed's engine reads the model, layer and ZeRO files through its
   `checkpoint_engine`; the trainer's engine (parallel/engine.py) gets this one.
3. `forced`: what DeepSpeed reads with `torch.load` itself (a universal checkpoint's files) is made
   weights-only by torch's TORCH_FORCE_WEIGHTS_ONLY_LOAD for the duration of a load; the universal
   conversion (`deepspeed.checkpoint.ds_to_universal`, a process of its own with worker processes)
   runs under `python -m runtime.safe_load MODULE ARGS`, which sets it for the whole process tree.
The manifest's SHA-256 (checkpoint/manifest.py) proves a file unchanged since its manifest was
written, not who wrote it: whoever ships a folder can rewrite both, so it is no defence here.
"""
from __future__ import annotations

import contextlib
import importlib
import os
import pickle
import re
import runpy
import subprocess
import sys
import warnings
import zipfile
from collections.abc import Iterator

import torch
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

from runtime.accelerator import HOST

FORCE = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"  # torch reads it on every torch.load call
_FORCE_NOT = "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"  # its opposite, which torch refuses beside it
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the project, for run_process
_FRAGMENT_FILES = re.compile(r"^(.*optim_states|mp_rank_\d+_model_states)\.pt$")


class UnsafeFile(ValueError):
    """A file that needs a type outside its allowlist to load; the message is the one line."""

    def __init__(self, path: str, name: str, allowed: tuple):
        self.path, self.name = path, name
        kinds = ", ".join(["tensors", "plain values", *(t.__name__ for t in allowed)])
        kinds = " and ".join(kinds.rsplit(", ", 1))
        super().__init__(f"{path}: holds {name}, which is not loaded: only {kinds} are (anything else could run code)")


class UnreadableFile(ValueError):
    """A file that is not a PyTorch file, or a damaged or unreadable one; `why` says which."""

    def __init__(self, path: str, why: str):
        self.path, self.why = path, why
        super().__init__(f"{path}: {why}")


def deepspeed_types() -> tuple[type, ...]:
    """Every type besides tensors and plain values DeepSpeed writes into a checkpoint file: its
    parameter slice mappings, and the shape of a fused parameter's parts in a universal
    checkpoint's files."""
    from deepspeed.checkpoint.universal_checkpoint import SubparamShape
    from deepspeed.utils.tensor_fragment import fragment_address

    return fragment_address, SubparamShape


def allowed_for(path: str) -> tuple[type, ...]:
    """The types besides tensors and plain values a file (or, for a folder, any of its files) of
    this name may hold (module docstring)."""
    from deepspeed.checkpoint.universal_checkpoint import SubparamShape
    from deepspeed.utils.tensor_fragment import fragment_address

    if os.path.isdir(path):
        return deepspeed_types()
    if _FRAGMENT_FILES.match(os.path.basename(path)):
        return (fragment_address,)
    if os.path.basename(os.path.dirname(os.path.dirname(path))) == "zero":  # <universal>/zero/<param>/fp32.pt
        return (SubparamShape,)
    return ()


@contextlib.contextmanager
def allowing(types: tuple) -> Iterator[None]:
    """torch's weights-only allowlist (beside its built-in tensors and plain values) exactly `types`
    for the block: not what libraries registered for their own types (torch.distributed's DTensor
    and DeviceMesh, nested tensors), which no checkpoint here holds; afterwards exactly what it was
    (torch's own `safe_globals` removes on exit what an enclosing block had allowed too)."""
    before = torch.serialization.get_safe_globals()
    torch.serialization.clear_safe_globals()
    torch.serialization.add_safe_globals(list(types))
    try:
        yield
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(before)


def refused_global(message: str) -> str | None:
    """The global a weights-only load refused, as the pickle names it, from torch's message."""
    found = re.search(r"GLOBAL (\S+)", message)
    if found is None:
        return None
    name = found.group(1)[:200]
    return name if "." in name else f"builtins.{name}"  # torch drops the builtins. of e.g. eval


def load(path: str, *, allowed: tuple | None = None, mmap: bool = False, map_location=HOST):
    """`torch.load(weights_only=True)` of `path` with the allowlist of its name (or `allowed`);
    `mmap`: tensors are read when touched (a file in the legacy format is read whole). Raises
    UnsafeFile or UnreadableFile, never torch's advice to load the file unsafely."""
    if allowed is None:
        allowed = allowed_for(path)
    try:
        if mmap and not zipfile.is_zipfile(path):
            mmap = False  # torch memory-maps only its zip format
        with allowing(allowed), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's notes on pickle protocols, addressed to its own tracker
            return torch.load(path, map_location=map_location, mmap=mmap, weights_only=True)
    except OSError as e:
        raise UnreadableFile(path, f"cannot be read ({e.strerror or e})") from None
    except pickle.UnpicklingError as e:  # torch refused it, or it is not a pickle at all
        name = refused_global(str(e))
        if name is not None:
            raise UnsafeFile(path, name, allowed) from None
        raise UnreadableFile(path, "not a PyTorch file") from None
    except Exception as e:  # a truncated archive, an empty or foreign file
        empty = os.path.isfile(path) and os.path.getsize(path) == 0
        raise UnreadableFile(path, "an empty file" if empty else "a damaged or truncated PyTorch file"
                             if "zip archive" in str(e) else "not a PyTorch file") from None


def check_folder(folder: str) -> str | None:
    """The refusal (one line) of the first file under `folder` (links followed) that needs a type
    outside its allowlist, None when every PyTorch file loads weights-only. Every file is tried, not
    only `*.pt` ones (DeepSpeed's universal loader takes any name matching `(.+).pt`); memory-mapped,
    so only the pickles are read. A damaged or foreign file (manifest.json, latest, a text file) is
    not this check's business (the manifest's, or the load's)."""
    seen = set()
    for root, dirs, names in os.walk(folder, followlinks=True):
        real = os.path.realpath(root)
        if real in seen:  # a link back up the tree
            dirs[:] = []
            continue
        seen.add(real)
        dirs.sort()
        for name in sorted(names):
            try:
                load(os.path.join(root, name), mmap=True)
            except UnsafeFile as e:
                return str(e)
            except UnreadableFile:
                pass
    return None


class SafeCheckpointEngine(TorchCheckpointEngine):
    """DeepSpeed's checkpoint engine whose `load` is this module's: the model states, layer files and
    ZeRO shards DeepSpeed's `load_checkpoint` reads are weights-only with their allowlists."""

    def load(self, path: str, map_location=None):
        return load(path, map_location=HOST if map_location is None else map_location)


@contextlib.contextmanager
def forced(allowed: tuple = ()) -> Iterator[None]:
    """Every `torch.load` of this process weights-only during the block, whatever its caller asks
    (TORCH_FORCE_WEIGHTS_ONLY_LOAD), allowing `allowed` besides tensors and plain values."""
    saved = {key: os.environ.pop(key, None) for key in (FORCE, _FORCE_NOT)}
    os.environ[FORCE] = "1"
    try:
        with allowing(allowed):
            yield
    finally:
        for key, value in saved.items():
            os.environ.pop(key, None)
            if value is not None:
                os.environ[key] = value


def run_process(module: str, args: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m module args` in a process of its own whose every torch.load is weights-only
    (`run_module`); its output captured."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (_ROOT, env.get("PYTHONPATH"))))
    return subprocess.run([sys.executable, "-m", "runtime.safe_load", module, *args], capture_output=True,
                          text=True, check=False, env=env)


def run_module(module: str, args: list[str], allowed: tuple) -> None:
    """Run `module` as `python -m module args` in this process with every torch.load weights-only,
    allowing exactly `allowed` (the module is imported first, so that what its imports register is
    replaced too); worker processes it starts inherit both (the variable through the environment,
    the allowlist by fork; a worker started afresh allows no more than torch's own types, so it
    fails rather than loads more)."""
    importlib.import_module(module)
    del sys.modules[module]  # runpy runs it afresh as __main__; what it imported stays imported
    os.environ.pop(_FORCE_NOT, None)
    os.environ[FORCE] = "1"
    torch.serialization.clear_safe_globals()
    torch.serialization.add_safe_globals(list(allowed))
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit("usage: python -m runtime.safe_load MODULE [ARGS...]")
    run_module(sys.argv[1], sys.argv[2:], deepspeed_types())
