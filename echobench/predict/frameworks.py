"""Each training framework as it runs at the version a published row names: the defaults a row
that leaves a setting out gets (overlap flags, the gradient reduction's dtype, the attention
kernel), how much of a block's element-wise work its kernels fuse, and how many kernels a block
launches. A row's own settings override these; the prediction's notes name every default taken.

Sources, per framework (the file and commit each default is read at):
- llm-foundry (composer FSDP v1, eager PyTorch): composer's DEFAULT mixed precision reduces
  gradients in fp32 (mosaicml/composer composer/distributed/mosaic_parallelism.py, the releases of
  2023-24); attention: attn_impl triton (FlashAttention's Triton port), the MPT yamls' and
  submit_benchmarks.py's default (llm-foundry scripts/train/yamls/pretrain/mpt-7b.yaml line 20,
  scripts/train/benchmarking/submit_benchmarks.py line 144, at 5e85bd62); eager element-wise kernels;
  activation checkpointing through composer's checkpoint_wrapper with CheckpointImpl.NO_REENTRANT
  (every MPT yaml sets activation_checkpointing_reentrant: false; composer
  composer/trainer/dist_strategy.py of 2024-01, lines 600-605) on torch 2.1 (setup.py pins
  torch>=2.1,<2.1.1), whose early stop leaves each block's last linear un-re-run (recompute.py).
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
  scale-mask-softmax (no FlashAttention in either paper), fused bias-GeLU and bias-dropout-add;
  pipeline messages scattered over the TP ranks and all-gathered on arrival (Narayanan et al. 2021
  section 4.1, Megatron-LM's default then: --no-scatter-gather-tensors-in-pipeline turned it off).
- nemo (24.07, NeMo-Framework-Launcher's training configs at 24c3d6bb): distributed_fused_adam
  with overlap_grad_sync and overlap_param_sync true, ub_tp_comm_overlap and overlap_p2p_comm per
  model config (the rows carry them), TransformerEngine with cuDNN fused attention.
- torchtitan (FSDP2, 2024): mixed_precision_reduce float32 (torchtitan config_manager.py at
  9dec370a), reshard after forward, SDPA (FlashAttention-2 on A100 / H100 at the nightlies of the
  time), torch.compile per row (training.compile). Gradient accumulation without PP runs each
  micro-batch's loss.backward() as is, so FSDP2 reduce-scatters every micro-batch (torchtitan/train.py
  train_step at 000204a4); with PP, torch.distributed.pipelining turns FSDP's gradient sync off for
  every backward and reduces once after the schedule's last one (pipelining/stage.py
  backward_maybe_with_nosync, perform_reduce_grad: the REDUCE_GRAD action after all micro-batches'
  backward), as GENERIC takes it too (every FSDP2 + PP run goes through that schedule).
  Activation checkpointing wraps each block in ptd_checkpoint_wrapper(module,
  preserve_rng_state=False) (torchtitan/parallelisms/parallelize_llama.py line 234 at 9dec370a),
  torch's non-reentrant checkpoint by default: early stop (recompute.py).
Megatron-LM and NeMo recompute through Megatron's own CheckpointFunction (a reentrant autograd
Function that re-runs the whole forward of the block): no early stop. GENERIC takes none either.

Element-wise bytes: where a framework runs eager with its own model code (llm-foundry's MPT,
torchtitan's Llama), its block's bytes as counted on that code (tools/count_card_blocks.py:
every ATen op that is not a GEMM or attention, forward and backward, cards.work.ELEMENTWISE_EAGER);
where its kernels are fused (TransformerEngine in Megatron-LM and NeMo, Megatron's fused kernels,
torch.compile), the per-op count of a pre-norm block (cards.work.ELEMENTWISE_READS_WRITES: each op
reads and writes once, what a fused chain does). Kernels per block and micro-batch (forward,
backward): eager, counted with the bytes; fused, the GEMMs and attention and about as many fused
kernels (12, 24, assumed).

A row that names no framework takes GENERIC, a stated default: what the current frameworks mostly
run (gradient reduction and parameter gathers overlapped, as llm-foundry, NeMo and torchtitan do
and Megatron-LM's published runs turn on; point-to-point overlapped in the interleaved schedule, as
Megatron-LM and NeMo do; no TP overlap; fp32 reduction; FlashAttention-2; fused element-wise
kernels; fused QKV), and its interval spans the row priced at each of SPANNED's defaults (the
frameworks as they run today; the 2021 and 2022 papers' Megatron-LM, without FlashAttention, are
versions of the past, not a default a row leaves unsaid). A framework outside FRAMEWORKS is
described by its own settings (described_settings: those its layout uses), and refused in one
line naming the ones missing; `elementwise_kernels` (fused, or an eager block counted on its
code: mpt, llama) and `fused_qkv` override any framework's.
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
    eager_block: str | None  # the counted eager block its model code is (cards.work.ELEMENTWISE_EAGER), None: fused
    kernels: tuple[int, int]  # kernel launches per block and micro-batch, forward and backward
    fused_qkv: bool  # q, k, v one GEMM (and a gated MLP's gate and up one)
    source: str
    # FSDP / HSDP under several micro-batches: the gradients reduced once a step (after the last
    # micro-batch's backward), not every micro-batch; under plain accumulation and under PP
    reduce_once: bool = False
    reduce_once_pp: bool = False
    # pipeline messages without sequence parallelism split over the TP ranks, all-gathered on arrival
    p2p_scatter_gather: bool = False
    # activation checkpointing through torch's non-reentrant checkpoint: its early stop ends a
    # whole-block re-run at the block's last linear (recompute.py; skips_last_linear)
    ac_early_stop: bool = False


FUSED_KERNELS = (12, 24)  # assumed: a fused block's GEMMs, attention and about as many fused kernels
# Kernel launches per block and micro-batch (forward, backward) of each counted eager block
# (cards.work.ELEMENTWISE_EAGER holds its bytes): llm-foundry's MPT block, torchtitan's Llama block.
EAGER_KERNELS = {"mpt": (5, 10), "llama": (26, 48)}
ELEMENTWISE_KERNELS = ("fused", *EAGER_KERNELS)  # a layout's elementwise_kernels
# The settings a framework gives a row that leaves them out (frameworks.resolved).
SETTINGS = ("overlap_grad_reduce", "overlap_param_gather", "tp_comm_overlap", "overlap_p2p_comm", "grad_reduce_dtype",
            "attention_kernel")

FRAMEWORKS: dict[str, Framework] = {
    "llm-foundry": Framework("llm-foundry", True, True, False, False, "fp32", "triton", "mpt", EAGER_KERNELS["mpt"], True,
                             "composer FSDP v1 (overlap is FSDP's prefetch), DEFAULT mixed precision: fp32 reduce",
                             ac_early_stop=True),
    "megatron-lm": Framework("megatron-lm", False, False, False, True, "fp32", "flash2", None, FUSED_KERNELS, True,
                             "megatron/training/arguments.py at f2e5db40: overlap flags off by default, bf16 -> fp32 "
                             "gradients, TransformerEngine layers"),
    "megatron-lm-2021": Framework("megatron-lm-2021", False, False, False, False, "fp32", "math", None, FUSED_KERNELS, True,
                                  "Megatron-LM of Narayanan et al. 2021: no DP overlap, fp32 gradients, fused-softmax "
                                  "attention", p2p_scatter_gather=True),
    "megatron-lm-2022": Framework("megatron-lm-2022", False, False, False, False, "fp32", "math", None, FUSED_KERNELS, True,
                                  "Megatron-LM of Korthikanti et al. 2022: no DP overlap, fp32 gradients, fused-softmax "
                                  "attention", p2p_scatter_gather=True),
    "nemo": Framework("nemo", True, True, False, True, "fp32", "cudnn", None, FUSED_KERNELS, True,
                      "NeMo-Framework-Launcher 24.07 configs: distributed_fused_adam, overlap_grad_sync / "
                      "overlap_param_sync true, TransformerEngine with cuDNN fused attention"),
    "torchtitan": Framework("torchtitan", True, True, False, False, "fp32", "flash2", "llama", EAGER_KERNELS["llama"], False,
                            "torchtitan config_manager.py at 9dec370a: FSDP2, mixed_precision_reduce float32, SDPA; "
                            "with PP, FSDP reduces once a step (torch.distributed.pipelining)", reduce_once_pp=True,
                            ac_early_stop=True),
}
GENERIC = Framework("", True, True, False, True, "fp32", "flash2", None, FUSED_KERNELS, True,
                    "no framework named: the generic default, gradient reduction, parameter gathers and "
                    "point-to-point overlapped, no TP overlap, fp32 gradients, FlashAttention-2, fused kernels, FSDP "
                    "with PP reducing once a step", reduce_once_pp=True)
# The frameworks whose defaults an unnamed row's interval spans (the module docstring).
SPANNED = ("llm-foundry", "megatron-lm", "nemo", "torchtitan")


def framework(name: str, compile: bool = False) -> Framework:
    """The framework's defaults (FRAMEWORKS; GENERIC where none is named), its element-wise work and
    kernel launches fused where the run compiles (torch.compile fuses each chain of element-wise ops
    into one kernel)."""
    if name == "":
        fw = GENERIC
    elif name in FRAMEWORKS:
        fw = FRAMEWORKS[name]
    else:
        raise PredictError(f"unknown framework {name!r}: give one of {', '.join(FRAMEWORKS)} (or leave it out, or "
                           "describe it by its settings in a card's run)")
    return compiled(fw) if compile else fw


def compiled(fw: Framework) -> Framework:
    return replace(fw, eager_block=None, kernels=FUSED_KERNELS)


def described_settings(layout) -> tuple[str, ...]:
    """The settings a framework outside FRAMEWORKS must give for this layout: those its pricing reads
    (the overlap flags of Megatron's data-parallel reduction, TP overlap with TP, point-to-point
    overlap in the interleaved schedule); the rest change nothing in it and take GENERIC's."""
    need = ["grad_reduce_dtype", "attention_kernel", "elementwise_kernels"]
    if layout.layout == "megatron":
        need.append("overlap_grad_reduce")
        if layout.distributed_optimizer:
            need.append("overlap_param_gather")
    if layout.tp > 1:
        need.append("tp_comm_overlap")
    if layout.vp > 1:
        need.append("overlap_p2p_comm")
    if layout.fsdp and layout.grad_accum > 1:
        need.append("fsdp_reduce_once")
    return tuple(need)


def check_described(layout) -> None:
    """A framework outside FRAMEWORKS with every setting described_settings names (one line naming
    those missing and the fix)."""
    if layout.framework in FRAMEWORKS or layout.framework == "":
        return
    missing = [k for k in described_settings(layout) if getattr(layout, k) is None]
    if missing:
        raise PredictError(f"run: framework {layout.framework!r} is not one of {', '.join(FRAMEWORKS)}: describe it by "
                           f"its settings (add {', '.join(missing)}), name one of those, or leave it out for the "
                           "generic default")


def layout_framework(layout) -> Framework:
    """The framework a layout runs as: a named one's defaults, GENERIC where it names none, one outside
    FRAMEWORKS as its own settings describe it (check_described; GENERIC's where they change nothing);
    then the layout's elementwise_kernels and fused_qkv over the framework's, and compiled where it
    compiles."""
    if layout.framework in FRAMEWORKS or layout.framework == "":
        fw = framework(layout.framework)
    else:
        check_described(layout)
        fw = replace(GENERIC, name=layout.framework, source="described by the row's own settings")
    if layout.elementwise_kernels == "fused":
        fw = replace(fw, eager_block=None, kernels=FUSED_KERNELS)
    elif layout.elementwise_kernels is not None:
        fw = replace(fw, eager_block=layout.elementwise_kernels, kernels=EAGER_KERNELS[layout.elementwise_kernels])
    if layout.fused_qkv is not None:
        fw = replace(fw, fused_qkv=layout.fused_qkv)
    return compiled(fw) if layout.compile else fw


def skips_last_linear(layout, fw: Framework) -> bool:
    """Whether early stop leaves the block's last linear itself un-re-run: a plain autograd op saves
    its inputs before it computes, so the re-run stops before it. A linear that is an autograd
    Function saves after it computes, so the re-run stops just after it: megatron-core's parallel
    linears (a Megatron layout's), an eager float8 linear (torchao's Float8Linear). Compiled, the
    partitioner re-runs only what the backward reads, which leaves it out as well."""
    plain = layout.precision != "fp8" and layout.layout != "megatron"
    return fw.ac_early_stop and (plain or layout.compile)


def resolved(layout, fw: Framework) -> tuple[dict, list[str]]:
    """The layout's options (SETTINGS and fsdp_reduce_once) with the framework's defaults where the
    row leaves them out (None), and a note naming each default taken; the framework's ac_early_stop
    beside them."""
    out, taken = {}, []
    for key in SETTINGS:
        value = getattr(layout, key)
        if value is None:
            value = getattr(fw, key)
            taken.append(f"{key} {value}")
        out[key] = value
    out["ac_early_stop"] = fw.ac_early_stop
    out["fsdp_reduce_once"] = layout.fsdp_reduce_once
    if layout.fsdp_reduce_once is None:
        out["fsdp_reduce_once"] = fw.reduce_once_pp if layout.pp > 1 else fw.reduce_once
        if layout.fsdp and layout.grad_accum > 1:
            taken.append(f"fsdp_reduce_once {out['fsdp_reduce_once']}")
    who = fw.name if fw.name else "the generic"
    notes = [f"{who} defaults taken ({fw.source}): {', '.join(taken)}"] if taken else []
    return out, notes
