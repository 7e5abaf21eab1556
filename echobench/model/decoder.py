"""A plain decoder-only transformer built from a model card (echobench.predict.cards.card.ModelCard), in
plain PyTorch as nanoGPT writes one: the reference workload that `echobench run --card` trains
through the same harness as Echo, so that a published configuration can be measured beside it.

    tokens -> embedding (+ learned positions) -> L x [x + attn(norm(x)); x + mlp(norm(x))]
           -> final norm -> LM head (the embedding's weight where tied) -> next-token cross-entropy

Pre-norm blocks: LayerNorm or RMSNorm (card.norm), biases on the linears (and LayerNorm) where
card.bias; one fused q/k/v projection with kv_heads key / value heads (GQA), rotary positions on q
and k (card.positions rotary), a learned table (learned) or none, causal SDPA (card.causal); the MLP
up and down (gelu, relu2: squared ReLU) or gate and up fused, down (swiglu). ALiBi is refused (a
bias inside the attention scores, which SDPA's fast kernels do not take).

The card is duck-typed (any object with ModelCard's fields): this package sits below predict.
FLOPs (decoder_flops, below) are held equal to FlopCounterMode's count by tests/test_card_runs.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from echobench.model.components import apply_rope, rope_frequencies
from echobench.model.config import decoder_problem
from echobench.model.echo import sample_seed  # the same per-sample seeding as Echo's draws
from echobench.model.flops import PartFlops, _linear

INIT_STD = 0.02  # GPT-2's: every weight N(0, 0.02), biases zero, norms one
NORM_EPS = 1e-5


def make_norm(card) -> nn.Module:
    if card.norm == "rmsnorm":
        return nn.RMSNorm(card.hidden, eps=NORM_EPS)
    return nn.LayerNorm(card.hidden, eps=NORM_EPS, bias=card.bias)


def decoder_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """The decoder's attention call: SDPA over (B, H, T, D) queries and (B, H_kv, T, D) keys and values,
    causal where the card is, query heads grouped over the key / value heads where fewer (GQA).
    calibrate --comm (calibrate.commbench.measure_attention) times this same call."""
    return F.scaled_dot_product_attention(q, k, v, **decoder_sdpa_options(q, k, causal))


def decoder_sdpa_options(q: torch.Tensor, k: torch.Tensor, causal: bool) -> dict:
    """SDPA's options in decoder_attention; train.kernels.card_sdpa_choices asks torch's choice with them."""
    return {"is_causal": causal, "enable_gqa": k.shape[1] != q.shape[1]}


class Attention(nn.Module):
    """Causal self-attention with `kv_heads` key / value heads shared by groups of query heads."""

    def __init__(self, card):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = card.heads, card.kv_heads, card.hidden // card.heads
        self.causal = card.causal
        self.qkv = nn.Linear(card.hidden, card.hidden + 2 * self.kv_heads * self.head_dim, bias=card.bias)
        self.out = nn.Linear(card.hidden, card.hidden, bias=card.bias)

    def forward(self, x: torch.Tensor, rope: torch.Tensor | None) -> torch.Tensor:
        kv = self.kv_heads * self.head_dim
        q, k, v = self.qkv(x).split([self.heads * self.head_dim, kv, kv], dim=-1)
        q, k, v = (t.unflatten(-1, (-1, self.head_dim)).transpose(1, 2) for t in (q, k, v))  # (B, H, T, D)
        if rope is not None:
            q, k = apply_rope(q, rope), apply_rope(k, rope)
        y = decoder_attention(q, k, v, self.causal)
        return self.out(y.transpose(1, 2).flatten(-2))


class MLP(nn.Module):
    """gelu and relu2: up, activation, down; swiglu: silu(gate) x up (one fused projection), down."""

    def __init__(self, card):
        super().__init__()
        self.activation = card.activation
        self.up = nn.Linear(card.hidden, (2 if card.activation == "swiglu" else 1) * card.ffn, bias=card.bias)
        self.down = nn.Linear(card.ffn, card.hidden, bias=card.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        if self.activation == "swiglu":
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        elif self.activation == "relu2":
            h = F.relu(h).square()
        else:
            h = F.gelu(h, approximate="tanh")
        return self.down(h)


class Block(nn.Module):
    def __init__(self, card):
        super().__init__()
        self.attn_norm, self.attn = make_norm(card), Attention(card)
        self.mlp_norm, self.mlp = make_norm(card), MLP(card)

    def forward(self, x: torch.Tensor, rope: torch.Tensor | None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), rope)
        return x + self.mlp(self.mlp_norm(x))


class Decoder(nn.Module):
    """The card's decoder at sequence length `seq`; forward(tokens) -> the next-token loss."""

    def __init__(self, card, seq: int):
        super().__init__()
        if problem := decoder_problem(card):
            raise ValueError(problem)
        self.card, self.seq = card, seq
        self.tok = nn.Embedding(card.vocab, card.hidden)
        self.pos = nn.Embedding(seq, card.hidden) if card.positions == "learned" else None
        self.blocks = nn.ModuleList(Block(card) for _ in range(card.layers))
        # Around the blocks: nothing here; a TP decoder under sequence parallelism (model.decoder_tp)
        # splits the sequence over its ranks after the embedding and gathers it before the final norm.
        self.enter_blocks, self.leave_blocks = nn.Identity(), nn.Identity()
        self.norm = make_norm(card)
        self.head = None if card.tied_embeddings else nn.Linear(card.hidden, card.vocab, bias=False)
        # The rotation table, float32 (a buffer: FSDP leaves it whole); handed to every block.
        self.register_buffer("rope", rope_frequencies(seq, card.hidden // card.heads)
                             if card.positions == "rotary" else None, persistent=False)
        self.apply(self._init)

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=INIT_STD)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens)
        return x + self.pos.weight[: tokens.shape[1]] if self.pos is not None else x

    def head_loss(self, x: torch.Tensor, targets: torch.Tensor, reduction: str) -> torch.Tensor:
        weight = self.tok.weight if self.head is None else self.head.weight
        logits = F.linear(self.norm(x), weight)
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction=reduction)

    def forward(self, tokens: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        """tokens: (B, seq + 1) ids; predicts tokens[:, 1:] from tokens[:, :-1]. reduction "sum": the
        loss summed over the B x seq predictions (the harness divides by the global batch's)."""
        x = self.enter_blocks(self.embed(tokens[:, :-1]))
        for block in self.blocks:
            x = block(x, self.rope)
        return self.head_loss(self.leave_blocks(x), tokens[:, 1:], reduction)

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]


def synthetic_tokens(seed: int, sample_ids: list[int], vocab: int, seq: int) -> torch.Tensor:
    """(len(sample_ids), seq + 1) token ids, uniform over the vocabulary, each row a function of
    (seed, global sample index) only: every layout trains on the same samples."""
    g = torch.Generator()
    rows = []
    for i in sample_ids:
        g.manual_seed(sample_seed(seed, i))
        rows.append(torch.randint(vocab, (seq + 1,), generator=g))
    return torch.stack(rows)


# ---- FLOPs: the MFU numerator ----
# The convention of echobench.model.flops, for a decoder: 2 FLOPs per multiply-add of every matmul
# (the block linears and the LM head; the embedding is a lookup and counts nothing), backward 2x
# forward (every matmul's input carries a gradient: the embedding trains); attention scores and
# weighted values counted in full, 4 x seq^2 x hidden per layer forward (a causal kernel skips about
# half; the count does not, as llm-foundry's 12 L d s and Megatron-LM's 12 L h s per token do not).
# Element-wise work (norms, RoPE, activations, softmax, the loss) counts nothing. Per token that is
# 6 x (block matmul weights + vocab x hidden) + 12 x layers x hidden x seq: llm-foundry's
# 6 N + 12 L d s less what N holds beyond the matmuls (norms, biases, a learned position table, an
# untied input embedding); Megatron-LM's 72 L h^2 + 12 L h s + 6 h V where the card is MHA with
# ffn 4h and GELU. It is what FlopCounterMode counts for a forward and backward.
FLOP_CONVENTION = ("echobench: every matmul forward + backward (2x), LM head included, embedding lookup not; "
                   "attention 4 seq^2 hidden per layer forward, causal mask not halved; element-wise work not "
                   "counted (= 6 x matmul weights + 12 L d s per token)")
PARTS = ("attention", "mlp", "lm_head")


def decoder_flops(card, seq: int) -> dict[str, PartFlops]:
    """Model FLOPs of ONE sample (seq predicted tokens) by part: forward and backward."""
    d, f, kv, T = card.hidden, card.ffn, card.kv_heads * (card.hidden // card.heads), seq
    parts = {name: PartFlops() for name in PARTS}
    up = 2 * f if card.activation == "swiglu" else f
    for _ in range(card.layers):
        parts["attention"].add(_linear(T, d, d + 2 * kv) + _linear(T, d, d))  # q, k, v; output
        parts["attention"].add(2 * 2 * T * T * d)  # scores q.k and weighted values, every score
        parts["mlp"].add(_linear(T, d, up) + _linear(T, f, d))
    parts["lm_head"].add(_linear(T, d, card.vocab))
    return parts


def recompute_flops(card, seq: int, ac_mode: str) -> int:
    """Forward FLOPs that activation checkpointing re-runs in backward (the HFU numerator's extra):
    full re-runs every block but its MLP down-projection (its output only feeds the residual add,
    so torch's non-reentrant checkpoint stops before it); selective-layer does so for every second
    block (backends.torchtitan.ac_mode); op-level selective saves every matmul and attention output."""
    if ac_mode in ("none", "selective"):
        return 0
    d, f, kv, T = card.hidden, card.ffn, card.kv_heads * (card.hidden // card.heads), seq
    up = 2 * f if card.activation == "swiglu" else f
    block = _linear(T, d, d + 2 * kv) + _linear(T, d, d) + 4 * T * T * d + _linear(T, d, up)
    if ac_mode == "full":
        return card.layers * block
    if ac_mode == "selective-layer":
        return card.layers // 2 * block
    raise ValueError(f"unknown activation checkpointing mode {ac_mode!r}: none, selective or full")


def decoder_flops_report(card, seq: int, ac_mode: str) -> dict:
    """The record's flops_breakdown of a card run: per sample (seq tokens), by part."""
    parts = decoder_flops(card, seq)
    total = sum(p.total for p in parts.values())
    return {"workload": "card", "convention": FLOP_CONVENTION, "seq": seq, "model_flops_per_sample": total,
            "model_flops_per_token": total / seq,
            "hardware_flops_per_sample": total + recompute_flops(card, seq, ac_mode), "ac": ac_mode,
            "breakdown": {"total": total, "forward": sum(p.forward for p in parts.values()),
                          "parts": {k: {"forward": v.forward, "backward": v.backward, "total": v.total}
                                    for k, v in parts.items()}}}
