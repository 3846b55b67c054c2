"""The generated SLURM job script and what it relies on, without a cluster: every bundled config's
layouts load, the GPU script's options, refused layouts and flags, srun's task variables mapped to
torch's rank variables, and a signal reaching one rank stopping every rank. tests/test_slurm.py
runs the jobs on a real SLURM cluster.
"""
from __future__ import annotations

import glob
import json
import os
import subprocess

from schema.text import count
from trainer.config import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "configs", "slurm-tiny.yaml")


# ---- the generated script and the rank mapping (no cluster needed) -----------------------------

def generate(tmp_path, *flags: str) -> tuple[int, str, str]:
    from launcher.cli import main

    run_dir = str(tmp_path / "run")
    code = main(["slurm", *flags, "--run-dir", run_dir])
    script = os.path.join(run_dir, "slurm", "job.sbatch")
    return code, run_dir, open(script).read() if os.path.exists(script) else ""


def test_every_bundled_config_and_cluster_layout_loads():
    configs = sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml")))
    layouts = 0
    for path in configs:
        cfg = load_config(path)
        for name, layout in cfg.clusters.items():
            laid_out = load_config(path, cluster=name)
            assert laid_out.world_size == layout.nodes * layout.gpus_per_node
            layouts += 1
    assert layouts >= 9  # three paper-scale models × three clusters


def test_gpu_cluster_script_runs_one_rank_per_gpu_with_nccl_and_requeue(tmp_path):
    from tests.bad_inputs import good_corpus

    corpus = good_corpus(tmp_path)  # slurm checks the corpus before it writes the job
    code, run_dir, script = generate(tmp_path, os.path.join(ROOT, "configs", "deepnet-100-100-1024.yaml"),
                                     "--cluster", "a100-80gb-x64", "--time", "2-00:00:00",
                                     "--partition", "gpu", "--cpus-per-task", "12", "--set", f"data.corpus={corpus}")
    assert code == 0
    for line in ("#SBATCH --nodes=8", "#SBATCH --ntasks-per-node=8", "#SBATCH --gpus-per-node=8",
                 "#SBATCH --time=2-00:00:00", "#SBATCH --partition=gpu", "#SBATCH --requeue",
                 "#SBATCH --signal=B:USR1@300", f"#SBATCH --output={run_dir}/slurm/logs/%x-%j.out",
                 "export DS_ACCELERATOR=cuda", "export TORCH_NCCL_ASYNC_ERROR_HANDLING=1",
                 'scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1', 'scontrol requeue "$SLURM_JOB_ID"',
                 "srun --nodes=8 --ntasks-per-node=8 --cpus-per-task=12 --kill-on-bad-exit=1",
                 'rm -f "$RUN_DIR/preempted.json" "$RUN_DIR/stopped.json"',  # a stop that would recur: no requeue
                 'if [ -f "$RUN_DIR/stopped.json" ]; then', 'exit "${code:-$rc}"',
                 # faults: NCCL's asynchronous error handling, bounded requeues, srun bounded
                 "export TORCH_NCCL_DUMP_ON_TIMEOUT=0", "MAX_FAULT_REQUEUES=3", "MAX_SAME_STEP_FAULTS=2",
                 'export DEEPNET_LAUNCH_ID="$SLURM_JOB_ID.$ATTEMPT"', 'faults begin "$RUN_DIR" || exit 1',
                 'faults end "$RUN_DIR" --rc "$rc"', 'if [ "$verdict" = 10 ]; then', 'kill -KILL "$train_pid"'):
        assert line in script, line
    assert subprocess.run(["bash", "-n", os.path.join(run_dir, "slurm", "job.sbatch")]).returncode == 0
    job_cfg = load_config(os.path.join(run_dir, "slurm", "config.yaml"))  # the cluster's layout, resolved
    p = job_cfg.parallel
    assert (p.pipeline_stages, p.data_parallel, p.precision, job_cfg.train.micro_batches) == (2, 32, "bf16", 16)
    assert job_cfg.run_dir == run_dir and not job_cfg.clusters


def test_layout_that_does_not_match_the_nodes_is_refused_naming_the_flags(tmp_path, capsys):
    code, _, script = generate(tmp_path, CONFIG, "--nodes", "2", "--gpus-per-node", "4")
    assert code == 2 and script == ""
    err = capsys.readouterr().err
    assert "--nodes 2 × --gpus-per-node 4 = 8" in err and "= 2 ranks" in err
    code, _, _ = generate(tmp_path, CONFIG, "--nodes", "2")
    assert code == 2 and "--gpus-per-node" in capsys.readouterr().err
    code, _, _ = generate(tmp_path, CONFIG, "--cluster", "x", "--nodes", "2", "--gpus-per-node", "0")
    assert code == 2 and "no clusters: section" in capsys.readouterr().err


def test_elastic_job_script_chooses_its_layout_at_every_start(tmp_path, capsys):
    """--nodes MIN-MAX: the range to sbatch, a start step that chooses the layout for the nodes it
    got and writes the config the ranks read; every count of the range checked before the job is
    written (a count without a layout is refused in one line)."""
    code, run_dir, script = generate(tmp_path, CONFIG, "--nodes", "1-2", "--gpus-per-node", "0", "--fixed", "tp",
                                     "--cpus-per-task", "1", "--dry-run")
    assert code == 0, capsys.readouterr().err
    assert "--ntasks-per-node=1 " not in script.split("set -uo pipefail")[0]  # (SLURM would give 1 node)
    for line in ("#SBATCH --nodes=1-2", "#SBATCH --mincpus=1", 'NODES=${SLURM_JOB_NUM_NODES:-1}',
                 '"$PYTHON" -u -m launcher.elastic --config "$CONFIG" --run-dir "$RUN_DIR" --nodes "$NODES"',
                 '--tasks-per-node 1 --elastic --fixed tp --out "$LAUNCH_CONFIG" || exit $?',
                 'srun --nodes="$NODES" --ntasks-per-node=1 --cpus-per-task=1 --kill-on-bad-exit=1',
                 '"$PYTHON" -u -m launcher.worker --config "$LAUNCH_CONFIG" --run-dir "$RUN_DIR" &',
                 "# deepnet-trainer: slurm-tiny on 1-2 nodes × 1 rank", "chosen at each start; fixed: tp"):
        assert line in script, line
    assert subprocess.run(["bash", "-n", os.path.join(run_dir, "slurm", "job.sbatch")]).returncode == 0
    # the start step itself, without a cluster: 1 node → pp1, 2 nodes → the planner's pick of pp2 / dp… (dp 1: the
    # config's 1 micro-batch per step)
    from launcher.elastic import main as start

    launch = str(tmp_path / "launch.yaml")
    for nodes, layout in ((1, (1, 1, 1)), (2, (2, 1, 1))):
        assert start(["--config", os.path.join(run_dir, "slurm", "config.yaml"), "--run-dir", run_dir, "--nodes",
                      str(nodes), "--tasks-per-node", "1", "--elastic", "--out", launch]) == 0
        p = load_config(launch).parallel
        assert (p.pipeline_stages, p.tensor_parallel, p.data_parallel) == layout
        assert f"layout for {count(nodes, 'node')} × 1 rank: pp{layout[0]}·tp1·dp1, train.micro_batches 1 (1 " \
               "micro-batch per step, as the config)" in capsys.readouterr().out
    cases = [(["--nodes", "1-2", "--fixed", "pp"], "1 node × 1 rank: no pp × tp × dp layout of 1 rank fits this "
              "model and its 1 micro-batch per step (fixed: pipeline_stages=2): pp1·tp1·dp1 changes a fixed key"),
             (["--nodes", "2-1"], "'2-1': nodes must be >= 1, MIN <= MAX"),
             (["--nodes", "1-2", "--fixed", "xx"], "--fixed xx: 'xx' is not a layout key; use pp, tp, dp"),
             (["--nodes", "2", "--fixed", "tp"], "--fixed is for elastic jobs (--nodes MIN-MAX)")]
    for flags, words in cases:
        code, _, _ = generate(tmp_path / "refused", CONFIG, "--gpus-per-node", "0", "--dry-run", *flags)
        err = capsys.readouterr().err
        assert code == 2 and words in err and err.count("\n") == 1, (flags, err)
    code, _, _ = generate(tmp_path / "gpu", os.path.join(ROOT, "configs", "deepnet-100-100-1024.yaml"), "--nodes",
                          "8-16", "--gpus-per-node", "8", "--dry-run")
    assert code == 2 and "an elastic job on GPU nodes needs --gpu TYPE" in capsys.readouterr().err


def test_bad_job_flags_are_refused_naming_the_flag_and_write_no_script(tmp_path, capsys):
    from launcher.commands.slurm import slurm_seconds

    assert [slurm_seconds(t) for t in ("30", "1:30", "2:00:00", "1-12", "1-00:30", "2-00:00:05")] == \
        [1800, 90, 7200, 129600, 88200, 172805]
    assert slurm_seconds("UNLIMITED") == float("inf")
    cases = [(["--cpus-per-task=0"], "--cpus-per-task 0"), (["--cpus-per-task=-3"], "--cpus-per-task -3"),
             (["--tasks-per-node=0"], "--tasks-per-node 0"), (["--time", "forever"], "--time forever"),
             (["--time", "1:00"], "not longer than --signal-before 300"), (["--time", "1-2-3"], "--time 1-2-3")]
    for flags, words in cases:
        code, _, script = generate(tmp_path, CONFIG, "--nodes", "2", "--gpus-per-node", "0", *flags)
        err = capsys.readouterr().err
        assert code == 2 and script == "" and err.startswith("error: ") and words in err, (flags, err)
    assert not os.path.exists(os.path.join(tmp_path, "run", "slurm"))


def test_srun_task_variables_become_torch_rank_variables():
    from runtime.distributed import slurm_rank_env

    task = {"SLURM_STEP_ID": "0", "SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_STEP_NUM_TASKS": "8",
            "SLURM_NTASKS": "8", "SLURM_JOB_ID": "123456", "MASTER_ADDR": "gpu017"}
    assert slurm_rank_env(task) == {"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "MASTER_PORT": "23456"}
    assert slurm_rank_env({**task, "RANK": "0"}) == {}  # a launcher (deepspeed, torchrun) already set ranks
    batch_shell = {k: v for k, v in task.items() if k != "SLURM_STEP_ID"}
    assert slurm_rank_env(batch_shell) == {}  # not inside an srun step


def _agreement_rank(rank: int, port: int, out: str) -> None:
    import signal

    import torch.distributed as dist

    from runtime.distributed import exit_rank
    from trainer import signals
    from trainer.trainer import preemption_agreed

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    signals.install_rank_handlers(25.0)
    before = preemption_agreed()
    if rank == 1:  # the signal reaches one process only
        os.kill(os.getpid(), signal.SIGUSR1)
    after = preemption_agreed()
    with open(f"{out}.{rank}", "w") as f:
        json.dump([before, after], f)
    exit_rank(0)  # neither rank tears gloo down while the other still uses it (it aborts)


def test_preemption_signal_to_one_rank_stops_every_rank(tmp_path):
    import torch.multiprocessing as mp

    from runtime.distributed import free_port

    out = str(tmp_path / "agreed")
    mp.spawn(_agreement_rank, args=(free_port(), out), nprocs=2)
    assert [json.load(open(f"{out}.{rank}")) for rank in (0, 1)] == [[False, True], [False, True]]


# ---- the real cluster --------------------------------------------------------------------------


def test_a_stopped_runs_relaunch_is_decided_before_the_job_is_written(tmp_path, capsys):
    """A run stopped at step 47 of the 60 it was launched with: `./run.sh slurm` asking for 40 is
    refused before anything is written, with `./run.sh train`'s line (exit 2); asking for 47 writes
    the job and notes that it ends the run there (its ranks record it finished)."""
    from checkpoint import manifest
    from trainer.config import to_dict

    run_dir = tmp_path / "run"
    (run_dir / "checkpoints" / "step47").mkdir(parents=True)
    (run_dir / "checkpoints" / "step47" / "weights.pt").write_bytes(b"w" * 64)
    saved = to_dict(load_config(CONFIG, {"run_dir": str(run_dir)}))
    saved["train"]["max_steps"] = 60
    manifest.commit(str(run_dir / "checkpoints"), "step47", 47, extra={"config": saved})  # as the trainer's do
    (run_dir / "config.json").write_text(json.dumps(saved))
    flags = (CONFIG, "--nodes", "2", "--gpus-per-node", "0", "--cpus-per-task", "1")
    code, _, script = generate(tmp_path, *flags, "--set", "train.max_steps=40")
    assert code == 2 and script == "" and not (run_dir / "slurm").exists()
    assert capsys.readouterr().err == (
        f"error: {run_dir} is not finished: it stopped at step 47 of the train.max_steps=60 it was last launched with "
        "(its config.json), and this launch's train.max_steps=40 is below step 47. To continue it: --set "
        "train.max_steps=60 (or more); to end it at step 47: --set train.max_steps=47\n")
    code, _, script = generate(tmp_path, *flags, "--set", "train.max_steps=47")
    assert code == 0 and "launcher.worker" in script
    assert (f"note: {run_dir} stopped at step 47 of the train.max_steps=60 it was launched with; this launch's "
            "train.max_steps=47 ends it there (recorded as finished)\n") in capsys.readouterr().err
