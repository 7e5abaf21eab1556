"""Pipeline parallelism's schedule (Narayanan et al. 2021, "Efficient Large-Scale Language Model
Training on GPU Clusters Using Megatron-LM", section 2.2): a step of m micro-batches on p stages.

- 1F1B (non-interleaved): the pipeline fills and drains once a step; the idle share of a stage
  is the bubble (p - 1) / m of the ideal time m x (t_f + t_b), a micro-batch's forward and backward
  on one stage.
- Interleaved 1F1B (v model chunks per rank, Megatron's virtual pipeline): the bubble shrinks to
  (p - 1) / (v m) and the point-to-point traffic grows v-fold (each chunk boundary sends).

Point-to-point: per micro-batch and chunk boundary, the activations forward (micro_batch x
seq / cp x hidden in the compute dtype, / tp with sequence parallelism) and their gradient back,
between ranks of adjacent stages (another node when the model-parallel group spans nodes).
Data-parallel gradient reduction under the interleaved schedule (Megatron-Core's, with
--overlap-grad-reduce: megatron/core/pipeline_parallel/schedules.py at f2e5db40, lines 731-758 and
1074-1079; NeMo 24.07 passes its distributed Adam's grad sync through the same hook): each model
chunk's gradients are reduced once its last micro-batch's backward is done, while the first stage
still runs the other chunks' backward of the last p micro-batches; the last chunk's (1 / v of the
bytes) waits for nothing and is exposed (interleaved_grad_exposed).
Memory: 1F1B keeps min(p, m) micro-batches' activations in flight on the first stage (interleaved
about p (1 + (p - 1) / (v p))), each of layers / p blocks.
"""

from __future__ import annotations


def bubble_fraction(pp: int, vp: int, micro_batches: int) -> float:
    """The pipeline bubble over the ideal time: (p - 1) / (v m); 0 without pipeline parallelism."""
    if pp <= 1:
        return 0.0
    return (pp - 1) / (vp * micro_batches)


def pipeline_seconds(micro_s: float, pp: int, vp: int, micro_batches: int, mean_s: float | None = None) -> float:
    """A step's compute: m micro-batches of the slowest stage's `micro_s` (forward + backward) in the
    steady state, and the fill and drain, (p - 1) / v micro-batches of a stage's mean `mean_s`
    (None: the slowest's): the bubble (p - 1) / (v m) when the stages are even."""
    if pp <= 1:
        return micro_s * micro_batches
    mean_s = micro_s if mean_s is None else mean_s
    return micro_s * micro_batches + mean_s * (pp - 1) / vp


def p2p_messages(pp: int, vp: int, micro_batches: int) -> int:
    """Sends one stage makes per step and direction: a message per micro-batch and chunk boundary."""
    return 0 if pp <= 1 else micro_batches * vp


def in_flight(pp: int, vp: int, micro_batches: int) -> float:
    """Micro-batches whose activations the first stage holds at once under (interleaved) 1F1B."""
    if pp <= 1:
        return 1.0
    return min(micro_batches, pp * (1 + (pp - 1) / (vp * pp)) if vp > 1 else pp)


def interleaved_grad_exposed(reduce_s: float, pp: int, vp: int, micro_batches: int, backward_micro_s: float) -> float:
    """Seconds of a step's data-parallel gradient reduction (`reduce_s`, every chunk's) left exposed
    on the first stage under the interleaved schedule (the module docstring): the last chunk's
    share, or what the link still has to send when the backward ends, whichever is more; the other
    chunks' reductions start as each chunk's last backward ends, with (v - 1) / v of the last
    min(p, m) micro-batches' backward (`backward_micro_s` each, on this stage) still to run."""
    window = (vp - 1) / vp * min(pp, micro_batches) * backward_micro_s
    return max(reduce_s / vp, reduce_s - window)
