"""A model card's memory per GPU under a layout (card_memory_gib): what `echobench tune` prunes
cards by. Not counted (echobench trains Echo, not the cards): the training state from what each
framework keeps, the activations from Korthikanti et al., "Reducing Activation Recomputation in
Large Transformer Models" (MLSys 2023, arXiv:2205.05198), section 4.

State, bytes per parameter the rank holds (bf16 mixed precision, AdamW):
- DDP, FSDP, HSDP (PyTorch AMP / FSDP mixed precision): float32 parameters 4, gradients 4, Adam's m
  and v 8 = 16, on the rank's shard (card.rank_params); FSDP also holds two layers gathered in bf16
  (the one running and the one prefetched), shard_grad_op every layer from forward to backward;
- Megatron: bf16 parameters 2, float32 main gradients 4 (its grad buffer), float32 main parameters
  4 and Adam 8 = 18 per parameter of the TP shard; the distributed optimizer shards the last 12
  over the data-parallel group (NeMo's distributed_fused_adam, apex's, the gradients' 4 as well).

Activations per layer and micro-batch of s tokens (the paper's 16-bit counts, its dropout masks
kept: an upper bound where dropout is off): attention 11 s h (the 5 a s^2 of the scores dropped:
FlashAttention-style kernels keep none), two norms 4 s h, the MLP 2 s h + 4 s f + s h (GeLU: the
paper's 19 s h at f = 4h) or 3 s h + 6 s f (SwiGLU: gate and up outputs both kept). Tensor
parallelism splits all but 10 s h of it by t; with sequence parallelism all of it. Selective AC
(Megatron's: the core attention re-run) saves what the scores' 5 a s^2 would be, none here; full AC
keeps each layer's input, 2 s h (split by t with sequence parallelism), for every micro-batch in
flight, plus one layer's whole activations while it is re-run (one at a time, whatever is in flight); the other recompute policies (recompute.py) keep the share of a
layer's activations POLICY_KEPT says (assumed from what each saves). The logits and cross entropy:
4 s V / t (float32), after the paper's section 4.3. Context parallelism splits s by cp; pipeline
parallelism holds a stage's ceil(layers / pp) blocks, each with pipeline.in_flight micro-batches.

A layout under torch.autocast over float32 weights (Layout.autocast: echobench's card runs, bench_card)
holds more (no constant fitted: each term follows from what autocast keeps; together they bring the
two card runs measured on one H200, allocated peaks 77.0 and 112.6 GiB, from 62.7 / 96.4 to
76.5 / 113.4: reports/h200-2026-12-04.md):
each linear's bf16 weight copy, saved for the backward (2 bytes a parameter; none where FSDP
gathers the weights in bf16 already); the two norms, which autocast runs in float32, save their
inputs at 4 bytes, not 2 (+4 s h a layer, split as the norms are); and the loss keeps the bf16
logits, their float32 copy and log-softmax's float32 output at once, 10 s V / t, not 4.
"""

from __future__ import annotations

from echobench.predict.cards.card import (
    Layout,
    ModelCard,
    _layer_split,
    layer_params,
    model_parallel_params,
    rank_params,
    stage_blocks,
)
from echobench.predict.memory import GIB, adam_state_bytes
from echobench.predict.pipeline import in_flight

# The share of a layer's no-AC activations a recompute policy keeps (assumed from what it saves):
# Megatron's selective and MaxText's minimal keep every GEMM output (the scores are never kept by a
# FlashAttention-style kernel); torchtitan's op SAC every other matmul's; layer SAC 2 half the
# layers whole; save_qkv_proj the q, k, v outputs; save_dot_except_mlp all but the MLP's.
POLICY_KEPT = {"none": 1.0, "selective": 1.0, "maxtext-minimal": 1.0, "selective-op": 0.5, "selective-layer-2": 0.5,
               "maxtext-save_qkv_proj": 0.25, "maxtext-save_dot_except_mlp": 0.5}


def state_parts(card: ModelCard, layout: Layout) -> dict[str, float]:
    """Bytes of the parameters (with FSDP's gathered layers), gradients and optimizer state one rank holds."""
    if layout.layout == "megatron":
        ranks = layout.data_parallel * layout.cp if layout.distributed_optimizer else 1
        state = adam_state_bytes(model_parallel_params(card, layout), bf16_params=True, main_shards=ranks)
        if layout.framework == "nemo" and layout.distributed_optimizer:  # apex's distributed fused Adam: grads sharded too
            state["gradients"] /= ranks
        return {"weights": state["weights"], "gradients": state["gradients"], "optimizer": state["main"] + state["moments"]}
    state = adam_state_bytes(rank_params(card, layout))
    gathered = 0.0
    if layout.shards_parameters:
        block = layer_params(card) - _layer_split(card) * (1 - 1 / layout.tp)
        gathered = 2 * (stage_blocks(card, layout)[0] if layout.sharding == "shard_grad_op" else 2) * block
    return {"weights": state["weights"] + gathered, "gradients": state["gradients"], "optimizer": state["moments"]}


def layer_activation_bytes(card: ModelCard, layout: Layout) -> float:
    """One layer's saved activations for one micro-batch, on one rank (no AC)."""
    s, h, f, t = layout.tokens, card.hidden, card.ffn, layout.tp
    mlp = 3 * h + 6 * f if card.activation == "swiglu" else 3 * h + 4 * f
    norms = 8 * h if layout.autocast else 4 * h  # two norms' saved inputs, float32 under autocast
    per_token = 11 * h + norms + mlp
    if layout.sp:
        return s * per_token / t
    unsplit = 6 * h + norms  # TP leaves the norms and the dropout masks whole
    return s * (unsplit + (per_token - unsplit) / t)


def activation_bytes(card: ModelCard, layout: Layout) -> float:
    """Every layer's saved activations for one micro-batch (as AC leaves them), and the logits."""
    s, t = layout.tokens, layout.tp
    one = layer_activation_bytes(card, layout)
    L = stage_blocks(card, layout)[0]
    held = in_flight(layout.pp, layout.vp, layout.grad_accum)
    logits = (10 if layout.autocast else 4) * s * card.vocab / t
    if layout.ac == "full":  # every micro-batch in flight keeps its layers' inputs; one layer re-runs at a time
        kept = 2 * s * card.hidden / (t if layout.sp else 1)
        return L * kept * held + one + logits
    return L * one * POLICY_KEPT[layout.ac] * held + logits


def weight_copy_bytes(card: ModelCard, layout: Layout) -> float:
    """Autocast's bf16 copies of a rank's weights, saved for the backward (none without autocast, or
    where FSDP / HSDP gather the weights in bf16)."""
    if not layout.autocast or (layout.shards_parameters):
        return 0.0
    return 2 * model_parallel_params(card, layout)


def card_memory_parts(card: ModelCard, layout: Layout) -> dict[str, float]:
    """One GPU's memory for `card` trained as `layout` by part, in bytes: state_parts, and the
    activations with autocast's weight copies (what the backward holds)."""
    return {**state_parts(card, layout),
            "activations": activation_bytes(card, layout) + weight_copy_bytes(card, layout)}


def card_memory_gib(card: ModelCard, layout: Layout) -> float:
    """One GPU's memory for `card` trained as `layout` (the module docstring), in GiB."""
    return sum(card_memory_parts(card, layout).values()) / GIB
