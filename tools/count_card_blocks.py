"""Counts the memory-bound work of one eager decoder block as two frameworks write it, for
predict's model cards (echobench/predict/cards/work.py ELEMENTWISE_EAGER): bytes read + written and
kernels launched by every op that is not a GEMM or the attention kernel (echobench.predict.stepcount_ops
.op_tally classifies each ATen op as a GPU runs it), forward and backward, per token, bf16 on the CPU.

- mpt: llm-foundry's MPT block (llmfoundry/models/layers/blocks.py, attention.py, ffn.py at
  5e85bd62): low_precision_layernorm (F.layer_norm in bf16), Wqkv with bias, attention, out_proj,
  residual add, norm, up_proj + GELU (exact), down_proj, residual add.
- llama: torchtitan's Llama block (torchtitan/models/llama/model.py at 9dec370a): RMSNorm in float32
  (`self._norm(x.float()).type_as(x) * self.weight`), wq / wk / wv, rotary through complex float32
  (`torch.view_as_complex(xq.float().reshape(...)) * freqs_cis`), attention, wo, residual add,
  norm, w2(F.silu(w1(x)) * w3(x)), residual add.

Each block is counted at shapes that vary hidden, ffn and the key/value width apart (MPT is
multi-head: two, kv_width = hidden), and the bytes per token solved for a x hidden + b x ffn + c x
kv_width (exact: every op's bytes are linear in them at a fixed token count); the output's gradient
is given, so no loss is counted. Prints the coefficients cards.work holds (a test holds them against a
fresh count).

    python tools/count_card_blocks.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from echobench.predict.stepcount_ops import op_tally  # noqa: E402  (after the path: run as a script)

TOKENS, HEAD_DIM = 64, 32
SHAPES = [(256, 512, 256), (512, 512, 256), (256, 1024, 128)]  # (hidden, ffn, kv_width)


class Bytes(TorchDispatchMode):
    """Memory-bound bytes and kernels by phase (backward: an autograd graph task is running)."""

    def __init__(self):
        super().__init__()
        self.tally = {("forward", "bytes"): 0, ("forward", "kernels"): 0, ("backward", "bytes"): 0, ("backward", "kernels"): 0}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        kind, _, t = op_tally(func, args, kwargs or {}, out)
        if kind == "memory":
            phase = "forward" if torch._C._current_graph_task_id() == -1 else "backward"
            self.tally[phase, "bytes"] += t.bytes
            self.tally[phase, "kernels"] += t.kernels
        return out


def attention(q, k, v):
    """The attention kernel (not counted: op_tally's "attention" kind)."""
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True).transpose(1, 2)


def mpt_block(d: int, f: int, kv: int):
    w = {name: (torch.randn(shape, dtype=torch.bfloat16) * 0.02).requires_grad_() for name, shape in
         (("wqkv", (d + 2 * kv, d)), ("out", (d, d)), ("up", (f, d)), ("down", (d, f)))}
    b = {name: torch.zeros(shape[0], dtype=torch.bfloat16, requires_grad=True) for name, shape in
         (("wqkv", (d + 2 * kv,)), ("out", (d,)), ("up", (f,)), ("down", (d,)))}
    ln = [(torch.ones(d, dtype=torch.bfloat16, requires_grad=True), torch.zeros(d, dtype=torch.bfloat16, requires_grad=True))
          for _ in range(2)]

    def run(x):
        h = F.layer_norm(x, (d,), *ln[0])
        qkv = F.linear(h, w["wqkv"], b["wqkv"])
        q, k, v = qkv.split([d, kv, kv], dim=-1)
        q, k, v = (t.reshape(1, TOKENS, d // HEAD_DIM, HEAD_DIM) for t in (q, k, v))  # MPT: multi-head, kv = d
        a = attention(q, k, v).reshape(1, TOKENS, d)
        x = x + F.linear(a, w["out"], b["out"])
        h = F.layer_norm(x, (d,), *ln[1])
        return x + F.linear(F.gelu(F.linear(h, w["up"], b["up"])), w["down"], b["down"])
    return run


def llama_block(d: int, f: int, kv: int):
    w = {name: (torch.randn(shape, dtype=torch.bfloat16) * 0.02).requires_grad_() for name, shape in
         (("wq", (d, d)), ("wk", (kv, d)), ("wv", (kv, d)), ("wo", (d, d)), ("w1", (f, d)), ("w2", (d, f)), ("w3", (f, d)))}
    norms = [torch.ones(d, dtype=torch.bfloat16, requires_grad=True) for _ in range(2)]
    freqs = torch.polar(torch.ones(TOKENS, HEAD_DIM // 2), torch.randn(TOKENS, HEAD_DIM // 2))

    def rms(x, weight):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5)).type_as(x) * weight

    def rope(t):
        c = torch.view_as_complex(t.float().reshape(*t.shape[:-1], -1, 2))
        return torch.view_as_real(c * freqs.view(1, TOKENS, 1, HEAD_DIM // 2)).flatten(3).type_as(t)

    def run(x):
        h = rms(x, norms[0])
        q = rope(F.linear(h, w["wq"]).view(1, TOKENS, d // HEAD_DIM, HEAD_DIM))
        k = rope(F.linear(h, w["wk"]).view(1, TOKENS, kv // HEAD_DIM, HEAD_DIM))
        v = F.linear(h, w["wv"]).view(1, TOKENS, kv // HEAD_DIM, HEAD_DIM)
        rep = d // kv
        k, v = (t[:, :, :, None, :].expand(1, TOKENS, kv // HEAD_DIM, rep, HEAD_DIM).reshape(1, TOKENS, d // HEAD_DIM, HEAD_DIM)
                for t in (k, v))
        x = x + F.linear(attention(q, k, v).reshape(1, TOKENS, d), w["wo"])
        h = rms(x, norms[1])
        return x + F.linear(F.silu(F.linear(h, w["w1"])) * F.linear(h, w["w3"]), w["w2"])
    return run


def count(block, d: int, f: int, kv: int) -> dict:
    """One block's forward and backward (the output's gradient given: no loss counted)."""
    run = block(d, f, kv)
    x = torch.randn(1, TOKENS, d, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(1, TOKENS, d, dtype=torch.bfloat16)
    with Bytes() as counter:
        run(x).backward(grad)
    return counter.tally


def coefficients(block, multi_head: bool) -> dict:
    """Per token, bytes = a hidden + b ffn + c kv_width, forward and backward (multi-head: kv_width =
    hidden, so a + c is solved as a and c is 0); kernels per block."""
    shapes = [(d, f, d) for d, f, _ in SHAPES[1:]] if multi_head else SHAPES
    tallies = [count(block, *s) for s in shapes]
    A = np.array([s[:2] for s in shapes] if multi_head else shapes, dtype=float)
    out = {}
    for phase in ("forward", "backward"):
        y = np.array([t[phase, "bytes"] / TOKENS for t in tallies])
        c = list(np.linalg.solve(A, y)) + ([0.0] if multi_head else [])
        out[phase] = tuple(round(float(x), 2) for x in c)
        out[phase + "_kernels"] = tallies[0][phase, "kernels"]
    return out


def main() -> None:
    torch.manual_seed(0)
    for name, block, mha in (("mpt", mpt_block, True), ("llama", llama_block, False)):
        c = coefficients(block, mha)
        print(f"{name}: forward bytes/token = {c['forward'][0]} d + {c['forward'][1]} f + {c['forward'][2]} kv; "
              f"backward {c['backward'][0]} d + {c['backward'][1]} f + {c['backward'][2]} kv; kernels "
              f"{c['forward_kernels']} / {c['backward_kernels']}")


if __name__ == "__main__":
    main()
