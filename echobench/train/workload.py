"""What the measured loop (echobench.train.bench) trains: a Workload supplies everything that differs
between Echo (bench_echo.EchoWorkload) and a model card's plain decoder (bench_card.DecoderWorkload),
so that one loop, one train_step and one run_benchmark serve both, and every feature of the loop
(progress, limits, failure injection, measured windows, --trace and its breakdown) works for each.

A workload gives, in the loop's order: its FLOP report (the record's flops_breakdown and the progress
lines' MFU); the model the backend builds; its micro-batches (read, then prepared: what the measured
window notes of each, then moved to the device); its warm-up shapes; the loss (StepLoss: a
micro-batch's summed loss and the step's normaliser); the counts of the measured micro-batches and
its own fields of the record. Adding a workload is a subclass and its backend's model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Normaliser:
    """The denominator of a step's loss: a count over the global batch (frames, tokens), still being
    summed over the data-parallel replicas while `pending` (an async all-reduce) is not None."""

    count: torch.Tensor | int
    pending: object = None

    def wait(self) -> None:
        """Makes the count usable (on GPU the stream waits, not the host)."""
        if self.pending is not None:
            self.pending.wait()
            self.pending = None

    def value(self) -> torch.Tensor | int:
        """The count, at least one (a step of stand-ins for skipped samples has no frames)."""
        return self.count.clamp(min=1) if isinstance(self.count, torch.Tensor) else max(1, self.count)


class StepLoss:
    """A workload's loss in train_step: each micro-batch's loss summed over its targets (under the
    autocast train_step opens), divided by the step's normaliser."""

    def loss_sum(self, model, micro_batch) -> torch.Tensor:
        raise NotImplementedError

    def normaliser(self, micro_batches: list, dp_group) -> Normaliser:
        raise NotImplementedError


class Workload:
    """What one run trains, seen by the loop. Built with the run's settings; open() once the backend
    has built the model; close() when the loop ends, whatever happened."""

    loss: StepLoss

    def flops_report(self, ac: str) -> dict:
        """The per-sample FLOP report (the record's flops_breakdown), under activation checkpointing ac."""
        raise NotImplementedError

    def title(self) -> str:
        """What the progress line `building ...` names."""
        raise NotImplementedError

    def build(self, info, dtype):
        """The backend's training setup (backends.build_training) of this workload's model."""
        raise NotImplementedError

    def open(self, setup, dp_rank: int, dp_size: int) -> None:
        """Ready the micro-batches of data-parallel rank dp_rank of dp_size and the warm-up shapes."""
        raise NotImplementedError

    def warmup_label(self) -> str:
        """The warm-up shapes, for the progress line `warm-up: ...`."""
        raise NotImplementedError

    def warm_up(self, setup) -> None:
        """One forward and backward of every micro-batch shape the window can meet, before the
        warm-up steps (what compiles, compiles here); the weights do not move."""
        raise NotImplementedError

    def next_batch(self):
        """The next micro-batch from the data, on the host (the only part counted as data wait in a
        traced step)."""
        raise NotImplementedError

    def prepare(self, batch):
        """The micro-batch train_step takes, before to_device."""
        raise NotImplementedError

    def note(self, item):
        """What the measured window keeps of a prepared micro-batch, for figures()."""
        return None

    def to_device(self, item):
        raise NotImplementedError

    def profile_kernels(self, setup) -> dict[str, dict[str, int]]:
        """On a GPU, after the window: per warm-up shape, the attention kernels it ran."""
        raise NotImplementedError

    def figures(self, setup, notes: list, dtype: torch.dtype) -> dict:
        """This rank's counts of its measured micro-batches (`notes`: what note() kept of each) and
        the workload's own per-rank fields (bench_record.summarize reads them)."""
        raise NotImplementedError

    def start_fields(self) -> dict:
        """The workload's fields of the record, set before the run (kept whatever happens)."""
        return {}

    def record_fields(self, record) -> dict:
        """The workload's fields of the record, from the summarized figures."""
        return {}

    def close(self) -> None:
        pass
