"""The SLURM job's account of its faults: which attempt lost which rank at which step, whether to
requeue, and when to stop because a fault recurs. Run by the job script (launcher/slurm.py) around
its training step:

    python -m launcher.faults begin RUN_DIR --job J --attempt N [limits]   before training
    python -m launcher.faults end RUN_DIR --job J --attempt N --rc RC [--preempted] [limits]

A fault is an attempt whose ranks ended with a failure that is neither a preemption nor a stop the
ranks agreed on (run_dir/stopped.json). Two ways an attempt can end with one:

- Its ranks end (a rank died or hung; the survivors named it: runtime/heartbeat.py) and the job
  script goes on: `end` records the fault and answers "requeue" (exit 10), and the script runs
  `scontrol requeue`. SLURM itself does not requeue a job whose step merely failed.
- SLURM ends the whole job (a node set DOWN, or the batch node lost): the script is killed with it,
  and SLURM requeues the job itself (`--requeue`, JobRequeue). The next attempt's `begin` finds the
  attempt that never reached `end` and records its fault then, from the report a survivor left or,
  failing that, from the heartbeats (`post_mortem`).

Either way the job stops instead of requeueing (exit 1, stopped.json, one line saying why) once the
same step has failed `--max-same-step` times (a fault that recurs there is the run's: its data,
model or code, not a node), or after more than `--max-requeues` faults in this job. Counts are per
SLURM job id: resubmitting starts them afresh. The record is `<run_dir>/slurm/faults.json`.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

from runtime import heartbeat
from schema.text import count
from trainer.run_dir import record_ending

REQUEUE = 10  # `end`'s exit status when the job should requeue itself
STATE = "faults.json"


def _now() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


def say(message: str) -> None:
    print(f"{_now()} {message}", flush=True)


def _load(path: str, job: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            state = json.load(f)
        if state.get("job") == job:
            return state
    except (OSError, ValueError):
        pass
    return {"job": job, "attempts": {}, "faults": []}


def _save(path: str, state: dict) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(state, f, indent=1)
    os.replace(tmp, path)


def _reported(run_dir: str, launch: str) -> dict | None:
    """The fault report a survivor of `launch` claimed (runtime/heartbeat.py claim), if any."""
    try:
        with open(heartbeat.fault_path(run_dir, launch), encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _finding(run_dir: str, launch: str) -> tuple[dict | None, bool]:
    """(what is known of `launch`'s fault, whether a rank already printed it)."""
    report = _reported(run_dir, launch)
    if report:
        return report, True
    found = heartbeat.post_mortem(run_dir, launch)
    return (found.to_dict() if found else None), False


def _newest_checkpoint(run_dir: str) -> str:
    from checkpoint import manifest

    newest = manifest.newest_committed(os.path.join(run_dir, "checkpoints"))
    return f"the newest intact checkpoint ({newest})" if newest else "the start (no checkpoint yet)"


def _where(fault: dict) -> str:
    return fault.get("where") or ("at start-up" if fault.get("step") is None else f"after step {fault['step']}")


def _verdict(state: dict, args) -> str | None:
    """Why the job must stop instead of requeueing after its newest fault, or None."""
    faults = state["faults"]
    last = faults[-1]
    same = [f for f in faults if f.get("step") == last.get("step")]
    if len(same) >= args.max_same_step:
        attempts = ", ".join(str(f["attempt"]) for f in same)
        return (f"the same step failed {count(len(same), 'time')} in job {state['job']} (attempts {attempts}; "
                f"{_where(last)}): a fault that recurs at one step is the run's (its data, model or code), "
                f"not a lost node, so the job is not requeued (MAX_SAME_STEP_FAULTS={args.max_same_step})")
    if len(faults) > args.max_requeues:
        return (f"{len(faults)} faults in job {state['job']}, more than MAX_FAULT_REQUEUES={args.max_requeues}: "
                "not requeued again")
    return None


def _stop(run_dir: str, why: str) -> int:
    from trainer.run_dir import record_stop

    message = (f"error: {why}. Resubmitting the job resumes from {_newest_checkpoint(run_dir)} with the counts "
               "afresh")
    say(message)
    record_stop(run_dir, message, 1)
    return 1


def begin(args) -> int:
    """Account for earlier attempts of this job that SLURM ended (no `end`): node failures."""
    path = os.path.join(args.run_dir, "slurm", STATE)
    state = _load(path, args.job)
    stop = None
    for attempt, record in sorted(state["attempts"].items(), key=lambda kv: int(kv[0])):
        if "end" in record or int(attempt) >= args.attempt:
            continue
        launch = f"{args.job}.{attempt}"
        found, _ = _finding(args.run_dir, launch)
        what = found["line"] if found else "no rank left a heartbeat"
        record.update(end=time.time(), how="ended by SLURM")
        state["faults"].append({**(found or {"step": None}), "attempt": int(attempt), "line": what,
                                "by": "SLURM (node failure)"})
        say(f"attempt {attempt} of job {args.job} (on {record.get('nodes', '?')}) was ended by SLURM, which requeued "
            f"the job (a node failure): {what}")
        stop = stop or _verdict(state, args)
    state["attempts"][str(args.attempt)] = {"start": time.time(), "nodes": os.environ.get("SLURM_JOB_NODELIST", "")}
    _save(path, state)
    return _stop(args.run_dir, stop) if stop else 0


def end(args) -> int:
    """Close this attempt; for a fault, record it and answer requeue (REQUEUE) or stop (1)."""
    path = os.path.join(args.run_dir, "slurm", STATE)
    state = _load(path, args.job)
    record = state["attempts"].setdefault(str(args.attempt), {})
    record.update(end=time.time(), rc=args.rc)
    markers = [os.path.exists(os.path.join(args.run_dir, name)) for name in ("stopped.json", "preempted.json")]
    if args.rc == 0 or args.preempted or any(markers):
        _save(path, state)
        return 0
    launch = f"{args.job}.{args.attempt}"
    found, printed = _finding(args.run_dir, launch)
    line = found["line"] if found else f"training ended with exit code {args.rc}; no rank named a lost one"
    state["faults"].append({**(found or {"step": None}), "attempt": args.attempt, "line": line, "rc": args.rc})
    _save(path, state)
    reason = found["line"] if found else "the training step failed; no rank named a lost one"  # the end line adds the code
    record_ending(args.run_dir, "failed", reason, args.rc)  # summary.json and train.log: the ranks could not
    if not printed:  # a survivor printed it already, else it is said here (e.g. NCCL ended the survivors)
        say(f"error: {line}")
    why = _verdict(state, args)
    if why:
        return _stop(args.run_dir, why)
    say(f"fault {len(state['faults'])} of job {args.job} (at most {args.max_requeues} requeued): requeueing; the next "
        f"attempt resumes from {_newest_checkpoint(args.run_dir)}")
    return REQUEUE


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=("begin", "end"))
    parser.add_argument("run_dir")
    parser.add_argument("--job", required=True, help="SLURM_JOB_ID")
    parser.add_argument("--attempt", type=int, required=True, help="SLURM_RESTART_COUNT (0 for the first start)")
    parser.add_argument("--rc", type=int, default=0, help="end: the training step's exit code")
    parser.add_argument("--preempted", action="store_true", help="end: the preemption signal came")
    parser.add_argument("--max-requeues", type=int, default=3, help="faults requeued per job (default 3)")
    parser.add_argument("--max-same-step", type=int, default=2,
                        help="stop once the same step failed this many times (default 2)")
    args = parser.parse_args(argv)
    os.makedirs(os.path.join(args.run_dir, "slurm"), exist_ok=True)
    return begin(args) if args.action == "begin" else end(args)


if __name__ == "__main__":
    sys.exit(main())
