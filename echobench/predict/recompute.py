"""Activation checkpointing as what a framework re-runs, not a level: each named policy says which
of a block's forward work runs again in backward (its linears by name, the core attention, the
element-wise ops, the TP collectives) and on what share of the layers. card_work prices the re-run
work as the forward's (so HFU counts it); cards.memory keeps what the policy saves.

A block's linears by name: q, k, v (separate projections, as torchtitan and HF Llama write them),
out, gate (SwiGLU's), up, down. Policies:

- none: nothing re-run.
- full: the whole block: Megatron --recompute-granularity full (uniform, every layer),
  composer's per-block checkpoint wrapper (llm-foundry activation_checkpointing: true),
  torchtitan activation_checkpoint.mode full, MaxText remat_policy full.
- selective: Megatron --recompute-granularity selective, the core attention (QK^T, softmax,
  dropout, the weighted sum; Korthikanti et al. 2022, section 5): the attention forward again,
  no linear; NeMo's activations_checkpoint_granularity selective is the same.
- selective-op: torchtitan's op-level SAC (selective_ac_option "op", torchtitan
  parallelisms/parallelize_llama.py `_save_list`): SDPA's outputs, reduce-scatters and max / abs
  are saved, a matmul's output only at odd counts in the block (`mm_count % 2 == 0` recomputes):
  of q, k, v, out, gate (w1), up (w3), down (w2) in their forward order, k, out and up (gated; w2
  ungated) re-run; every element-wise op re-runs; the attention kernel does not.
- selective-layer-2: torchtitan's layer SAC (selective_ac_option "2"): every second block wrapped
  in a full checkpoint: half the layers' whole forward.
- maxtext-minimal: MaxText remat_policy minimal (jax.checkpoint_policies
  .checkpoint_dots_with_no_batch_dims): every matmul's output saved, attention included; the
  element-wise ops re-run.
- maxtext-save_qkv_proj: MaxText remat_policy save_qkv_proj: the q, k, v projections saved, the
  rest of the block re-run (out, the MLP, the attention, the element-wise ops).
- maxtext-save_dot_except_mlp: MaxText remat_policy save_dot_except_mlp: every dot saved but the
  MLP's: gate, up, down and the element-wise ops re-run.

Early stop: torch.utils.checkpoint's non-reentrant checkpoint stops re-running a region as soon as
every tensor its backward saved has been recomputed (the default since torch 2.1,
pytorch/pytorch#96866; torch/utils/checkpoint.py raises _StopRecomputationError at the last saved
tensor's pack). An autograd op saves its inputs before it computes, so the region's last linear (a
pre-norm block's MLP down projection, whose output nothing in the block saves) is never re-run,
nor what follows it (its row-parallel reduction, the residual add). A whole-block policy (full,
selective-layer-2) wrapped that way re-runs every linear but `down` (recomputed_linears'
early_stop) where that linear is a plain autograd op; one that is an autograd Function saves after
it computes and runs before the stop (frameworks.Framework.ac_early_stop, skips_last_linear).
"""

from __future__ import annotations

from dataclasses import dataclass

LINEARS = ("q", "k", "v", "out", "gate", "up", "down")


@dataclass(frozen=True)
class Policy:
    """What a recompute policy re-runs of a block's forward, on `layers` of them (a share)."""

    linears: frozenset[str]  # the block's linears re-run (LINEARS)
    attention: bool  # the core attention's forward re-run
    elementwise: bool  # the block's element-wise forward ops re-run
    collectives: bool  # the block's forward TP collectives re-run
    layers: float = 1.0  # the share of the blocks the policy wraps
    source: str = ""


ALL = frozenset(LINEARS)
LAST_LINEAR = "down"  # a pre-norm block's last linear: the one early stop does not re-run
WHOLE_BLOCK = ("full", "selective-layer-2")  # the policies that wrap a whole block in one checkpoint
POLICIES: dict[str, Policy] = {
    "none": Policy(frozenset(), False, False, False, 1.0, "no activation checkpointing"),
    "full": Policy(ALL, True, True, True, 1.0, "every block's forward re-run (Megatron full, composer's per-block "
                                                 "wrapper, torchtitan full, MaxText full)"),
    "selective": Policy(frozenset(), True, False, False, 1.0, "Megatron / NeMo selective: the core attention re-run "
                                                               "(Korthikanti et al. 2022)"),
    "selective-op": Policy(frozenset(), False, True, False, 1.0, "torchtitan op SAC: every other matmul of a block "
                                                                  "and its element-wise ops re-run, SDPA saved"),
    "selective-layer-2": Policy(ALL, True, True, True, 0.5, "torchtitan layer SAC 2: every second block re-run whole"),
    "maxtext-minimal": Policy(frozenset(), False, True, False, 1.0, "MaxText minimal: every dot saved, element-wise "
                                                                     "ops re-run"),
    "maxtext-save_qkv_proj": Policy(frozenset({"out", "gate", "up", "down"}), True, True, True, 1.0,
                                    "MaxText save_qkv_proj: q, k, v saved, the rest of the block re-run"),
    "maxtext-save_dot_except_mlp": Policy(frozenset({"gate", "up", "down"}), False, True, False, 1.0,
                                          "MaxText save_dot_except_mlp: the MLP's dots and the element-wise ops re-run"),
}


def recomputed_linears(policy_name: str, gated: bool, early_stop: bool = False) -> frozenset[str]:
    """The block's linears `policy_name` re-runs (torchtitan's op SAC by its matmul count: the
    even-numbered of q, k, v, out, [gate,] up / down in forward order); `early_stop`: the block is
    wrapped in torch's non-reentrant checkpoint, whose early stop leaves a whole-block policy's
    last linear out (the module docstring)."""
    if policy_name != "selective-op":
        names = POLICIES[policy_name].linears
        return names - {LAST_LINEAR} if early_stop and policy_name in WHOLE_BLOCK else names
    order = ("q", "k", "v", "out", "gate", "up", "down") if gated else ("q", "k", "v", "out", "up", "down")
    return frozenset(name for i, name in enumerate(order, 1) if i % 2 == 0)


def policy(name: str) -> Policy:
    return POLICIES[name]
