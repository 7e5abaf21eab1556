"""megatron-core on a CPU: the two places where it assumes CUDA, redirected to the CPU.

Applied only on a CPU run (backends/megatron.py); on a GPU megatron-core runs as it is.

1. torch.cuda.current_device(): where megatron-core allocates its communication buffers (the
   outputs of its sequence-parallel all-gathers and reduce-scatters, the global memory buffer its
   sequence-parallel linears gather into, DDP's gradient and parameter buffers). A CPU process has
   no CUDA device; these buffers belong on the CPU, which every collective of gloo reads.
2. FP32Optimizer: its __init__ makes its loss scale, a constant 1.0 that this backend never reads,
   on "cuda". CPUFP32Optimizer makes it on the CPU and is FP32Optimizer otherwise.

What stays GPU only (backends/checks.megatron_problem refuses it before launch): megatron-core's
mixed-precision optimizers (bf16 parameters, the distributed optimizer), which accept only
parameters whose type is torch.cuda.*Tensor.
"""

from __future__ import annotations

from contextlib import contextmanager

import megatron.core.optimizer as mcore_optimizer
import torch
import torch._dynamo.trace_rules
from megatron.core.optimizer.optimizer import FP32Optimizer, MegatronOptimizer


def cpu_device() -> str:
    return "cpu"


def redirect_cuda_to_cpu() -> None:
    """torch.cuda.current_device() answers "cpu" for the rest of this (CPU-only) process.

    Inside compiled code dynamo inlines cpu_device to the constant "cpu", provided it does not
    take it for the torch function: dynamo reads its table of torch functions from their names
    when it first needs it, so the table is read here first, with the real current_device in it.
    """
    torch._dynamo.trace_rules.get_torch_obj_rule_map()
    torch.cuda.current_device = cpu_device


class CPUFP32Optimizer(FP32Optimizer):
    """megatron-core's FP32Optimizer with its loss scale on the CPU."""

    def __init__(self, optimizer, config, init_state_fn):
        MegatronOptimizer.__init__(self, optimizer, config, init_state_fn)
        self._scale = torch.ones(1)
        self.is_stub_optimizer = optimizer is None


@contextmanager
def cpu_optimizer():
    """get_megatron_optimizer, called inside, builds CPUFP32Optimizer where it builds FP32Optimizer."""
    built = mcore_optimizer.FP32Optimizer
    mcore_optimizer.FP32Optimizer = CPUFP32Optimizer
    try:
        yield
    finally:
        mcore_optimizer.FP32Optimizer = built
