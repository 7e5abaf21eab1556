"""Building blocks of the Echo DiT: plain PyTorch, no parallelism."""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32: bf16 sums of squares lose too much precision.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).type_as(x)


def rope_frequencies(seq_len: int, head_dim: int, device=None, theta: float = 10000.0) -> torch.Tensor:
    """Rotation cosines and sines, (seq_len, head_dim/2, 2), for rotary position embedding.

    Real-valued rather than complex: inductor fuses real arithmetic into one kernel, while
    complex ops fall back to eager kernels and break the compiled block apart.
    """
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv)
    return torch.stack([angles.cos(), angles.sin()], dim=-1)


def apply_rope(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """x: (B, H, T, D); freqs: (T, D/2, 2). Rotates each pair of channels by its angle."""
    pairs = x.float().unflatten(-1, (-1, 2))
    x0, x1 = pairs[..., 0], pairs[..., 1]
    cos, sin = freqs[..., 0], freqs[..., 1]
    out = torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1).flatten(-2)
    return out.type_as(x)


def timestep_features(t: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
    """Sinusoidal features of diffusion time t in [0, 1] (scaled to [0, 1000])."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
    args = (t.float() * 1000.0)[:, None] * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class TimestepEmbedding(nn.Module):
    """Sinusoidal features -> MLP: the conditioning vector shared by every block."""

    def __init__(self, feature_dim: int, width: int):
        super().__init__()
        self.feature_dim = feature_dim
        self.fc1 = nn.Linear(feature_dim, width)
        self.fc2 = nn.Linear(width, width)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        feats = timestep_features(t, self.feature_dim).to(self.fc1.weight.dtype)
        return self.fc2(F.silu(self.fc1(feats)))


class LowRankAdaLN(nn.Module):
    """Per-block modulation from the timestep embedding through a rank-r bottleneck.

    A full AdaLN projection is 6 * width^2 per block; the low-rank factorisation
    (width -> rank -> n_chunks * width) keeps that small at 8B scale.
    Returns n_chunks tensors of shape (B, 1, width): shift / scale / gate triples.
    """

    def __init__(self, width: int, rank: int, n_chunks: int = 6):
        super().__init__()
        self.n_chunks = n_chunks
        self.down = nn.Linear(width, rank, bias=False)
        self.up = nn.Linear(rank, n_chunks * width)
        # Zero-init the up-projection: every block starts as the identity (DiT's adaLN-Zero).
        nn.init.zeros_(self.up.weight)
        nn.init.zeros_(self.up.bias)

    def forward(self, cond: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.split(self.up(self.down(F.silu(cond))))

    def split(self, mods: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(B, n_chunks * width) -> n_chunks modulations (B, 1, width) for (B, T, width) activations."""
        return mods.unsqueeze(1).chunk(self.n_chunks, dim=-1)


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * (1 + scale) + shift


class GatedMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up as one GEMM (`gate_up`, gate rows first)."""

    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.gate_up = nn.Linear(width, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


def split_heads(x: torch.Tensor, heads: int, seq_first: bool = False) -> torch.Tensor:
    """(B, T, H*D), or (T, B, H*D) when seq_first -> (B, H, T, D)"""
    x = x.unflatten(-1, (heads, -1))
    return x.permute(1, 2, 0, 3) if seq_first else x.transpose(1, 2)


def merge_heads(x: torch.Tensor, seq_first: bool = False) -> torch.Tensor:
    """(B, H, T, D) -> (B, T, H*D), or (T, B, H*D) when seq_first"""
    return (x.permute(2, 0, 1, 3) if seq_first else x.transpose(1, 2)).flatten(-2)


# How an attention skips the padded keys of a batch that has some (a batch without padding
# attends with no mask at all, which FlashAttention serves): "dense" gives SDPA a boolean key mask
# (on a GPU it then runs the memory-efficient or cuDNN kernel, never FlashAttention); "flex" builds
# a FlexAttention block mask from the key mask, whose kernel skips the key blocks that are all
# padding and masks the rest inside the kernel.
KEY_MASKINGS = ("dense", "flex")


def key_mask(mask: torch.Tensor, queries: int, masking: str):
    """The mask object `attention` takes for a (B, Tk) boolean key mask (True = attend) and
    `queries` queries: the mask itself (dense) or a FlexAttention BlockMask (flex)."""
    if masking == "dense":
        return mask
    if masking != "flex":
        raise ValueError(f"unknown key masking {masking!r}: allowed {', '.join(KEY_MASKINGS)}")

    def attends(b, h, q_idx, kv_idx):
        return mask[b, kv_idx]

    return create_block_mask(attends, B=mask.shape[0], H=None, Q_LEN=queries, KV_LEN=mask.shape[1],
                             device=mask.device)


@functools.cache
def _compiled_flex_attention():
    # FlexAttention is only a fused kernel when compiled; eager it materialises the scores.
    return torch.compile(flex_attention, dynamic=False)


def attention(q, k, v, mask=None) -> torch.Tensor:
    """Bidirectional attention on (B, H, T, D) over the keys `mask` lets through: None, every key
    (SDPA with no mask); a (B, Tk) boolean key mask, True = attend (SDPA with that mask); or a
    BlockMask made by key_mask (FlexAttention, compiled on a GPU)."""
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v)
    if isinstance(mask, BlockMask):
        flex = _compiled_flex_attention() if q.is_cuda and not torch.compiler.is_compiling() else flex_attention
        return flex(q, k, v, block_mask=mask)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :])


class ConditioningDrop(NamedTuple):
    """The key mask of a micro-batch whose streams have no padding but some of whose samples drop
    their text and speaker conditioning (cfg_drop mask): every sample attends to the latent keys,
    only the kept ones to the conditioning keys. keep: (B,) bool on the device. joint_attention
    gives it to merged_attention: no mask reaches a kernel."""

    keep: torch.Tensor


def _flash_forward(q, k, v):
    """SDPA's flash kernel with its log-sum-exp: (out, lse, the tensors and the ints its backward needs
    besides). The ints (max_q, max_k) are kept apart: autograd saves tensors only."""
    if q.is_cuda:
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, False, False)
        return out, lse, (cum_q, cum_k, seed, offset), (max_q, max_k)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False)
    return out, lse, (), ()


def _flash_backward(grad, q, k, v, out, lse, tensors, ints):
    if q.is_cuda:
        (cum_q, cum_k, seed, offset), (max_q, max_k) = tensors, ints
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            grad, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, False, seed, offset)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(grad, q, k, v, out, lse, 0.0, False)


def merged_attention_runs(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why merged_attention cannot run here (None when it can): it calls SDPA's flash kernel, which a
    GPU has for bf16 and fp16 at head_dim <= 256 only (the CPU's for any float dtype)."""
    if device.type == "cpu":
        return None
    if device.type != "cuda":
        return f"no flash attention kernel with its log-sum-exp on {device.type}"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"the GPU's flash attention kernel takes bf16 or fp16, not {str(dtype).removeprefix('torch.')}"
    if head_dim > 256:
        return f"the GPU's flash attention kernel takes head_dim <= 256, not {head_dim}"
    return None


class _MergedAttention(torch.autograd.Function):
    """Attention over [a; b] keys as two flash calls, one per key set, merged by their log-sum-exp;
    the b keys count only for the rows of `keep` (the others' b log-sum-exp is -inf).

    Backward is flash's backward of each key set given the MERGED output and log-sum-exp: a
    softmax over the union recomputes each key set's probabilities from the merged log-sum-exp,
    so the two backward calls give exactly the union's key and value gradients and the two parts
    of its query gradient. A dropped row's b probabilities come out zero (its log-sum-exp given
    as +inf there)."""

    @staticmethod
    def forward(ctx, q, k_a, v_a, k_b, v_b, keep):
        out_a, lse_a, extra_a, ints_a = _flash_forward(q, k_a, v_a)
        out_b, lse_b, extra_b, ints_b = _flash_forward(q, k_b, v_b)
        dropped = ~keep.view(-1, *([1] * (lse_b.dim() - 1)))
        lse_b = lse_b.masked_fill(dropped, -math.inf)
        lse = torch.logaddexp(lse_a, lse_b)
        out = (out_a.float() * (lse_a - lse).exp().unsqueeze(-1)
               + out_b.float() * (lse_b - lse).exp().unsqueeze(-1)).to(q.dtype)
        lse_for_b = lse.masked_fill(dropped, math.inf)  # exp(score - inf) = 0: no gradient reaches b
        ctx.save_for_backward(q, k_a, v_a, k_b, v_b, out, lse, lse_for_b, *extra_a, *extra_b)
        ctx.extra, ctx.ints = len(extra_a), (ints_a, ints_b)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k_a, v_a, k_b, v_b, out, lse, lse_for_b, *extra = ctx.saved_tensors
        n = ctx.extra
        grad = grad.contiguous() if grad.stride(-1) != 1 else grad
        dq_a, dk_a, dv_a = _flash_backward(grad, q, k_a, v_a, out, lse, extra[:n], ctx.ints[0])
        dq_b, dk_b, dv_b = _flash_backward(grad, q, k_b, v_b, out, lse_for_b, extra[n:], ctx.ints[1])
        return dq_a + dq_b, dk_a, dv_a, dk_b, dv_b, None


def merged_attention(q, k_a, v_a, k_b, v_b, keep: torch.Tensor) -> torch.Tensor:
    """Bidirectional attention of (B, H, T, D) queries over the keys [k_a; k_b], the k_b keys only
    for the samples `keep` (B,) holds True: what `attention` gives over their concatenation with a
    key mask that hides k_b from the other samples, computed without a mask (two flash calls whose
    softmaxes are merged; _MergedAttention). merged_attention_runs says where it can run."""
    return _MergedAttention.apply(q, k_a, v_a, k_b, v_b, keep)


class QKNormAttention(nn.Module):
    """What every attention of the plain model starts with: the projections of its input stream,
    `projections` x `width` outputs in one GEMM (q / k / v, and the DiT's gate), and a per-head
    QK-norm (the speaker encoder's self-attention, the DiT's joint attention).

    Each subclass makes its own output projection `wo` after its other layers: layers draw their
    initial weights in the order they are made, and this order keeps a seed's weights unchanged.
    """

    def __init__(self, width: int, heads: int, eps: float = 1e-6, projections: int = 3):
        super().__init__()
        self.heads = heads
        self.projections = projections
        self.in_proj = nn.Linear(width, projections * width, bias=False)
        self.q_norm, self.k_norm = RMSNorm(width // heads, eps), RMSNorm(width // heads, eps)

    def project_in(self, x) -> tuple[torch.Tensor, ...]:
        """q, k, v (and gate): views of one GEMM's output."""
        return self.in_proj(x).chunk(self.projections, dim=-1)


class SelfAttention(QKNormAttention):
    """Plain bidirectional self-attention with QK-norm and RoPE (speaker encoder)."""

    def __init__(self, width: int, heads: int, eps: float = 1e-6):
        super().__init__(width, heads, eps)
        self.wo = nn.Linear(width, width, bias=False)

    def forward(self, x, freqs, mask):
        q, k, v = (split_heads(t, self.heads) for t in self.project_in(x))
        q = apply_rope(self.q_norm(q), freqs)
        k = apply_rope(self.k_norm(k), freqs)
        return self.wo(merge_heads(attention(q, k, v, mask)))
