"""The megatron backend: the Echo DiT tensor-parallel on megatron-core, data-parallel across the rest.

Rank layout (megatron's default order, tp first): TP groups are contiguous ranks
[0..tp-1], [tp..2tp-1], ...; the data-parallel rank is rank // tp, which is how bench.run_loop
picks the batch (TP peers read the same batch) and how bench.summarize counts samples.

Replicated on every rank: the frozen text encoder, the text projection, the speaker encoder,
and inside the DiT the norms, AdaLN, timestep embedding and input / output projections.
Data parallelism: torch DDP over megatron's data-parallel group (when dp > 1).
Activation recompute (--ac) and compile (--compile) wrap the TP DiT blocks and the speaker
blocks with the torchtitan backend's functions; fp8 is refused (it would need TE's fp8 layers).

This module imports megatron-core only inside build(): validate() runs before any process
starts, on machines that may not have it.

CPU: what this model uses of megatron-core (parallel_state, Column/RowParallelLinear, MLP)
runs on CPU over gloo unpatched, so no CUDA redirection is applied. The CUDA-only parts
stay unused: the RNG tracker (seeded on GPU only; no dropout, weights come from the plain
model), GlobalMemoryBuffer and the sequence-parallel collectives in tensor_parallel.mappings
(both allocate on torch.cuda.current_device()), hence sequence parallelism is GPU only.
"""

from __future__ import annotations

import importlib.util

import torch

from echobench.backends import TrainSetup


def te_installed() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def validate(cfg) -> str | None:
    """Why this tpN run cannot work (None when it can); the registry has checked the layout."""
    tp, par, gpn, model = cfg.tp, cfg.parallelism, cfg.gpus_per_node, cfg.model_config()
    if tp > gpn:
        return f"{par} needs {tp} GPUs in one node; a node has {gpn}"
    if cfg.world_size % tp:
        return f"world size {cfg.world_size} is not divisible by tp={tp}"
    if gpn % tp:
        return (f"tp={tp} must divide the {gpn} processes per node "
                f"(tensor parallelism stays inside a node): change --tp or --nproc")
    if model.heads % tp:
        return f"tp={tp} does not divide the {model.heads} attention heads of {cfg.scale}"
    if model.mlp % tp:
        return f"tp={tp} does not divide the DiT's MLP width {model.mlp} ({cfg.scale})"
    if cfg.precision == "fp8":
        return ("fp8 on megatron would need TransformerEngine's fp8 layers, which echobench does not drive: "
                "use --framework torchtitan for fp8 (torchao float8), or precision bf16")
    if cfg.te == "on" and not te_installed():
        return "--te on: transformer_engine is not installed here; use --te auto or --te off"
    if cfg.sequence_parallel:
        if tp == 1:
            return "sequence parallelism needs tp > 1"
        if cfg.device == "cpu":
            return "sequence parallelism runs on GPU only (megatron's sequence-parallel collectives allocate on CUDA): drop it on CPU"
        if cfg.audio_frames % tp:
            return f"sequence parallelism needs --audio-frames ({cfg.audio_frames}) divisible by tp={tp}"
    return None


def resolve_te(mode: str) -> bool:
    """Whether TransformerEngine kernels run: auto uses them when they import, on requires them."""
    if mode == "off":
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means no TE (it raises more than ImportError)
        if mode == "on":
            raise RuntimeError(f"--te on: transformer_engine does not import ({type(exc).__name__}: {exc})") from exc
        return False
    return True


def init_model_parallel(tp: int, seed: int, device: torch.device) -> None:
    """megatron's process groups (tp innermost, so TP groups are contiguous ranks)."""
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

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
    from importlib.metadata import PackageNotFoundError, version

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


def tp_partial_grad_params(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """Replicated parameters whose gradient on each TP rank covers only that rank's share: the
    TP model marks them (per-head QK-norms; block norms under sequence parallelism)."""
    from echobench.model.megatron import PARTIAL_GRAD

    return [p for p in model.parameters() if p.requires_grad and getattr(p, PARTIAL_GRAD, False)]


def allreduce_partial_grads(params: list[torch.nn.Parameter], group) -> None:
    """Sums the partial gradients of `params` over the TP group (one flat all-reduce)."""
    import torch.distributed as dist

    grads = [p.grad for p in params if p.grad is not None]
    if not grads or dist.get_world_size(group) == 1:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    for g, synced in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(synced.view_as(g))


def tp_grad_norm(params: list[torch.nn.Parameter], group) -> torch.Tensor:
    """Global L2 norm of the gradients of a TP model, each element counted once.

    Sharded parameters (megatron marks them `tensor_model_parallel`) contribute from every
    rank; replicated ones only from TP rank 0 (megatron's param_is_not_tensor_parallel_duplicate).
    """
    import torch.distributed as dist
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    grads = [p.grad for p in params if p.grad is not None and param_is_not_tensor_parallel_duplicate(p, group)]
    # One foreach norm (as the torchtitan backend's clipping), not a kernel chain per tensor; the
    # trainable parameters, hence their gradients, are float32.
    sq = (torch.nn.utils.get_total_norm(grads, foreach=True) ** 2 if grads
          else torch.zeros((), device=params[0].device, dtype=torch.float32))
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(sq, group=group)
    return sq.sqrt()


def tp_clip_grad(params: list[torch.nn.Parameter], partial: list[torch.nn.Parameter], group, max_norm: float):
    """TP-aware clipping: sum partial gradients over the TP group, then clip by the global norm."""

    def clip() -> torch.Tensor:
        allreduce_partial_grads(partial, group)
        norm = tp_grad_norm(params, group)
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=True)
        return norm

    return clip


def build(cfg, dist_info, dtype: torch.dtype) -> TrainSetup:
    """The TP model and its step pieces; `cfg` passed validate() (backends.build_training checks it)."""
    device = dist_info.device
    sequence_parallel = cfg.sequence_parallel
    if sequence_parallel and device.type != "cuda":
        raise ValueError("sequence parallelism runs on GPU only: drop --sequence-parallel on CPU")
    te = resolve_te(cfg.te)
    tp = cfg.tp
    init_model_parallel(tp, cfg.seed, device)

    from megatron.core import parallel_state

    from echobench.backends.torchtitan import RECOMPUTE, apply_ac, apply_compile, build_model, build_optimizer
    from echobench.model.megatron import build_tp_dit

    # The plain model with the run's seed (same weights as the torchtitan backend); its DiT
    # is then replaced by the TP DiT holding this rank's shards of the same weights.
    model = build_model(cfg, device, dtype)
    plain_dit = model.dit
    model.dit = build_tp_dit(model.cfg, plain_dit, parallel_state.get_tensor_model_parallel_rank(), tp, te,
                             sequence_parallel, device)
    del plain_dit
    # Activation recompute and compile of the blocks, applied from outside as in the torchtitan
    # backend: the TP DiT's blocks and the (replicated) speaker encoder's blocks.
    apply_ac(model, cfg.ac)
    if cfg.compile:
        # fullgraph=False: megatron-core's parallel linears call functions dynamo will not trace
        # (its process-group lookups), so each block compiles into pieces around them.
        apply_compile(model, fullgraph=False)
    params = model.trainable_parameters()
    partial = tp_partial_grad_params(model)
    tp_group = parallel_state.get_tensor_model_parallel_group()
    dp = parallel_state.get_data_parallel_world_size()
    dp_group = parallel_state.get_data_parallel_group() if dp > 1 else None
    if dp > 1:
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model, process_group=dp_group,
                                        device_ids=[device] if device.type == "cuda" else None)
    return TrainSetup(
        model=model,
        optimizer=build_optimizer(params, device),
        clip_grad=tp_clip_grad(params, partial, tp_group, 1.0),
        autocast_dtype=dtype if dtype != torch.float32 else None,
        info={
            "backend": "megatron",
            "te": te,
            "kernels": ("transformer_engine (TE linear, norm, attention)" if te else
                        "megatron-core local (ColumnParallelLinear, RowParallelLinear, MLP) + torch SDPA attention"),
            "tp": tp,
            "dp": dp,
            "sequence_parallel": sequence_parallel,
            "ac": cfg.ac,
            "recompute": RECOMPUTE[cfg.ac],
            "compile": cfg.compile,
            "compiled": ("torch.compile(fullgraph=False) of each TP DiT block and speaker-encoder block"
                         if cfg.compile else "nothing"),
            "data_parallel": "torch DDP over megatron's data-parallel group" if dp > 1 else "none",
            "sharding": "DiT attention heads and MLP across the TP group",
            "replicated": "text encoder (frozen or not), text projection, speaker encoder; DiT norms, AdaLN, "
                          "timestep embedding, input/output projections",
            **versions(),
        },
        dp_group=dp_group,
    )
