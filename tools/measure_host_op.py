"""Measures what eager PyTorch costs the host per dispatched ATen op, forward + autograd backward,
with tensors so small that the kernels do no work: the Python, dispatch and autograd part of the
shipped GPU profiles' assumed `host_op` (profiles/*.yaml; the CUDA launch is added there, assumed).
Ops are counted as echobench counts them (under a dispatch mode, views included); one thread.

  python3 tools/measure_host_op.py     # prints ops per step, the median step, us per op
"""

from __future__ import annotations

import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class Count(TorchDispatchMode):
    n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        Count.n += 1
        return func(*args, **(kwargs or {}))


def main() -> None:
    torch.set_num_threads(1)
    lin, norm, x = torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.randn(4, 8)

    def step():
        h = x
        for _ in range(16):  # 16 residual blocks of norm, linear, gelu
            h = h + torch.nn.functional.gelu(lin(norm(h))) * 0.5
        h.sum().backward()

    for _ in range(50):
        step()
    with Count():
        step()
    times = []
    for _ in range(7):
        start = time.perf_counter()
        for _ in range(50):
            step()
        times.append((time.perf_counter() - start) / 50)
    median = sorted(times)[3]
    print(f"torch {torch.__version__}: {Count.n} ATen ops per step, median {median * 1e3:.3f} ms, "
          f"{median / Count.n * 1e6:.2f} us per op")


if __name__ == "__main__":
    main()
