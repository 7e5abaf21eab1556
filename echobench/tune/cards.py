"""`echobench tune` of a model card (a plain decoder, echobench.predict.card): its layouts searched,
pruned by the card's memory estimate (predict.card_memory) and the rules a layout must meet, and
ranked by predict_card's samples/s. Ranked only: echobench trains Echo, not the cards, so a card's
candidates are not measured (the report says so).

The space: DDP, FSDP (full_shard, shard_grad_op), HSDP on several nodes, Megatron TP of every width
dividing the GPUs per node and the heads (sequence parallelism with TP > 1; the distributed optimizer
on and off); micro-batch (1 .. 32 unless the tune file's search says); AC none, selective, full;
gradient accumulation from the global batch, held at the card file's (or the tune file's).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace
from pathlib import Path

from rich.table import Table

from echobench.hardware.profile import HardwareProfile
from echobench.records.console import esc
from echobench.predict import PredictError, load_profiles
from echobench.predict.card import Layout, ModelCard, load_card_file
from echobench.predict.card_memory import card_memory_gib
from echobench.predict.card_model import CardPrediction, predict_card
from echobench.tune.space import MICRO_BATCHES, TuneError, TuneFile, capacity

CARD_AXES = ("layout", "micro_batch", "ac")


@dataclass
class CardCandidate:
    layout: Layout
    memory_gib: float
    pruned: str | None = None
    prediction: CardPrediction | None = None

    @property
    def family(self) -> str:
        return self.layout.layout

    @property
    def run_id(self) -> str:
        lay = self.layout
        name = {"fsdp": f"fsdp-{lay.sharding}", "megatron": f"megatron-tp{lay.tp}" + ("-dopt" if lay.distributed_optimizer
                                                                                       else "")}.get(lay.layout, lay.layout)
        return f"{name}-n{lay.nodes}x{lay.gpus_per_node}-mb{lay.micro_batch}-ga{lay.grad_accum}-ac{lay.ac}"

    @property
    def samples_per_s(self) -> float:
        return self.layout.global_batch / self.prediction.step_time_s

    @property
    def interval(self) -> tuple[float, float]:
        """Predicted samples/s over the cross-validated interval of the step (predict.intervals)."""
        p = self.prediction
        return self.layout.global_batch / p.step_time_high_s, self.layout.global_batch / p.step_time_low_s


@dataclass
class CardProblem:
    name: str
    nodes: int
    gpus_per_node: int
    capacity_gib: float | None
    profile: HardwareProfile
    candidates: list[CardCandidate] = field(default_factory=list)

    @property
    def key(self) -> str:
        return f"{self.name}@{self.nodes}x{self.gpus_per_node}"

    @property
    def ranked(self) -> list[CardCandidate]:
        kept = [c for c in self.candidates if c.prediction is not None]
        return sorted(kept, key=lambda c: (-c.samples_per_s, c.memory_gib, c.run_id))

    @property
    def pruned(self) -> list[CardCandidate]:
        return [c for c in self.candidates if c.pruned is not None]


def layouts(card: ModelCard, nodes: int, gpus_per_node: int) -> list[dict]:
    """The layouts a card can take on this many nodes (as Layout fields)."""
    out = [{"layout": "ddp"}, {"layout": "fsdp", "sharding": "full_shard"}, {"layout": "fsdp", "sharding": "shard_grad_op"}]
    if nodes > 1 and gpus_per_node > 1:
        out.append({"layout": "hsdp", "sharding": "hybrid_shard"})
    for t in (1, 2, 4, 8):
        if t <= gpus_per_node and gpus_per_node % t == 0:
            for dopt in (False, True):
                out.append({"layout": "megatron", "tp": t, "sequence_parallel": t > 1, "distributed_optimizer": dopt})
    return out


def _rule(card: ModelCard, lay: Layout) -> str | None:
    if lay.tp > 1 and (card.heads % lay.tp or card.kv_heads % lay.tp):
        return f"rule: tp={lay.tp} does not divide the {card.heads} heads ({card.kv_heads} key/value heads)"
    return None


def card_problem(spec: TuneFile, name: str, card: ModelCard, base: Layout, nodes: int,
                 profile: HardwareProfile) -> CardProblem:
    """The card's candidates on `nodes` nodes: pruned (rules, the held global batch, memory with the
    tune file's margin against the profile device's memory), the rest priced by predict_card."""
    gib, _ = capacity(spec, profile)
    problem = CardProblem(name, nodes, spec.gpus_per_node, gib, profile)
    batch = spec.global_batch or base.global_batch
    gpus = nodes * spec.gpus_per_node
    micro = spec.search.get("micro_batch", MICRO_BATCHES)
    acs = spec.search.get("ac", ["none", "selective", "full"])
    for fields, mb, ac in itertools.product(layouts(card, nodes, spec.gpus_per_node), micro, acs):
        fields = {"tp": 1, "sequence_parallel": False, "distributed_optimizer": False, "sharding": "full_shard",
                  **fields}
        dp = gpus // fields["tp"]
        accum = max(1, batch // (mb * dp))
        whole = batch == mb * dp * accum
        lay = replace(base, gpus=gpus, gpus_per_node=spec.gpus_per_node, micro_batch=mb, ac=ac, grad_accum=accum,
                      global_batch=batch if whole else mb * dp * accum, **fields)
        c = CardCandidate(lay, 0.0)
        problem.candidates.append(c)
        if (why := _rule(card, lay)) is not None:
            c.pruned = why
            continue
        if not whole:
            c.pruned = f"batch: global batch {batch} is not a whole number of micro_batch {mb} x {dp} data-parallel ranks"
            continue
        c.memory_gib = card_memory_gib(card, lay)
        if gib is not None and c.memory_gib * (1 + spec.memory_margin) > gib:
            c.pruned = f"memory: ~{c.memory_gib:.1f} GiB per device + {spec.memory_margin:.0%} margin > {gib:.1f} GiB"
            continue
        try:
            c.prediction = predict_card(card, lay, profile)
        except PredictError as exc:
            raise TuneError(f"{name}: {exc}") from None
    if not problem.ranked:
        raise TuneError(f"{name} on {nodes} node(s) x {spec.gpus_per_node}: no layout fits "
                        f"({problem.pruned[0].pruned if problem.pruned else 'no candidates'})"
                        + _where_it_fits(spec, name, card, base, nodes, profile))
    return problem


def _where_it_fits(spec: TuneFile, name: str, card: ModelCard, base: Layout, nodes: int,
                   profile: HardwareProfile) -> str:
    """The smallest node count (doubling, up to 1024) at which some layout of the card fits."""
    n = nodes * 2
    while n <= 1024:
        try:
            card_problem(spec, name, card, base, n, profile)
        except TuneError:
            n *= 2
            continue
        return f": the smallest node count where a layout fits is {n}: tune at nodes: [{n}]"
    return ": no node count up to 1024 fits it"


def card_problems(spec: TuneFile, profile: HardwareProfile | None) -> list[CardProblem]:
    """The tune file's card (if any) on each of its node counts, ranked on `profile` (the tune's),
    else on the profile its card file names."""
    if spec.card is None:
        return []
    try:
        card, base, named = load_card_file(spec.card)
        prof = profile or load_profiles([str(_beside(spec.card, named))])[0]
    except PredictError as exc:
        raise TuneError(str(exc)) from None
    return [card_problem(spec, spec.card.stem, card, base, n, prof) for n in spec.nodes]


def _beside(card_file: Path, named: str) -> Path | str:
    """A card file's profile: a shipped name, or a file relative to the card file."""
    path = card_file.parent / named
    return path if path.is_file() else named


def card_table(problem: CardProblem, rows: int = 10) -> Table:
    t = Table(title=f"{esc(problem.key)} (model card, predicted, not measured on {esc(problem.profile.name)}): "
              f"{len(problem.ranked)} ranked, {len(problem.pruned)} pruned", title_justify="left")
    for col in ("rank", "layout", "memory GiB", "pred samples/s [interval]", "MFU"):
        t.add_column(col, justify="left" if col == "layout" else "right")
    for i, c in enumerate(problem.ranked[:rows]):
        low, high = c.interval
        t.add_row(str(i + 1), esc(c.run_id), f"{c.memory_gib:.1f}", f"{c.samples_per_s:.4g} [{low:.4g}, {high:.4g}]",
                  f"{c.prediction.mfu:.1%}")
    return t


def card_entry(problem: CardProblem) -> dict:
    """A card problem in tune.json: every ranked layout (predicted only) and what was pruned."""
    ranked = problem.ranked
    return {"key": problem.key, "card": problem.name, "profile": problem.profile.name, "nodes": problem.nodes, "gpus_per_node": problem.gpus_per_node,
            "capacity_gib": problem.capacity_gib, "measured": False,
            "stop": "a model card is ranked, not measured (echobench trains Echo)",
            "predicted_winner": ranked[0].run_id,
            "candidates": [{"run_id": c.run_id, "family": c.family, "rank": i + 1, "memory_gib": c.memory_gib,
                            "samples_per_s": c.samples_per_s, "samples_per_s_low": c.interval[0],
                            "samples_per_s_high": c.interval[1], "tokens_per_s": c.samples_per_s * c.layout.seq,
                            "step_time_s": c.prediction.step_time_s, "mfu": c.prediction.mfu,
                            "grad_accum": c.layout.grad_accum} for i, c in enumerate(ranked)],
            "pruned": [{"run_id": c.run_id, "reason": c.pruned} for c in problem.pruned]}
