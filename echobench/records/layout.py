"""A run's layout: how its processes split the model and the batch, parsed once from the
`parallelism` setting (what torchtitan's ParallelDims is to a run). The setting stays the stored
text (records and matrix files keep their words); the code asks the Layout.

The layouts, one vocabulary for Echo runs and model card runs:

    single   one process holds the whole model
    ddp      every rank holds the whole model; gradients are all-reduced (torch DDP)
    fsdp2    parameters, gradients and optimizer state sharded over every rank (FSDP2)
    hsdp     sharded within a node, replicated across nodes (FSDP2's HSDP)
    tpN      tensor parallelism N wide within a node (megatron-core), data-parallel over the rest

A published model card names its layouts as the frameworks it describes do (CARD_LAYOUTS: ddp,
fsdp, hsdp, megatron); Layout.of_card and Layout.card_layout translate, here only.

Adding a layout: its kind and properties here, the backend that runs it (its `layouts`), its pricing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from echobench.backends import BACKENDS

KINDS = ("single", "ddp", "fsdp2", "hsdp", "tpN")  # tpN: any width N >= 1
SHARDED = ("fsdp2", "hsdp")
# A card's layout names (predict.cards.card.Layout.layout) -> the kind that runs it.
CARD_LAYOUTS = {"ddp": "ddp", "fsdp": "fsdp2", "hsdp": "hsdp", "megatron": "tpN"}


@dataclass(frozen=True)
class Layout:
    kind: str  # one of KINDS
    tp: int = 1  # tensor-parallel width (tpN's N; 1 for the rest)

    def __post_init__(self) -> None:
        if self.kind not in KINDS or self.tp < 1 or (self.tp > 1 and self.kind != "tpN"):
            raise ValueError(f"no layout {self.kind!r} with tp {self.tp}: give one of {', '.join(KINDS)}")

    @classmethod
    def parse(cls, name) -> Layout:
        """The layout a `parallelism` setting names; ValueError in one line naming the valid ones."""
        if isinstance(name, str) and name in KINDS and name != "tpN":
            return cls(name)
        if isinstance(name, str) and (m := re.fullmatch(r"tp([1-9][0-9]*)", name)):
            return cls.tensor(int(m.group(1)))
        raise ValueError(f"parallelism={name!r} is not a layout: give {allowed_text()}")

    @classmethod
    def tensor(cls, width: int) -> Layout:
        """Tensor parallelism `width` wide (the setting tpN)."""
        return cls("tpN", width)

    @classmethod
    def of_card(cls, card_layout: str, tp: int, gpus: int) -> Layout:
        """The layout that runs a card's (a published row's `layout`, CARD_LAYOUTS) of tensor-parallel
        width tp on `gpus` GPUs: ddp or fsdp on one GPU is single (nothing to replicate or shard over);
        hsdp stays hsdp (the run's check refuses it on one node)."""
        kind = CARD_LAYOUTS[card_layout]
        if kind == "tpN":
            return cls.tensor(tp)
        return cls("single") if gpus == 1 and not cls(kind).hybrid else cls(kind)

    @property
    def name(self) -> str:
        """The setting's text: single, ddp, fsdp2, hsdp, tp4."""
        return f"tp{self.tp}" if self.tensor_parallel else self.kind

    def __str__(self) -> str:
        return self.name

    @property
    def single(self) -> bool:
        """One process, nothing split."""
        return self.kind == "single"

    @property
    def tensor_parallel(self) -> bool:
        """tpN: the blocks' GEMMs split N ways (megatron-core), also at N = 1."""
        return self.kind == "tpN"

    @property
    def data_parallel(self) -> bool:
        """A data-parallel layout of the whole model over every rank: ddp, fsdp2, hsdp."""
        return not (self.single or self.tensor_parallel)

    @property
    def replicates(self) -> bool:
        """Every rank holds the whole model and all-reduces its gradients (torch DDP)."""
        return self.kind == "ddp"

    @property
    def shards_parameters(self) -> bool:
        """Parameters, gradients and optimizer state sharded (FSDP2): fsdp2, hsdp."""
        return self.kind in SHARDED

    @property
    def hybrid(self) -> bool:
        """Sharded within a node and replicated across nodes (HSDP)."""
        return self.kind == "hsdp"

    @property
    def within_node(self) -> Layout:
        """The layout the ranks of one node run: a hybrid layout's shard group is FSDP2's."""
        return Layout("fsdp2") if self.hybrid else self

    @property
    def card_layout(self) -> str:
        """The name a model card gives this layout (CARD_LAYOUTS): single and ddp are DDP."""
        return "ddp" if self.single else next(c for c, k in CARD_LAYOUTS.items() if k == self.kind)

    @property
    def framework(self) -> str:
        """The backend that runs it."""
        return next(b.name for b in BACKENDS.values() if self.kind in b.layouts)

    def shard_ranks(self, nodes: int, gpus_per_node: int) -> int:
        """The ranks one shard group spans, over which parameters, gradients and optimizer state are
        split: every rank (fsdp2), a node (hsdp), none (1)."""
        if not self.shards_parameters:
            return 1
        return gpus_per_node if self.hybrid else nodes * gpus_per_node

    def dp(self, world_size: int) -> int:
        """The data-parallel ranks of a world of this size: the ranks over tensor parallelism's width."""
        return world_size // self.tp


def layouts_on(nodes: int, gpus_per_node: int, tp_widths=(2, 4, 8)) -> list[Layout]:
    """The layouts a world of nodes x gpus_per_node can run: single on one process; else the
    data-parallel ones (hybrid where there are nodes to replicate over and GPUs to shard within each)
    and tensor parallelism of each width in tp_widths that divides a node."""
    if nodes * gpus_per_node == 1:
        return [Layout("single")]
    data = [lay for lay in map(Layout, KINDS)
            if lay.data_parallel and (not lay.hybrid or nodes > 1 and gpus_per_node > 1)]
    return data + [Layout.tensor(t) for t in tp_widths if t <= gpus_per_node and gpus_per_node % t == 0]


def is_layout(name) -> bool:
    """Whether `name` is a layout's setting text."""
    try:
        Layout.parse(name)
    except ValueError:
        return False
    return True


def allowed_text() -> str:
    """The layouts in words, each with the backend that runs it: for an error and the docs' table."""
    return "; ".join(f"{', '.join(k.replace('tpN', 'tpN with N >= 1') for k in b.layouts)} ({b.name})"
                     for b in BACKENDS.values())
