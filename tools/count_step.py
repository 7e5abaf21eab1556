"""Counts one training step on FakeTensors (echobench.predict.stepcount): kernels and memory-bound bytes by part,
eager and compiled (inductor on the CPU as the proxy), GEMM and attention FLOPs, for a micro-batch
that keeps its samples' conditioning and one that drops it (its DiT attends over a key mask); then
the step's projected time by term and MFU on one device of a hardware profile (default: the shipped
H200 one), the two micro-batches weighted by the run's share of masked ones
(echobench.predict.stepcount_project: every rate from echobench.hardware.devicerates, with its source).

    PYTHONPATH=. .venv/bin/python tools/count_step.py [--config SCALE:AC ...] [--json FILE]

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
    rows = [("GEMM (per shape)", lambda p: p["gemm_ms"])]
    rows += [(f"attention ({k})", lambda p, k=k: p["attention_ms"].get(k, 0.0)) for k in kernels]
    rows += [("memory-bound", lambda p: p["memory_ms"]), ("kernel gaps", lambda p: p["gaps_ms"]),
             ("optimizer + clipping", lambda p: p["optimizer_ms"]), ("step", lambda p: p["step_ms"])]
    for name, value in rows:
        table.add_row(name, *(f"{value(p):.1f}" for p in projections.values()))
    table.add_row("masked micro-batches", *(f"{p['masked_share']:.0%}" for p in projections.values()))
    table.add_row(f"MFU (of {first['peak_tflops']} TFLOP/s)", *(f"{p['mfu']:.1%}" for p in projections.values()))
    return table


def rates_lines(projection: dict) -> list[str]:
    """Each rate the projection priced with, and its source."""
    r = projection["rates"]
    g = r["gemm"]
    out = [f"GEMM: {g['flop_weighted_tflops']:.0f} TFLOP/s FLOP-weighted over the shapes; the largest "
           f"{'x'.join(map(str, g['largest_shape']))} at {g['tflops']:.0f}: {g['source']}"]
    out += [f"attention {k}: {a['tflops']:.0f} TFLOP/s at {a['at'][0]} x {a['at'][1]} (head_dim {a['at'][2]})"
            f"{' (assumed)' if a['assumed'] else ''}: {a['source']}" for k, a in r["attention"].items()]
    out += [f"{name}: {r[name]['value']:.4g} {r[name]['unit']}{' (assumed)' if r[name]['assumed'] else ''}: "
            f"{r[name]['source']}" for name in ("memory", "kernel_gap", "optimizer", "clock")]
    return out


def ablation(counts: dict, share: float, profile, peak, project, fit_type) -> list[tuple[str, dict]]:
    """The compiled micro-batch priced as the 2026-12-02 projection priced it, then with each honest
    term added in turn: (what was added, the projection)."""
    unmasked, masked = counts["compiled"], counts["compiled masked"]
    no_triton = [m for m in profile.memory if m.op != "triton"]
    bare = profile.model_copy(update={"sm_count": None, "kernel_gap": None, "memory": no_triton})
    stages = [("the best GEMM point for every shape, no clock, memory-bound at the add bandwidth, no gaps, "
               "every micro-batch unmasked (2026-12-02's terms)", bare, fit_type(), 0.0),
              ("+ each GEMM at its shape (tile and wave quantization)",
               bare.model_copy(update={"sm_count": profile.sm_count}), fit_type(), 0.0),
              ("+ the sustained clock (the fitted in-step clock)", bare.model_copy(update={"sm_count": profile.sm_count}),
               None, 0.0),
              ("+ compiled memory-bound work at Triton's bandwidth",
               profile.model_copy(update={"kernel_gap": None}), None, 0.0),
              ("+ a gap per kernel", profile, None, 0.0),
              (f"+ the path mix ({share:.0%} of micro-batches masked: FlexAttention)", profile, None, share)]
    return [(label, project([(unmasked, 1 - sh), (masked, sh)], prof, peak, fit=fit))
            for label, prof, fit, sh in stages]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", action="append", help="SCALE:AC[:PRECISION] (repeatable; default 800M:none, "
                                                          "3B:none, 3B:full; precision bf16, fp8 or fp8-rowwise)")
    parser.add_argument("--modes", default="eager,compiled", help="eager, compiled or both (default)")
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--audio-frames", type=int, default=750)
    parser.add_argument("--text-tokens", type=int, default=256)
    parser.add_argument("--speaker-frames", type=int, default=750)
    parser.add_argument("--cudnn", action="store_true", help="attention as torch runs it where it prefers cuDNN")
    parser.add_argument("--profile", default="h200-hgx-ib", help="hardware profile (name or file) of the projection")
    parser.add_argument("--peak", type=float, help="peak TFLOP/s of the MFU (default: the profile device's datasheet)")
    parser.add_argument("--grad-accum", default="1", help="micro-batches per optimizer step projected, e.g. 1,4 "
                                                            "(the count is one micro-batch and one optimizer step)")
    parser.add_argument("--cfg-drop", default="mask", choices=("mask", "null"),
                        help="how dropped conditioning is formed (the run setting): mask weights in the masked "
                             "micro-batches, null attends without a mask")
    parser.add_argument("--from-json", type=Path, help="price the counts a --json of this script wrote, again "
                                                       "(another profile or accumulation; nothing is counted)")
    parser.add_argument("--ablate", action="store_true", help="also price each compiled count as the 2026-12-02 "
                                                                  "projection did, then with each honest term added")
    parser.add_argument("--json", type=Path, help="also write every figure here")
    args = parser.parse_args()

    import torch

    from echobench.hardware import devicerates
    from echobench.predict import stepcount
    from echobench.predict import stepcount_project
    from echobench.records.config import RunConfig
    from echobench.hardware.profile import find_profile, load_profile
    from echobench.model.config import masked_share

    console = Console()
    profile = load_profile(find_profile(args.profile))
    modes = [m for m in args.modes.split(",") if m]
    accums = [int(k) for k in args.grad_accum.split(",")]
    out = {"command": " ".join(sys.argv), "torch": torch.__version__, "python": platform.python_version(),
           "machine": f"{platform.machine()} CPU, {platform.node()}", "date": datetime.date.today().isoformat(),
           "profile": profile.name, "configs": []}
    if args.from_json:
        stored = json.loads(args.from_json.read_text())
        out["counted_by"] = stored["command"]
        configs = [(c["title"], c["cfg"], {name: stepcount.StepCount.from_dict(v["count"]) for name, v in c.items()
                                          if isinstance(v, dict) and "count" in v}, {}) for c in stored["configs"]]
    else:
        configs = []
        for spec in args.config or ["800M:none", "3B:none", "3B:full"]:
            parts = spec.split(":")
            scale, ac, precision = parts[0], (parts[1:2] or ["none"])[0], (parts[2:3] or ["bf16"])[0]
            precision, _, recipe = precision.partition("-")  # fp8-rowwise: torchao's rowwise recipe
            cfg = RunConfig(scale=scale, ac=ac, micro_batch=args.micro_batch, audio_frames=args.audio_frames,
                            text_tokens=args.text_tokens, speaker_frames=args.speaker_frames, precision=precision,
                            float8_recipe=recipe or "tensorwise")
            counts, seconds = {}, {}
            for mode in modes:
                for masked in (False, True):
                    name = f"{mode} masked" if masked else mode
                    start = time.perf_counter()
                    counts[name] = stepcount.count_step(cfg, compiled=mode == "compiled", prefer_cudnn=args.cudnn,
                                                        masked=masked)
                    seconds[name] = time.perf_counter() - start
            title = (f"{scale}, ac {cfg.ac}, micro-batch {cfg.micro_batch}, {cfg.audio_frames} / {cfg.text_tokens} / "
                     f"{cfg.speaker_frames} frames, {cfg.precision}"
                     + (f" {cfg.float8_recipe}" if cfg.precision == "fp8" else ""))
            configs.append((title, cfg.to_dict(), counts, seconds))
    for title, settings, counts, seconds in configs:
        cfg = RunConfig(**settings)
        share = masked_share(cfg.micro_batch, cfg.model_config().cfg_dropout, args.cfg_drop)
        projections = {}
        for mode in [m for m in counts if not m.endswith(" masked")]:
            for k in accums:  # a column per accumulation: the count's forward and backward k times
                name = mode if k == 1 else f"{mode} x{k} accum"
                projections[name] = stepcount_project.project(
                    [(counts[mode], 1 - share), (counts[f"{mode} masked"], share)], profile, args.peak, grad_accum=k)
        console.print(counts_table(f"{title}: one step's kernels and memory-bound bytes", counts))
        for name, some in counts.items():
            attention = ", ".join(f"{k} x{v.kernels}" for k, v in some.attention.items())
            console.print(f"{name}: GEMM {some.total(kind='gemm').flops / 1e12:.2f} TFLOP, attention "
                          f"{some.total(kind='attention').flops / 1e12:.2f} TFLOP ({attention}); model FLOPs "
                          f"{some.settings['model_flops_per_sample'] * cfg.micro_batch / 1e12:.2f} TFLOP")
        console.print(projection_table(f"{title}, cfg_drop {args.cfg_drop}: projected on one {profile.device} "
                                       f"({profile.name})", projections))
        for line in rates_lines(next(iter(projections.values()))):
            console.print(line, markup=False, highlight=False)
        steps = []
        if args.ablate and "compiled" in counts:
            steps = ablation(counts, share, profile, args.peak, stepcount_project.project, devicerates.InStepFit)
            table = Table(title=f"{title}: compiled, one micro-batch, each term added")
            for col in ("term", "step ms", "MFU"):
                table.add_column(col, justify="left" if col == "term" else "right")
            for label, p in steps:
                table.add_row(label, f"{p['step_ms']:.1f}", f"{p['mfu']:.1%}")
            console.print(table)
        out["configs"].append({"title": title, "cfg": settings, "masked_share": share,
                               "ablation": [{"term": label, "step_ms": p["step_ms"], "mfu": p["mfu"]} for label, p in steps],
                               **{name: {"count": c.as_dict(), "count_seconds": seconds.get(name)}
                                  for name, c in counts.items()},
                               "projections": projections})
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
