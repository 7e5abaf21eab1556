"""Data-path benchmark (not a test): how fast shards stream and batches collate on this machine.

    python scripts/bench_data.py                  # writes synthetic shards to a temp dir
    python scripts/bench_data.py --data DIR       # reads existing shards

Files just written sit in the page cache, so the figures are for warm reads (no disk).
"""
import argparse
import datetime
import os
import platform
import shlex
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout
from echobench.data import LocalTarDataset, build_tokenizer, iter_shard, make_loader, synth_shards  # noqa: E402
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
    p.add_argument("--shards", type=int, default=16)
    p.add_argument("--per-shard", type=int, default=128)
    p.add_argument("--samples", type=int, default=3000, help="samples timed for LocalTarDataset")
    p.add_argument("--batches", type=int, default=200, help="batches timed for BatchLoader")
    args = p.parse_args()

    print(f"command: {shlex.join([sys.executable] + sys.argv)}")
    print(f"python {platform.python_version()}, torch {torch.__version__}, "
          f"CPU {cpu_model()} ({os.cpu_count()} cores), torch threads {torch.get_num_threads()}")
    print(f"date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}, "
          f"load average before: {os.getloadavg()[0]:.2f} (other work on the CPUs skews figures)")

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
    from echobench.bench import run_benchmark
    from echobench.config import RunConfig

    # The peak only scales MFU, which is not printed here; step time and data wait are measured.
    cfg = RunConfig(scale="tiny", steps=10, warmup_steps=3, micro_batch=8, data=str(source), device="cpu",
                    peak_tflops=1.0)
    record = run_benchmark(cfg, out)
    if record.status != "ok":
        raise SystemExit(f"tiny run failed: {record.error}")
    return record.step_time_s, record.data_wait_frac


if __name__ == "__main__":
    main()
