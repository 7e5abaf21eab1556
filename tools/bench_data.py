"""Data-path benchmark (not a test): how fast shards stream and batches collate on this machine.

    python tools/bench_data.py                  # writes synthetic shards to a temp dir
    python tools/bench_data.py --data DIR       # reads existing shards
    python tools/bench_data.py --ranks          # CPU per own sample of rank r of N = 1 .. 1024
                                                  # (x W workers), by the index and by the walk

Files just written sit in the page cache, so the figures are for warm reads (no disk).
"""
import argparse
import datetime
import json
import os
import platform
import shlex
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout
from echobench.data import (  # noqa: E402
    LocalTarDataset, build_tokenizer, iter_shard, make_loader, synth_shards, write_shard,
)
from echobench.data.dataset import find_shards  # noqa: E402


def cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def bench_dataset(data, num_samples: int, rank: int = 0, world_size: int = 1):
    it = iter(LocalTarDataset(data, rank=rank, world_size=world_size, shuffle_seed=0, loop=True))
    next(it)  # open the first shard before timing
    nbytes, t0, cpu0 = 0, time.perf_counter(), time.process_time()
    for _ in range(num_samples):
        s = next(it)
        nbytes += s["latent"].nbytes + s["ref"].nbytes
    dt, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    # Reads from the page cache are CPU work: samples per CPU-second hardly depend on other load.
    return num_samples / dt, nbytes / dt / 1e6, num_samples / cpu


def bench_header_walk(data) -> float:
    """CPU seconds per sample to walk the shards' tar headers without reading a sample: what a
    reader pays for each sample of another rank (every rank numbers every sample)."""
    shards = find_shards(data)
    slots, cpu0 = 0, time.process_time()
    for shard in shards:
        for _ in iter_shard(shard, keep=lambda i: False):  # (index, None) per slot, members unread
            slots += 1
    cpu = time.process_time() - cpu0
    return cpu / slots


def write_small_shards(out: Path, num_shards: int, per_shard: int, frames: int) -> list[Path]:
    """Shards of small samples (latent and reference of `frames` frames), with their indexes: the
    walk's cost per skipped sample and the index's per own sample do not depend on the sample's
    size, and decoding a real (larger) sample adds the same to both; small samples keep a data
    set with enough samples for 1024 ranks x W workers a few hundred MB."""
    rng = np.random.default_rng(0)
    latent = rng.standard_normal((frames, 128)).astype(np.float16)
    paths = []
    for j in range(num_shards):
        samples = ({"key": f"s{j:06d}-{i:06d}", "latent": latent, "ref": latent, "text": f"[S1] sample {i}",
                    "target_duration": frames / 25} for i in range(per_shard))
        paths.append(write_shard(out / f"shard-{j:06d}.tar", samples))
    return paths


def bench_rank(data, world_size: int, workers: int, use_index: bool, micro_batch: int) -> tuple[float, float, int]:
    """(CPU-us to open the data set, CPU-us per own sample of one pass, own samples) for the last
    worker of the last rank of world_size ranks x workers DataLoader workers. Opening (reading every
    shard's index header) happens once per rank, before its workers start: counted once here."""
    cpu0 = time.process_time()
    ds = LocalTarDataset(data, rank=world_size - 1, world_size=world_size, micro_batch=micro_batch,
                         shuffle_seed=0, loop=False, use_index=use_index)
    cpu1 = time.process_time()
    own = sum(1 for _ in ds.samples(workers, workers - 1))
    cpu2 = time.process_time()
    return (cpu1 - cpu0) * 1e6, (cpu2 - cpu1) / max(own, 1) * 1e6, own


def bench_ranks(args, data) -> list[dict]:
    """The rank-scaling curve: one row per (N, W), the median of --repeats passes by the index (more
    where a reader has few samples: at least --min-samples over all passes, 64 passes at most) and
    of --walk-repeats by the walk (each walks every shard: seconds per pass)."""
    rows = []
    for workers in args.workers:
        n = 1
        while n <= args.max_ranks:
            row = {"ranks": n, "workers": workers, "readers": n * workers}
            for mode, use_index, repeats in (("walk", False, args.walk_repeats), ("index", True, args.repeats)):
                runs = [bench_rank(data, n, workers, use_index, args.micro_batch)]
                if use_index:  # few samples per pass: more passes, or noise swamps the figure
                    repeats = max(repeats, min(64, -(-args.min_samples // max(runs[0][2], 1))))
                runs += [bench_rank(data, n, workers, use_index, args.micro_batch) for _ in range(repeats - 1)]
                row[f"{mode}_passes"] = len(runs)
                row[f"{mode}_open_us"] = float(np.median([r[0] for r in runs]))
                row[f"{mode}_us_per_own_sample"] = float(np.median([r[1] for r in runs]))
                row["own_samples"] = runs[0][2]
            row["index_total_us_per_own_sample"] = (row["index_us_per_own_sample"]
                                                     + row["index_open_us"] / max(row["own_samples"], 1))
            rows.append(row)
            print(f"| {n:5d} | {workers} | {n * workers:5d} | {row['own_samples']:6d} | "
                  f"{row['walk_us_per_own_sample']:12.0f} | {row['index_us_per_own_sample']:9.1f} | "
                  f"{row['index_open_us']:8.0f} | {row['index_total_us_per_own_sample']:9.1f} |", flush=True)
            n *= 2
    return rows


def main_ranks(args):
    shards = args.shards or 8
    per_shard = args.per_shard or 8192
    with tempfile.TemporaryDirectory() as tmp:
        data = args.data
        if data is None:
            t0 = time.perf_counter()
            paths = write_small_shards(Path(tmp), shards, per_shard, args.frames)
            size = sum(p.stat().st_size for p in paths) / 1e6
            print(f"wrote {shards} x {per_shard} samples of {args.frames} frames ({size:.0f} MB, indexed) "
                  f"in {time.perf_counter() - t0:.1f} s to {tmp}")
            data = tmp
        next(LocalTarDataset(data, loop=False).samples())  # imports and page cache warm
        print(f"rank N-1 of N, worker W-1 of W, micro-batch {args.micro_batch}, one pass over "
              f"{len(find_shards(data))} shards; CPU-us (time.process_time), median of {args.repeats} "
              f"passes or more (index: >= {args.min_samples} own samples in all; walk: {args.walk_repeats})")
        print("| N ranks | W | readers | own samples | walk: us/own sample | index: us/own sample "
              "| index: open, us once | index: us/own incl. open |")
        print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        load = os.getloadavg()[0]
        rows = bench_ranks(args, data)
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    if args.json:
        env = {"python": platform.python_version(), "torch": torch.__version__, "numpy": np.__version__,
               "cpu": cpu_model(), "cores": os.cpu_count(), "load_average_before": load,
               "load_average_after": os.getloadavg()[0],
               "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}
        Path(args.json).write_text(json.dumps({"command": shlex.join([sys.executable] + sys.argv), "env": env,
                                               "shards": len(find_shards(data)) if args.data else shards,
                                               "per_shard": None if args.data else per_shard,
                                               "frames": None if args.data else args.frames,
                                               "micro_batch": args.micro_batch, "rows": rows}, indent=2) + "\n")
        print(f"wrote {args.json}")


def bench_loader(source, num_batches: int, num_workers: int = 0):
    loader = make_loader(source, micro_batch=8, audio_frames=750, text_tokens=256,
                         speaker_frames=750, tokenizer=build_tokenizer(512), prefetch=4,
                         num_workers=num_workers)
    with loader:
        next(loader)  # warm-up: thread and workers started
        t0 = time.perf_counter()
        for _ in range(num_batches):
            next(loader)
        return num_batches / (time.perf_counter() - t0)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", help="directory of shards (default: write synthetic ones)")
    p.add_argument("--shards", type=int, help="synthetic shards (default 16; --ranks: 8)")
    p.add_argument("--per-shard", type=int, help="samples per shard (default 128; --ranks: 8192)")
    p.add_argument("--samples", type=int, default=3000, help="samples timed for LocalTarDataset")
    p.add_argument("--batches", type=int, default=200, help="batches timed for BatchLoader")
    p.add_argument("--ranks", action="store_true",
                   help="only the rank-scaling curve: CPU per own sample for N = 1, 2, 4 .. --max-ranks")
    p.add_argument("--max-ranks", type=int, default=1024)
    p.add_argument("--workers", type=lambda s: [int(w) for w in s.split(",")], default=[1, 4],
                   help="--ranks: DataLoader workers per rank, comma-separated (default 1,4)")
    p.add_argument("--micro-batch", type=int, default=4, help="--ranks: micro-batch per rank")
    p.add_argument("--frames", type=int, default=4, help="--ranks: latent frames per synthetic sample")
    p.add_argument("--repeats", type=int, default=3, help="--ranks: passes per point by the index (the median)")
    p.add_argument("--walk-repeats", type=int, default=1, help="--ranks: passes per point by the walk")
    p.add_argument("--min-samples", type=int, default=1024,
                   help="--ranks: own samples per point by the index, over its passes")
    p.add_argument("--json", help="--ranks: also write the rows to this JSON file")
    args = p.parse_args()

    print(f"command: {shlex.join([sys.executable] + sys.argv)}")
    print(f"python {platform.python_version()}, torch {torch.__version__}, numpy {np.__version__}, "
          f"CPU {cpu_model()} ({os.cpu_count()} cores), torch threads {torch.get_num_threads()}")
    print(f"date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}, "
          f"load average before: {os.getloadavg()[0]:.2f} (other work on the CPUs skews figures)")
    if args.ranks:
        return main_ranks(args)
    args.shards, args.per_shard = args.shards or 16, args.per_shard or 128

    with tempfile.TemporaryDirectory() as tmp:
        data = args.data
        if data is None:
            t0 = time.perf_counter()
            paths = synth_shards(tmp, args.shards, args.per_shard, seed=0)
            size = sum(p.stat().st_size for p in paths) / 1e6
            print(f"wrote {args.shards} x {args.per_shard} synthetic samples ({size:.0f} MB) "
                  f"in {time.perf_counter() - t0:.1f} s to {tmp}")
            data = tmp
        sps, mbps, per_cpu = bench_dataset(data, args.samples)
        print(f"LocalTarDataset: {sps:8.0f} samples/s  {mbps:7.0f} MB/s of latents "
              f"(audio + ref, float16) over {args.samples} samples, warm page cache; "
              f"{per_cpu:.0f} samples per CPU-second")
        # A rank of two reads half the samples (and, for one global order, walks every header).
        sps, mbps, per_cpu = bench_dataset(data, args.samples, rank=0, world_size=2)
        print(f"LocalTarDataset(rank 0 of 2): {sps:8.0f} samples/s  {mbps:7.0f} MB/s of latents; "
              f"{per_cpu:.0f} samples per CPU-second")
        walk = bench_header_walk(data)
        print(f"tar header walk: {walk * 1e6:.0f} CPU-us per sample (skipped unread)")
        for workers in (0, 2):
            bps = bench_loader(data, args.batches, num_workers=workers)
            print(f"BatchLoader(shards, num_workers={workers}): {bps:7.1f} batches/s "
                  f"= {bps * 8:6.0f} samples/s (micro-batch 8, lengths 750/256/750, "
                  f"over {args.batches} batches)")
        bps = bench_loader("synthetic", args.batches)
        print(f"BatchLoader(synthetic):            {bps:7.1f} batches/s "
              f"= {bps * 8:6.0f} samples/s (collate only, no I/O)")
        for source in (data, "synthetic"):
            step, wait = bench_tiny_model(source, Path(tmp) / "run")
            label = "shards" if source == data else "synthetic"
            print(f"tiny model on CPU ({label}):  {step * 1e3:7.1f} ms/step median, data wait {wait:.1%} "
                  f"(micro-batch 8, 750/256/750, fp32, 10 measured steps after 3 warm-up)")


def bench_tiny_model(source, out: Path) -> tuple[float, float]:
    """The tiny model's training step time through the real benchmark loop."""
    from echobench.train.bench import run_benchmark
    from echobench.records.config import RunConfig

    # The peak only scales MFU, which is not printed here; step time and data wait are measured.
    cfg = RunConfig(scale="tiny", steps=10, warmup_steps=3, micro_batch=8, data=str(source), device="cpu",
                    peak_tflops=1.0)
    record = run_benchmark(cfg, out)
    if record.status != "ok":
        raise SystemExit(f"tiny run failed: {record.error}")
    return record.step_time_s, record.data_wait_frac


if __name__ == "__main__":
    main()
