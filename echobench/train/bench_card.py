"""What a card run (setting `card`: a plain decoder, model.decoder) does in bench.py's loop in place of
Echo's: its batches of synthetic tokens, its training step, and the counts of its measured steps.
Timing, warm-up and the measured windows are bench.py's, the same for both workloads.

The global batch of step s is the samples s x G .. (s + 1) x G - 1 (G: global_batch), each a
function of (seed, sample index) only (decoder.synthetic_tokens); data-parallel rank r's k-th
micro-batch takes the micro_batch samples at s x G + (k x dp + r) x micro_batch. Every layout of one
global batch therefore trains on the same samples in each step, and its loss, the next-token
cross-entropy summed over the step's micro-batches and divided by the global batch's predicted
tokens, is the same mean.
"""

from __future__ import annotations

import torch

from echobench.model.config import CardWorkload
from echobench.model.decoder import synthetic_tokens


class TokenBatches:
    """This data-parallel rank's micro-batches, in step order: (micro_batch, seq + 1) token ids on the host."""

    def __init__(self, workload: CardWorkload, micro_batch: int, grad_accum: int, seed: int, dp_rank: int,
                 dp_size: int):
        self.workload, self.micro_batch, self.seed = workload, micro_batch, seed
        self.grad_accum, self.dp_rank, self.dp_size = grad_accum, dp_rank, dp_size
        self.taken = 0  # micro-batches taken

    def __iter__(self):
        return self

    def __next__(self) -> torch.Tensor:
        step, k = divmod(self.taken, self.grad_accum)
        self.taken += 1
        first = (step * self.grad_accum + k) * self.dp_size * self.micro_batch + self.dp_rank * self.micro_batch
        return synthetic_tokens(self.seed, list(range(first, first + self.micro_batch)), self.workload.card.vocab,
                                self.workload.seq)


def card_train_step(setup, micro_batches: list[torch.Tensor], device_type: str, dp_size: int,
                    step_tokens: int) -> torch.Tensor:
    """One optimizer step over its micro-batches (token tensors on the device), as bench.train_step
    does Echo's: each forward under autocast and backward, gradients reduced in the last backward
    only; then clip and update. Each micro-batch's summed loss over the global batch's predicted
    tokens (step_tokens), x dp_size since the replicas average their gradients. Returns the loss."""
    total = None
    for k, tokens in enumerate(micro_batches):
        if setup.gradient_sync is not None and len(micro_batches) > 1:
            setup.gradient_sync(k == len(micro_batches) - 1)
        with torch.autocast(device_type, dtype=setup.autocast_dtype or torch.float32,
                            enabled=setup.autocast_dtype is not None):
            err = setup.model(tokens, reduction="sum")
        loss = err / step_tokens * dp_size
        loss.backward()
        total = loss.detach() if total is None else total + loss.detach()
    setup.clip_grad()
    setup.optimizer.step()
    setup.optimizer.zero_grad(set_to_none=True)
    return total


def card_warmup(setup, workload: CardWorkload, micro_batch: int, device: torch.device) -> None:
    """One forward and backward of a micro-batch of the run's one shape before the warm-up steps (what
    compiles, compiles here), its gradients dropped: the weights do not move."""
    tokens = torch.zeros(micro_batch, workload.seq + 1, dtype=torch.long, device=device)
    with torch.autocast(device.type, dtype=setup.autocast_dtype or torch.float32,
                        enabled=setup.autocast_dtype is not None):
        loss = setup.model(tokens, reduction="mean")
    loss.backward()
    setup.optimizer.zero_grad(set_to_none=True)


def card_counts(micro_batches: int, micro_batch: int, flops_report: dict) -> dict:
    """The counts of a rank's measured micro-batches, in bench.count_measured's keys: samples, model and
    hardware FLOPs (per sample x samples), padded FLOPs (the hardware's: every row is full length); no
    Echo streams (tokens) and no audio."""
    samples = micro_batches * micro_batch
    hardware = flops_report["hardware_flops_per_sample"] * samples
    return {"samples": samples, "model_flops": flops_report["model_flops_per_sample"] * samples,
            "hardware_flops": hardware, "padded_flops": hardware, "audio_frames": 0,
            "tokens": {}}
