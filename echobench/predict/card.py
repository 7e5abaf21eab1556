"""A plain decoder as a small model card (ModelCard) and the run's layout (Layout), and what one
training step of it runs on one rank (card_work): the same kinds of work as Echo's (work.Matmul,
work.AttentionWork, element-wise bytes, the parameters a rank updates), so that both go through
pricing.work_seconds. The step's collectives are card_traffic.py's.

Counted per micro-batch, then x grad_accum (the step):
- GEMMs: x (rows, k) @ W^T (k, n), rows = micro_batch x seq (sequence parallelism gathers the
  sequence before each column-parallel GEMM, so the GEMM rows stay whole): QKV as one GEMM with
  kv_heads for K and V (GQA), the output projection, the MLP (GELU: up, down; SwiGLU: gate+up as one
  GEMM, down), the LM head over the vocabulary (tied or not: the head's GEMMs are the same; the input
  embedding is a lookup). Backward: the weight gradient and the input gradient of every one (the
  first layer's input is the trained embedding's output). Megatron TP: QKV, MLP up / gate+up and the
  LM head column-parallel (n / tp), the output projection and MLP down row-parallel (k / tp).
- Attention: forward 4 x micro_batch x seq^2 x head_dim per head and layer (every score, as flops.py
  counts it; AttentionWork.causal tells the kernel the mask), backward 2x, heads / tp per rank.
- Activation checkpointing: full re-runs every layer's forward (GEMMs, attention, element-wise) in
  backward (composer's per-block checkpoint wrapper; Megatron's --recompute-granularity full,
  uniform, every layer); selective re-runs the core attention only (Megatron's selective
  granularity: the scores, softmax and weighted sum, here the attention forward).
- Element-wise bytes: ELEMENTWISE_READS_WRITES, per token, from the ops a pre-norm decoder runs.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, fields
from pathlib import Path


from echobench.predict.errors import PredictError
from echobench.predict.work import AttentionWork, Matmul
from echobench.yamltext import read_yaml

ACTIVATIONS = ("gelu", "swiglu")
POSITIONS = ("learned", "rotary", "alibi", "none")
NORMS = ("layernorm", "rmsnorm")
LAYOUTS = ("ddp", "fsdp", "hsdp", "megatron")
SHARDINGS = ("full_shard", "shard_grad_op", "hybrid_shard", "no_shard")
AC = ("none", "full", "selective")
PRECISION_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
# Element-wise work per token and layer, in elements read + written of the compute dtype (d: hidden,
# f: ffn, q/kv: the query / key widths), each op counted from what it reads and writes (bias adds
# are fused into the GEMM epilogue or into the bias-dropout-add and count 0; no dropout):
#   forward: two norms (read x, write y: 2d each), two residual adds (read 2, write 1: 3d each),
#            the activation (GELU read f, write f: 2f; SwiGLU read gate and up, write f: 3f),
#            rotary on q and k (read, write: 2 (q + kv)) where positions are rotary;
#   backward: two norm backwards (read x and dy, write dx: 3d each), two gradient adds where the
#            residual branches meet (3d each), the activation's backward (GELU read x, dy, write dx:
#            3f; SwiGLU read gate, up, dy, write both: 5f), rotary's (as its forward).
# Once per token: the embedding lookup (2d; backward its scatter-add, 3d), learned positions (add:
# 3d; backward 1d), the final norm (2d; 3d), softmax cross-entropy over the vocabulary logits (read
# the logits, write the log-probabilities: 2V; backward read the probabilities, write the gradient: 2V).
# Sequence parallelism splits the norms and residual adds by tp; without it each TP rank runs them whole.
ELEMENTWISE_READS_WRITES = {"norm": (2, 3), "residual": (3, 3), "gelu": (2, 3), "swiglu": (3, 5),
                            "rotary": (2, 2), "embedding": (2, 3), "positions": (3, 1), "cross_entropy": (2, 2)}
# torch.compile fuses each element-wise chain into one kernel that reads its inputs and writes its
# outputs once: assumed to halve the bytes (no compiled decoder step was counted here).
COMPILED_ELEMENTWISE = 0.5


@dataclass(frozen=True)
class ModelCard:
    """A plain decoder-only transformer (pre-norm blocks of attention and an MLP)."""

    layers: int
    hidden: int
    ffn: int
    activation: str  # gelu (up, down) or swiglu (gate, up, down)
    heads: int
    kv_heads: int
    vocab: int
    tied_embeddings: bool
    positions: str  # learned (a table of seq rows), rotary, alibi, none
    bias: bool
    causal: bool = True
    norm: str = "layernorm"
    params: int | None = None  # the published parameter count, where there is one

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "ffn", "heads", "kv_heads", "vocab"):
            if getattr(self, name) < 1:
                raise PredictError(f"model card: {name} {getattr(self, name)} must be >= 1")
        if self.activation not in ACTIVATIONS:
            raise PredictError(f"model card: unknown activation {self.activation!r}: give one of {', '.join(ACTIVATIONS)}")
        if self.positions not in POSITIONS:
            raise PredictError(f"model card: unknown positions {self.positions!r}: give one of {', '.join(POSITIONS)}")
        if self.norm not in NORMS:
            raise PredictError(f"model card: unknown norm {self.norm!r}: give one of {', '.join(NORMS)}")
        if self.hidden % self.heads:
            raise PredictError(f"model card: heads {self.heads} do not divide hidden {self.hidden}: give a head "
                               "count that does (head_dim = hidden / heads)")
        if self.heads % self.kv_heads:
            raise PredictError(f"model card: kv_heads {self.kv_heads} do not divide heads {self.heads} (GQA groups "
                               "query heads evenly)")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim


@dataclass(frozen=True)
class Layout:
    """How a card is trained: ranks, batch, data / tensor parallel layout and its options."""

    gpus: int
    gpus_per_node: int
    seq: int
    micro_batch: int
    grad_accum: int
    global_batch: int
    layout: str  # ddp, fsdp, hsdp, megatron (TP with DP, Megatron-LM)
    sharding: str = "full_shard"  # fsdp / hsdp: full_shard, shard_grad_op (hybrid_shard: hsdp)
    tp: int = 1
    pp: int = 1
    sequence_parallel: bool = False
    distributed_optimizer: bool = False  # Megatron's ZeRO-1
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    tp_comm_overlap: bool = False
    ac: str = "none"
    compile: bool = False
    precision: str = "bf16"
    grad_reduce_dtype: str = "fp32"
    framework: str = ""
    attention_kernel: str | None = None  # as the profile's attention points name it (None: whichever it has)

    def __post_init__(self) -> None:
        if self.pp > 1:
            raise PredictError(f"pipeline parallelism is not modelled yet: pp {self.pp} (give a row with pp: 1)")
        for name in ("gpus", "gpus_per_node", "seq", "micro_batch", "grad_accum", "global_batch", "tp"):
            if getattr(self, name) < 1:
                raise PredictError(f"run: {name} {getattr(self, name)} must be >= 1")
        checks = [(self.layout in LAYOUTS, f"unknown layout {self.layout!r}: give one of {', '.join(LAYOUTS)} (or tpN)"),
                  (self.sharding in SHARDINGS, f"unknown sharding {self.sharding!r}: give one of {', '.join(SHARDINGS)}"),
                  (self.ac in AC, f"unknown ac {self.ac!r}: give one of {', '.join(AC)}"),
                  (self.precision in PRECISION_BYTES, f"unknown precision {self.precision!r}: give one of "
                   f"{', '.join(PRECISION_BYTES)}"),
                  (self.grad_reduce_dtype in PRECISION_BYTES, f"unknown grad_reduce_dtype {self.grad_reduce_dtype!r}: "
                   f"give one of {', '.join(PRECISION_BYTES)}"),
                  (self.gpus % self.tp == 0, f"tp {self.tp} does not divide gpus {self.gpus}"),
                  (self.tp == 1 or self.layout == "megatron", f"tp {self.tp} with layout {self.layout}: tensor "
                   "parallelism is modelled as Megatron-LM's (layout megatron or tpN)"),
                  (self.tp <= self.gpus_per_node, f"tp {self.tp} spans nodes of {self.gpus_per_node} GPUs: keep a TP "
                   "group within a node"),
                  (self.layout != "hsdp" or self.gpus % self.gpus_per_node == 0,
                   f"hsdp shards within a node: gpus {self.gpus} must be whole nodes of {self.gpus_per_node}"),
                  (self.micro_batch * self.grad_accum * self.dp == self.global_batch,
                   f"micro_batch {self.micro_batch} x grad_accum {self.grad_accum} x data-parallel ranks {self.dp} "
                   f"= {self.micro_batch * self.grad_accum * self.dp}, not global_batch {self.global_batch}")]
        for ok, why in checks:
            if not ok:
                raise PredictError(f"run: {why}")

    @property
    def dp(self) -> int:
        return self.gpus // self.tp

    @property
    def nodes(self) -> int:
        return -(-self.gpus // self.gpus_per_node)

    @property
    def compute_bytes(self) -> int:
        return PRECISION_BYTES[self.precision]

    @property
    def sp(self) -> bool:
        """Sequence parallelism in effect (it needs TP)."""
        return self.sequence_parallel and self.tp > 1


def check_card_fits_layout(card: ModelCard, layout: Layout) -> None:
    """TP splits heads, KV heads, the FFN and the vocabulary evenly (one line naming what does not)."""
    for name, value in (("heads", card.heads), ("kv_heads", card.kv_heads), ("ffn", card.ffn), ("vocab", card.vocab)):
        if value % layout.tp:
            raise PredictError(f"run: tp {layout.tp} does not divide the model's {name} {value}: give a tp that does")


def _take(d: Mapping, cls, where: str, **fixed) -> dict:
    """The fields of dataclass `cls` from mapping `d` (required ones present, types checked): one-line
    errors naming `where` and the key; `fixed`: fields given, not read."""
    out = dict(fixed)
    for f in fields(cls):
        if f.name in out:
            continue
        key = f.name
        if key not in d or d[key] is None:
            if f.default is MISSING:  # required
                raise PredictError(f"{where} lacks {key!r}: add it")
            continue
        value, kind = d[key], str(f.type)
        ok = {"int": isinstance(value, int) and not isinstance(value, bool), "bool": isinstance(value, bool),
              "str": isinstance(value, str), "int | None": isinstance(value, int) and not isinstance(value, bool),
              "str | None": isinstance(value, str)}
        if kind in ok and not ok[kind]:
            raise PredictError(f"{where}.{key}: {value!r} is not {'an int' if 'int' in kind else 'a ' + kind}")
        out[f.name] = value
    return out


def model_card(d: Mapping, where: str = "model") -> ModelCard:
    """A ModelCard from a published row's `model` (or a card file's): params or params_estimate."""
    if not isinstance(d, Mapping):
        raise PredictError(f"{where}: expected a mapping of the model's shape")
    params = d.get("params", d.get("params_estimate"))
    return ModelCard(**_take(d, ModelCard, where, params=params if isinstance(params, int) else None))


def run_layout(run: Mapping, hardware: Mapping, where: str = "run", hw_where: str = "hardware") -> Layout:
    """A Layout from a published row's `run` and `hardware`: layout tpN is Megatron-LM with tp N."""
    if not isinstance(run, Mapping) or not isinstance(hardware, Mapping):
        raise PredictError(f"{where}: expected mappings `run` and `hardware`")
    if isinstance(run.get("pp"), int) and run["pp"] > 1:  # refused before anything else is checked
        raise PredictError(f"pipeline parallelism is not modelled yet: pp {run['pp']} (rows with pp: 1 are priced)")
    layout = run.get("layout")
    if isinstance(layout, str) and (m := re.fullmatch(r"tp(\d+)", layout)):
        layout = "megatron"
        if run.get("tp") is None:
            run = {**run, "tp": int(m.group(1))}
    if layout == "fsdp" and run.get("sharding") == "hybrid_shard":
        layout = "hsdp"
    for key in ("gpus", "gpus_per_node"):
        if not isinstance(hardware.get(key), int):
            raise PredictError(f"{hw_where} lacks an integer {key!r}: add it")
    merged = {**run, "gpus": hardware["gpus"], "gpus_per_node": hardware["gpus_per_node"], "layout": layout}
    return Layout(**_take(merged, Layout, where))


def load_card_file(path: Path | str) -> tuple[ModelCard, Layout, str]:
    """A small YAML card file, laid out as a published row without `published`: `model`, `run`,
    `hardware` (with `profile`, a shipped name or a file) -> the card, its layout and the profile."""
    path = Path(path)
    data = read_yaml(path, "model card", PredictError)
    if not isinstance(data, Mapping) or not all(isinstance(data.get(k), Mapping) for k in ("model", "run", "hardware")):
        raise PredictError(f"{path}: a model card is a mapping with `model`, `run` and `hardware` mappings")
    if not isinstance(data["hardware"].get("profile"), str):
        raise PredictError(f"{path}: hardware lacks `profile`: name a shipped profile or a profile file")
    return (model_card(data["model"], f"{path}: model"),
            run_layout(data["run"], data["hardware"], f"{path}: run", f"{path}: hardware"), data["hardware"]["profile"])


# ---- counting ----

def layer_params(card: ModelCard) -> int:
    """One block's parameters: QKV, output projection, MLP (with biases where `bias`), two norms
    (LayerNorm weight and bias, RMSNorm or bias-free LayerNorm a weight)."""
    d, f, b = card.hidden, card.ffn, int(card.bias)
    qkv = d * (d + 2 * card.kv_width) + b * (d + 2 * card.kv_width)
    mlp = (3 * d * f + b * (2 * f + d)) if card.activation == "swiglu" else (2 * d * f + b * (f + d))
    return qkv + d * d + b * d + mlp + 2 * norm_params(card)


def norm_params(card: ModelCard) -> int:
    return (2 if card.norm == "layernorm" and card.bias else 1) * card.hidden


def root_params(card: ModelCard, seq: int) -> int:
    """What is not in a block: the embedding (and an untied head), a learned position table of `seq`
    rows, the final norm (FSDP's root unit)."""
    embed = card.vocab * card.hidden * (1 if card.tied_embeddings else 2)
    return embed + (seq * card.hidden if card.positions == "learned" else 0) + norm_params(card)


def card_params(card: ModelCard, seq: int) -> int:
    """Every trainable parameter: the blocks' and the root's. llm-foundry's MPT rows' NumParams equal it."""
    return card.layers * layer_params(card) + root_params(card, seq)


def tp_split_params(card: ModelCard) -> int:
    """The parameters Megatron's TP splits across its ranks: QKV, output projection and MLP weights,
    the column-parallel biases, the vocabulary-parallel embedding (and head)."""
    d, f, b = card.hidden, card.ffn, int(card.bias)
    up = (2 if card.activation == "swiglu" else 1) * f
    layer = d * (d + 2 * card.kv_width) + d * d + up * d + f * d + b * (d + 2 * card.kv_width + up)
    return card.layers * layer + card.vocab * d * (1 if card.tied_embeddings else 2)


def rank_params(card: ModelCard, layout: Layout) -> float:
    """The parameters one rank holds and updates (its optimizer step): FSDP shards all over its shard
    group (every rank, HSDP a node); DDP keeps them whole; Megatron splits tp_split_params by tp and,
    with the distributed optimizer, the rank's share over the data-parallel group."""
    n = card_params(card, layout.seq)
    if layout.layout == "fsdp" and layout.sharding != "no_shard":
        return n / layout.gpus
    if layout.layout == "hsdp":
        return n / layout.gpus_per_node
    if layout.layout == "megatron":
        split = tp_split_params(card)
        per_tp = n - split + split / layout.tp
        return per_tp / layout.dp if layout.distributed_optimizer else per_tp
    return float(n)


@dataclass(frozen=True)
class CardWork:
    """One rank's step of a card: pricing.work_seconds' arguments, and the host's ops."""

    matmuls: tuple[Matmul, ...]
    attention: tuple[AttentionWork, ...]
    elementwise: tuple[float, float]  # bytes read + written, forward and backward (AC's re-run included)
    params: float  # the parameters this rank updates
    host_ops: int


def _linear(out: list, part: str, rows: int, n: int, k: int, count: int, recompute: bool) -> None:
    """One linear's GEMMs: forward (rows, n, k), backward weight gradient (n, k, rows) and input
    gradient (rows, k, n), and under full AC its forward again in backward."""
    out += [Matmul(part, "forward", rows, n, k, count), Matmul(part, "backward", n, k, rows, count),
            Matmul(part, "backward", rows, k, n, count)]
    if recompute:
        out.append(Matmul(part, "recompute", rows, n, k, count))


def elementwise_elements(card: ModelCard, layout: Layout) -> tuple[float, float]:
    """Elements read + written per token on one rank, forward and backward (ELEMENTWISE_READS_WRITES),
    before AC's re-run and compile's fusion."""
    e, tp = ELEMENTWISE_READS_WRITES, layout.tp
    d, f = card.hidden, card.ffn / tp
    whole = d / tp if layout.sp else d  # norms and residual adds: split by sequence parallelism
    act = e["swiglu" if card.activation == "swiglu" else "gelu"]
    rot = e["rotary"] if card.positions == "rotary" else (0, 0)
    qk = (card.hidden + card.kv_width) / tp
    fwd = card.layers * (2 * e["norm"][0] * whole + 2 * e["residual"][0] * whole + act[0] * f + rot[0] * qk)
    bwd = card.layers * (2 * e["norm"][1] * whole + 2 * e["residual"][1] * whole + act[1] * f + rot[1] * qk)
    pos = e["positions"] if card.positions == "learned" else (0, 0)
    fwd += (e["embedding"][0] + pos[0] + e["norm"][0]) * whole + e["cross_entropy"][0] * card.vocab / tp
    bwd += (e["embedding"][1] + pos[1] + e["norm"][1]) * whole + e["cross_entropy"][1] * card.vocab / tp
    return fwd, bwd


# ATen ops a rank's host dispatches, counted (tests/test_validate.py holds them): an eager pre-norm GPT
# block (LayerNorm, fused QKV linear with bias, causal SDPA, output projection, LayerNorm, GELU MLP,
# two residual adds) and its tied-embedding decoder, one step on the CPU under commbench.count_ops,
# L = 1 and 2 layers apart: per layer and fixed, forward / backward / optimizer (foreach AdamW).
# The layouts' hooks (FSDP, DDP, TP collectives) and fused kernels (TransformerEngine) are not in it.
HOST_OPS_PER_LAYER = {"forward": 28, "backward": 65, "optimizer": 24}
HOST_OPS_FIXED = {"forward": 14, "backward": 23, "optimizer": 22}


def card_work(card: ModelCard, layout: Layout) -> CardWork:
    """One rank's work in one step of `card` under `layout` (the module docstring's counts): every
    micro-batch's GEMMs and attention (counts x grad_accum), element-wise bytes, the parameters it
    updates and the host's ops."""
    check_card_fits_layout(card, layout)
    tp, L, acc = layout.tp, card.layers, layout.grad_accum
    rows, full = layout.micro_batch * layout.seq, layout.ac == "full"
    d, f, hd = card.hidden, card.ffn, card.head_dim
    mm: list[Matmul] = []
    _linear(mm, "attention", rows, (d + 2 * card.kv_width) // tp, d, L * acc, full)  # q, k, v
    _linear(mm, "attention", rows, d, d // tp, L * acc, full)  # output projection (row-parallel)
    up = 2 * f if card.activation == "swiglu" else f
    _linear(mm, "mlp", rows, up // tp, d, L * acc, full)  # up (gelu) or gate + up (swiglu)
    _linear(mm, "mlp", rows, d, f // tp, L * acc, full)  # down (row-parallel)
    _linear(mm, "lm_head", rows, card.vocab // tp, d, acc, False)  # logits over the vocabulary
    fwd = 4 * layout.micro_batch * layout.seq * layout.seq * hd * (card.heads // tp) * L * acc
    att = [AttentionWork("attention", "forward", layout.seq, layout.seq, fwd, L * acc, hd, card.causal),
           AttentionWork("attention", "backward", layout.seq, layout.seq, 2 * fwd, L * acc, hd, card.causal)]
    if layout.ac != "none":  # full: the whole layer again; selective: the core attention
        att.append(AttentionWork("attention", "recompute", layout.seq, layout.seq, fwd, L * acc, hd, card.causal))
    ef, eb = elementwise_elements(card, layout)
    scale = rows * acc * layout.compute_bytes * (COMPILED_ELEMENTWISE if layout.compile else 1.0)
    fwd_bytes, bwd_bytes = ef * scale, (eb + (ef if full else 0.0)) * scale
    per, fixed = HOST_OPS_PER_LAYER, HOST_OPS_FIXED
    micro = (per["forward"] * (2 if full else 1) + per["backward"]) * L + fixed["forward"] + fixed["backward"]
    ops = acc * micro + per["optimizer"] * L + fixed["optimizer"]  # full AC re-dispatches the forward
    return CardWork(tuple(mm), tuple(att), (fwd_bytes, bwd_bytes), rank_params(card, layout), int(ops))


def model_flops_per_token(card: ModelCard, layout: Layout) -> float:
    """echobench's model FLOPs per token (every rank's share summed, AC's re-run not counted): the
    card's GEMMs forward + backward and its attention, every score counted (flops.py's convention)."""
    one = Layout(**{**layout.__dict__, "tp": 1, "sequence_parallel": False, "layout": "fsdp", "grad_accum": 1,
                    "ac": "none", "global_batch": layout.micro_batch * layout.gpus, "gpus_per_node": layout.gpus})
    w = card_work(card, one)
    tokens = one.micro_batch * one.seq
    return (sum(m.flops for m in w.matmuls) + sum(a.flops for a in w.attention)) / tokens
