"""Each training framework as it runs at the version a published row names: the defaults a row
that leaves a setting out gets (overlap flags, the gradient reduction's dtype, the attention
kernel), how much of a block's element-wise work its kernels fuse, and how many kernels a block
launches. A row's own settings override these; the prediction's notes name every default taken.

Sources, per framework (the file and commit each default is read at):
- llm-foundry (composer FSDP v1, eager PyTorch): composer's DEFAULT mixed precision reduces
  gradients in fp32 (mosaicml/composer composer/distributed/mosaic_parallelism.py, the releases of
  2023-24); attention: attn_impl triton (FlashAttention's Triton port), the MPT yamls' and
  submit_benchmarks.py's default (llm-foundry scripts/train/yamls/pretrain/mpt-7b.yaml line 20,
  scripts/train/benchmarking/submit_benchmarks.py line 144, at 5e85bd62); eager element-wise kernels.
- megatron-lm (Megatron-Core 0.9, 2024): --overlap-grad-reduce, --overlap-param-gather and
  --tp-comm-overlap default off, p2p overlap on (--no-overlap-p2p-communication turns it off; in
  effect only in the interleaved schedule, lines 254-277), bf16 forces fp32 gradient accumulation
  and reduction (megatron/training/arguments.py at f2e5db40, lines 199-305); with
  --overlap-grad-reduce the interleaved schedule reduces each model chunk's gradients after its
  last backward (megatron/core/pipeline_parallel/schedules.py: pipeline.interleaved_grad_exposed);
  TransformerEngine layers: attention through TE's DotProductAttention (FlashAttention-2 where
  installed, cuDNN's fused attention otherwise: which one, unstated).
- megatron-lm-2021 / megatron-lm-2022 (Narayanan et al. 2021; Korthikanti et al. 2022): no
  overlap of the data-parallel reduction, fp32 gradients, softmax attention with Megatron's fused
  scale-mask-softmax (no FlashAttention in either paper), fused bias-GeLU and bias-dropout-add.
- nemo (24.07, NeMo-Framework-Launcher's training configs at 24c3d6bb): distributed_fused_adam
  with overlap_grad_sync and overlap_param_sync true, ub_tp_comm_overlap and overlap_p2p_comm per
  model config (the rows carry them), TransformerEngine with cuDNN fused attention.
- torchtitan (FSDP2, 2024): mixed_precision_reduce float32 (torchtitan config_manager.py at
  9dec370a), reshard after forward, SDPA (FlashAttention-2 on A100 / H100 at the nightlies of the
  time), torch.compile per row (training.compile).

Element-wise bytes: where a framework runs eager with its own model code (llm-foundry's MPT,
torchtitan's Llama), its block's bytes as counted on that code (tools/count_card_blocks.py:
every ATen op that is not a GEMM or attention, forward and backward, card_work.ELEMENTWISE_EAGER);
where its kernels are fused (TransformerEngine in Megatron-LM and NeMo, Megatron's fused kernels,
torch.compile), the per-op count of a pre-norm block (card_work.ELEMENTWISE_READS_WRITES: each op
reads and writes once, what a fused chain does). Kernels per block and micro-batch (forward,
backward): eager, counted with the bytes; fused, the GEMMs and attention and about as many fused
kernels (12, 24, assumed).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from echobench.predict.errors import PredictError


@dataclass(frozen=True)
class Framework:
    """A framework's defaults and how its kernels run (the module docstring)."""

    name: str
    overlap_grad_reduce: bool
    overlap_param_gather: bool
    tp_comm_overlap: bool
    overlap_p2p_comm: bool
    grad_reduce_dtype: str
    attention_kernel: str
    eager_block: str | None  # the counted eager block its model code is (card_work.ELEMENTWISE_EAGER), None: fused
    kernels: tuple[int, int]  # kernel launches per block and micro-batch, forward and backward
    fused_qkv: bool  # q, k, v one GEMM (and a gated MLP's gate and up one)
    source: str


FUSED_KERNELS = (12, 24)  # assumed: a fused block's GEMMs, attention and about as many fused kernels

FRAMEWORKS: dict[str, Framework] = {
    "llm-foundry": Framework("llm-foundry", True, True, False, False, "fp32", "triton", "mpt", (5, 10), True,
                             "composer FSDP v1 (overlap is FSDP's prefetch), DEFAULT mixed precision: fp32 reduce"),
    "megatron-lm": Framework("megatron-lm", False, False, False, True, "fp32", "flash2", None, FUSED_KERNELS, True,
                             "megatron/training/arguments.py at f2e5db40: overlap flags off by default, bf16 -> fp32 "
                             "gradients, TransformerEngine layers"),
    "megatron-lm-2021": Framework("megatron-lm-2021", False, False, False, False, "fp32", "math", None, FUSED_KERNELS, True,
                                  "Megatron-LM of Narayanan et al. 2021: no DP overlap, fp32 gradients, fused-softmax "
                                  "attention"),
    "megatron-lm-2022": Framework("megatron-lm-2022", False, False, False, False, "fp32", "math", None, FUSED_KERNELS, True,
                                  "Megatron-LM of Korthikanti et al. 2022: no DP overlap, fp32 gradients, fused-softmax "
                                  "attention"),
    "nemo": Framework("nemo", True, True, False, True, "fp32", "cudnn", None, FUSED_KERNELS, True,
                      "NeMo-Framework-Launcher 24.07 configs: distributed_fused_adam, overlap_grad_sync / "
                      "overlap_param_sync true, TransformerEngine with cuDNN fused attention"),
    "torchtitan": Framework("torchtitan", True, True, False, False, "fp32", "flash2", "llama", (26, 48), False,
                            "torchtitan config_manager.py at 9dec370a: FSDP2, mixed_precision_reduce float32, SDPA"),
    "": Framework("", False, False, False, False, "fp32", "flash2", None, FUSED_KERNELS, True,
                  "no framework named: every overlap off, fp32 gradients, fused element-wise kernels (assumed)"),
}


def framework(name: str, compile: bool = False) -> Framework:
    """The framework's defaults (FRAMEWORKS), its element-wise work and kernel launches fused where
    the run compiles (torch.compile fuses each chain of element-wise ops into one kernel)."""
    try:
        fw = FRAMEWORKS[name]
    except KeyError:
        raise PredictError(f"unknown framework {name!r}: give one of {', '.join(k for k in FRAMEWORKS if k)} "
                           "(or leave it out)") from None
    if compile:
        fw = replace(fw, eager_block=None, kernels=FUSED_KERNELS)
    return fw


def resolved(layout, fw: Framework) -> tuple[dict, list[str]]:
    """The layout's options with the framework's defaults where the row leaves them out (None), and a
    note naming each default taken."""
    out, taken = {}, []
    for key in ("overlap_grad_reduce", "overlap_param_gather", "tp_comm_overlap", "overlap_p2p_comm",
                "grad_reduce_dtype", "attention_kernel"):
        value = getattr(layout, key)
        if value is None:
            value = getattr(fw, key)
            taken.append(f"{key} {value}")
        out[key] = value
    notes = [f"{fw.name or 'no framework'} defaults taken ({fw.source}): {', '.join(taken)}"] if taken else []
    return out, notes
