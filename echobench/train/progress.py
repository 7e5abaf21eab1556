"""The lines a run prints while it runs (rank 0 only, into the job's log as well): what it is doing
(building, warm-up, the measured window, profiling) and, at most once per `progress_every_s`, a step
line: step, phase, loss, step time, samples/s, TFLOP/s, MFU and memory, as torchtitan logs them.

The measured window gains no device sync for a line: its figures come from the host's clock between
the lines, and the loss is read only where reading it costs no sync (the CPU, or outside the window).
A line printed inside the window is host time in the next step (microseconds, once per interval). The record's figures, from the step timer, are the ones to quote; these say the run is alive
and roughly how fast it goes.
"""

from __future__ import annotations

import resource
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from echobench.records.run_figures import peak_fraction

GIB = 1024**3


def say(text: str) -> None:
    """One line on stdout, flushed: a job's log shows it as it happens."""
    print(f"[echobench] {text}", file=sys.stdout, flush=True)


def memory_gib(device: torch.device) -> float:
    """Peak memory so far without a device sync: the CUDA allocator's host-side counter, else the
    process's peak resident set."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / GIB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB


@dataclass
class Progress:
    """Step lines of rank 0, at most one per `every_s` seconds (0: every step; None: none).
    `flops_per_step`: model FLOPs per step per rank; `peak_tflops`: for the MFU (None: no MFU)."""

    every_s: float | None
    total_steps: int
    samples_per_step: int
    flops_per_step: float
    peak_tflops: float | None
    device: torch.device
    enabled: bool = True  # rank 0
    clock: Callable[[], float] = time.monotonic
    out: Callable[[str], None] = say
    metrics: object = None  # a metrics_log logger: gets each step line's figures
    _since: tuple[float, int] = field(default=(0.0, 0), init=False)

    def start(self, step: int = 0) -> None:
        """Steps are timed from here (the first step line covers the steps since)."""
        self._since = (self.clock(), step)

    def phase(self, text: str) -> None:
        """A line saying what the run does now (always, once per phase)."""
        if self.enabled and self.every_s is not None:
            self.out(text)

    def step(self, step: int, phase: str, loss: torch.Tensor | None) -> bool:
        """After step `step` (1-based, of total_steps): a line if `every_s` has passed since the last
        one (then True). `loss`: the step's loss where reading it costs no sync, else None."""
        if not self.enabled or self.every_s is None:
            return False
        now = self.clock()
        (then, then_step) = self._since
        if now - then < self.every_s or step <= then_step:
            return False
        step_s = (now - then) / (step - then_step)
        tflops = self.flops_per_step / step_s / 1e12
        figures = {"step_time_s": step_s, "samples_per_s": self.samples_per_step / step_s, "tflops": tflops,
                   **({"mfu": peak_fraction(tflops, self.peak_tflops)} if self.peak_tflops else {}),
                   "memory_gib": memory_gib(self.device), **({"loss": float(loss)} if loss is not None else {})}
        parts = [f"step {step}/{self.total_steps} {phase}",
                 f"loss {figures['loss']:.4f}" if loss is not None else "loss -",
                 f"{step_s:.3g} s/step", f"{figures['samples_per_s']:.3g} samples/s", f"{tflops:.3g} TFLOP/s"]
        if self.peak_tflops:
            parts.append(f"MFU {figures['mfu']:.1%}")
        parts.append(f"mem {figures['memory_gib']:.2f} GiB")
        self.out(", ".join(parts) + (" (host clock)" if phase == "measured" else ""))
        if self.metrics is not None:
            self.metrics.log(step, figures)
        self._since = (now, step)
        return True
