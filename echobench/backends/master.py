"""bf16 compute weights with an fp32 master copy in the optimizer (RunConfig.master_weights bf16-compute).

Under torch's AMP recipe (fp32-autocast) the parameters are fp32 and autocast casts every weight
to bf16 in the forward of every micro-batch (and keeps the bf16 copy for backward); backward writes
bf16 weight gradients that are cast to fp32 and accumulated. Here the model holds its trainable
parameters in bf16: autocast finds them in bf16 and casts nothing, backward writes and accumulates
bf16 gradients (DDP reduces them in bf16). The micro-batches' gradients are summed either in bf16
(in the parameters' gradients, cast to the fp32 masters' gradients once per step: one multi-tensor
pass) or in fp32 (accumulate_fp32: each parameter's bf16 gradient added into its master's fp32
gradient as soon as backward has written it, and freed: Megatron-LM's main gradients). Then the
gradients are clipped, the optimizer (fused AdamW on a GPU: one multi-tensor kernel over the masters
and moments) updates the fp32 masters, and the masters are copied back into the bf16 parameters
(one multi-tensor copy): no weight is cast in any micro-batch.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
from torch import nn

RECIPES = {
    "fp32": "fp32 parameters and compute",
    "fp32-autocast": "fp32 parameters; bf16 autocast casts each weight in every micro-batch's forward; bf16 weight "
                     "gradients cast to fp32 and accumulated in fp32",
    "bf16-compute": "bf16 parameters used as they are (autocast casts no weight); bf16 gradients summed across "
                    "micro-batches in grad_accum_dtype (bf16: cast to fp32 once per step; fp32: added into the fp32 "
                    "masters' gradients as backward writes them); an fp32 master copy updated by the optimizer and "
                    "copied back to bf16",
    "fsdp2": "fp32 sharded parameters (the master); FSDP2's MixedPrecisionPolicy gathers them in bf16 "
             "(each rank casts its shard once per all-gather; autocast casts no weight), gradients reduce-scattered "
             "in grad_reduce_dtype",
}


class MasterWeights:
    """The optimizer of bf16 parameters over their fp32 master copies, with the optimizer's interface
    the step uses (step, zero_grad, defaults, param_groups). Built before data parallelism wraps the
    model: it turns `params` (fp32) into bf16 in place, keeping each Parameter object."""

    def __init__(self, params: list[nn.Parameter], make_optimizer: Callable[[list], torch.optim.Optimizer],
                 accumulate_fp32: bool = False):
        self.params = params
        self.masters = [nn.Parameter(p.detach().float().clone()) for p in params]
        for p in params:
            p.data = p.data.to(torch.bfloat16)
        self.optimizer = make_optimizer(self.masters)
        self.defaults, self.param_groups = self.optimizer.defaults, self.optimizer.param_groups
        self.accumulate_fp32 = accumulate_fp32
        if accumulate_fp32:
            for p, m in zip(params, self.masters):
                p.register_post_accumulate_grad_hook(functools.partial(_add_into_fp32, m))

    def load_grads(self) -> list[nn.Parameter]:
        """The step's bf16 gradients cast to fp32 into the masters' gradients (the bf16 ones freed):
        the parameters for clipping and the update. A parameter without a gradient keeps none. With
        accumulate_fp32 the masters hold the step's fp32 sums already."""
        if self.accumulate_fp32:
            return self.masters
        have = [(m, p.grad) for m, p in zip(self.masters, self.params) if p.grad is not None]
        fp32 = [torch.empty_like(m) for m, _ in have]
        if have:
            torch._foreach_copy_(fp32, [g for _, g in have])
        for (m, _), g in zip(have, fp32):
            m.grad = g
        for p in self.params:
            p.grad = None
        return self.masters

    def step(self) -> None:
        self.load_grads()  # where clipping (the step's clip_grad) did not: the bf16 gradients are freed there
        self.optimizer.step()
        with torch.no_grad():
            torch._foreach_copy_([p.data for p in self.params], self.masters)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for group in (self.params, self.masters):
            for p in group:
                p.grad = None


def _add_into_fp32(master: nn.Parameter, param: nn.Parameter) -> None:
    """A parameter's post-accumulate-grad hook (accumulate_fp32): its micro-batch's bf16 gradient
    added into the master's fp32 gradient, then freed, so each micro-batch's is summed in fp32."""
    with torch.no_grad():
        if master.grad is None:
            master.grad = param.grad.float()
        else:
            master.grad.add_(param.grad)
    param.grad = None
