"""`python -m checkpoint.to_universal --input_folder TAG_DIR --output_folder OUT ...`: DeepSpeed's
universal checkpoint conversion (`deepspeed.checkpoint.ds_to_universal`, same arguments) for this
trainer's checkpoints, run by checkpoint/checkpoints.py `to_universal`.

Two things differ from running DeepSpeed's module directly:

* A checkpoint written before the stages declared how their tensor-parallel parameters are split
  (parallel/universal.py) carries no `universal_checkpoint_info`; DeepSpeed's
  `--inject_missing_state` would then treat every parameter as split along dimension 0, which
  resumes a row-parallel weight or a fused q/k/v projection wrongly at another tensor-parallel
  degree. The info is derived here from the checkpoint's own parameter names instead.
* The conversion's worker processes (DeepSpeed's ProcessPoolExecutor) die with this process, and
  this process with its parent (`PR_SET_PDEATHSIG`): a launch killed while it reshards leaves no
  process writing into a folder the next launch recreates.
"""
from __future__ import annotations

import concurrent.futures
import functools
import sys


def die_with_parent() -> None:
    """SIGKILL this process when its parent dies (Linux; elsewhere nothing)."""
    import ctypes
    import signal

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def checkpoint_info(ds_checkpoint) -> dict:
    """The checkpoint's own universal info, or the one its parameter names give (every stage's
    model states listed, tensor-parallel rank 0's shapes: the tied embedding gives the width)."""
    from deepspeed.checkpoint.constants import PARAM_SHAPES, TP_REPLICATED_PARAMETER_PATTERNS, UNIVERSAL_CHECKPOINT_INFO

    from parallel.universal import TIED_PREFIX, universal_info

    info = ds_checkpoint.get_checkpoint_info(UNIVERSAL_CHECKPOINT_INFO)
    if info and TP_REPLICATED_PARAMETER_PATTERNS in info:
        return info
    shapes: dict = {}
    for _, metadata in ds_checkpoint.model_state_metadata:
        shapes.update(metadata[PARAM_SHAPES])
    d_model = tuple(shapes[f"{TIED_PREFIX}.weight"])[1]
    return universal_info(shapes, d_model, ds_checkpoint.tp_degree)


def main(argv: list[str]) -> None:
    import deepspeed.checkpoint.ds_to_universal as converter
    from deepspeed.checkpoint.constants import UNIVERSAL_CHECKPOINT_INFO

    die_with_parent()

    def inject(ds_checkpoint) -> None:
        ds_checkpoint.global_state[UNIVERSAL_CHECKPOINT_INFO] = checkpoint_info(ds_checkpoint)

    converter._inject_missing_state = inject
    converter.ProcessPoolExecutor = functools.partial(concurrent.futures.ProcessPoolExecutor,
                                                      initializer=die_with_parent)
    sys.argv = ["ds_to_universal", *argv]
    converter.main(converter.parse_arguments())


if __name__ == "__main__":
    main(sys.argv[1:])
