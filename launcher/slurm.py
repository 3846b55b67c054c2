"""SLURM batch jobs for multi-node training: the sbatch script and the config it reads.

The script runs one rank per device as an `srun` task (runtime/distributed.py maps SLURM_PROCID,
SLURM_LOCALID and the step's task count to RANK, LOCAL_RANK and WORLD_SIZE), rendezvous on the
job's first node, and handles preemption: SLURM signals the batch shell `signal_before` seconds
before the time limit, the shell forwards the signal to srun, which passes it to every rank; the
trainers save a checkpoint together and exit, and the shell requeues the job, whose next start
resumes from that checkpoint (trainer/trainer.py).
"""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass

import yaml

from launcher.faults import REQUEUE
from runtime import accelerator, heartbeat
from schema.text import count
from trainer.config import RunConfig, to_dict
from trainer.run_dir import PREEMPTED_MARKER, STOPPED_MARKER

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass(kw_only=True)
class JobSpec:
    """What the sbatch script needs beyond the run config."""

    name: str
    """Job name (sbatch --job-name); also the prefix of the log files."""
    run_dir: str
    """Absolute run directory: data, checkpoints, logs. Must be on a file system every node sees."""
    config: str
    """Absolute path of the resolved config the job reads (written into run_dir/slurm/)."""
    nodes: int
    """Nodes of the job; with `max_nodes` above it, the least an elastic job starts on."""
    gpus_per_node: int
    """GPUs per node, one rank each; 0 means CPU nodes (gloo)."""
    tasks_per_node: int
    """Ranks per node (= gpus_per_node on GPU nodes)."""
    layout: str
    """pp × tp × dp, for the header comment."""
    max_nodes: int | None = None
    """An elastic job: SLURM may start it on nodes..max_nodes nodes, and each start chooses its
    layout (launcher/elastic.py). None or `nodes`: a fixed node count."""
    fixed: str | None = None
    """An elastic job's layout keys kept at the config's values (`--fixed`)."""
    gpu: str | None = None
    """An elastic job's GPU type, which the planner prices its layouts for."""
    cpus_per_task: int | None = None
    partition: str | None = None
    time: str | None = None
    account: str | None = None
    signal_before: int = 300
    """Seconds before the time limit at which SLURM sends SIGUSR1 (checkpoint, then requeue)."""
    max_fault_requeues: int = 3
    """Faults (a lost or hung rank or node) after which the job still requeues itself; one more stops it."""
    max_same_step_faults: int = 2
    """The job stops, not requeued, once the same step has failed this many times (launcher/faults.py)."""
    fault_grace: int = 45
    """Seconds srun may still run after a rank reported a fault, or after every rank's heartbeat
    stopped, before the script ends it (srun waits for a node that no longer answers until SLURM
    declares it DOWN: SlurmdTimeout, 300 s by default). Above SLURM's KillWait (30 s by default)."""
    stall_seconds: int = 60
    """No heartbeat from any rank for this long, with srun still running: the ranks are gone."""
    python: str = sys.executable
    root: str = ROOT
    command: str = ""
    """The command that generated the script, recorded in its header."""
    notes: tuple[str, ...] = ()
    """Lines for the header comment: tokens per step, where --cpus-per-task came from, a dry run."""


def tokens_per_step(cfg: RunConfig) -> tuple[int, str]:
    """Target tokens per optimizer step at most, data_parallel × train.micro_batches ×
    data.max_tokens, and that product written out."""
    p, t, d = cfg.parallel, cfg.train, cfg.data
    return (p.data_parallel * t.micro_batches * d.max_tokens,
            f"{p.data_parallel} × {t.micro_batches} × {d.max_tokens}")


def node_cpus(partition: str | None) -> tuple[int | None, str]:
    """CPUs per node of `partition` (SLURM's default partition when None) as sinfo reports them,
    the smallest where its nodes differ, and how that was read (None and why not, without an
    answer)."""
    sinfo = shutil.which("sinfo")
    if sinfo is None:
        return None, "sinfo is not on PATH"
    command = [sinfo, "--noheader", "--format=%P %c", *(["--partition", partition] if partition else [])]
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"sinfo did not answer ({e})"
    rows = [line.split() for line in proc.stdout.splitlines() if len(line.split()) == 2]
    if partition is None:  # the default partition is marked with a *
        rows = [row for row in rows if row[0].endswith("*")] or rows
    counts = [int(m.group()) for _, cpus in rows if (m := re.match(r"\d+", cpus))]
    if proc.returncode != 0 or not counts:
        return None, f"sinfo gave no CPU count ({(proc.stderr.strip() or 'no nodes').splitlines()[0]})"
    name = partition or rows[0][0].rstrip("*")
    spread = ", the smallest of its nodes" if len(set(counts)) > 1 else ""
    return min(counts), f"sinfo -p {name} -o %c{spread}"


def resolved_config_text(cfg: RunConfig, source: str, cluster: str | None) -> str:
    """The run config as the job will read it: every key explicit, the cluster layout applied."""
    values = json.loads(json.dumps(to_dict(cfg)))  # tuples → lists, for YAML
    values.pop("clusters", None)  # (its paths are absolute: load_config made them so)
    origin = f"{source}" + (f" with clusters.{cluster}" if cluster else "")
    tokens, product = tokens_per_step(cfg)
    header = (f"# Resolved from {origin} by ./run.sh slurm.\n"
              f"# Tokens per step: data_parallel × train.micro_batches × data.max_tokens = {product} = {tokens:,}.\n"
              "# The job reads this copy: editing the original does not change a running or requeued\n"
              "# job. Regenerate to change it.\n")
    return header + yaml.safe_dump(values, sort_keys=False)


def render_sbatch(spec: JobSpec) -> str:
    """The batch script, written to be read by whoever runs the cluster."""
    q = shlex.quote
    gpu = spec.gpus_per_node > 0
    elastic = (spec.max_nodes or spec.nodes) > spec.nodes
    node_range = f"{spec.nodes}-{spec.max_nodes}" if elastic else str(spec.nodes)
    nodes = f"{node_range} nodes" if elastic else count(spec.nodes, "node")
    ranks = (f"{spec.nodes * spec.tasks_per_node}-{spec.max_nodes * spec.tasks_per_node} ranks" if elastic
             else count(spec.nodes * spec.tasks_per_node, "rank"))
    logs = os.path.join(spec.run_dir, "slurm", "logs")
    options = [(f"--job-name={spec.name}", ""),
               (f"--nodes={node_range}", "any count in the range: each start chooses its layout" if elastic else "")]
    if elastic:  # with a task count SLURM (22.05) gives a node range its minimum; the steps set theirs
        options.append((f"--mincpus={spec.tasks_per_node * (spec.cpus_per_task or 1)}",
                        f"per node: {count(spec.tasks_per_node, 'rank')} × {count(spec.cpus_per_task or 1, 'CPU')}"))
    else:
        options.append((f"--ntasks-per-node={spec.tasks_per_node}", "one rank per GPU" if gpu else "ranks per node"))
    if gpu:
        options.append((f"--gpus-per-node={spec.gpus_per_node}", ""))
    if spec.cpus_per_task:
        options.append((f"--cpus-per-task={spec.cpus_per_task}", "CPUs per rank"))
    for flag, value in (("partition", spec.partition), ("account", spec.account), ("time", spec.time)):
        if value:
            options.append((f"--{flag}={value}", ""))
    options += [(f"--output={logs}/%x-%j.out", "one log per job id: stdout and stderr"),
                ("--open-mode=append", "a requeued job appends to its log"),
                ("--requeue", "may be requeued (after preemption, a fault, a node failure)"),
                (f"--signal=B:USR1@{spec.signal_before}",
                 f"{spec.signal_before} s before the time limit: checkpoint, requeue")]
    width = max(len(option) for option, _ in options) + 2
    sb = [f"#SBATCH {option:<{width}}# {note}" if note else f"#SBATCH {option}" for option, note in options]
    if gpu:
        backend = """# GPUs: NCCL. Ranks pick their GPU by LOCAL_RANK (= SLURM_LOCALID).
export DS_ACCELERATOR=""" + accelerator.GPU + """
# A lost rank fails the collectives (NCCL's watchdog, after train.collective_timeout_seconds)
# instead of hanging them; runtime/accelerator.py collective_fault_env says why these values.
""" + "\n".join(f"export {k}={v}" for k, v in accelerator.collective_fault_env(accelerator.GPU).items()) + """
export NCCL_DEBUG=WARN
# Site-specific, uncomment and set for this cluster's fabric:
# export NCCL_SOCKET_IFNAME=ib0            # interface for NCCL's bootstrap
# export NCCL_IB_HCA=mlx5                  # InfiniBand adapters to use
export OMP_NUM_THREADS=${SLURM_CPUS_PER_TASK:-1}"""
    else:
        backend = """# CPUs: gloo over TCP. Each rank computes with its task's CPUs.
export DS_ACCELERATOR=""" + accelerator.HOST + """
# export GLOO_SOCKET_IFNAME=eth0           # site-specific: the interface gloo should use
export OMP_NUM_THREADS=${SLURM_CPUS_PER_TASK:-1}"""
    # Since SLURM 22.05 srun no longer inherits --cpus-per-task from the job: pass it on.
    cpus = f" --cpus-per-task={spec.cpus_per_task}" if spec.cpus_per_task else ""
    choose = " --elastic" + (f" --fixed {q(spec.fixed)}" if spec.fixed else "") + (f" --gpu {q(spec.gpu)}" if spec.gpu else "")
    return f"""#!/bin/bash
# deepnet-trainer: {spec.name} on {nodes} × {count(spec.tasks_per_node, "rank")}
#   = {ranks} ({spec.layout}), {"NCCL on GPUs" if gpu else "gloo on CPUs"}
{"".join(f"# {note}{chr(10)}" for note in spec.notes)}# Generated by: {spec.command}
# Submit with:  sbatch {spec.run_dir}/slurm/job.sbatch
# Run directory (data, checkpoints, metrics, logs): {spec.run_dir}
{chr(10).join(sb)}
set -uo pipefail

ROOT={q(spec.root)}
PYTHON={q(spec.python)}
CONFIG={q(spec.config)}
RUN_DIR={q(spec.run_dir)}
cd "$ROOT"
export PYTHONPATH="$ROOT${{PYTHONPATH:+:$PYTHONPATH}}"
export PYTHONWARNINGS=ignore

# Rendezvous: rank 0 runs on the job's first node. The port is derived from the job id, so a
# requeued job reuses it and two jobs sharing a node do not collide.
export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000))
{backend}

echo "$(date -Is) job $SLURM_JOB_ID start ${{SLURM_RESTART_COUNT:-0}} on $SLURM_JOB_NODELIST," \\
     "master $MASTER_ADDR:$MASTER_PORT"

# Preemption: SLURM sends USR1 to this shell only (--signal=B:...). Remember it, and pass it to
# srun, which forwards it to every rank; the trainers finish the current step, save a checkpoint,
# write $RUN_DIR/{PREEMPTED_MARKER} and exit.
preempted=0
train_pid=""
on_preempt() {{
  preempted=1
  echo "$(date -Is) preemption signal: asking the ranks to checkpoint"
  if [ -n "$train_pid" ]; then kill -USR1 "$train_pid"; fi
}}
trap on_preempt USR1

# Faults: a rank or node lost or hung mid-run ends the training step (the surviving ranks name it:
# runtime/heartbeat.py) and the job requeues itself, resuming from the newest intact checkpoint;
# at most MAX_FAULT_REQUEUES times, and not again once the same step has failed
# MAX_SAME_STEP_FAULTS times. When SLURM itself ends the job for a node failure it requeues it
# (--requeue); the next start counts that attempt (launcher/faults.py, <run_dir>/slurm/faults.json).
MAX_FAULT_REQUEUES={spec.max_fault_requeues}
MAX_SAME_STEP_FAULTS={spec.max_same_step_faults}
FAULT_GRACE={spec.fault_grace}
STALL_SECONDS={spec.stall_seconds}
ATTEMPT=${{SLURM_RESTART_COUNT:-0}}
export {heartbeat.LAUNCH_ENV}="$SLURM_JOB_ID.$ATTEMPT"
HEARTBEATS="$RUN_DIR/{heartbeat.DIR}"
FAULT_REPORT="$HEARTBEATS/fault-${heartbeat.LAUNCH_ENV}.json"
faults() {{
  "$PYTHON" -m launcher.faults "$@" --job "$SLURM_JOB_ID" --attempt "$ATTEMPT" \\
    --max-requeues "$MAX_FAULT_REQUEUES" --max-same-step "$MAX_SAME_STEP_FAULTS"
}}
faults begin "$RUN_DIR" || exit 1

# 1. Data: tokenise and binarise once into the run directory (a no-op when it is up to date).
srun --nodes=1 --ntasks=1{cpus} \\
  "$PYTHON" -u -m launcher.cli prepare "$CONFIG" --run-dir "$RUN_DIR" --no-progress || exit 1

# 2. This start's layout{" for the nodes it got (the planner's best within memory)" if elastic else ""}, the
#    run's checks before a resume, and the newest checkpoint converted when it was written at another
#    layout (launcher/elastic.py); the ranks read $LAUNCH_CONFIG. A refusal ends the job.
NODES=${{SLURM_JOB_NUM_NODES:-{spec.nodes}}}
LAUNCH_CONFIG="$RUN_DIR/slurm/launch.yaml"
srun --nodes=1 --ntasks=1{cpus} \\
  "$PYTHON" -u -m launcher.elastic --config "$CONFIG" --run-dir "$RUN_DIR" --nodes "$NODES" \\
  --tasks-per-node {spec.tasks_per_node}{choose if elastic else ""} --out "$LAUNCH_CONFIG" || exit $?

# 3. Training: one task per rank; a checkpoint in $RUN_DIR/checkpoints is resumed.
rm -f "$RUN_DIR/{PREEMPTED_MARKER}" "$RUN_DIR/{STOPPED_MARKER}"
if [ "$preempted" = 0 ]; then
  # --kill-on-bad-exit: one failed rank ends the others at once (SIGTERM, SIGKILL after KillWait)
  # instead of leaving them blocked in a collective. (After a preemption checkpoint the ranks exit
  # with code 75 together; srun may report the last ones as terminated.)
  started=$(date +%s)
  srun --nodes={'"$NODES"' if elastic else spec.nodes} --ntasks-per-node={spec.tasks_per_node}{cpus} --kill-on-bad-exit=1 \\
    "$PYTHON" -u -m launcher.worker --config "$LAUNCH_CONFIG" --run-dir "$RUN_DIR" &
  train_pid=$!
  # srun also waits for the tasks of a node that no longer answers (power, network, slurmd lost)
  # until SLURM declares it DOWN (SlurmdTimeout). So: once a rank reported a fault, or no rank has
  # had a heartbeat for STALL_SECONDS, srun gets FAULT_GRACE more seconds, then is ended.
  fault_since=""
  while kill -0 "$train_pid" 2>/dev/null; do
    sleep 2 & wait $!  # (a trapped signal interrupts this wait, not srun)
    now=$(date +%s)
    if [ -z "$fault_since" ]; then
      if [ -e "$FAULT_REPORT" ]; then
        fault_since=$now
      elif [ -n "$(find "$HEARTBEATS" -name 'rank*.json' -newermt "@$started" 2>/dev/null | head -n 1)" ] &&
           [ -z "$(find "$HEARTBEATS" -name 'rank*.json' -newermt "@$((now - STALL_SECONDS))" | head -n 1)" ]; then
        echo "$(date -Is) no rank has had a heartbeat for $STALL_SECONDS s, but srun still runs"
        fault_since=$now
      fi
    elif [ $((now - fault_since)) -ge "$FAULT_GRACE" ]; then
      echo "$(date -Is) srun still running $FAULT_GRACE s after the ranks stopped (a node that no longer" \\
           "answers?): ending it"
      kill -KILL "$train_pid" 2>/dev/null
      fault_since=$((now + 3600))  # said once
    fi
  done 2>/dev/null  # (bash's own "Killed" line for srun is not needed)
  wait "$train_pid" 2>/dev/null; rc=$?
else
  rc=1
fi
faults end "$RUN_DIR" --rc "$rc" $([ "$preempted" = 1 ] && echo --preempted); verdict=$?

# 4. Stopped for a reason a requeue would meet again (no room for a checkpoint, a failed write, a
#    fault that recurs): the job ends with the ranks' exit code, also after a preemption signal.
if [ -f "$RUN_DIR/{STOPPED_MARKER}" ]; then
  echo "$(date -Is) training stopped and is not requeued: $(cat "$RUN_DIR/{STOPPED_MARKER}")"
  code=$("$PYTHON" -c 'import json, sys; print(json.load(open(sys.argv[1])).get("code", ""))' \\
         "$RUN_DIR/{STOPPED_MARKER}" 2>/dev/null)
  exit "${{code:-$rc}}"  # the ranks' code: srun may report the ones it killed instead
fi
# 5. Preempted: requeue this job (same id, same log); its next start resumes from the checkpoint.
#    Also when the signal came before the trainers could take it: they resume from the last one.
if [ -f "$RUN_DIR/{PREEMPTED_MARKER}" ] || {{ [ "$preempted" = 1 ] && [ "$rc" != 0 ]; }}; then
  if [ -f "$RUN_DIR/{PREEMPTED_MARKER}" ]; then
    mv "$RUN_DIR/{PREEMPTED_MARKER}" "{logs}/{PREEMPTED_MARKER}.$SLURM_JOB_ID.${{SLURM_RESTART_COUNT:-0}}"
  fi
  echo "$(date -Is) requeueing job $SLURM_JOB_ID"
  scontrol requeue "$SLURM_JOB_ID"
  exit 0
fi
# 6. A lost or hung rank (named above): requeue; the next start resumes from the newest intact
#    checkpoint, on the nodes SLURM gives it (a DOWN node is not among them).
if [ "$verdict" = {REQUEUE} ]; then
  echo "$(date -Is) requeueing job $SLURM_JOB_ID after a fault"
  scontrol requeue "$SLURM_JOB_ID"
  exit 0
fi
echo "$(date -Is) training ended with exit code $rc"
exit "$rc"
"""


def write_job(spec: JobSpec, config_text: str) -> str:
    """Write the resolved config and the script into <run_dir>/slurm/; return the script's path."""
    slurm_dir = os.path.join(spec.run_dir, "slurm")
    os.makedirs(os.path.join(slurm_dir, "logs"), exist_ok=True)  # sbatch does not create them
    with open(spec.config, "w", encoding="utf-8") as f:
        f.write(config_text)
    path = os.path.join(slurm_dir, "job.sbatch")
    with open(path, "w", encoding="utf-8") as f:
        f.write(render_sbatch(spec))
    os.chmod(path, 0o755)
    return path

