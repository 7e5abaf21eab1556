"""The megatron backend: the Echo DiT tensor-parallel on megatron-core, data-parallel across the rest,
run as Megatron-LM runs TP.

Rank layout (megatron's default order, tp first): TP groups are contiguous ranks
[0..tp-1], [tp..2tp-1], ...; the data-parallel rank is rank // tp, which is how bench.run_loop
picks the batch (TP peers read the same batch) and how bench.summarize counts samples.

Replicated on every rank: the frozen text encoder, the text projection, the speaker encoder,
and inside the DiT the norms, AdaLN, timestep embedding and input / output projections.
Megatron-LM's practice, each item recorded in the record's `backend` (backend_info), on where it
can run (tp_options):
  - sequence parallelism for tp > 1 on a GPU (sequence_parallel: auto);
  - bf16 parameters on a GPU with fp32 main gradients in megatron-core's DistributedDataParallel
    (contiguous buffers, bucketed, reduced while backward runs) and fp32 main parameters in
    megatron-core's optimizer, or its distributed optimizer (distributed_optimizer);
  - fused SwiGLU; TE's weight-gradient accumulation fusion and TP communication overlap where TE runs;
  - TE's key packing once per step (model.megatron.pack_keys).
Clipping: TP-aware and without a host sync (megatron_clip). Activation recompute (--ac) and
compile (--compile) wrap the TP DiT blocks and the speaker blocks with the torchtitan backend's
functions; with megatron-core's local layers each block compiles to one graph, with TE's to several
(dynamo does not trace TE's modules: each is a graph break; the record's compile_graphs counts what
compiled), and op-level selective AC re-runs TE's GEMMs and fused attention (flops.TE_SELECTIVE, in
HFU). fp8 is refused (it would need TE's fp8 layers).

This module imports megatron-core only inside functions: validate() runs before any process
starts, on machines that may not have it.

CPU: megatron-core's layers, sequence parallelism, DDP and FP32Optimizer run over gloo with the two
redirections of backends/megatron_cpu.py (applied on a CPU run only); bf16 parameters and the
distributed optimizer need a GPU. The RNG tracker is seeded on GPU only (no dropout; the weights
come from the plain model).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import replace
from importlib.metadata import PackageNotFoundError, version

import torch
import torch.distributed as dist

from echobench.backends import TrainSetup
from echobench.backends.checks import DISTRIBUTED_OPTIMIZER_CPU, GRAD_REDUCE_BF16
from echobench.backends.torchtitan import ADAMW, ModelParts, ac_mode, apply_ac, apply_compile, model_parts
from echobench.model.flops import TE_SELECTIVE

def resolve_te(mode: str) -> bool:
    """Whether TransformerEngine kernels run: auto uses them when they import, on requires them."""
    if mode == "off":
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401 - lazy: TE is optional; this probes for it
    except Exception as exc:  # noqa: BLE001 - any import failure means no TE (it raises more than ImportError)
        if mode == "on":
            raise RuntimeError(f"--te on: transformer_engine does not import ({type(exc).__name__}: {exc})") from exc
        return False
    return True


def init_model_parallel(tp: int, seed: int, device: torch.device) -> None:
    """megatron's process groups (tp innermost, so TP groups are contiguous ranks)."""
    from megatron.core import parallel_state, tensor_parallel  # optional dependency (module docstring)

    if device.type == "cpu":
        from echobench.backends.megatron_cpu import redirect_cuda_to_cpu  # imports megatron-core

        redirect_cuda_to_cpu()
    if not dist.is_initialized():  # a single-process run: megatron still needs a group
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        # No gloo groups: nothing here uses them, and gloo binds to the host name's address (127.0.1.1 on
        # common Ubuntu hosts), where other nodes cannot reach it.
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, create_gloo_process_groups=False)
    rank = dist.get_rank()
    if parallel_state.get_tensor_model_parallel_rank() != rank % tp:
        raise RuntimeError("megatron placed TP groups on non-contiguous ranks; bench.py assumes rank // tp is the DP rank")
    if device.type == "cuda":
        # megatron's RNG tracker (TE layers take it); the CPU run needs none: no dropout, no init.
        tensor_parallel.model_parallel_cuda_manual_seed(seed)


def versions() -> dict:
    out = {}
    for key, dist_names in (("megatron_core", ("megatron-core", "megatron_core")),
                            ("transformer_engine", ("transformer-engine", "transformer_engine"))):
        out[key] = None
        for name in dist_names:
            try:
                out[key] = version(name)
                break
            except PackageNotFoundError:
                continue
    return out


def te_ac_mode(mode: str, te: bool) -> str:
    """The checkpointing that runs with TE's layers: op-level selective re-runs their GEMMs and fused
    attention (flops.TE_SELECTIVE, counted in HFU)."""
    return TE_SELECTIVE if te and mode == "selective" else mode


def tp_comm_overlap_problem(cfg, te: bool, gpu: bool, sequence_parallel: bool) -> str | None:
    """Why TE's TP communication overlap does not run here (None: it runs): it needs TE, a GPU,
    sequence parallelism with tp > 1, and one activation shape, since its userbuffers are allocated
    once at micro_batch x audio_frames x width (init_tp_comm_overlap): a bucketed run's batches have
    several shapes, which the buffers do not hold."""
    if not (te and gpu and sequence_parallel and cfg.tp > 1):
        return "off: needs TransformerEngine, sequence parallelism with tp > 1 and a GPU"
    if cfg.batching != "pad":
        return ("off: batching bucket gives batches of several shapes; TE's userbuffers hold one "
                "(micro_batch x audio_frames x width): use batching pad for the overlap")
    return None


def tp_options(cfg, device: torch.device, te: bool, compiled: bool, dtype: torch.dtype):
    """What of Megatron-LM's TP practice this run takes (model.megatron.TPOptions)."""
    from echobench.model.megatron import TPOptions  # imports megatron-core

    gpu = device.type == "cuda"
    sequence_parallel = cfg.sequence_parallel_on(device.type)
    return TPOptions(
        te=te,
        sequence_parallel=sequence_parallel,
        traced=compiled and not te,
        # megatron-core's mixed-precision optimizers take CUDA parameters only (megatron_cpu).
        params_dtype=torch.bfloat16 if gpu and dtype == torch.bfloat16 else torch.float32,
        # Its fused SwiGLU is torch.compile'd: on a CPU every process would first wait for inductor
        # to build it (tens of seconds), which every CPU test and smoke run would pay.
        fused_swiglu=gpu,
        # TE's GEMMs accumulate weight gradients into DDP's fp32 main_grad themselves;
        # megatron-core's local linears would need Apex's fused_weight_gradient_mlp_cuda.
        grad_accum_fusion=te and gpu,
        tp_comm_overlap=tp_comm_overlap_problem(cfg, te, gpu, sequence_parallel) is None,
    )


def init_tp_comm_overlap(cfg, model_cfg) -> str | None:
    """TE's userbuffers for the TP collectives overlapped with the GEMMs (tp_comm_overlap), sized as
    Megatron-LM sizes them: the latent stream's tokens (micro-batch x audio frames) x width. Returns
    why it cannot run here, or None when it runs."""
    try:
        from transformer_engine.pytorch.module.base import initialize_ub  # TE: optional dependency

        initialize_ub(shape=[cfg.micro_batch * cfg.audio_frames, model_cfg.width], tp_size=cfg.tp,
                      bootstrap_backend="nccl")
    except Exception as exc:  # noqa: BLE001 - any failure: the run goes on without the overlap, and says why
        return f"TE's initialize_ub failed ({type(exc).__name__}: {str(exc)[:200]})"
    return None


def tp_partial_grad_params(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """Replicated parameters whose gradient on each TP rank covers only that rank's share: the
    TP model marks them (per-head QK-norms; block norms under sequence parallelism)."""
    from echobench.model.megatron import PARTIAL_GRAD  # imports megatron-core

    return [p for p in model.parameters() if p.requires_grad and getattr(p, PARTIAL_GRAD, False)]


def allreduce_partial_grads(grads: list[torch.Tensor], group) -> None:
    """Sums the partial gradients `grads` over the TP group (one flat all-reduce), in place."""
    if not grads or dist.get_world_size(group) == 1:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    for g, synced in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(synced.view_as(g))


def grad_norm(grads: list[torch.Tensor], group, device: torch.device) -> torch.Tensor:
    """Global L2 norm of `grads`, each rank holding a disjoint share of the elements (megatron-core's
    optimizer picks them: TP duplicates only on TP rank 0; under the distributed optimizer, this
    data-parallel rank's shard), summed over `group`. One foreach norm; no host sync."""
    sq = (torch.nn.utils.get_total_norm(grads, foreach=True) ** 2 if grads
          else torch.zeros((), device=device, dtype=torch.float32))
    if dist.get_world_size(group) > 1:
        dist.all_reduce(sq, group=group)
    return sq.sqrt()


def megatron_ddp(model: torch.nn.Module, config, grad_reduce_in_fp32: bool, distributed_optimizer: bool):
    """megatron-core's DistributedDataParallel over megatron's data-parallel group, as Megatron-LM runs it:
    gradients accumulated into contiguous buffers (main_grad, fp32 with grad_reduce_in_fp32) and
    reduced per bucket while backward runs (overlap_grad_reduce); reduce-scattered to the
    distributed optimizer's shards, else all-reduced. Buckets: megatron's default size."""
    from megatron.core.distributed import (  # optional dependency (module docstring)
        DistributedDataParallel, DistributedDataParallelConfig)

    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=grad_reduce_in_fp32, overlap_grad_reduce=True,
                                               use_distributed_optimizer=distributed_optimizer)
    return DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)


def megatron_optimizer(ddp, params_dtype: torch.dtype, distributed: bool, device: torch.device):
    """megatron-core's optimizer (get_megatron_optimizer) over the DDP model, with the torchtitan
    backend's AdamW settings: bf16 parameters get fp32 main parameters (Float16OptimizerWithFloat16Params,
    or the DistributedOptimizer, which shards them and the Adam state over the data-parallel group);
    fp32 parameters step in place (FP32Optimizer). No clipping inside (megatron_clip does it without a
    host sync); weight decay on every parameter, as the other backend."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer  # optional dependency

    config = OptimizerConfig(optimizer="adam", lr=ADAMW["lr"], weight_decay=ADAMW["weight_decay"],
                             adam_beta1=ADAMW["betas"][0], adam_beta2=ADAMW["betas"][1],
                             bf16=params_dtype == torch.bfloat16, params_dtype=params_dtype,
                             use_distributed_optimizer=distributed, clip_grad=0.0)
    if device.type == "cpu":
        from echobench.backends.megatron_cpu import cpu_optimizer as building  # imports megatron-core
    else:
        building = nullcontext
    with building():
        # Without gloo groups (initialize_model_parallel made none): megatron-core uses them only to
        # save the distributed optimizer's state, which a benchmark never does.
        optimizer = get_megatron_optimizer(config, [ddp], config_overrides={}, use_gloo_process_groups=False)
    for inner in optimizer.chained_optimizers:
        if type(inner.optimizer) is torch.optim.AdamW:
            # Without TE's or Apex's FusedAdam, megatron-core builds torch's AdamW unfused; torch
            # reads `fused` per group at each step: the fused kernel, as the other backend's.
            inner.optimizer.defaults["fused"] = True
            for group in inner.optimizer.param_groups:
                group["fused"], group["foreach"] = True, False
    return optimizer


def megatron_clip(ddp, optimizer, partial: list[torch.nn.Parameter], tp_group, max_norm: float):
    """The step's gradients made ready and clipped, megatron-core's way without its host sync: the
    overlapped reduction awaited, the partial gradients summed over the TP group (as megatron's
    finalize_model_grads does), the main gradients handed to the main parameters
    (prepare_grads), their global norm (each element counted once) and the clip: through torch's
    fused AdamW's grad_scale where it steps (its kernel divides each gradient as it reads it, as
    the torchtitan backend's clip_grad_norm_ does), else in place."""

    def clip() -> torch.Tensor:
        ddp.finish_grad_sync()
        allreduce_partial_grads([p.main_grad for p in partial], tp_group)
        optimizer.prepare_grads()
        (inner,) = optimizer.chained_optimizers
        params = inner.get_parameters()
        norm = grad_norm(inner.get_main_grads_for_grad_norm(), inner.get_grad_stats_parallel_group(),
                         params[0].device)
        if inner.optimizer.defaults.get("fused"):
            # 1 / torch's clip coefficient: grads x min(max_norm / (norm + 1e-6), 1)
            inner.optimizer.grad_scale = torch.clamp((norm + 1e-6) / max_norm, min=1.0).float()
        else:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=True)
        return norm

    return clip


class MegatronStep:
    """bench.train_step's optimizer on megatron-core: step() updates from the main gradients that
    megatron_clip readied (train_step clips first); zero_grad() empties DDP's gradient buffers
    and the main gradients."""

    def __init__(self, ddp, optimizer):
        self.ddp, self.optimizer = ddp, optimizer

    def step(self) -> None:
        self.optimizer.step_with_ready_grads()

    def zero_grad(self, set_to_none: bool = True) -> None:
        # A backward outside train_step (bench.warm_buckets) may leave an overlapped reduction in
        # flight: it lands before its buffer is zeroed, and megatron allows one at a time.
        for group in self.ddp.bucket_groups + self.ddp.expert_parallel_bucket_groups:
            if group.grad_reduce_handle is not None:
                group.grad_reduce_handle.wait()
                group.grad_reduce_handle = None
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad(set_to_none)


def megatron_gradient_sync(ddp):
    """TrainSetup.gradient_sync on megatron's DDP: the switch its no_sync() context flips (off, the
    buckets' reductions wait for the last micro-batch's backward)."""

    def sync(on: bool) -> None:
        for group in ddp.bucket_groups + ddp.expert_parallel_bucket_groups:
            group.is_last_microbatch = on

    return sync


def build_card(cfg, dist_info, dtype: torch.dtype, parts: ModelParts) -> TrainSetup:
    """A card run's decoder tensor-parallel (model.decoder_tp) on megatron-core's DDP and optimizer,
    as Echo's TP DiT below: the plain decoder built with the run's seed, its block linears then this
    rank's shards; AC and compile of its blocks as the torchtitan backend applies them. Megatron-core's
    local layers only (no TransformerEngine: backends.checks refuses asking for it); sequence
    parallelism as Echo's (cfg.sequence_parallel_on: auto on for tp > 1 on a GPU), its partial
    gradients (norms, row-parallel biases) summed over TP in the clip."""
    from megatron.core import parallel_state  # optional dependency (module docstring)

    from echobench.model.decoder_tp import card_megatron_config, tp_decoder  # imports megatron-core

    device = dist_info.device
    if device.type != "cuda" and cfg.distributed_optimizer:
        raise ValueError(DISTRIBUTED_OPTIMIZER_CPU)
    compiled = cfg.compiled_on(device.type)
    init_model_parallel(cfg.tp, cfg.seed, device)
    params_dtype = torch.bfloat16 if device.type == "cuda" and dtype == torch.bfloat16 else torch.float32
    if cfg.grad_reduce_dtype == "bf16" and params_dtype != torch.bfloat16:
        raise ValueError(GRAD_REDUCE_BF16)
    sequence_parallel = cfg.tp > 1 and cfg.sequence_parallel_on(device.type)
    plain = parts.build(cfg, device, dtype)
    config = card_megatron_config(plain.card, cfg.tp, params_dtype, use_cpu=device.type == "cpu",
                                  sequence_parallel=sequence_parallel)
    model = tp_decoder(plain, parallel_state.get_tensor_model_parallel_rank(), cfg.tp, config,
                       parallel_state.get_tensor_model_parallel_group(), traced=compiled)
    model.to(params_dtype)  # Megatron-LM's bf16 parameters on a GPU, fp32 main copies in the optimizer
    ac = ac_mode(cfg.ac, compiled)
    apply_ac(model, parts, ac)
    if compiled:
        apply_compile(model, parts)
    dp = parallel_state.get_data_parallel_world_size()
    ddp = megatron_ddp(model, config, cfg.grad_reduce_dtype == "fp32", cfg.distributed_optimizer)
    optimizer = megatron_optimizer(ddp, params_dtype, cfg.distributed_optimizer, device)
    (inner,) = optimizer.chained_optimizers
    main_grads = "float32" if cfg.grad_reduce_dtype == "fp32" else dtype_name(params_dtype)
    info = {"backend": "megatron", "te": False, "tp": cfg.tp, "dp": dp, "sequence_parallel": sequence_parallel,
            **parts.info(cfg, model, device, dtype),
            "kernels": "megatron-core local (ColumnParallelLinear, RowParallelLinear) + torch SDPA attention",
            "sharding": "q / k / v heads and the MLP's columns across the TP group (column-parallel q/k/v and up, "
                        "row-parallel output and down)",
            "replicated": "embedding, learned positions, norms, LM head"
                          + ("; the blocks' hidden states split along the sequence between the TP regions "
                             "(sequence parallelism: all-gathered into the column-parallel linears, "
                             "reduce-scattered out of the row-parallel ones)" if sequence_parallel else ""),
            "param_dtype": dtype_name(params_dtype), "main_grad_dtype": main_grads,
            "data_parallel": f"megatron-core DistributedDataParallel over megatron's data-parallel group (dp={dp}): "
                             f"{main_grads} gradient buffers, reduced while backward runs, "
                             + ("reduce-scattered to the optimizer's shards" if cfg.distributed_optimizer
                                else "all-reduced"),
            "optimizer": f"megatron-core {type(inner).__name__} over {type(inner.optimizer).__name__}"
                         + (", sharded over the data-parallel group" if cfg.distributed_optimizer else ""),
            "distributed_optimizer": cfg.distributed_optimizer, "ac": cfg.ac, "ac_mode": ac,
            "recompute": parts.recompute[ac], "compile": compiled,
            "compiled": (f"torch.compile(fullgraph=True, dynamic=False) of each {parts.compiled} and of the top "
                         "level's functions" if compiled else "nothing"), **versions()}
    return TrainSetup(
        model=ddp,
        optimizer=MegatronStep(ddp, optimizer),
        clip_grad=megatron_clip(ddp, optimizer, tp_partial_grad_params(model),
                                parallel_state.get_tensor_model_parallel_group(), 1.0),
        autocast_dtype=dtype if dtype != torch.float32 else None,
        info=info,
        dp_group=parallel_state.get_data_parallel_group() if dp > 1 else None,
        gradient_sync=megatron_gradient_sync(ddp),
    )


def build(cfg, dist_info, dtype: torch.dtype, workload=None) -> TrainSetup:
    """The TP model and its step pieces; `cfg` passed validate() (backends.build_training checks it).
    workload: a card run's (model.config.CardWorkload), whose decoder replaces Echo (torchtitan.model_parts)."""
    parts = model_parts(workload)
    return TP_BUILDS[parts.name](cfg, dist_info, dtype, parts)


def build_echo(cfg, dist_info, dtype: torch.dtype, parts: ModelParts) -> TrainSetup:
    """Echo (parts: torchtitan.ECHO_PARTS) with its DiT tensor-parallel (model.megatron.build_tp_dit),
    the rest replicated."""
    device = dist_info.device
    if device.type != "cuda" and cfg.distributed_optimizer:
        raise ValueError(DISTRIBUTED_OPTIMIZER_CPU)
    compiled = cfg.compiled_on(device.type)
    te = resolve_te(cfg.te)
    tp = cfg.tp
    init_model_parallel(tp, cfg.seed, device)
    options = tp_options(cfg, device, te, compiled, dtype)
    if cfg.grad_reduce_dtype == "bf16" and options.params_dtype != torch.bfloat16:
        raise ValueError(GRAD_REDUCE_BF16)
    overlap_problem = (init_tp_comm_overlap(cfg, cfg.model_config()) if options.tp_comm_overlap else
                       tp_comm_overlap_problem(cfg, te, device.type == "cuda", options.sequence_parallel))
    if options.tp_comm_overlap and overlap_problem:
        options = replace(options, tp_comm_overlap=False)

    from megatron.core import parallel_state  # optional dependency (module docstring)

    from echobench.model.megatron import build_tp_dit  # imports megatron-core

    # The plain model with the run's seed (same weights as the torchtitan backend); its DiT
    # is then replaced by the TP DiT holding this rank's shards of the same weights.
    model = parts.build(cfg, device, dtype)
    model.cfg_drop_attention = "masked"  # the TP DiT's attention (TE's or SDPA's) takes the key mask
    if te:  # TE's fused attention reads a dense key mask (TECoreAttention packs the valid keys)
        model.key_masking = "dense"
    plain_dit = model.dit
    model.dit = build_tp_dit(model.cfg, plain_dit, parallel_state.get_tensor_model_parallel_rank(), tp, options,
                             device)
    del plain_dit
    if options.params_dtype != torch.float32:
        # Megatron-LM's bf16 parameters: the whole model (its Float16Module casts it all), the fp32
        # copies in the optimizer. The frozen text encoder is already in the compute dtype.
        model.to(options.params_dtype)
    # Activation recompute and compile of the blocks, applied from outside as in the torchtitan
    # backend: the TP DiT's blocks and the (replicated) speaker encoder's blocks.
    ac = te_ac_mode(ac_mode(cfg.ac, compiled), te)
    apply_ac(model, parts, ac)
    if compiled:
        # One graph per block with megatron-core's local layers (TracedColumnParallelLinear): the
        # run's record counts the graphs and breaks. TE's layers are left to break where they do.
        apply_compile(model, parts, fullgraph=not te)
    partial = tp_partial_grad_params(model)
    tp_group = parallel_state.get_tensor_model_parallel_group()
    dp = parallel_state.get_data_parallel_world_size()
    ddp = megatron_ddp(model, model.dit.config, cfg.grad_reduce_dtype == "fp32", cfg.distributed_optimizer)
    optimizer = megatron_optimizer(ddp, options.params_dtype, cfg.distributed_optimizer, device)
    return TrainSetup(
        model=ddp,
        optimizer=MegatronStep(ddp, optimizer),
        clip_grad=megatron_clip(ddp, optimizer, partial, tp_group, 1.0),
        autocast_dtype=dtype if dtype != torch.float32 else None,
        info=backend_info(cfg, options, ac, parts.recompute[ac], compiled, dp, model.key_masking, optimizer,
                          overlap_problem),
        dp_group=parallel_state.get_data_parallel_group() if dp > 1 else None,
        gradient_sync=megatron_gradient_sync(ddp),
    )


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def backend_info(cfg, options, ac: str, recompute: str, compiled: bool, dp: int, key_masking: str, optimizer,
                 overlap_problem: str | None) -> dict:
    """The record's `backend`: what ran, each item of Megatron-LM's TP practice on or off and why."""
    (inner,) = optimizer.chained_optimizers
    main_grads = "float32" if cfg.grad_reduce_dtype == "fp32" else dtype_name(options.params_dtype)
    if options.te:
        linears = "TransformerEngine's (their TP collectives inside TE)"
    elif cfg.tp == 1:
        linears = "megatron-core's (one rank: no TP collective)"
    elif options.traced:
        linears = ("megatron-core's, their collectives in megatron's region functions around the GEMM "
                   "(synchronous: dynamo traces them; TracedColumnParallelLinear)")
    else:
        linears = ("megatron-core's, the input-gradient all-reduce (or the sequence-parallel all-gather and "
                   "reduce-scatter) overlapped with the weight-gradient GEMM in backward")
    return {
        "backend": "megatron",
        "te": options.te,
        "kernels": ("transformer_engine (TE linear, norm, attention)" if options.te else
                    "megatron-core local (ColumnParallelLinear, RowParallelLinear, MLP) + torch SDPA attention"),
        "tp": cfg.tp,
        "dp": dp,
        "tp_linears": linears,
        "sequence_parallel": options.sequence_parallel,
        "fused_swiglu": ("megatron-core's fused SwiGLU (bias_activation_fusion)" if options.fused_swiglu else
                         "off: SwiGLU as the plain model's element-wise ops (megatron's fused one is compiled "
                         "by inductor in each process, on a GPU only)"),
        "tp_comm_overlap": ("TE userbuffers: TP all-gathers / reduce-scatters overlapped with the GEMMs"
                            if options.tp_comm_overlap else
                            overlap_problem if overlap_problem.startswith("off:") else f"off: {overlap_problem}"),
        "gradient_accumulation_fusion": options.grad_accum_fusion,
        "key_packing": "valid keys packed once per step for TE's attention" if options.te else None,
        "param_dtype": dtype_name(options.params_dtype),
        "main_grad_dtype": main_grads,
        "data_parallel": (f"megatron-core DistributedDataParallel over megatron's data-parallel group (dp={dp}): "
                          f"{main_grads} gradient buffers (main_grad), bucketed, reduced while backward runs "
                          f"(overlap_grad_reduce), "
                          + ("reduce-scattered to the optimizer's shards" if cfg.distributed_optimizer
                             else "all-reduced")),
        "optimizer": (f"megatron-core {type(inner).__name__} over {type(inner.optimizer).__module__}."
                      f"{type(inner.optimizer).__name__}"
                      + (" (fused)" if inner.optimizer.param_groups[0].get("fused") else "")
                      + (", fp32 main parameters" if options.params_dtype != torch.float32 else "")
                      + (", sharded over the data-parallel group" if cfg.distributed_optimizer else "")),
        "distributed_optimizer": cfg.distributed_optimizer,
        "clipping": "global norm, TP-aware, no host sync; " + (
            "the coefficient applied by the fused AdamW (grad_scale)" if inner.optimizer.defaults.get("fused")
            else "the main gradients scaled in place"),
        "key_masking": key_masking,
        "cfg_drop": cfg.cfg_drop,
        "cfg_drop_attention": "masked",
        "ac": cfg.ac,
        "ac_mode": ac,
        "recompute": recompute,
        "compile": compiled,
        "compiled": (f"torch.compile(fullgraph={not options.te}, dynamic=False) of each TP DiT block, "
                     "speaker-encoder and text-encoder block and of the top level's functions"
                     + (" (TE's modules are not traced: each is a graph break, compile_graphs counts the graphs "
                        "between them)" if options.te else "") if compiled else "nothing"),
        "sharding": "DiT attention heads and MLP across the TP group",
        "replicated": "text encoder (frozen or not), text projection, speaker encoder; DiT norms, AdaLN, "
                      "timestep embedding, input/output projections",
        **versions(),
    }


# The TP build of each model (torchtitan.ModelParts.name): they share the techniques, not the conversion.
TP_BUILDS = {"echo": build_echo, "decoder": build_card}
