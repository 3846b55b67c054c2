"""./run.sh bench data: throughput of every preparation step, and the loader against a step.

Runs the real steps on a real multilingual corpus (by default every language of Django's
gettext catalogs, each line joining one to five consecutive catalog entries so that lines have
sentence length) once with one worker and once with all, then times the training loader
against a training step of the config's model, and projects to 12B pairs.

Rates are given per CPU-second as well as per wall-clock second: on a machine shared with other
jobs the wall clock measures the neighbours, while CPU time per pair is what a dedicated core
would spend.
"""

import argparse
import json
import os
import resource
import shutil
import tempfile
import time
from itertools import groupby

import numpy as np

from schema.text import count

BENCH = dict(name="data", help="preparation and loader throughput", config="--config", paths=("--corpus", "--out"))
TARGET_PAIRS = 12_000_000_000  # the paper's largest run (102 languages, 1,932 directions)


def _bench_corpus(folder: str, join: int, dev_test: int) -> int:
    """Every Django language with enough entries, OPUS-100 layout; returns the pairs written.
    A line joins 1..``join`` consecutive catalog entries, starting at every entry: all lines
    distinct, lengths from UI strings to sentences, ~``join``× the catalog per language."""
    from data.gettext_corpus import catalog_pairs, django_locale_root, find_catalogs

    total = 0
    for language, files in find_catalogs(django_locale_root()).items():
        pairs = catalog_pairs(files)
        lines = [tuple(" ".join(p[s] for p in pairs[i:i + width]) for s in (0, 1))
                 for width in range(1, join + 1) for i in range(len(pairs) - width + 1)]
        lines = [lines[k] for k in np.random.default_rng(0).permutation(len(lines))]
        if len(lines) < 4 * dev_test:
            continue
        splits = {"dev": lines[:dev_test], "test": lines[dev_test:2 * dev_test],
                  "train": lines[2 * dev_test:]}
        os.makedirs(os.path.join(folder, f"en-{language}"))
        for split, rows in splits.items():
            prefix = os.path.join(folder, f"en-{language}", f"opus.en-{language}-{split}")
            for side, suffix in ((0, "en"), (1, language)):
                with open(f"{prefix}.{suffix}", "w", encoding="utf-8") as handle:
                    handle.writelines(row[side] + "\n" for row in rows)
            total += len(rows)
    return total


def _cpu_seconds() -> float:
    """CPU time of this process and of its finished children (the worker pools)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def _timed(fn, *args):
    """``(wall seconds, CPU seconds, result)``."""
    wall, cpu = time.perf_counter(), _cpu_seconds()
    result = fn(*args)
    return time.perf_counter() - wall, _cpu_seconds() - cpu, result


def _rss_mb() -> float:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _binarize_measured(task) -> float:
    """Worker: binarise a shard; return how far the worker's peak RSS rose above what it had
    when it started (the forked parent's pages are not the worker's doing)."""
    from data.binarize import binarize_shard
    from data.workers import worker_state

    binarize_shard(task)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return peak - worker_state()["rss_mb"]


def _step_seconds(cfg, batches: list[dict], steps: int) -> float:
    """Median CPU time of a full training step (forward, backward, clipping, AdamW) of the
    config's model in one single-threaded process on these micro-batches: the work of all
    pipeline stages together (training ranks run with one thread each)."""
    import torch

    from model.step import plain_step
    from model.transformer import EncoderDecoder

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = EncoderDecoder(cfg.model, seed=cfg.train.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=cfg.train.adam_betas)
    times = []
    for _ in range(steps + 1):  # the first step warms up allocators and kernels
        start = time.process_time()
        plain_step(model, batches, optimizer, clip_norm=1.0)
        times.append(time.process_time() - start)
    return float(np.median(times[1:]))


def _logged_step_seconds(run_dir: str, tokens_per_step: float) -> float | None:
    """Step time of a finished pipeline run, from its logged target tokens/s."""
    path = os.path.join(run_dir, "metrics", "train", "train_target_tokens_per_s.csv")
    if not os.path.exists(path):
        return None
    values = np.loadtxt(path, delimiter=",", skiprows=1, ndmin=2)[:, 1]
    return tokens_per_step / float(np.median(values)) if len(values) else None


def main(argv: list[str] | None = None) -> int:
    from data.batching import BatchStream, epoch_stats
    from data.binarize import load_stats, token_dtype
    from data.corpus import SPLITS, list_pairs
    from data.dataset import PairDataset
    from data.prepare import split_index
    from data.shards import plan_shards, raw_rows
    from data.spm import load_tokenizer, train_spm, write_sample
    from data.validate import check_shard, deduplicate
    from data.workers import run_tasks, worker_count
    from launcher.launch import DEFAULT_CONFIG
    from trainer.config import load_config

    parser = argparse.ArgumentParser(prog="run.sh bench data", description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=DEFAULT_CONFIG, help="model, batching and data settings")
    parser.add_argument("--corpus", help="benchmark this corpus folder instead of the catalogs")
    parser.add_argument("--join", type=int, default=5, help="up to this many entries per line")
    parser.add_argument("--shard-size", type=int, default=20_000)
    parser.add_argument("--workers", type=int, default=0, help="0 = one per core")
    parser.add_argument("--loader-steps", type=int, default=400)
    parser.add_argument("--out", help="write bench_data.json here (default: the config's run_dir)")
    args = parser.parse_args(argv)
    cfg = load_config(args.config)
    workers = worker_count(args.workers)
    root = tempfile.mkdtemp(prefix="bench-data-")
    results: dict = {"workers": workers, "cores": os.cpu_count()}
    try:
        corpus = args.corpus or os.path.join(root, "corpus")
        if not args.corpus:
            _bench_corpus(corpus, args.join, dev_test=50)
        pairs = list_pairs(corpus)
        shards = plan_shards(pairs, args.shard_size, SPLITS)
        lines = sum(s.lines for s in shards)
        print(f"corpus: {count(len(pairs), 'pair')}, {count(lines, 'line pair', spec=',')}, {count(len(shards), 'shard')} "
              f"of ≤{args.shard_size:,}; {count(workers, 'worker')} on {count(os.cpu_count() or 1, 'core')}")

        def stage(name, fn, make_task, setup=None, results_to=None):
            entry = {}
            for n in sorted({1, workers}):
                out = os.path.join(root, f"{name}-{n}")
                work = os.path.join(root, f"work-{n}")
                tasks = [make_task(s, out, work) for s in shards]
                wall, cpu, done = _timed(lambda t=tasks, c=n: list(
                    run_tasks(fn, t, c, name, setup=setup, progress=False)))
                entry[f"wall_{n}"] = lines / wall
                entry[f"cpu_{n}"] = lines / cpu
                if results_to is not None:
                    results_to.extend(result for _, result in done)
            entry["per_worker"] = entry["cpu_1"]
            entry["total"] = entry[f"wall_{workers}"]
            results[name] = entry
            print(f"{name:>12}: {entry['cpu_1']:>9,.0f} pairs per CPU-second ({entry['wall_1']:,.0f}"
                  f"/s wall with 1 worker); {entry['total']:,.0f}/s wall with {count(workers, 'worker')} "
                  f"({entry[f'cpu_{workers}']:,.0f} per CPU-second)")

        stage("validation", check_shard, lambda s, out, work: (s, work, cfg.data.max_chars))
        for n in sorted({1, workers}):
            for _, group in groupby(shards, key=lambda s: (s.split, s.pair)):
                deduplicate(list(group), os.path.join(root, f"work-{n}"))
        work = os.path.join(root, f"work-{workers}")
        train = [s for s in shards if s.split == "train"]
        model_path = os.path.join(root, "spm.model")
        sample = os.path.join(root, "sample.txt")
        seconds, _, taken = _timed(write_sample, train, [p.langs for p in pairs], work, sample,
                                   cfg.data.spm_sample_sentences, cfg.data.spm_temperature, 1,
                                   workers)
        languages = sorted({lang for p in pairs for lang in p.langs})
        spm_seconds, _, _ = _timed(train_spm, sample, model_path, languages, cfg.data.vocab_size,
                                cfg.data.spm_model_type, cfg.data.character_coverage,
                                cfg.data.spm_normalization)
        results["spm_training"] = {"sample_lines": sum(taken.values()), "sample_seconds": seconds,
                                   "train_seconds": spm_seconds, "vocab_size": cfg.data.vocab_size}
        print(f"SentencePiece: sampled {count(sum(taken.values()), 'line', spec=',')} in {seconds:.1f} s, trained "
              f"vocab {cfg.data.vocab_size} in {spm_seconds:.1f} s")

        tokenizer = load_tokenizer(model_path)
        texts = [side.decode().strip() for shard in train[:40] for _, rows in raw_rows(shard)
                 for row in rows for side in row]
        _, seconds, ids = _timed(tokenizer.encode_batch, texts, 1)
        pieces = sum(map(len, ids)) / len(ids)
        results["spm_encoding"] = {"per_worker": len(texts) / 2 / seconds,
                                   "pieces_per_side": pieces,
                                   "chars_per_side": sum(map(len, texts)) / len(texts)}
        print(f"{'encoding':>12}: {len(texts) / 2 / seconds:>9,.0f} pairs per CPU-second (1 thread,"
              f" {pieces:.1f} pieces and {results['spm_encoding']['chars_per_side']:.0f} "
              "characters per side)")

        token_dtype(tokenizer.vocab_size)  # import megatron-core before the workers fork
        limits = {"spm_model": model_path, "max_source_len": cfg.data.max_source_len,
                  "max_target_len": cfg.data.max_target_len,
                  "max_length_ratio": cfg.data.max_length_ratio}
        rss: list[float] = []
        stage("binarisation", _binarize_measured,
              lambda s, out, work: (s, out, os.path.join(root, f"work-{workers}"), limits),
              setup=lambda: {"tokenizer": load_tokenizer(model_path), "rss_mb": _rss_mb()},
              results_to=rss)
        out = os.path.join(root, f"binarisation-{workers}")
        stats = {s.id: load_stats(out, s) for s in shards}
        kept = sum(v["reasons"]["kept"] for v in stats.values())
        disk = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(os.path.join(out, "shards"))
                   for f in fs if f.endswith((".bin", ".idx")))
        results["disk_bytes_per_pair"] = disk / kept
        results["worker_rss_growth_mb"] = max(rss)
        print(f"{'disk':>12}: {disk / kept:.1f} bytes per kept pair ({kept:,} kept); a worker's "
              f"memory grew by at most {max(rss):.0f} MB at shard size {args.shard_size:,}")

        tags = [[tokenizer.tag_id(lang) for lang in p.langs] for p in pairs]
        directions = [d for p in pairs for d in p.directions()]
        index = split_index(pairs, tags, directions, shards, stats, "train", out)
        with open(os.path.join(out, "train.shards.json"), "w") as handle:
            json.dump(index, handle)
        dataset = PairDataset(os.path.join(out, "train"))
        micro = cfg.train.micro_batches * cfg.parallel.data_parallel
        stream = BatchStream(dataset, cfg.data.max_tokens, cfg.data.seed,
                             cfg.data.sampling_temperature)
        epoch = epoch_stats(stream)
        _, window, batches = _timed(stream.window_batches, 0, 0)
        examples = int(stream.wants.sum()) // stream.windows
        _, loader, steps = _timed(lambda: [stream.next_step(micro) for _ in range(args.loader_steps)])
        loader /= args.loader_steps
        tokens_per_step = float(np.mean([sum(b["ntokens"] for b in step) for step in steps]))
        cfg.model.vocab_size = tokenizer.vocab_size
        step = _step_seconds(cfg, steps[0], steps=2)
        logged = _logged_step_seconds(cfg.run_dir, tokens_per_step)
        # A full window (WINDOW examples) is built once per WINDOW/examples-per-batch batches;
        # its cost grows ~linearly with its size, so per batch it is the same as measured here.
        per_step_window = window / len(batches) * micro
        results["loader"] = {
            "window_examples": examples, "window_build_seconds": window,
            "window_share_per_step_ms": 1000 * per_step_window,
            "batches_per_s": micro / loader, "ms_per_step": 1000 * loader,
            "micro_batches_per_step": micro,
            "padding_fraction": epoch["padding_fraction"], "tokens_per_step": tokens_per_step,
            "step_seconds_single_process": step, "step_seconds_logged_run": logged,
            "share_of_step": (loader + per_step_window) / min(step, logged or step),
        }
        print(f"{'loader':>12}: {micro / loader:,.0f} batches per CPU-second, {1000 * loader:.2f} ms per step of "
              f"{count(micro, 'micro-batch', 'micro-batches')} (max_tokens {cfg.data.max_tokens}, padding "
              f"{epoch['padding_fraction']:.1%}); building a window of {count(examples, 'example', spec=',')} "
              f"took {window:.2f} CPU-s = {1000 * per_step_window:.2f} ms per step over its "
              f"{count(len(batches), 'batch', 'batches', ',')}")
        print(f"{'step':>12}: {step:.2f} CPU-s for the config's model (all stages, one thread)"
              + (f", {logged:.2f} s from {cfg.run_dir}'s logged tokens/s" if logged else "")
              + f" → loader and window = {100 * results['loader']['share_of_step']:.2f}% of a step")

        per_pair = 1 / results["validation"]["per_worker"] + 1 / results["binarisation"]["per_worker"]
        hours = TARGET_PAIRS * per_pair / 3600
        results["projection_12B"] = {"worker_hours": hours, "disk_tb": TARGET_PAIRS * disk / kept / 1e12}
        print(f"{'12B pairs':>12}: {hours:,.0f} worker-hours of validation + binarisation "
              f"({hours / 64:,.1f} h on 64 workers, {hours / 256:,.1f} h on 256) at these line "
              f"lengths; {TARGET_PAIRS * disk / kept / 1e12:.2f} TB of shards")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    path = os.path.join(args.out or cfg.run_dir, "bench_data.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as handle:
        json.dump(results, handle, indent=1)
    print(f"written {path}")
    return 0
