"""One ATen op as a GPU would run it, for echobench.predict.stepcount: its kind (GEMM, attention,
memory-bound or view), kernel launches, FLOPs and bytes (op_tally), and the GPU's dispatch of
scaled_dot_product_attention emulated on a CPU build (gpu_attention). The conventions are the
module docstring of echobench.predict.stepcount."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry, sdpa_flop_count

aten = torch.ops.aten
GEMM_OPS = {aten.mm, aten.addmm, aten.bmm, aten.baddbmm, aten._scaled_mm}
# ATen attention op -> the GPU kernel it is; backward ops are counted at 2x their forward's FLOPs.
ATTENTION_OPS = {
    aten._scaled_dot_product_flash_attention: ("flash", False),
    aten._scaled_dot_product_flash_attention_backward: ("flash", True),
    aten._scaled_dot_product_efficient_attention: ("efficient", False),
    aten._scaled_dot_product_efficient_attention_backward: ("efficient", True),
    aten._scaled_dot_product_cudnn_attention: ("cudnn", False),
    aten._scaled_dot_product_cudnn_attention_backward: ("cudnn", True),
    # Only reached if an attention call escapes gpu_attention(): the record then names the CPU kernel.
    aten._scaled_dot_product_flash_attention_for_cpu: ("cpu-flash", False),
    aten._scaled_dot_product_flash_attention_for_cpu_backward: ("cpu-flash", True),
}
# FlexAttention as a GPU runs it (gpu_flex_attention): one fused kernel forward, one backward.
FLEX_OPS = {"flex_attention": False, "flex_attention_backward": True}
# Ops that launch no kernel beyond the views (op.is_view): allocation, metadata, an alias.
NO_KERNEL = {aten.empty, aten.empty_strided, aten.empty_like, aten.new_empty, aten.new_empty_strided,
             aten._unsafe_view, aten.sym_size, aten.sym_stride, aten.sym_numel, aten.sym_storage_offset,
             aten.is_same_size, aten.set_, aten.resize_}
WRITE_ONLY = {aten.copy_, aten.fill_, aten.zero_, aten.normal_, aten.uniform_}  # overwrite self unread
LOOKUPS = {aten.embedding, aten.index_select, aten.index, aten.gather}  # read the rows they gather

# multi_tensor_apply (ATen/native/cuda/MultiTensorApply.cuh): elements per chunk (one block), and per
# launch at most 320 chunks and, by the number of tensor lists (depth), this many tensors.
CHUNK, MAX_BLOCKS, MAX_TENSORS = 65536, 320, (110, 64, 48, 36, 30)


@dataclass
class Tally:
    ops: int = 0  # ATen ops dispatched, views included
    kernels: int = 0  # GPU kernels they launch
    bytes: int = 0  # read + written by those kernels
    flops: int = 0  # GEMM and attention

    def add(self, other: "Tally", times: int = 1) -> None:
        self.ops += other.ops * times
        self.kernels += other.kernels * times
        self.bytes += other.bytes * times
        self.flops += other.flops * times


# ---- the GPU's attention ----

def attention_kernel(masked: bool, prefer_cudnn: bool) -> str:
    """The kernel torch's SDPA picks on sm90 for bidirectional bf16 attention of head_dim <= 256:
    cuDNN first where torch prefers it (cuDNN newer than 9.15), else FlashAttention-2, which takes
    no mask, then the memory-efficient kernel."""
    return "cudnn" if prefer_cudnn else "efficient" if masked else "flash"


def gpu_attention(prefer_cudnn: bool = False):
    """F.scaled_dot_product_attention as torch runs it on an sm90 GPU, the kernel's ATen op called
    directly (aten/src/ATen/native/transformers/attention.cpp of recent torch: a boolean mask becomes
    a bias of the query's dtype, where(mask, 0, -inf); the memory-efficient kernel takes it padded to
    8-aligned strides and expanded, as a view, to (B, H, Tq, Tk); cuDNN takes it as it is)."""

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if dropout_p or is_causal:
            raise NotImplementedError("stepcount emulates bidirectional attention without dropout only")
        kernel = attention_kernel(attn_mask is not None, prefer_cudnn)
        if enable_gqa and kernel == "efficient":
            raise NotImplementedError("the memory-efficient kernel takes no grouped-query attention")
        logsumexp = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
        bias = attn_mask
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            bias = torch.where(attn_mask, 0.0, torch.scalar_tensor(-math.inf, dtype=query.dtype,
                                                                      device=query.device))
        if kernel == "flash":
            return aten._scaled_dot_product_flash_attention(query, key, value, scale=scale)[0]
        if kernel == "cudnn":
            return aten._scaled_dot_product_cudnn_attention(query, key, value, bias, logsumexp, scale=scale)[0]
        if bias is not None:
            if any(s % 8 for s in bias.stride()[:-1]) or bias.stride(-1) != 1:
                bias = F.pad(bias, (0, 8 - bias.shape[-1] % 8))[..., : bias.shape[-1]]
            bias = bias.expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])
        return aten._scaled_dot_product_efficient_attention(query, key, value, bias, logsumexp, scale=scale)[0]

    return sdpa


@torch.library.custom_op("echobench_stepcount::flex_attention", mutates_args=())
def _flex_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    raise NotImplementedError("stepcount's FlexAttention stands in on FakeTensors only")


@_flex_attention.register_fake
def _(q, k, v):
    return q.new_empty(*q.shape[:-1], v.shape[-1]), q.new_empty(q.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("echobench_stepcount::flex_attention_backward", mutates_args=())
def _flex_attention_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             out: torch.Tensor, logsumexp: torch.Tensor
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    raise NotImplementedError("stepcount's FlexAttention stands in on FakeTensors only")


@_flex_attention_backward.register_fake
def _(grad, q, k, v, out, logsumexp):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _flex_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs, *output)


def _flex_backward(ctx, grad, grad_logsumexp):
    q, k, v, out, logsumexp = ctx.saved_tensors
    return torch.ops.echobench_stepcount.flex_attention_backward(grad, q, k, v, out, logsumexp)


_flex_attention.register_autograd(_flex_backward, setup_context=_flex_setup)
ATTENTION_OPS.update({getattr(torch.ops.echobench_stepcount, name): ("flex", backward)
                      for name, backward in FLEX_OPS.items()})


def gpu_flex_attention(query, key, value, block_mask=None, **kwargs):
    """flex_attention as a GPU runs it compiled (model.components.attention): one fused kernel that
    reads q, k, v (and the block mask's few indices) and writes the output and its logsumexp, and one
    backward kernel; every score counted, as echobench.model.flops counts attention."""
    if kwargs.get("score_mod") is not None:
        raise NotImplementedError("stepcount emulates FlexAttention with a block mask only")
    return torch.ops.echobench_stepcount.flex_attention(query, key, value)[0]


FLOAT8 = {torch.float8_e4m3fn, torch.float8_e5m2}


def gemm_precision(func, args) -> str:
    """fp8 for a float8 GEMM: torch._scaled_mm, or a GEMM of torchao's float8 tensors (their
    __torch_dispatch__ runs _scaled_mm below the counting mode, which sees the mm on them), else bf16."""
    if func._overloadpacket is aten._scaled_mm:
        return "fp8"
    return "fp8" if any(getattr(t, "_data", t).dtype in FLOAT8 for t in tensors(args)) else "bf16"


def gemm_shape(func, args) -> tuple[int, int, int]:
    """(m, n, k) of a GEMM op's call; a batched one's batch folded into m (its GEMMs fill the SMs together)."""
    packet = func._overloadpacket
    a, b = (args[1], args[2]) if packet in (aten.addmm, aten.baddbmm) else (args[0], args[1])
    batch = a.shape[0] if a.dim() == 3 else 1
    return batch * a.shape[-2], b.shape[-1], a.shape[-1]


def attention_shape(func, args) -> tuple[int, int, int]:
    """(queries, keys, head_dim) of an attention op's call (q, k as (B, H, T, D))."""
    _, backward = ATTENTION_OPS[func._overloadpacket]
    q, k = args[1:3] if backward else args[:2]
    return q.shape[-2], k.shape[-2], q.shape[-1]


# ---- one op: kind, kernels, FLOPs, bytes ----

def read_bytes(t: torch.Tensor) -> int:
    """The distinct elements of t (a stride-0, broadcast dimension holds one), in bytes."""
    return math.prod(s for s, st in zip(t.shape, t.stride()) if st != 0) * t.element_size()


def tensors(tree) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def multi_tensor_launches(numels: list[int], depth: int) -> int:
    """Kernel launches of multi_tensor_apply over tensors of these sizes with `depth` tensor lists."""
    launches, in_launch, blocks = 0, 0, 0
    sizes = [n for n in numels if n]
    for i, n in enumerate(sizes):
        in_launch += 1
        chunks = -(-n // CHUNK)
        for c in range(chunks):
            blocks += 1
            last_chunk = c == chunks - 1
            if (in_launch == MAX_TENSORS[depth - 1] and last_chunk) or blocks == MAX_BLOCKS or \
                    (last_chunk and i == len(sizes) - 1):
                launches, blocks = launches + 1, 0
                in_launch = 0 if last_chunk else 1
    return launches


def op_tally(func, args, kwargs, out) -> tuple[str, str | None, Tally]:
    """(kind, attention kernel or None, tally) of one dispatched op."""
    packet = func._overloadpacket
    if func.is_view or packet in NO_KERNEL or func.namespace in ("prim", "profiler"):
        return "view", None, Tally(ops=1)
    inputs, outputs = tensors((args, kwargs)), tensors(out)
    written = outputs
    if not func._schema.returns:  # in place on lists (foreach, fused AdamW): the mutated arguments
        mutated = [a.name for a in func._schema.arguments if a.alias_info is not None and a.alias_info.is_write]
        # fused AdamW writes its gradients back only when a grad scale unscales them
        mutated = [m for m in mutated if not (packet in (aten._fused_adamw_, aten._fused_adam_) and m == "grads")]
        named = dict(zip((a.name for a in func._schema.arguments), args)) | kwargs
        written = tensors([named.get(m) for m in mutated])
    if packet in WRITE_ONLY:
        inputs = inputs[1:]
    elif packet.__name__.endswith("_like") or packet in (aten.new_zeros, aten.new_ones, aten.new_full):
        inputs = []  # a factory reads its argument's shape, not its data
    elif packet in LOOKUPS:
        inputs = [t for t in inputs if not t.is_floating_point()] + outputs  # indices, and the gathered rows
    nbytes = sum(map(read_bytes, inputs)) + sum(t.numel() * t.element_size() for t in written)
    if packet in GEMM_OPS:
        return "gemm", None, Tally(1, 1, nbytes, flop_registry[packet](*args, **kwargs, out_val=out))
    if packet in ATTENTION_OPS:
        kernel, backward = ATTENTION_OPS[packet]
        q, k, v = args[1:4] if backward else args[:3]
        return "attention", kernel, Tally(1, 1, nbytes, (2 if backward else 1) * sdpa_flop_count(q.shape, k.shape,
                                                                                                 v.shape))
    kernels = 1
    if func.namespace == "aten" and packet.__name__.startswith(("_foreach_", "_fused_")):
        lists = [a for a in args if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor)]
        depth = 4 if packet in (aten._fused_adamw_, aten._fused_adam_) else len(lists)
        kernels = multi_tensor_launches([t.numel() for t in lists[0]], min(depth, 5))
    return "memory", None, Tally(1, kernels, nbytes)
