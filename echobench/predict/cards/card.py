"""A plain decoder as a small model card (ModelCard) and the run's layout (Layout), read from a
published row's (or a card file's) `model`, `run` and `hardware` with every key checked: an unknown
key is refused in one line naming it and the row, never dropped. What one training step of it runs
on a rank is work.py's; its collectives traffic.py's; pipeline and context parallelism
predict/pipeline.py's.

A layout's ranks: gpus = dp x tp x pp x cp (data, tensor, pipeline and context parallel). Options a
row leaves out (None) take the framework's default at the version the row names (predict/frameworks.py;
none named: its generic default; one it does not know: described by the row's own settings), and
the prediction's notes say which.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, fields
from pathlib import Path

from echobench.predict.errors import PredictError
from echobench.predict.frameworks import ELEMENTWISE_KERNELS, check_described
from echobench.predict.recompute import POLICIES
from echobench.records.layout import CARD_LAYOUTS, Layout as RunLayout
from echobench.records.yamltext import read_yaml

ACTIVATIONS = ("gelu", "swiglu", "relu2")  # relu2: squared ReLU (Nemotron), up and down like GELU
POSITIONS = ("learned", "rotary", "alibi", "none")
NORMS = ("layernorm", "rmsnorm")
LAYOUTS = tuple(CARD_LAYOUTS)  # ddp, fsdp, hsdp, megatron
SHARDINGS = ("full_shard", "shard_grad_op", "hybrid_shard", "no_shard")
PRECISION_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8": 2}  # fp8: the activations stay bf16 between GEMMs
REDUCE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
FP8_RECIPES = ("delayed", "current", "tensorwise", "rowwise")
# Keys a row's `model` may carry beside ModelCard's fields (what the source says of its size).
MODEL_EXTRA = ("params_estimate", "params_label")


@dataclass(frozen=True)
class ModelCard:
    """A plain decoder-only transformer (pre-norm blocks of attention and an MLP)."""

    layers: int
    hidden: int
    ffn: int
    activation: str  # gelu (up, down), swiglu (gate, up, down), relu2 (up, down)
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
        for name, value, allowed in (("activation", self.activation, ACTIVATIONS), ("positions", self.positions, POSITIONS),
                                     ("norm", self.norm, NORMS)):
            if value not in allowed:
                raise PredictError(f"model card: unknown {name} {value!r}: give one of {', '.join(allowed)}")
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

    @property
    def gated(self) -> bool:
        return self.activation == "swiglu"


@dataclass(frozen=True)
class Layout:
    """How a card is trained: ranks, batch, parallelism and its options (None: the framework's default)."""

    gpus: int
    gpus_per_node: int
    seq: int
    micro_batch: int
    grad_accum: int  # micro-batches per step (with pipeline parallelism: the schedule's m)
    global_batch: int
    layout: str  # ddp, fsdp (torchtitan's 2D: fsdp with tp), hsdp, megatron (TP / PP / CP with DP)
    sharding: str = "full_shard"  # fsdp / hsdp: full_shard, shard_grad_op (hybrid_shard: hsdp)
    shard_group: int | None = None  # hsdp: ranks of a shard group (None: a node)
    tp: int = 1
    pp: int = 1
    vp: int = 1  # virtual pipeline stages per rank (interleaved 1F1B)
    embedding_chunk: bool = False  # pp: the first chunk holds the embedding only (no blocks)
    head_chunk: bool = False  # pp: the last chunk holds the final norm and LM head only (no blocks)
    cp: int = 1
    dp: int | None = None  # the data-parallel ranks, where the row states them (checked against the rest)
    sequence_parallel: bool = False
    distributed_optimizer: bool = False  # Megatron's ZeRO-1
    overlap_grad_reduce: bool | None = None
    overlap_param_gather: bool | None = None
    tp_comm_overlap: bool | None = None
    overlap_p2p_comm: bool | None = None
    ac: str = "none"  # a recompute policy (recompute.POLICIES)
    compile: bool = False
    precision: str = "bf16"  # bf16, fp16, fp32, fp8 (the linear layers' GEMMs in float8)
    fp8_recipe: str | None = None  # delayed / current (TransformerEngine), tensorwise / rowwise (torchao)
    fp8_all_gather: bool = False  # FSDP2 all-gathers float8 weights (torchao)
    grad_reduce_dtype: str | None = None
    framework: str = ""
    framework_version: str | None = None
    attention_kernel: str | None = None  # as the profile's attention points name it (None: the framework's)
    elementwise_kernels: str | None = None  # fused, or an eager block counted on its code: mpt, llama (None: the framework's)
    fused_qkv: bool | None = None  # q, k, v one GEMM, a gated MLP's gate and up one (None: the framework's)
    fsdp_reduce_once: bool | None = None  # fsdp / hsdp: gradients reduced once a step, not per micro-batch (None: the framework's)
    autocast: bool = False  # bf16 under torch.autocast over fp32 weights, as echobench's card runs (cards.memory)

    def __post_init__(self) -> None:
        for name in ("gpus", "gpus_per_node", "seq", "micro_batch", "grad_accum", "global_batch", "tp", "pp", "vp", "cp"):
            if getattr(self, name) < 1:
                raise PredictError(f"run: {name} {getattr(self, name)} must be >= 1")
        model_parallel = self.tp * self.pp * self.cp
        checks = [(self.layout in LAYOUTS, f"unknown layout {self.layout!r}: give one of {', '.join(LAYOUTS)} (or tpN)"),
                  (self.sharding in SHARDINGS, f"unknown sharding {self.sharding!r}: give one of {', '.join(SHARDINGS)}"),
                  (self.ac in POLICIES, f"unknown ac {self.ac!r}: give one of {', '.join(POLICIES)}"),
                  (self.precision in PRECISION_BYTES, f"unknown precision {self.precision!r}: give one of "
                   f"{', '.join(PRECISION_BYTES)}"),
                  (self.fp8_recipe is None or self.fp8_recipe in FP8_RECIPES, f"unknown fp8_recipe {self.fp8_recipe!r}: "
                   f"give one of {', '.join(FP8_RECIPES)}"),
                  (self.elementwise_kernels is None or self.elementwise_kernels in ELEMENTWISE_KERNELS,
                   f"unknown elementwise_kernels {self.elementwise_kernels!r}: give one of {', '.join(ELEMENTWISE_KERNELS)}"),
                  (self.grad_reduce_dtype is None or self.grad_reduce_dtype in REDUCE_BYTES,
                   f"unknown grad_reduce_dtype {self.grad_reduce_dtype!r}: give one of {', '.join(REDUCE_BYTES)}"),
                  (self.gpus % model_parallel == 0, f"tp {self.tp} x pp {self.pp} x cp {self.cp} does not divide "
                   f"gpus {self.gpus}"),
                  (self.dp is None or self.dp == self.gpus // model_parallel,
                   f"dp {self.dp} is not gpus {self.gpus} / (tp {self.tp} x pp {self.pp} x cp {self.cp}) = "
                   f"{self.gpus // model_parallel}"),
                  (self.layout == "megatron" or (self.pp == 1 or self.layout == "fsdp") and self.cp == 1 or self.layout == "fsdp",
                   f"pp {self.pp} / cp {self.cp} with layout {self.layout}: give layout megatron (or fsdp, torchtitan's)"),
                  (self.tp == 1 or self.layout in ("megatron", "fsdp"), f"tp {self.tp} with layout {self.layout}: tensor "
                   "parallelism is Megatron-LM's (layout megatron or tpN) or torchtitan's 2D (layout fsdp)"),
                  (self.tp <= self.gpus_per_node, f"tp {self.tp} spans nodes of {self.gpus_per_node} GPUs: keep a TP "
                   "group within a node"),
                  (self.vp == 1 or self.pp > 1, f"vp {self.vp} without pipeline parallelism: give pp > 1 or vp 1"),
                  (self.layout != "hsdp" or self.gpus % self.shard_size == 0,
                   f"hsdp: shard group {self.shard_size} does not divide gpus {self.gpus}"),
                  (self.micro_batch * self.grad_accum * self.data_parallel == self.global_batch,
                   f"micro_batch {self.micro_batch} x grad_accum {self.grad_accum} x data-parallel ranks "
                   f"{self.data_parallel} = {self.micro_batch * self.grad_accum * self.data_parallel}, not global_batch "
                   f"{self.global_batch}")]
        for ok, why in checks:
            if not ok:
                raise PredictError(f"run: {why}")
        check_described(self)

    @property
    def data_parallel(self) -> int:
        """Data-parallel ranks: gpus / (tp x pp x cp)."""
        return self.gpus // (self.tp * self.pp * self.cp)

    @property
    def shard_size(self) -> int:
        """The ranks one FSDP / HSDP shard group spans (FSDP: every data-parallel rank)."""
        if self.hybrid:
            return self.shard_group or self.gpus_per_node
        return self.data_parallel

    @property
    def as_run_layout(self) -> RunLayout | None:
        """The run layout of this layout's name (CARD_LAYOUTS; tp aside); None for a name not there
        (__post_init__'s checks ask before the one that refuses it)."""
        return RunLayout(CARD_LAYOUTS[self.layout]) if self.layout in CARD_LAYOUTS else None

    @property
    def fsdp(self) -> bool:
        """FSDP or HSDP, of any sharding (the run layout of their name shards)."""
        return self.as_run_layout is not None and self.as_run_layout.shards_parameters

    @property
    def hybrid(self) -> bool:
        """HSDP: sharded within a shard group, replicated across the groups."""
        return self.as_run_layout is not None and self.as_run_layout.hybrid

    @property
    def shards_parameters(self) -> bool:
        """Parameters, gradients and optimizer state sharded over the shard group: FSDP / HSDP but no_shard."""
        return self.fsdp and self.sharding != "no_shard"

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

    @property
    def tokens(self) -> int:
        """Tokens of one micro-batch on one rank: micro_batch x seq / cp."""
        return self.micro_batch * self.seq // self.cp


def check_card_fits_layout(card: ModelCard, layout: Layout) -> None:
    """TP splits heads, KV heads, the FFN and the vocabulary evenly; CP the sequence (one line naming what does not)."""
    for name, value in (("heads", card.heads), ("kv_heads", card.kv_heads), ("ffn", card.ffn), ("vocab", card.vocab)):
        if value % layout.tp:
            raise PredictError(f"run: tp {layout.tp} does not divide the model's {name} {value}: give a tp that does")
    if layout.seq % (2 * layout.cp) and layout.cp > 1:
        raise PredictError(f"run: cp {layout.cp} needs seq {layout.seq} divisible by 2 x cp (load-balanced chunks)")
    chunks = block_chunks(layout)
    if layout.pp > 1 and not 1 <= chunks <= card.layers:
        raise PredictError(f"run: pp {layout.pp} x vp {layout.vp} chunks leave {chunks} for the model's {card.layers} "
                           "layers (less an embedding-only and a head-only chunk): give each at least one layer")


def block_chunks(layout: Layout) -> int:
    """The pipeline chunks that hold blocks: pp x vp, less an embedding-only first and a head-only last."""
    return layout.pp * layout.vp - int(layout.embedding_chunk) - int(layout.head_chunk)


def rank_blocks(card: ModelCard, layout: Layout) -> list[int]:
    """The blocks each pipeline rank holds: chunk i on rank i mod pp (interleaved), the layers spread
    over the chunks that hold blocks as evenly as they go (the first ones one more)."""
    first = int(layout.embedding_chunk)
    base, extra = divmod(card.layers, block_chunks(layout))
    out = [0] * layout.pp
    for j in range(block_chunks(layout)):
        out[(first + j) % layout.pp] += base + (j < extra)
    return out


def stage_blocks(card: ModelCard, layout: Layout) -> tuple[int, bool]:
    """The slowest pipeline rank's blocks and whether it runs the LM head. Without an embedding- or
    head-only chunk, ceil(layers / pp) and the head (the last stage taken as the slowest); with one,
    of the rank holding the most blocks and the last rank (the head's), the one with more weights
    to run: blocks x a block's parameters, the head's vocab x hidden."""
    if layout.pp == 1:
        return card.layers, True
    if not (layout.embedding_chunk or layout.head_chunk):
        return -(-card.layers // layout.pp), True
    blocks = rank_blocks(card, layout)
    last, most = blocks[-1], max(blocks)
    if last * layer_params(card) + card.vocab * card.hidden >= most * layer_params(card):
        return last, True
    return most, False


def _take(d: Mapping, cls, where: str, extra: tuple[str, ...] = (), **fixed) -> dict:
    """The fields of dataclass `cls` from mapping `d` (required ones present, types checked, unknown
    keys refused): one-line errors naming `where` and the key; `extra`: keys allowed and not read;
    `fixed`: fields given, not read."""
    known = {f.name for f in fields(cls)}
    for key in d:
        if key not in known and key not in extra and key not in fixed:
            raise PredictError(f"{where}: unknown key {key!r}: remove it or give one of {', '.join(sorted(known - set(fixed)))}")
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
              "str | None": isinstance(value, str), "bool | None": isinstance(value, bool)}
        if kind in ok and not ok[kind]:
            want = "an int" if "int" in kind else "true or false" if "bool" in kind else "a string"
            raise PredictError(f"{where}.{key}: {value!r} is not {want}")
        out[f.name] = value
    return out


def model_card(d: Mapping, where: str = "model") -> ModelCard:
    """A ModelCard from a published row's `model` (or a card file's): params or params_estimate;
    norm layernorm1p (NeMo's, LayerNorm with a shifted weight) is a LayerNorm."""
    if not isinstance(d, Mapping):
        raise PredictError(f"{where}: expected a mapping of the model's shape")
    params = d.get("params", d.get("params_estimate"))
    if d.get("norm") == "layernorm1p":
        d = {**d, "norm": "layernorm"}
    return ModelCard(**_take(d, ModelCard, where, extra=MODEL_EXTRA, params=params if isinstance(params, int) else None))


def run_layout(run: Mapping, hardware: Mapping, where: str = "run", hw_where: str = "hardware") -> Layout:
    """A Layout from a published row's `run` and `hardware`: layout tpN is Megatron-LM with tp N,
    fsdp with sharding hybrid_shard is hsdp; a `note` is the row's prose, not read."""
    if not isinstance(run, Mapping) or not isinstance(hardware, Mapping):
        raise PredictError(f"{where}: expected mappings `run` and `hardware`")
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
    fields_ = _take(merged, Layout, where, extra=("note",))
    if (fields_.get("embedding_chunk") or fields_.get("head_chunk")) and fields_.get("pp", 1) == 1:
        raise PredictError(f"{where}: embedding_chunk / head_chunk without pipeline parallelism: give pp > 1 or leave "
                           "them out")
    try:
        return Layout(**fields_)
    except PredictError as exc:
        raise PredictError(f"{where}: {str(exc).removeprefix('run: ')}") from None


def load_card_file(path: Path | str) -> tuple[ModelCard, Layout, str]:
    """A small YAML card file, laid out as a published row without `published`: `model`, `run`,
    `hardware` (with `profile`, a shipped name or a file) -> the card, its layout and the profile."""
    path = Path(path)
    data = read_yaml(path, "model card", PredictError)
    if not isinstance(data, Mapping) or not all(isinstance(data.get(k), Mapping) for k in ("model", "run", "hardware")):
        raise PredictError(f"{path}: a model card is a mapping with `model`, `run` and `hardware` mappings")
    hardware = data["hardware"]
    if not isinstance(hardware.get("profile"), str):
        raise PredictError(f"{path}: hardware lacks `profile`: name a shipped profile or a profile file")
    unknown = set(hardware) - {"profile", "gpus", "gpus_per_node"}
    if unknown:
        raise PredictError(f"{path}: hardware: unknown key {sorted(unknown)[0]!r}: give profile, gpus, gpus_per_node")
    return (model_card(data["model"], f"{path}: model"),
            run_layout(data["run"], hardware, f"{path}: run", f"{path}: hardware"), hardware["profile"])


# ---- parameters ----

def layer_params(card: ModelCard) -> int:
    """One block's parameters: QKV, output projection, MLP (with biases where `bias`), two norms
    (LayerNorm weight and bias, RMSNorm or bias-free LayerNorm a weight)."""
    d, f, b = card.hidden, card.ffn, int(card.bias)
    qkv = d * (d + 2 * card.kv_width) + b * (d + 2 * card.kv_width)
    mlp = (3 * d * f + b * (2 * f + d)) if card.gated else (2 * d * f + b * (f + d))
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


def _layer_split(card: ModelCard) -> int:
    """A block's parameters TP splits: QKV, output projection and MLP weights, the column-parallel biases."""
    d, f, b = card.hidden, card.ffn, int(card.bias)
    up = (2 if card.gated else 1) * f
    return d * (d + 2 * card.kv_width) + d * d + up * d + f * d + b * (d + 2 * card.kv_width + up)


def tp_split_params(card: ModelCard) -> int:
    """The parameters Megatron's TP splits across its ranks: every block's _layer_split and the
    vocabulary-parallel embedding (and head)."""
    return card.layers * _layer_split(card) + card.vocab * card.hidden * (1 if card.tied_embeddings else 2)


def model_parallel_params(card: ModelCard, layout: Layout) -> float:
    """The parameters one model-parallel rank holds: TP splits tp_split_params by tp; with pipeline
    parallelism, the slowest stage's: its blocks (stage_blocks) and an embedding (the first stage
    holds the input embedding, the last the head, or a copy of the tied embedding)."""
    per_tp = card_params(card, layout.seq) - tp_split_params(card) * (1 - 1 / layout.tp)
    if layout.pp == 1:
        return per_tp
    block = layer_params(card) - _layer_split(card) * (1 - 1 / layout.tp)
    other = (layout.seq * card.hidden if card.positions == "learned" else 0) + norm_params(card)
    return stage_blocks(card, layout)[0] * block + card.vocab * card.hidden / layout.tp + other


def rank_params(card: ModelCard, layout: Layout) -> float:
    """The parameters one rank holds and updates (its optimizer step): FSDP shards its model-parallel
    share over its shard group (every data-parallel rank, HSDP a shard group); DDP keeps it whole;
    Megatron's distributed optimizer shards it over the data-parallel group (x cp: its gradients
    are reduced there too)."""
    mine = model_parallel_params(card, layout)
    if layout.shards_parameters:
        return mine / layout.shard_size
    if layout.layout == "megatron" and layout.distributed_optimizer:
        return mine / (layout.data_parallel * layout.cp)
    return mine
