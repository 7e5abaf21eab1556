"""Fits the GEMM shape model's three constants (devicerates.GEMM_FIT: the rate scale, the k-loop cost per
tile k0, the fixed cost per GEMM t0) to OpenXLA's measured H100 bf16 matmul table (the XLA_H100 rows in
tests/test_compute_pricing.py, their source there): a grid search for the least mean |log error| over
every second row (sorted by (m, n, k)) of the rows of at least 2^31 FLOPs, then the error on the other
rows, which the fit did not see, and on the smaller (launch-bound) rows outside it.

  python3 tools/fit_gemm_model.py     # prints the constants and the three errors (seconds)
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from echobench.hardware.devicerates import gemm_efficiency  # after the path: run as a script from any directory
from test_compute_pricing import XLA_H100  # the published rows live beside the test that holds them

SMS = 132  # H100 SXM


def rate(shape: tuple[int, int, int], tflops: float, k0: float, t0_s: float) -> float:
    m, n, k = shape
    flops = 2 * m * n * k
    busy = flops / (tflops * 1e12 * gemm_efficiency(m, n, k, SMS)) * (1 + k0 / k)
    return flops / (busy + t0_s) / 1e12


def errors(rows, *constants) -> tuple[float, float]:
    e = [abs(math.log(rate(s, *constants) / XLA_H100[s])) for s in rows]
    return sum(e) / len(e), max(e)


def main() -> None:
    rows = sorted(s for s in XLA_H100 if 2 * s[0] * s[1] * s[2] >= 2**31)
    fit, held_out = rows[0::2], rows[1::2]
    small = [s for s in XLA_H100 if 2 * s[0] * s[1] * s[2] < 2**31]
    grid = ((r, k0, t0 / 2 * 1e-6) for r in range(800, 990, 10) for k0 in range(0, 300, 10) for t0 in range(30))
    best = min(grid, key=lambda c: errors(fit, *c)[0])
    print(f"tflops {best[0]}, k0 {best[1]}, t0 {best[2] * 1e6:.1f} us")
    for name, part in (("fitted rows", fit), ("held-out rows", held_out), ("rows under 2^31 FLOPs", small)):
        mean, worst = errors(part, *best)
        print(f"{name} ({len(part)}): mean |log error| {mean:.3f}, max {worst:.3f}")


if __name__ == "__main__":
    main()
