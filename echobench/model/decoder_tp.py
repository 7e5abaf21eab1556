"""A card run's decoder (model.decoder) tensor-parallel on megatron-core's layers, as Megatron-LM splits
a GPT block: in every block the fused q / k / v projection and the MLP's up (SwiGLU: gate and up)
column-parallel (this rank's query heads, key / value heads and FFN columns), the attention output
and the MLP's down projection row-parallel (their partial sums all-reduced). The embedding, the
norms and the LM head stay replicated (every TP rank computes the same loss). The blocks keep the
plain decoder's forward: only their linears and head counts change, and their weights are the plain
model's, sharded (the backend builds the plain decoder with the run's seed and converts it in
place), so both backends start from the same weights.

Sequence parallelism (sequence_parallel, as Echo's TP DiT, model.megatron): between the TP regions
the hidden states are this rank's slice of the sequence. The embedding (and learned positions) run
on the whole sequence and scatter it (enter_blocks), the final norm and LM head gather it back
(leave_blocks: backward only splits, every rank computing the same loss). Inside the blocks the
column-parallel linears all-gather their input along the sequence and the row-parallel ones
reduce-scatter their output, megatron-core's linears doing both on sequence-first tensors: the
blocks stay batch-first, TPLinear transposing at its boundaries. The norms and the row-parallel
biases then see only this rank's tokens: their gradients are marked PARTIAL_GRAD and summed over TP
before the clip, as Echo's block norms are (backends.megatron.megatron_clip).
"""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel import (
    ColumnParallelLinear,
    gather_from_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    set_tensor_model_parallel_attributes,
)
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import nn

from echobench.model.decoder import Decoder
from echobench.model.megatron import PARTIAL_GRAD, GroupRowParallelLinear, TracedColumnParallelLinear, _no_init


def card_megatron_config(card, tp: int, params_dtype: torch.dtype, use_cpu: bool,
                         sequence_parallel: bool = False) -> TransformerConfig:
    """megatron-core's TransformerConfig of the card's blocks (its layers, DDP and optimizer read it);
    weights are not initialised here (perform_initialization=False): they come from the plain model."""
    return TransformerConfig(
        num_layers=card.layers, hidden_size=card.hidden, num_attention_heads=card.heads,
        num_query_groups=card.kv_heads, kv_channels=card.hidden // card.heads, ffn_hidden_size=card.ffn,
        add_bias_linear=card.bias, hidden_dropout=0.0, attention_dropout=0.0, tensor_model_parallel_size=tp,
        sequence_parallel=sequence_parallel, params_dtype=params_dtype, bf16=params_dtype == torch.bfloat16,
        use_cpu_initialization=use_cpu, perform_initialization=False,
        cuda_graph_scope=[])  # megatron-core's default "full" warns of its own deprecation; [] means the same


class TPLinear(nn.Module):
    """A plain nn.Linear's place taken by this rank's share of it on a megatron-core parallel linear:
    column-parallel (the rows of each of `parts`, the fused projections it stacks, split evenly across
    ranks and this rank's slices stacked again, so that splitting the local output as the plain
    forward does gives this rank's share of each) or row-parallel (its input columns; the bias,
    whole, added after the all-reduce). Returns the output alone, as nn.Linear does. Under sequence
    parallelism its (B, T, .) input and output are handed to megatron-core sequence-first."""

    def __init__(self, plain: nn.Linear, kind: str, parts: list[int], rank: int, tp: int, config: TransformerConfig,
                 tp_group, traced: bool):
        super().__init__()
        bias = plain.bias is not None
        self.sequence_first = config.sequence_parallel
        if kind == "column":
            cls = TracedColumnParallelLinear if traced else ColumnParallelLinear
            self.linear = cls(plain.in_features, plain.out_features, config=config, init_method=_no_init, bias=bias,
                              gather_output=False, skip_bias_add=True, is_expert=False, tp_group=tp_group)
            shard = lambda t: torch.cat([p.chunk(tp, 0)[rank] for p in t.split(parts, 0)], 0)  # noqa: E731
            weight, b = shard(plain.weight), shard(plain.bias) if bias else None
        else:
            self.linear = GroupRowParallelLinear(plain.in_features, plain.out_features, config=config,
                                                 init_method=_no_init, bias=bias, input_is_parallel=True,
                                                 skip_bias_add=True, is_expert=False, tp_group=tp_group)
            weight, b = plain.weight.chunk(tp, 1)[rank], plain.bias
        with torch.no_grad():
            self.linear.weight.copy_(weight)
            if bias:
                self.linear.bias.copy_(b)
        # megatron-core marks a weight as split only when it initialises it; the gradient norm counts
        # a weight without the mark once per TP group (TP rank 0's), as a replicated one.
        if not getattr(self.linear.weight, "tensor_model_parallel", False):
            set_tensor_model_parallel_attributes(self.linear.weight, True, 0 if kind == "column" else 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_first:
            x = x.transpose(0, 1)
        out, bias = self.linear(x)
        out = out if bias is None else out + bias
        return out.transpose(0, 1) if self.sequence_first else out


class SequenceSplit(nn.Module):
    """Sequence parallelism's region boundaries on a batch-first (B, T, H) stream: "scatter" keeps
    this TP rank's T / tp (backward all-gathers), "gather" all-gathers them (backward splits: what
    follows is replicated, every rank computing the same loss). Echo's region functions, sequence-first."""

    def __init__(self, kind: str, tp: int, tp_group):
        super().__init__()
        self.kind, self.tp, self.tp_group = kind, tp, tp_group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.transpose(0, 1)
        if self.kind == "scatter":
            if x.shape[0] % self.tp:
                raise ValueError(f"sequence parallelism needs the card's seq ({x.shape[0]}) divisible by tp={self.tp}")
            x = scatter_to_sequence_parallel_region(x, group=self.tp_group)
        else:
            x = gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False, group=self.tp_group)
        return x.transpose(0, 1)


def tp_decoder(model: Decoder, rank: int, tp: int, config: TransformerConfig, tp_group, traced: bool) -> Decoder:
    """The plain decoder made this TP rank's, in place: each block's linears TPLinear, its attention's
    head counts this rank's; under config.sequence_parallel the sequence split around the blocks and
    the gradients that then cover this rank's tokens only marked PARTIAL_GRAD. `traced`: the blocks
    will be compiled (TracedColumnParallelLinear)."""
    card = model.card
    d, f, kv = card.hidden, card.ffn, card.kv_heads * (card.hidden // card.heads)
    up_parts = [f, f] if card.activation == "swiglu" else [f]
    for block in model.blocks:
        attn, mlp = block.attn, block.mlp
        attn.qkv = TPLinear(attn.qkv, "column", [d, kv, kv], rank, tp, config, tp_group, traced)
        attn.out = TPLinear(attn.out, "row", [d], rank, tp, config, tp_group, traced)
        attn.heads, attn.kv_heads = card.heads // tp, card.kv_heads // tp
        mlp.up = TPLinear(mlp.up, "column", up_parts, rank, tp, config, tp_group, traced)
        mlp.down = TPLinear(mlp.down, "row", [f], rank, tp, config, tp_group, traced)
        if config.sequence_parallel:
            partial = [*block.attn_norm.parameters(), *block.mlp_norm.parameters(),
                       *(b for b in (attn.out.linear.bias, mlp.down.linear.bias) if b is not None)]
            for param in partial:
                setattr(param, PARTIAL_GRAD, True)
    if config.sequence_parallel:
        model.enter_blocks = SequenceSplit("scatter", tp, tp_group)
        model.leave_blocks = SequenceSplit("gather", tp, tp_group)
    model.config = config  # megatron-core's DDP and optimizer read it
    return model
