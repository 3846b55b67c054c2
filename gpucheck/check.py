"""The GPU check: every part under a hard time limit inside one budget, each result kept as it comes.

    gpucheck/gpu_check.sh OUT [--only a,b] [--skip a,b] [--budget S]   (the carried wheels first)
    ./run.sh bench gpu-check OUT [--rehearse] [--only a,b] [--skip a,b] [--budget S] [--scale X]
    python -m gpucheck.check OUT --merge A B                                 (a run and its rerun)

Each part runs in a process session of its own (docs/gpu-check.md says how to run and read it).

Parts, in the order of what matters most when time runs out (PARTS):
  versions  python, torch, deepspeed, GPU, the image's packages, a bf16 matmul probe (versions.txt)
  layers    the first number: compiled bf16 d = 1024 stage layers (bench/gpu.py layers-d1024) at
            4k target tokens per micro-batch, then 8k and 2k: MFU, GPU busy, kernels, syncs, compile
  syncs     host syncs per micro-batch and per step of the real Trainer at pp = 1 on this device
            (bf16, eager layers: `layers` counts the compiled ones; the sync debug mode and the
            counting rule; bench/ops_syncs.py); the rehearsal counts the engine's operations too
  eager     the layers of `layers`, eager (what compiling gains, how host-bound eager is)
  shapes    the last stage at 128k pieces and 6L-6L d = 512, compiled, then eager
  costs     F, B, W per layer kind at d = 1024, eager then compiled (bench/zb_costs.py; each mode
            enters costs.json once every kind has it)
  replay    1F1B and ZB-H1 replayed on those costs at pp = 2, 4, 8, 16 (bench/zb_replay.py: on the
            compiled costs where measured)
  ops       ./run.sh bench ops' layer counts at d = 1024 in bf16: kernel operations per layer kind
            eager and compiled, graph breaks, graphs per kind over varying shapes, logit cost
  pp2       host syncs at pp = 2: two ranks; on a machine with one GPU, two CPU ranks (saying so);
            then a traced step, whose timeline comes back as trace.json (`syncs` traces one at pp = 1
            on the GPU: device events, its numbers in results.jsonl)
  tests     ./run.sh test-gpu

Limits: each part runs as `timeout -k GRACE LIMIT …` in a process session of its own; a part still
alive GRACE seconds after SIGTERM (a Trainer ignores the first for up to 25 s) is killed, and
so is anything it started (its process group, and every process carrying its marker in its
environment). A part starts only while the budget (--budget, 7 minutes on a GPU) leaves it time,
and gets no more than what is left; the rest are cut, and summary.md says which and gives the
command that runs just those. --rehearse runs every part on this machine's CPU at tiny shapes, the
limits scaled by --scale (default 1 + the load per core).

OUT gets at most 8 files (what a device run hands back): results.jsonl (every measurement, one JSON
line each, appended as it is made: bench/gpu_results.py), summary.md (rewritten after every part;
the replay's table is a section of it, kept in results.jsonl), versions.txt, train.json (the
planner's file, docs/bench/gpu-<type>/train.json), ops.json, costs.json (planner/zb.py's),
trace.json (the pipelined part's timeline: Chrome trace events, for ui.perfetto.dev), logs.txt (each
part's last lines). Scratch goes to a temporary folder outside OUT.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid

from bench import gpu_results as results
from runtime.accelerator import HOST
from schema.text import count

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MADE = ("summary.md", "versions.txt", "train.json", "ops.json", "costs.json", "trace.json")
"""The files a check writes into OUT besides results.jsonl and logs.txt (which gpu_check.sh's wheel
install starts, and the check continues)."""
GRACE = 5
"""Seconds between a part's SIGTERM and its SIGKILL."""
RESERVE = 10
"""Seconds of the budget kept for the last summary."""
MIN_START = 15
"""A part starts only with at least this many seconds of the budget left."""


@dataclasses.dataclass(frozen=True)
class Part:
    name: str
    gpu: tuple[str, ...]
    """The command on a GPU ({py}: the python, {work}: scratch, {jsonl}: OUT/results.jsonl)."""
    cpu: tuple[str, ...]
    """The same at tiny shapes on the CPU (the rehearsal)."""
    limit: int
    """Seconds on an H100."""
    cpu_limit: int
    """Seconds on a 2-core CPU (multiplied by --scale)."""
    stall: tuple[str, ...] = ()
    """Arguments that make it stall after its first result, ignoring SIGTERM (--stall, the test)."""


GPU_TRAIN = ("{py}", "-m", "bench.gpu", "--precision", "bf16", "--steps", "5", "--warmup", "2",
             "--tokens", "4096,8192,2048", "--out", "{work}/train", "--jsonl", "{jsonl}")
CPU_TRAIN = ("{py}", "-m", "bench.gpu", "--precision", "fp32", "--steps", "1", "--warmup", "1",
             "--tokens", "256", "--out", "{work}/train", "--jsonl", "{jsonl}")
SMALL_DATA = ("--set", "data.languages=[de]", "--set", "data.vocab_size=600", "--set", "data.max_tokens=256",
              "--set", "train.micro_batches=2")
TINY = ("--set", "model.encoder_layers=2", "--set", "model.decoder_layers=2", "--set", "model.d_model=32",
        "--set", "model.heads=4", "--set", "model.ffn_dim=64", *SMALL_DATA)
OPS = ("{py}", "-m", "bench.ops", "--out", "{work}/ops", "--jsonl", "{jsonl}")
STALL = ("--stall-after", "1")
PARTS = [
    Part("versions", ("{py}", "-m", "gpucheck.check", "--versions", "{out}/versions.txt"),
         ("{py}", "-m", "gpucheck.check", "--versions", "{out}/versions.txt"), 45, 30),
    Part("layers", (*GPU_TRAIN, "--worker", "layers-d1024:compiled"), (*CPU_TRAIN, "--worker", "tiny:compiled"),
         170, 90, STALL),
    # the real Trainer's step (data, pinned copies, guard, logs) on a small corpus, its layers eager:
    # `layers` counts the compiled layers' step; compiling the default model here would cost a minute
    Part("syncs", (*OPS, *SMALL_DATA, "--skip", "layers,compiled,engine", "--pp", "1",
                   "--set", "parallel.precision=bf16", "--set", "train.compile=false"),
         (*OPS, *TINY, "--skip", "layers,compiled", "--pp", "1"), 90, 60),
    Part("eager", (*GPU_TRAIN, "--worker", "layers-d1024:eager"), (*CPU_TRAIN, "--worker", "tiny:eager"), 60, 30,
         STALL),
    Part("shapes", (*GPU_TRAIN, "--shapes", "last-stage-128k,6L-6L-d512", "--variants", "compiled,eager"),
         (*CPU_TRAIN, "--device", HOST, "--shapes", "tiny-last", "--variants", "compiled"), 150, 40),
    Part("costs", ("{py}", "-m", "bench.zb_costs", "--modes", "eager,compiled", "--d-model", "1024",
                   "--out", "{work}/costs", "--jsonl", "{jsonl}"),
         ("{py}", "-m", "bench.zb_costs", "--modes", "eager", "--d-model", "32", "--sequences", "4", "--seq-len",
          "16", "--timed", "1", "--repeats", "1", "--out", "{work}/costs", "--jsonl", "{jsonl}"), 90, 40),
    Part("replay", ("{py}", "-m", "bench.schedules", "--replay", "{out}/costs.json", "--pp", "2,4,8,16",
                    "--out", "{work}/replay"),
         ("{py}", "-m", "bench.schedules", "--replay", "{out}/costs.json", "--pp", "2,4", "--out", "{work}/replay"),
         30, 30),
    # counted on the GPU in bf16, the layers of deepnet-100-100-1024 (its α: the compile cache of `layers`)
    Part("ops", (*OPS, "configs/deepnet-100-100-1024.yaml", "--skip", "engine,syncs", "--batch", "16", "--src", "128",
                 "--tgt", "128"),
         (*OPS, *TINY, "--skip", "engine,syncs,compiled", "--batch", "4", "--src", "12", "--tgt", "10"), 90, 40),
    Part("pp2", (*OPS, *SMALL_DATA, "--skip", "layers,compiled,engine,pp1", "--pp", "2"),
         (*OPS, *TINY, "--skip", "layers,compiled,engine,pp1", "--pp", "2"), 60, 60),
    Part("tests", ("./run.sh", "test-gpu"), ("./run.sh", "test-gpu"), 180, 40),  # 118 s on an H200
]
NAMES = [p.name for p in PARTS]


PACKAGES = os.path.join(ROOT, "gpucheck", "packages.txt")
"""The packages the check relies on and where each comes from (image, built, wheel); wheels.sh
builds and fetches from the same list."""


def packages() -> list[tuple[str, str, str]]:
    """(distribution, import name, where) of every package in PACKAGES, in its order."""
    with open(PACKAGES) as f:
        rows = [line.split() for line in f if line.strip() and not line.startswith("#")]
    return [(row[0], row[1], row[2]) for row in rows]


def versions(path: str) -> None:
    """versions.txt: what the numbers depend on, the image's packages the check relies on, the GPU
    and a bf16 matmul probe (the GPU's real peak next to the datasheet's)."""
    import importlib
    import platform
    from importlib import metadata

    lines = [f"python {platform.python_version()} ({sys.executable}), {count(os.cpu_count() or 1, 'core')}"]
    for dist, module, _ in packages():
        try:
            version = metadata.version(dist)
            found = importlib.util.find_spec(module) is not None
            lines.append(f"{dist} {version}" + ("" if found else " (installed but not importable)"))
        except metadata.PackageNotFoundError:
            lines.append(f"{dist} MISSING")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    from runtime import accelerator

    if os.environ.get("DS_ACCELERATOR") == HOST:
        lines.append(f"device: {HOST}")
    else:
        import torch

        lines.append(f"gpu {accelerator.gpu_name()}, {accelerator.gpu_memory_bytes() / 2**30:.0f} GiB, "
                     f"torch built for CUDA {torch.version.cuda}")
        a, b = (torch.randn(8192, 8192, device=accelerator.device(), dtype=torch.bfloat16) for _ in range(2))
        for _ in range(3):
            a @ b
        accelerator.synchronize()
        start = time.perf_counter()
        for _ in range(10):
            a @ b
        accelerator.synchronize()
        lines.append(f"bf16 8192^3 matmul: {10 * 2 * 8192**3 / (time.perf_counter() - start) / 1e12:.0f} TFLOP/s")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def _sweep(marker: str, group: int | None = None) -> list[int]:
    """SIGKILL every process whose environment carries `marker` (a part's, escaped from its group);
    the ones escaped: not those of process group `group`, which the caller killed already (they may
    still be on their way out, however soon that is on a loaded machine)."""
    killed = []
    needle = f"DEEPNET_CHECK_PART={marker}".encode()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    os.kill(int(pid), signal.SIGKILL)
                    if group is None or os.getpgid(int(pid)) != group:
                        killed.append(int(pid))
        except OSError:
            continue
    return killed


_running: dict = {}
"""The part running now (its process group and marker), for `stop_running` on a signal to the check."""


def stop_running(signum, frame) -> None:
    """The check itself was told to stop (the device's time limit, Ctrl-C): the running part and
    everything it started are killed now (they run in sessions of their own and would outlive the
    check), the parts not run yet are cut, and the summary is written with what came back."""
    _running["stopped"] = signal.Signals(signum).name
    if "pid" in _running:
        try:
            os.killpg(_running["pid"], signal.SIGKILL)
        except ProcessLookupError:
            pass
        _sweep(_running["marker"])


def run_part(part: Part, command: list[str], limit: int, log: str, env: dict) -> dict:
    """Run `command` under `timeout -k GRACE limit` in a session of its own; what happened."""
    marker = f"{uuid.uuid4().hex[:12]}-{part.name}"
    env = dict(env, DEEPNET_CHECK_PART=marker)
    start, cpu = time.monotonic(), resource.getrusage(resource.RUSAGE_CHILDREN)
    with open(log, "w") as f:
        proc = subprocess.Popen(["timeout", "-k", str(GRACE), str(limit), *command], cwd=ROOT, env=env,
                                stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        _running.update(pid=proc.pid, marker=marker)
        forced = False
        try:
            code = proc.wait(timeout=limit + GRACE + 10)
        except subprocess.TimeoutExpired:  # timeout itself did not end it
            os.killpg(proc.pid, signal.SIGKILL)
            code, forced = proc.wait(), True
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # whatever it left in its group
    except ProcessLookupError:
        pass
    stragglers = _sweep(marker, group=proc.pid)
    _running.pop("pid", None)
    seconds = time.monotonic() - start
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_seconds = used.ru_utime + used.ru_stime - cpu.ru_utime - cpu.ru_stime
    status = "ok" if code == 0 else (f"killed: the check got {_running['stopped']}" if "stopped" in _running else
                                     f"killed by the check {limit + GRACE + 10} s after it started (timeout did not "
                                     "end it)" if forced else
                                     f"killed at its {limit} s limit (SIGTERM)" if code == 124 else
                                     f"killed at its {limit} s limit (SIGKILL: SIGTERM was ignored for {GRACE} s)"
                                     if code in (137, -9) else f"failed (exit {code})")
    return {"part": "check", "name": part.name, "status": status, "exit": code, "seconds": round(seconds, 1),
            "cpu_seconds": round(cpu_seconds, 1), "limit": limit, "stragglers_killed": len(stragglers), "command": " ".join(command)}


def assemble(out: str, jsonl: str) -> dict:
    """The files made of the results so far (train.json, ops.json, costs.json); what exists."""
    records = results.read_jsonl(jsonl)
    made = {}
    train = results.train_results(records)
    if train:
        results.write_json(os.path.join(out, "train.json"), train)
        made["train"] = train
    ops = results.ops_result(records)
    if ops:
        results.write_json(os.path.join(out, "ops.json"), ops)
        made["ops"] = ops
    costs = results.cost_file(records)
    if costs:
        results.write_json(os.path.join(out, "costs.json"), costs)
        made["costs"] = costs
    made["records"] = records
    return made


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpucheck/gpu_check.sh", description=__doc__.splitlines()[0])
    parser.add_argument("out", help="the folder that comes back (at most 8 files)")
    parser.add_argument("--rehearse", action="store_true", help="every part on this machine's CPU, tiny shapes")
    parser.add_argument("--only", help=f"comma-separated parts to run (of {', '.join(NAMES)})")
    parser.add_argument("--skip", default="", help="comma-separated parts to leave out")
    parser.add_argument("--budget", type=float, help="seconds for the whole check (420 on a GPU; 600 rehearsing)")
    parser.add_argument("--scale", type=float, help="multiply every limit (rehearsal default: 1 + load per core)")
    parser.add_argument("--limit", action="append", default=[], metavar="PART=SECONDS",
                        help="this part's limit instead (not scaled)")
    parser.add_argument("--stall", help=argparse.SUPPRESS)  # a part that hangs after its first result (tests)
    parser.add_argument("--merge", nargs="+", metavar="DIR",
                        help="join the results of earlier checks' folders (a run and its rerun) into OUT")
    parser.add_argument("--spent", type=float, default=0.0, help=argparse.SUPPRESS)  # seconds before (the wheels)
    parser.add_argument("--versions", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.versions:
        versions(args.out)
        return 0
    from gpucheck.summary import summary

    if args.merge:
        return merge(args.out, args.merge, summary)

    chosen = args.only.split(",") if args.only else NAMES
    skipped = set(filter(None, args.skip.split(",")))
    try:
        limits = {k: float(v) for k, v in (item.split("=", 1) for item in args.limit)}
    except ValueError:
        parser.error(f"--limit {args.limit}: PART=SECONDS")
    unknown = (set(chosen) | skipped | set(limits)) - set(NAMES)
    if unknown:
        parser.error(f"unknown part {sorted(unknown)[0]}; parts: {', '.join(NAMES)}")
    budget = (args.budget or (600.0 if args.rehearse else 420.0)) - args.spent
    scale = args.scale or (1.0 + os.getloadavg()[0] / (os.cpu_count() or 1) if args.rehearse else 1.0)
    started = time.monotonic()
    os.makedirs(args.out, exist_ok=True)
    out = os.path.abspath(args.out)
    jsonl = os.path.join(out, "results.jsonl")
    logs: dict[str, str] = {}
    if os.path.exists(os.path.join(out, "logs.txt")):  # gpu_check.sh's wheel install wrote it: kept on top
        with open(os.path.join(out, "logs.txt"), errors="replace") as f:
            logs["wheels"] = f.read()
    for name in ("results.jsonl", *MADE):  # a check starts afresh (--merge joins several): no earlier file stays
        if os.path.exists(os.path.join(out, name)):
            os.remove(os.path.join(out, name))
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, stop_running)
    work = tempfile.mkdtemp(prefix="gpu-check.")
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore",
               PYTHONPATH=os.pathsep.join(filter(None, (ROOT, os.environ.get("PYTHONPATH")))))
    py = sys.executable
    env.update(DEEPNET_VENV=sys.prefix, DEEPNET_NO_INSTALL="1")  # ./run.sh test-gpu: this Python, nothing installed
    if args.rehearse:
        env.update(DS_ACCELERATOR=HOST, OMP_NUM_THREADS="1")
    header = {"mode": "rehearsal (CPU, tiny shapes)" if args.rehearse else "GPU", "budget": budget,
              "scale": round(scale, 2), "started": datetime.datetime.now(datetime.timezone.utc).strftime(
                  "%Y-%m-%d %H:%M UTC"), "argv": list(argv if argv is not None else sys.argv[1:])}
    outcomes: list[dict] = []
    for part in PARTS:
        if part.name not in chosen:
            continue
        left = budget - (time.monotonic() - started) - RESERVE
        if part.name in skipped:
            outcome = {"name": part.name, "status": "skipped (--skip)"}
        elif "stopped" in _running:
            outcome = {"name": part.name, "status": f"cut: the check got {_running['stopped']}"}
        elif part.name == "replay" and not os.path.exists(os.path.join(out, "costs.json")):
            outcome = {"name": part.name, "status": "cut: no costs.json here (rerun it with costs)"}
        elif left < MIN_START:
            outcome = {"name": part.name, "status": f"cut: {max(0, left):.0f} s of the budget left"}
        else:
            limit = limits.get(part.name, (part.cpu_limit * scale) if args.rehearse else part.limit)
            limit = int(min(limit, left - GRACE))
            fields = {"py": py, "work": work, "jsonl": jsonl, "out": out}
            command = [a.format(**fields) for a in (part.cpu if args.rehearse else part.gpu)]
            if args.stall == part.name:
                command += list(part.stall)
            log = os.path.join(work, f"{part.name}.log")
            print(f"[{time.monotonic() - started:5.0f} s] {part.name}: limit {limit} s", flush=True)
            outcome = run_part(part, command, limit, log, env)
            with open(log, errors="replace") as f:
                tail = f.readlines()[-150:]
            logs[part.name] = "".join(tail)
            outcome["last_line"] = next((line.strip() for line in reversed(tail) if line.strip()), "")[:300]
            keep_files(part.name, work, out, jsonl)
        outcome["at_seconds"] = round(time.monotonic() - started, 1)
        results.append_jsonl(jsonl, {**outcome, "part": "check"})
        outcomes.append(outcome)
        print(f"[{outcome['at_seconds']:5.0f} s] {part.name}: {outcome['status']}", flush=True)
        _write_outputs(out, jsonl, header, outcomes, logs, chosen, summary)
    shutil.rmtree(work, ignore_errors=True)
    with open(os.path.join(out, "summary.md")) as f:
        print(f.read())
    return 0


def merge(out: str, folders: list[str], summary) -> int:
    """OUT from the folders of several checks (a run and the reruns of its missing parts): their
    results.jsonl lines in order, the files made of them, a summary whose parts are each part's
    last outcome; versions.txt, trace.json and logs.txt from the last folder that has them."""
    os.makedirs(out, exist_ok=True)
    records = results.read_jsonl(*(os.path.join(f, "results.jsonl") for f in folders))
    jsonl = os.path.join(out, "results.jsonl")
    with open(jsonl, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    for name in ("versions.txt", "trace.json", "logs.txt"):
        for folder in reversed(folders):
            if os.path.exists(os.path.join(folder, name)) and os.path.abspath(folder) != os.path.abspath(out):
                shutil.copy(os.path.join(folder, name), os.path.join(out, name))
                break
    last = {r["name"]: r for r in records if r.get("part") == "check"}
    outcomes = [last[n] for n in NAMES if n in last]
    header = {"mode": "merged", "budget": 0, "scale": 1, "argv": [out, "--merge", *folders],
              "started": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
    text = summary(header, outcomes, assemble(out, jsonl), [n for n in NAMES if n in last])
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(text)
    print(text)
    return 0


def keep_files(part: str, work: str, out: str, jsonl: str) -> None:
    """What a part made besides its results, within OUT's 8 files: the replay's table as a line of
    results.jsonl (summary.md shows it), the pipelined part's timeline as OUT/trace.json (the file
    bench ops names in its trace_pp2 result)."""
    if part == "replay" and os.path.exists(os.path.join(work, "replay", "zb-replay.md")):
        with open(os.path.join(work, "replay", "zb-replay.md"), encoding="utf-8") as f:
            results.append_jsonl(jsonl, {"part": "replay", "text": f.read()})
    if part == "pp2":
        traced = results.ops_result(results.read_jsonl(jsonl)).get("trace_pp2", {})
        if traced.get("paths") and os.path.exists(traced["paths"][0]):
            shutil.copy(traced["paths"][0], os.path.join(out, "trace.json"))


def _write_outputs(out, jsonl, header, outcomes, logs, chosen, summary) -> None:
    made = assemble(out, jsonl)
    with open(os.path.join(out, "logs.txt"), "w") as f:
        for name, text in logs.items():
            f.write(f"===== {name} (last lines) =====\n{text}\n")
    try:
        text = summary(header, outcomes, made, [p for p in NAMES if p in chosen])
    except Exception as e:  # the summary must come back: the parts' outcomes at least
        import traceback

        text = (f"# GPU check ({header['mode']})\n\nThe summary could not be made ({type(e).__name__}: {e}); "
                "the parts' outcomes:\n\n" + "\n".join(f"- {o['name']}: {o['status']}" for o in outcomes) +
                "\n\n```\n" + traceback.format_exc() + "```\n")
    tmp = os.path.join(out, "summary.md.tmp")
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, os.path.join(out, "summary.md"))


# What ./run.sh bench reads from this source (launcher/commands/bench.py).
BENCH = dict(name="gpu-check", help="the GPU check: every part under a hard limit inside one budget, each result "
             "kept as it comes (--rehearse: on this CPU, tiny shapes)", switches=("--rehearse",))


if __name__ == "__main__":
    sys.exit(main())
