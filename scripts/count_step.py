"""Counts one training step on FakeTensors (echobench.stepcount): kernels and memory-bound bytes by part,
eager and compiled (inductor on the CPU as the proxy), GEMM and attention FLOPs, and the step's
projected time by term and MFU on one device of a hardware profile (default: the shipped H200 one).

    PYTHONPATH=. .venv/bin/python scripts/count_step.py [--config SCALE:AC ...] [--json FILE]

Each --config (default 800M:none, 3B:none, 3B:full) is counted eager and compiled at --micro-batch
and the lengths given (default 8 x 750 / 256 / 750, bf16). No model is allocated; the compiled count
runs inductor's code generation for each compiled unit (tens of seconds each on two cores).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def counts_table(title: str, counts: dict) -> Table:
    """Kernels (all kinds) and memory-bound GB by phase and part, one column pair per mode."""
    table = Table(title=title)
    table.add_column("phase")
    table.add_column("part")
    for mode in counts:
        table.add_column(f"{mode}\nkernels", justify="right")
        table.add_column(f"{mode}\nmem GB", justify="right")
    first = next(iter(counts.values()))
    for phase, part in first.rows() + [(None, None)]:
        cells = []
        for count in counts.values():
            cells += [f"{count.total(phase, part).kernels:,}", f"{count.total(phase, part, 'memory').bytes / 1e9:.1f}"]
        table.add_row(phase or "total", part or "", *cells)
    return table


def projection_table(title: str, projections: dict) -> Table:
    table = Table(title=title)
    table.add_column("term")
    for mode in projections:
        table.add_column(f"{mode} ms", justify="right")
    first = next(iter(projections.values()))
    kernels = sorted({k for p in projections.values() for k in p["attention_ms"]})
    rows = [("GEMM", lambda p: p["gemm_ms"])]
    rows += [(f"attention ({k})", lambda p, k=k: p["attention_ms"].get(k, 0.0)) for k in kernels]
    rows += [("memory-bound", lambda p: p["memory_ms"]), ("optimizer + clipping", lambda p: p["optimizer_ms"]),
             ("step", lambda p: p["step_ms"])]
    for name, value in rows:
        table.add_row(name, *(f"{value(p):.1f}" for p in projections.values()))
    table.add_row(f"MFU (of {first['peak_tflops']} TFLOP/s)", *(f"{p['mfu']:.1%}" for p in projections.values()))
    return table


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", action="append", help="SCALE:AC (repeatable; default 800M:none, 3B:none, 3B:full)")
    parser.add_argument("--modes", default="eager,compiled", help="eager, compiled or both (default)")
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--audio-frames", type=int, default=750)
    parser.add_argument("--text-tokens", type=int, default=256)
    parser.add_argument("--speaker-frames", type=int, default=750)
    parser.add_argument("--precision", default="bf16", choices=("bf16", "fp32"))
    parser.add_argument("--cudnn", action="store_true", help="attention as torch runs it where it prefers cuDNN")
    parser.add_argument("--profile", default="h200-hgx-ib", help="hardware profile (name or file) of the projection")
    parser.add_argument("--peak", type=float, help="peak TFLOP/s of the MFU (default: the profile device's datasheet)")
    parser.add_argument("--grad-accum", default="1", help="micro-batches per optimizer step projected, e.g. 1,4 "
                                                            "(the count is one micro-batch and one optimizer step)")
    parser.add_argument("--json", type=Path, help="also write every figure here")
    args = parser.parse_args()

    import torch

    from echobench import stepcount
    from echobench.config import RunConfig
    from echobench.hwprofile import find_profile, load_profile

    console = Console()
    profile = load_profile(find_profile(args.profile))
    modes = [m for m in args.modes.split(",") if m]
    out = {"command": " ".join(sys.argv), "torch": torch.__version__, "python": platform.python_version(),
           "machine": f"{platform.machine()} CPU, {platform.node()}", "date": datetime.date.today().isoformat(),
           "profile": profile.name, "configs": []}
    for spec in args.config or ["800M:none", "3B:none", "3B:full"]:
        scale, _, ac = spec.partition(":")
        cfg = RunConfig(scale=scale, ac=ac or "none", micro_batch=args.micro_batch, audio_frames=args.audio_frames,
                        text_tokens=args.text_tokens, speaker_frames=args.speaker_frames, precision=args.precision)
        counts, projections, seconds = {}, {}, {}
        accums = [int(k) for k in args.grad_accum.split(",")]
        for mode in modes:
            start = time.perf_counter()
            counts[mode] = stepcount.count_step(cfg, compiled=mode == "compiled", prefer_cudnn=args.cudnn)
            seconds[mode] = time.perf_counter() - start
            for k in accums:  # a column per accumulation: the count's forward and backward k times
                name = mode if k == 1 else f"{mode} x{k} accum"
                projections[name] = stepcount.project(counts[mode], profile, args.peak, grad_accum=k)
        title = (f"{scale}, ac {cfg.ac}, micro-batch {cfg.micro_batch}, {cfg.audio_frames} / {cfg.text_tokens} / "
                 f"{cfg.speaker_frames} frames, {cfg.precision}")
        console.print(counts_table(f"{title}: one step's kernels and memory-bound bytes", counts))
        some = next(iter(counts.values()))
        attention = ", ".join(f"{k} x{v.kernels}" for k, v in some.attention.items())
        console.print(f"GEMM {some.total(kind='gemm').flops / 1e12:.2f} TFLOP, attention "
                      f"{some.total(kind='attention').flops / 1e12:.2f} TFLOP ({attention}); model FLOPs "
                      f"{some.settings['model_flops_per_sample'] * cfg.micro_batch / 1e12:.2f} TFLOP")
        console.print(projection_table(f"{title}: projected on one {profile.device} ({profile.name})", projections))
        out["configs"].append({"scale": scale, "ac": cfg.ac, **{mode: {"count": counts[mode].as_dict(),
                                                                       "projection": projections[mode],
                                                                       "count_seconds": seconds[mode]}
                                                                for mode in modes},
                               "projections": projections})
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
