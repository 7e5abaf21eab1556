"""What each backend's runs need, checked without torch (a plan, a sweep or a `run` before it launches
asks, and none of them should pay torch's import for it): the registry's (echobench.backends) check
of a run after its layout.

May import: nothing of echobench but the model's config (a run's `model_config()`, a card's decoder_problem).
"""

from __future__ import annotations

import importlib.util

from echobench.model.config import decoder_problem

DISTRIBUTED_OPTIMIZER_CPU = ("distributed_optimizer runs on a GPU only (megatron-core's distributed optimizer takes "
                             "torch.cuda parameters): drop --distributed-optimizer on the CPU")
GRAD_REDUCE_BF16 = ("grad_reduce_dtype bf16: megatron reduces gradients in its buffers' dtype, the parameters' when "
                    "not fp32, and parameters are bf16 only with precision bf16 on a GPU: use grad_reduce_dtype fp32")


def te_installed() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def torchtitan_problem(cfg) -> str | None:
    """Why this torchtitan run cannot work (None when it can); the registry has checked the layout."""
    if cfg.distributed_optimizer:
        return ("distributed_optimizer is megatron-core's: use --framework megatron, or fsdp2 / hsdp to shard the "
                "optimizer state on torchtitan")
    if cfg.layout.single and cfg.world_size != 1:
        return f"single runs on one process, not {cfg.nodes} node(s) x {cfg.gpus_per_node}: use ddp, fsdp2 or hsdp"
    if cfg.layout.data_parallel and cfg.world_size < 2:
        return f"parallelism {cfg.parallelism!r} needs at least 2 processes (--nproc 2): use single for one"
    if cfg.layout.hybrid and cfg.nodes < 2:
        return "hsdp replicates across nodes and shards inside one: it needs nodes >= 2 (on one node use fsdp2)"
    return master_weights_problem(cfg)


def master_weights_problem(cfg) -> str | None:
    """Why this run's master_weights (or grad_accum_dtype) setting cannot run (None when it can)."""
    if cfg.master_weights == "auto":
        return grad_accum_dtype_problem(cfg)
    if cfg.layout.shards_parameters:
        return (f"master_weights {cfg.master_weights}: {cfg.parallelism} gathers bf16 weights from its fp32 shards "
                "(FSDP2's MixedPrecisionPolicy) whatever it is set to: use master_weights auto")
    if cfg.master_weights != "bf16-compute":
        return grad_accum_dtype_problem(cfg)
    if cfg.precision == "fp8":
        return ("master_weights bf16-compute: fp8 runs keep fp32 weights for torchao's float8 linears: use "
                "master_weights auto or fp32-autocast")
    if cfg.precision == "fp32":
        return "master_weights bf16-compute: precision fp32 computes in fp32: use precision bf16 (or auto on a GPU)"
    if cfg.layout.replicates and cfg.grad_reduce_dtype != "bf16":
        return ("master_weights bf16-compute: DDP reduces the bf16 gradients in bf16, not grad_reduce_dtype "
                f"{cfg.grad_reduce_dtype}: add --grad-reduce-dtype bf16")
    return grad_accum_dtype_problem(cfg)


def grad_accum_dtype_problem(cfg) -> str | None:
    """Why this run's grad_accum_dtype cannot run (None when it can): only bf16-compute chooses."""
    if cfg.grad_accum_dtype == "auto":
        return None
    if cfg.layout.shards_parameters:
        return (f"grad_accum_dtype {cfg.grad_accum_dtype}: {cfg.parallelism} sums its gradients in grad_reduce_dtype "
                "(FSDP2's reduce dtype): use grad_accum_dtype auto and set grad_reduce_dtype")
    if cfg.layout.replicates and cfg.grad_accum_dtype == "fp32":
        return ("grad_accum_dtype fp32: DDP sums the bf16 gradients of bf16-compute in its bf16 reduction buckets: "
                "use grad_accum_dtype auto (bf16), or fsdp2 with grad_reduce_dtype fp32")
    if cfg.grad_accum_dtype == "bf16" and (cfg.precision == "fp32" or cfg.master_weights == "fp32-autocast"):
        return ("grad_accum_dtype bf16: fp32 parameters have fp32 gradients: use master_weights bf16-compute, or "
                "grad_accum_dtype auto")
    return None


def megatron_problem(cfg) -> str | None:
    """Why this megatron tpN run cannot work (None when it can); the registry has checked the layout.
    A card run's model is checked by card_problem (the card is read by the command, not here); its
    decoder runs megatron-core's local layers."""
    tp, par, gpn, model = cfg.tp, cfg.parallelism, cfg.gpus_per_node, cfg.model_config()
    if tp > gpn:
        return f"{par} needs {tp} GPUs in one node; a node has {gpn}"
    if cfg.world_size % tp:
        return f"world size {cfg.world_size} is not divisible by tp={tp}"
    if gpn % tp:
        return (f"tp={tp} must divide the {gpn} processes per node "
                f"(tensor parallelism stays inside a node): change --tp or --nproc")
    if cfg.card is None and model.heads % tp:
        return f"tp={tp} does not divide the {model.heads} attention heads of {cfg.scale}"
    if cfg.card is None and model.mlp % tp:
        return f"tp={tp} does not divide the DiT's MLP width {model.mlp} ({cfg.scale})"
    if cfg.precision == "fp8":
        return ("fp8 on megatron would need TransformerEngine's fp8 layers, which echobench does not drive: "
                "use --framework torchtitan for fp8 (torchao float8), or precision bf16")
    if cfg.te == "on" and cfg.card is not None:
        return ("--te on: a card's TP decoder runs megatron-core's local layers, not TransformerEngine's: use "
                "--te auto or --te off")
    if cfg.te == "on" and not te_installed():
        return "--te on: transformer_engine is not installed here; use --te auto or --te off"
    if cfg.sequence_parallel is True:  # auto turns it on only where it can run (RunConfig.sequence_parallel_on)
        if tp == 1:
            return "sequence parallelism needs tp > 1"
        if cfg.card is None and cfg.audio_frames % tp:  # a card's seq: card_problem
            return f"sequence parallelism needs --audio-frames ({cfg.audio_frames}) divisible by tp={tp}"
        if cfg.batching == "bucket" and cfg.buckets and (odd := [b for b in map(int, cfg.buckets.split(",")) if b % tp]):
            return (f"sequence parallelism splits each bucket's frames over tp={tp}: buckets "
                    f"{', '.join(map(str, odd))} are not divisible by it; give boundaries that are (the default "
                    f"quantile boundaries are multiples of 8)")
    if cfg.distributed_optimizer and cfg.device == "cpu":  # device auto on a CPU machine: build() says so
        return DISTRIBUTED_OPTIMIZER_CPU
    if cfg.grad_reduce_dtype == "bf16" and (cfg.device == "cpu" or cfg.precision == "fp32"):
        return GRAD_REDUCE_BF16
    return None


FLOAT8_ROWS = 16  # torch._scaled_mm's alignment of a GEMM's rows (backends.torchtitan.SCALED_MM_ALIGN)


def card_problem(cfg, workload) -> str | None:
    """Why this card run cannot work (None when it can): the card as echobench's decoder builds it
    (model.config.decoder_problem), then what the backend cannot do for a card. workload: a
    model.config.CardWorkload."""
    card, seq = workload.card, workload.seq
    if problem := decoder_problem(card):
        return problem
    if cfg.framework == "megatron":
        for name in ("heads", "kv_heads", "ffn"):  # megatron_problem checked the rest
            if getattr(card, name) % cfg.tp:
                return f"tp={cfg.tp} does not divide the card's {name} {getattr(card, name)}: give a tp that does"
        # auto: on for tp > 1 on a GPU (RunConfig.sequence_parallel_on; device auto may be one)
        if cfg.sequence_parallel_on("cpu" if cfg.device == "cpu" else "cuda") and seq % cfg.tp:
            return (f"sequence parallelism splits the card's seq {seq} over tp={cfg.tp}, which does not divide it: "
                    "give --no-sequence-parallel or a seq that tp divides")
    if cfg.precision == "fp8" and (cfg.micro_batch * seq) % FLOAT8_ROWS:
        return (f"fp8: the card's linears see micro_batch {cfg.micro_batch} x seq {seq} = {cfg.micro_batch * seq} rows; "
                f"torch._scaled_mm needs rows divisible by {FLOAT8_ROWS}: give a micro_batch that makes them so, or "
                "precision bf16")
    return None
