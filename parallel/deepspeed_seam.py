"""The seam between this project and DeepSpeed: every DeepSpeed name the project overrides, replaces
or reaches into (its private methods and attributes), with the source it was reviewed against.

The project subclasses DeepSpeed's pipeline engine, module, schedule and bf16 optimizer
(parallel/engine.py, parallel/schedule_engine.py, parallel/pipeline.py, parallel/optimizer.py) and
reads or replaces a few of its internals elsewhere. None of that is DeepSpeed's public API: an
upgrade can change any of it without notice. So each name is listed here with a digest of the
installed source it was written against (DeepSpeed `VERSION`); tests/test_deepspeed_seam.py fails,
naming the method, when the installed DeepSpeed's source of any of them differs, and when the code
uses a DeepSpeed name this list lacks. An upgrade is then a decision: read what changed, adapt
the project, and refresh the digests (`python -m parallel.deepspeed_seam` prints what differs and
the table).

A digest covers a method's or function's source; for an attribute (one DeepSpeed sets on its
objects, or a module global), the source lines of DeepSpeed's module that mention it.
"""
from __future__ import annotations

import hashlib
import importlib
import inspect
import re
from dataclasses import dataclass

VERSION = "0.19.8"
"""The DeepSpeed the seam was reviewed against (requirements.txt pins it)."""


@dataclass(frozen=True)
class Seam:
    name: str
    """`module:Qualified.name` in DeepSpeed."""
    use: str
    """What the project does with it, and where."""
    digest: str
    """sha256 (first 16 hex digits) of the reviewed source: `digest(name)` at review."""
    scanned: bool = True
    """The test's scan of the code finds this use (False: a use it cannot see, e.g. a module run by
    name)."""


def resolve(name: str):
    """(module, the object or None for an attribute DeepSpeed sets at run time, the last part)."""
    module_name, _, qualified = name.partition(":")
    module = importlib.import_module(module_name)
    obj = module
    parts = qualified.split(".")
    for part in parts:
        obj = vars(obj).get(part) if hasattr(obj, "__dict__") else None
        if obj is None:
            break
    return module, obj, parts[-1]


def source(name: str) -> str:
    """The installed source a digest covers (see the module docstring)."""
    module, obj, last = resolve(name)
    if inspect.isfunction(obj) or inspect.ismethod(obj):
        return inspect.getsource(obj)
    if isinstance(obj, (staticmethod, classmethod)):
        return inspect.getsource(obj.__func__)
    if isinstance(obj, property):
        return inspect.getsource(obj.fget)
    pattern = re.compile(rf"\b{re.escape(last)}\b")
    return "".join(line for line in inspect.getsource(module).splitlines(keepends=True) if pattern.search(line))


def digest(name: str) -> str:
    return hashlib.sha256(source(name).encode()).hexdigest()[:16]


SEAMS: tuple[Seam, ...] = (
    Seam('deepspeed.checkpoint.ds_to_universal:ProcessPoolExecutor',
         'replaced by checkpoint.to_universal (workers that die with the conversion)',
         '25ce32447d100341'),
    Seam('deepspeed.checkpoint.ds_to_universal:_inject_missing_state',
         "replaced by checkpoint.to_universal (the stages' universal info for a checkpoint that lacks it)",
         '73b19730671e65b0'),
    Seam('deepspeed.checkpoint.ds_to_universal:main',
         "run under runtime/safe_load.py's weights-only wrapper by checkpoint/checkpoints.py reshard (its "
         "loads must be torch.load calls)",
         '24d330b69ba1d510', scanned=False),
    Seam('deepspeed.ops:__compatible_ops__',
         'replaced by runtime.distributed',
         '1423ec57f759d635'),
    Seam('deepspeed.runtime.bf16_optimizer:BF16_Optimizer._lazy_init_hp_params_optimizer_state',
         'used by parallel.optimizer',
         '756e7b78c340beef'),
    Seam('deepspeed.runtime.bf16_optimizer:BF16_Optimizer._link_all_hp_params',
         'used by parallel.optimizer',
         '2b94de27d517c1b4'),
    Seam('deepspeed.runtime.bf16_optimizer:BF16_Optimizer.backward_prologue',
         'overridden by parallel.optimizer.FlatOptimizer',
         '411f078ab35b2557'),
    Seam('deepspeed.runtime.bf16_optimizer:BF16_Optimizer.clear_hp_grads',
         'overridden by parallel.optimizer.FlatOptimizer',
         '82cb16a0c5b97d8e'),
    Seam('deepspeed.runtime.bf16_optimizer:BF16_Optimizer.clear_lp_grads',
         'overridden by parallel.optimizer.FlatOptimizer',
         '455d9b064085c761'),
    Seam('deepspeed.runtime.bf16_optimizer:BF16_Optimizer.get_grads_for_norm',
         'overridden by parallel.optimizer.FlatOptimizer',
         '81ed7f0b119f7ad8'),
    Seam('deepspeed.runtime.bf16_optimizer:BF16_Optimizer.load_state_dict',
         'overridden by parallel.optimizer.FlatOptimizer',
         '36b743b7c8d04a27'),
    Seam('deepspeed.runtime.bf16_optimizer:BF16_Optimizer.state_dict',
         'overridden by parallel.optimizer.FlatOptimizer',
         'f03ab7b09f6dd8f6'),
    Seam('deepspeed.runtime.bf16_optimizer:BF16_Optimizer.step',
         'overridden by parallel.optimizer.FlatOptimizer',
         '9b21d4a28f8714d9'),
    Seam('deepspeed.runtime.bf16_optimizer:BF16_Optimizer.update_hp_grads',
         'overridden by parallel.optimizer.FlatOptimizer',
         'e36698422d4d5d5d'),
    Seam('deepspeed.runtime.bf16_optimizer:BF16_Optimizer.update_lp_params',
         'overridden by parallel.optimizer.FlatOptimizer',
         '128911db918ae80c'),
    Seam('deepspeed.runtime.bf16_optimizer:BF16_Optimizer.zero_grad',
         'overridden by parallel.optimizer.FlatOptimizer',
         'd071d3bc77f25419'),
    Seam('deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine:TorchCheckpointEngine.load',
         'overridden by runtime.safe_load.SafeCheckpointEngine',
         '634b7e06db58550c'),
    Seam('deepspeed.runtime.engine:DeepSpeedEngine._check_for_duplicates',
         'used by parallel.engine',
         '8966d805664ffdde'),
    Seam('deepspeed.runtime.engine:DeepSpeedEngine._config',
         'used by parallel.engine',
         '04059ea96ca43411'),
    Seam('deepspeed.runtime.engine:DeepSpeedEngine._configure_checkpointing',
         'overridden by parallel.engine.TrainerEngine',
         '98e9abf5e50b1dce'),
    Seam('deepspeed.runtime.engine:DeepSpeedEngine._configure_optimizer',
         'overridden by parallel.engine.TrainerEngine',
         'dd82a70f2f92fe12'),
    Seam('deepspeed.runtime.engine:DeepSpeedEngine._configure_python_gc',
         'used by parallel.engine',
         '8e536ba269eb3dd9'),
    Seam('deepspeed.runtime.engine:DeepSpeedEngine._get_all_zero_checkpoint_names',
         'overridden by parallel.engine.TrainerEngine',
         '039f75184814ff2c'),
    Seam('deepspeed.runtime.engine:DeepSpeedEngine._get_all_zero_checkpoint_state_dicts',
         'used by parallel.engine',
         '6eae1e15f058a37e'),
    Seam('deepspeed.runtime.engine:DeepSpeedEngine._get_all_zero_checkpoints',
         'overridden by parallel.engine.TrainerEngine',
         '14f40e45e7772375'),
    Seam('deepspeed.runtime.engine:DeepSpeedEngine._global_grad_norm',
         'used by parallel.optimizer',
         'face84e6d731bf65'),
    Seam('deepspeed.runtime.engine:DeepSpeedEngine.clip_fp32_gradients',
         'overridden by parallel.engine.TrainerEngine',
         'c3ad53cbce68a72f'),
    Seam('deepspeed.runtime.engine:DeepSpeedEngine.zero_grad',
         'overridden by parallel.engine.TrainerEngine',
         '3fae900220129021'),
    Seam('deepspeed.runtime.pipe.engine:PipelineEngine._INSTRUCTION_MAP',
         'overridden by parallel.pipe_io.MessageIO',
         'd4a70b426a84325b'),
    Seam('deepspeed.runtime.pipe.engine:PipelineEngine._aggregate_total_loss',
         'overridden by parallel.engine.TrainerEngine',
         '562a551f98754b28'),
    Seam('deepspeed.runtime.pipe.engine:PipelineEngine._bf16_reduce_grads',
         'overridden by parallel.engine.TrainerEngine',
         '9b1ca8cb866b533e'),
    Seam('deepspeed.runtime.pipe.engine:PipelineEngine._exec_backward_pass',
         'overridden by parallel.schedule_engine.ScheduleEngine',
         'ae2eeff56b84d1e4'),
    Seam('deepspeed.runtime.pipe.engine:PipelineEngine._exec_forward_pass',
         'overridden by parallel.schedule_engine.ScheduleEngine',
         'cf4dfb0f5996528b'),
    Seam('deepspeed.runtime.pipe.engine:PipelineEngine._exec_load_micro_batch',
         'overridden by parallel.pipe_io.MessageIO',
         '2243e24e1b7f1425'),
    Seam('deepspeed.runtime.pipe.engine:PipelineEngine._exec_recv_activations',
         'overridden by parallel.pipe_io.MessageIO',
         '04213b4788a27299'),
    Seam('deepspeed.runtime.pipe.engine:PipelineEngine._exec_recv_grads',
         'overridden by parallel.schedule_engine.ScheduleEngine',
         'b0c95dcc5b8114f3'),
    Seam('deepspeed.runtime.pipe.engine:PipelineEngine._exec_reduce_tied_grads',
         'overridden by parallel.schedule_engine.ScheduleEngine',
         '00d7e6e1e18d8b62'),
    Seam('deepspeed.runtime.pipe.engine:PipelineEngine._exec_send_activations',
         'overridden by parallel.pipe_io.MessageIO',
         'c2127e600a547683'),
    Seam('deepspeed.runtime.pipe.engine:PipelineEngine._exec_send_grads',
         'overridden by parallel.schedule_engine.ScheduleEngine',
         'fc5d06a5dddd0d22'),
    Seam('deepspeed.runtime.pipe.engine:PipelineEngine._next_batch',
         'used by parallel.pipe_io',
         '1361d9be9ee39dbf'),
    Seam('deepspeed.runtime.pipe.engine:PipelineEngine._train_schedule',
         'overridden by parallel.schedule_engine.ScheduleEngine',
         '8423c0c94dd23883'),
    Seam('deepspeed.runtime.pipe.engine:PipelineEngine.eval_batch',
         'overridden by parallel.pipe_io.MessageIO',
         '439640583d6943cf'),
    Seam('deepspeed.runtime.pipe.engine:PipelineEngine.train_batch',
         'overridden by parallel.engine.TrainerEngine',
         '8be6f9d1eebf30c1'),
    Seam('deepspeed.runtime.pipe.module:PipelineModule._local_start',
         'used by parallel.pipeline',
         '3c76520a9627ff70'),
    Seam('deepspeed.runtime.pipe.module:PipelineModule._local_stop',
         'used by parallel.pipeline',
         'ae30c5fca652b156'),
    Seam('deepspeed.runtime.pipe.module:PipelineModule._partition_layers',
         'overridden by parallel.pipeline.TranslationPipe',
         '7289164616d3e075'),
    Seam('deepspeed.runtime.pipe.module:PipelineModule._set_bounds',
         'used by parallel.pipeline',
         'fb08a3bd6a5fd1ce'),
    Seam('deepspeed.runtime.pipe.module:PipelineModule._topo',
         'used by parallel.pipeline',
         'b23e7309f76f83b2'),
    Seam('deepspeed.runtime.pipe.module:PipelineModule.forward',
         'overridden by parallel.pipeline.TranslationPipe',
         '14236ae76fbcecb8'),
    Seam('deepspeed.runtime.pipe.p2p:send',
         'replaced by parallel.schedule_engine',
         'a28ede4b78797592'),
    Seam('deepspeed.runtime.pipe.schedule:PipeSchedule.num_pipe_buffers',
         'overridden by parallel.pipe_schedule.OrderSchedule',
         '31c216b524f87f94'),
    Seam('deepspeed.runtime.pipe.schedule:PipeSchedule.steps',
         'overridden by parallel.pipe_schedule.OrderSchedule',
         'd4f5ea91fe731250'),
)
"""Every DeepSpeed name the project relies on, sorted; tests/test_deepspeed_seam.py finds the ones
its scan of the code can see (overrides, private names, replaced module attributes) and requires
them here; the others (`scanned=False`) are listed by hand."""


def drifted() -> list[str]:
    """One line per listed name whose installed source differs from the reviewed one."""
    out = []
    for seam in SEAMS:
        try:
            now = digest(seam.name)
        except (ImportError, OSError, TypeError) as e:
            out.append(f"{seam.name}: not found in the installed DeepSpeed ({type(e).__name__}); {seam.use}")
            continue
        if now != seam.digest:
            out.append(f"{seam.name}: its source differs from the one reviewed for DeepSpeed {VERSION} "
                       f"({seam.digest} → {now}); {seam.use}")
    return out


def table(seams: list[Seam]) -> str:
    """SEAMS entries with the installed digests, as source (to paste after a review)."""
    return "\n".join(f"    Seam({s.name!r},\n         {s.use!r},\n         {digest(s.name)!r}"
                     f"{'' if s.scanned else ', scanned=False'})," for s in sorted(seams, key=lambda s: s.name))


if __name__ == "__main__":  # review an upgrade: what differs, then the table with the installed digests
    print("\n".join(drifted()) or f"every listed source is the one reviewed for DeepSpeed {VERSION}")
    print(table(list(SEAMS)))
