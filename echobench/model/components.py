"""Building blocks of the Echo DiT: plain PyTorch, no parallelism."""

from __future__ import annotations

import functools
import math

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
