"""What one training step of a model card (card.py) runs on one rank: the same kinds of work as
Echo's (predict.work's Matmul, AttentionWork, element-wise bytes, the parameters a rank updates), so that
both go through pricing.work_seconds; plus the host's dispatched ops and the kernels launched.

Counted per micro-batch, then x grad_accum (the step); with pipeline parallelism, for the slowest
stage (card.stage_blocks: ceil(layers / pp) blocks and the LM head; with embedding- or head-only
chunks the rank with the most to run; pipeline.py prices its schedule):
- GEMMs: x (rows, k) @ W^T (k, n), rows = micro_batch x seq / cp (sequence parallelism gathers
  the sequence before each column-parallel GEMM, so the rows stay whole): q, k, v (one GEMM where
  the framework fuses them, with kv_heads for K and V: GQA), the output projection, the MLP (GELU
  and squared ReLU: up, down; SwiGLU: gate and up, down), the LM head over the vocabulary (the
  input embedding is a lookup). Backward: the weight gradient and the input gradient of every one.
  Megatron TP: q, k, v, MLP up / gate+up and the LM head column-parallel (n / tp), the output
  projection and MLP down row-parallel (k / tp). precision fp8: every block linear in float8 (the
  LM head stays bf16: TransformerEngine's layers and torchao's filter both leave it out).
- Attention: forward 4 x micro_batch x (seq / cp) x seq x head_dim per head and layer (every score,
  as flops.py counts it; AttentionWork.causal tells the kernel the mask), backward 2x, heads / tp.
- Activation checkpointing: the policy's re-run work (recompute.py) in backward, priced as the
  forward's; under torch's non-reentrant checkpoint a whole block's last linear is not re-run
  (recompute.py's early stop, frameworks.skips_last_linear).
- Element-wise bytes: counted on the framework's own eager block (ELEMENTWISE_EAGER), or, where
  its kernels are fused, ELEMENTWISE_READS_WRITES per token from the ops a pre-norm decoder runs
  (frameworks.py says which); float8: the casts, transposes and amax reductions of each linear's
  input, weight and output gradient (FP8_BYTES).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from echobench.predict.cards.card import Layout, ModelCard, check_card_fits_layout, rank_params, stage_blocks
from echobench.predict.frameworks import Framework, skips_last_linear
from echobench.predict.recompute import POLICIES, recomputed_linears
from echobench.predict.work import FP8_BYTES, AttentionWork, Matmul

# Element-wise work per token and layer, in elements read + written of the compute dtype (d: hidden,
# f: ffn, q/kv: the query / key widths), each op counted from what it reads and writes (bias adds
# are fused into the GEMM epilogue or into the bias-dropout-add and count 0; no dropout):
#   forward: two norms (read x, write y: 2d each), two residual adds (read 2, write 1: 3d each),
#            the activation (GELU / squared ReLU read f, write f: 2f; SwiGLU read gate and up,
#            write f: 3f), rotary on q and k (read, write: 2 (q + kv)) where positions are rotary;
#   backward: two norm backwards (read x and dy, write dx: 3d each), two gradient adds where the
#            residual branches meet (3d each), the activation's backward (read x, dy, write dx: 3f;
#            SwiGLU read gate, up, dy, write both: 5f), rotary's (as its forward).
# Once per token: the embedding lookup (2d; backward its scatter-add, 3d), learned positions (add:
# 3d; backward 1d), the final norm (2d; 3d), softmax cross-entropy over the vocabulary logits (read
# the logits, write the log-probabilities: 2V; backward read the probabilities, write the gradient: 2V).
# Sequence parallelism splits the norms and residual adds by tp; without it each TP rank runs them whole.
ELEMENTWISE_READS_WRITES = {"norm": (2, 3), "residual": (3, 3), "gelu": (2, 3), "swiglu": (3, 5),
                            "rotary": (2, 2), "embedding": (2, 3), "positions": (3, 1), "cross_entropy": (2, 2)}
# Bytes per token of one eager block's element-wise ops, counted on the framework's own block code
# (tools/count_card_blocks.py, bf16; tests/test_card_work.py holds them): forward and backward, as
# (a, b, c) in bytes = a hidden + b ffn + c kv_width, where TP splits the ffn and kv terms and
# sequence parallelism the hidden one.
ELEMENTWISE_EAGER = {"mpt": ((20.14, 4.01, 0.0), (46.42, 8.04, 0.0)),
                     "llama": ((116.06, 10.2, 8.79), (246.12, 18.55, 10.21))}
# ATen ops a rank's host dispatches, counted (tests/test_validate.py holds them): an eager pre-norm GPT
# block (LayerNorm, fused QKV linear with bias, causal SDPA, output projection, LayerNorm, GELU MLP,
# two residual adds) and its tied-embedding decoder, one step on the CPU under commbench.count_ops,
# L = 1 and 2 layers apart: per layer and fixed, forward / backward / optimizer (foreach AdamW).
# The layouts' hooks (FSDP, DDP, TP collectives) and fused kernels (TransformerEngine) are not in it.
HOST_OPS_PER_LAYER = {"forward": 28, "backward": 65, "optimizer": 24}
HOST_OPS_FIXED = {"forward": 14, "backward": 23, "optimizer": 22}


@dataclass(frozen=True)
class CardWork:
    """One rank's step of a card (its slowest pipeline stage's): pricing.work_seconds' arguments,
    the host's ops, the kernels it launches, and the float8 cast bytes (in `elementwise`)."""

    matmuls: tuple[Matmul, ...]
    attention: tuple[AttentionWork, ...]
    elementwise: tuple[float, float]  # bytes read + written, forward and backward (re-runs and float8 casts in)
    params: float  # the parameters this rank updates
    host_ops: int
    kernels: int  # kernel launches per step
    layers: int  # the blocks this rank runs (a pipeline stage's)
    lm_head: bool  # whether this rank runs the LM head (pipeline: the last stage)


def _linears(card: ModelCard, layout: Layout, fw: Framework) -> list[tuple[str, int, int, tuple[str, ...]]]:
    """A block's linears on one rank: (part, n, k, the recompute names that re-run it)."""
    d, f, kv, tp = card.hidden, card.ffn, card.kv_width, layout.tp
    out = [("attention", (d + 2 * kv) // tp, d, ("q", "k", "v"))] if fw.fused_qkv else \
        [("attention", d // tp, d, ("q",)), ("attention", kv // tp, d, ("k",)), ("attention", kv // tp, d, ("v",))]
    out.append(("attention", d, d // tp, ("out",)))
    if card.gated:
        out += [("mlp", 2 * f // tp, d, ("gate", "up"))] if fw.fused_qkv else \
            [("mlp", f // tp, d, ("gate",)), ("mlp", f // tp, d, ("up",))]
    else:
        out.append(("mlp", f // tp, d, ("up",)))
    out.append(("mlp", d, f // tp, ("down",)))
    return out


def elementwise_elements(card: ModelCard, layout: Layout) -> tuple[float, float, float]:
    """Elements read + written per token on one rank: a block's forward and backward
    (ELEMENTWISE_READS_WRITES), and the once-a-token ops' (embedding, positions, final norm,
    cross-entropy) forward + backward."""
    e, tp = ELEMENTWISE_READS_WRITES, layout.tp
    d, f = card.hidden, card.ffn / tp
    whole = d / tp if layout.sp else d  # norms and residual adds: split by sequence parallelism
    act = e["swiglu" if card.gated else "gelu"]
    rot = e["rotary"] if card.positions == "rotary" else (0, 0)
    qk = (card.hidden + card.kv_width) / tp
    fwd = 2 * e["norm"][0] * whole + 2 * e["residual"][0] * whole + act[0] * f + rot[0] * qk
    bwd = 2 * e["norm"][1] * whole + 2 * e["residual"][1] * whole + act[1] * f + rot[1] * qk
    pos = e["positions"] if card.positions == "learned" else (0, 0)
    once = sum((e["embedding"][i] + pos[i] + e["norm"][i]) * whole + e["cross_entropy"][i] * card.vocab / tp
               for i in (0, 1))
    return fwd, bwd, once


def stage_layers(card: ModelCard, layout: Layout) -> int:
    """The blocks of the slowest pipeline stage (card.stage_blocks; all of them without PP)."""
    return stage_blocks(card, layout)[0]


def card_work(card: ModelCard, layout: Layout, fw: Framework, kernel: str | None = None) -> CardWork:
    """One rank's work in one step of `card` under `layout` as `fw` runs it (the module docstring):
    every micro-batch's GEMMs and attention (counts x grad_accum), element-wise bytes, the parameters
    it updates, the host's ops and the kernels launched."""
    check_card_fits_layout(card, layout)
    acc, L = layout.grad_accum, stage_layers(card, layout)
    rows, seq_q = layout.tokens, layout.seq // layout.cp
    pol = POLICIES[layout.ac]
    again = recomputed_linears(layout.ac, card.gated, skips_last_linear(layout, fw))
    re_layers = pol.layers
    fp8 = layout.precision == "fp8"
    prec = "fp8" if fp8 else "bf16"
    mm: list[Matmul] = []
    fp8_elements = 0.0
    for part, n, k, names in _linears(card, layout, fw):
        count = L * acc
        mm += [Matmul(part, "forward", rows, n, k, count, prec), Matmul(part, "backward", n, k, rows, count, prec),
               Matmul(part, "backward", rows, k, n, count, prec)]
        if set(names) & again:
            mm.append(Matmul(part, "recompute", rows, n, k, round(count * re_layers) or 0, prec))
        if fp8:
            fp8_elements += count * (rows * k + rows * n) + L * (acc if fw.name == "torchtitan" else 1) * n * k
    head = stage_blocks(card, layout)[1]  # the slowest stage runs the LM head (card.stage_blocks)
    if head:
        v = card.vocab // layout.tp
        mm += [Matmul("lm_head", "forward", rows, v, card.hidden, acc), Matmul("lm_head", "backward", v, card.hidden, rows, acc),
               Matmul("lm_head", "backward", rows, card.hidden, v, acc)]
    fwd = 4 * layout.micro_batch * seq_q * layout.seq * card.head_dim * (card.heads // layout.tp) * L * acc
    hd = card.head_dim
    att = [AttentionWork("attention", "forward", seq_q, layout.seq, fwd, L * acc, hd, card.causal),
           AttentionWork("attention", "backward", seq_q, layout.seq, 2 * fwd, L * acc, hd, card.causal)]
    if pol.attention:
        att.append(AttentionWork("attention", "recompute", seq_q, layout.seq, int(fwd * re_layers), L * acc, hd, card.causal))
    ef, eb, once = elementwise_elements(card, layout)
    scale = rows * acc * layout.compute_bytes
    block_fwd, block_bwd = ef * L * scale, eb * L * scale
    if fw.eager_block is not None:  # counted on the framework's eager block, in bytes
        d = card.hidden / (layout.tp if layout.sp else 1)
        (fa, fb, fc), (ba, bb, bc) = ELEMENTWISE_EAGER[fw.eager_block]
        f, kv = card.ffn / layout.tp, card.kv_width / layout.tp
        block_fwd = (fa * d + fb * f + fc * kv) * L * rows * acc
        block_bwd = (ba * d + bb * f + bc * kv) * L * rows * acc
    if pol.elementwise:
        block_bwd += block_fwd * re_layers
    head_bytes = once * scale if head else 0.0
    cast = FP8_BYTES["compiled_cast"] if layout.compile else FP8_BYTES["cast"]
    amax = FP8_BYTES["amax"] if (layout.fp8_recipe or "delayed") != "delayed" else 0
    fp8_bytes = fp8_elements * (cast + amax)
    per, fixed = HOST_OPS_PER_LAYER, HOST_OPS_FIXED
    micro = (per["forward"] + per["forward"] * re_layers * (1 if pol.linears or pol.elementwise else 0) + per["backward"]) * L \
        + fixed["forward"] + fixed["backward"]
    ops = acc * micro + per["optimizer"] * L + fixed["optimizer"]
    kf, kb = fw.kernels
    kernels = acc * L * (kf * (1 + re_layers * bool(pol.linears or pol.elementwise)) + kb)
    return CardWork(tuple(mm), tuple(att), (block_fwd + head_bytes / 2 + fp8_bytes / 3, block_bwd + head_bytes / 2 + 2 * fp8_bytes / 3),
                    rank_params(card, layout), int(ops), int(kernels), L, head)


def model_flops_per_token(card: ModelCard, layout: Layout, fw: Framework) -> float:
    """echobench's model FLOPs per token (every rank's share summed, re-runs not counted): the card's
    GEMMs forward + backward and its attention, every score counted (flops.py's convention)."""
    one = replace(layout, tp=1, pp=1, vp=1, cp=1, dp=None, sequence_parallel=False, layout="fsdp", grad_accum=1,
                  ac="none", precision="bf16", global_batch=layout.micro_batch * layout.gpus, gpus_per_node=layout.gpus)
    w = card_work(card, one, fw)
    return (sum(m.flops for m in w.matmuls) + sum(a.flops for a in w.attention)) / (one.micro_batch * one.seq)
