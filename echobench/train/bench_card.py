"""A card run (setting `card`: a plain decoder, model.decoder) in the measured loop
(echobench.train.bench): the Workload whose batches are synthetic tokens, whose loss is the next-token
cross-entropy, and whose counts are the decoder's FLOP report times the measured samples. Timing,
warm-up, the measured windows, --trace and the limits are the loop's, the same for every workload.

The global batch of step s is the samples s x G .. (s + 1) x G - 1 (G: global_batch), each a
function of (seed, sample index) only (decoder.synthetic_tokens); data-parallel rank r's k-th
micro-batch takes the micro_batch samples at s x G + (k x dp + r) x micro_batch. Every layout of one
global batch therefore trains on the same samples in each step, and its loss, the next-token
cross-entropy summed over the step's micro-batches and divided by the global batch's predicted
tokens, is the same mean.
"""

from __future__ import annotations

import torch

from echobench.backends import build_training
from echobench.model.config import CardWorkload
from echobench.model.decoder import FLOP_CONVENTION, decoder_flops_report, synthetic_tokens
from echobench.records.config import RunConfig
from echobench.records.run_figures import mfu_of
from echobench.train.bench_warmup import profiled_attention_kernels
from echobench.train.kernels import card_sdpa_choices
from echobench.train.workload import Normaliser, StepLoss, Workload


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


class CardLoss(StepLoss):
    """A card's loss: a micro-batch's (token ids on the device) next-token cross-entropy summed, over the
    global batch's predicted tokens (step_tokens)."""

    def __init__(self, step_tokens: int):
        self.step_tokens = step_tokens

    def loss_sum(self, model, micro_batch) -> torch.Tensor:
        return model(micro_batch, reduction="sum")

    def normaliser(self, micro_batches: list, dp_group) -> Normaliser:
        return Normaliser(self.step_tokens)


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
    """The counts of a rank's measured micro-batches, in bench_echo.count_measured's keys: samples, model and
    hardware FLOPs (per sample x samples), padded FLOPs (the hardware's: every row is full length); no
    Echo streams (tokens) and no audio."""
    samples = micro_batches * micro_batch
    hardware = flops_report["hardware_flops_per_sample"] * samples
    return {"samples": samples, "model_flops": flops_report["model_flops_per_sample"] * samples,
            "hardware_flops": hardware, "padded_flops": hardware, "audio_frames": 0,
            "tokens": {}}


def card_figures(workload: CardWorkload, record) -> dict:
    """The record's `card`: the workload (config.CardWorkload.as_record), echobench's FLOP convention
    (the MFU's) and, for a published row with a FLOP formula, the measured throughput and MFU under
    the row's own convention (its FLOPs per token x the measured tokens, the same peak); the tokens
    per second per device."""
    out = {**workload.as_record(), "flops_convention": FLOP_CONVENTION}
    if record.status != "ok":
        return out
    tokens_per_s_per_gpu = record.measured_samples * workload.seq / record.measured_time_s / record.world_size
    out["tokens_per_s_per_gpu"] = tokens_per_s_per_gpu
    if workload.row_flops_per_token:
        per_gpu = workload.row_flops_per_token * tokens_per_s_per_gpu
        out.update(row_tflops_per_gpu=per_gpu / 1e12,
                   row_mfu=mfu_of(per_gpu, 1, 1, record.peak_tflops) if record.peak_tflops else None)
    return out


class DecoderWorkload(Workload):
    """A card's plain decoder (workload: model.config.CardWorkload, read by the command) on synthetic
    token batches of the card's one shape, micro_batch x seq."""

    def __init__(self, cfg: RunConfig, workload: CardWorkload):
        self.cfg, self.workload = cfg, workload
        self.loss = CardLoss(cfg.global_batch * workload.seq)

    def flops_report(self, ac: str) -> dict:
        return decoder_flops_report(self.workload.card, self.workload.seq, ac)

    def title(self) -> str:
        card, w = self.workload.card, self.workload
        return f"card {w.label} ({card.layers} layers, hidden {card.hidden}, seq {w.seq})"

    def build(self, info, dtype):
        self.info = info
        return build_training(self.cfg, info, dtype, self.workload)

    def open(self, setup, dp_rank: int, dp_size: int) -> None:
        cfg = self.cfg
        self.batches = TokenBatches(self.workload, cfg.micro_batch, cfg.grad_accum, cfg.seed, dp_rank, dp_size)

    def shape(self) -> str:
        return f"{self.cfg.micro_batch} x {self.workload.seq} tokens"  # the run's one micro-batch shape

    def warmup_label(self) -> str:
        return f"1 shape ({self.shape()})"

    def warm_up(self, setup) -> None:
        card_warmup(setup, self.workload, self.cfg.micro_batch, self.info.device)

    def next_batch(self):
        return next(self.batches)

    def prepare(self, batch):
        return batch  # every micro-batch is the one shape: nothing to note

    def to_device(self, item):
        return item.to(self.info.device)

    def profile_kernels(self, setup) -> dict[str, dict[str, int]]:
        # As Echo's warm-up variants: the run's one micro-batch shape once more after the window,
        # profiled (one forward and backward; every rank runs it, so its collectives match).
        return {self.shape(): profiled_attention_kernels(lambda: self.warm_up(setup), self.info.device)}

    def figures(self, setup, notes: list, dtype: torch.dtype) -> dict:
        cfg, w = self.cfg, self.workload
        flops_report = self.flops_report(setup.info.get("ac_mode", cfg.ac))
        return {
            **card_counts(len(notes), cfg.micro_batch, flops_report),
            "padded_audio_frames": [],
            "skipped_samples": 0,
            "sdpa_backends_predicted": card_sdpa_choices(w.card, cfg.micro_batch, w.seq, self.info.device,
                                                         setup.autocast_dtype or dtype, tp=cfg.tp),
            "warmup_variants": [self.shape()],
        }

    def start_fields(self) -> dict:
        return {"card": self.workload.as_record()}

    def record_fields(self, record) -> dict:
        # no audio; the card and the MFU under a published row's convention
        return {"audio_seconds_per_s": None, "card": card_figures(self.workload, record)}
