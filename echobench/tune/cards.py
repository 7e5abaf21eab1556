"""`echobench tune` of a model card (a plain decoder, echobench.predict.cards.card): its layouts searched,
pruned by the card's memory estimate (predict.cards.memory) and the rules a layout must meet, and
ranked by predict_card's samples/s. Where the tune measures, its picks are measured as card runs
(`echobench run --card`'s, the settings `echobench reproduce` maps a layout to) in the tune's sweep,
beside Echo's, and their residuals join the recalibration (echobench.tune.loop), priced by
predict_card. A layout echobench cannot run as a card run (the distributed optimizer on a CPU,
pipeline parallelism, TransformerEngine's fp8, more nodes than the executor has, ...) is ranked only,
its reason said in the output.

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
from echobench.records.config import RunConfig, run_id
from echobench.records.console import esc
from echobench.predict import PredictError, load_profiles
from echobench.predict.cards.card import Layout, ModelCard, load_card_file
from echobench.predict.cards.memory import card_memory_gib
from echobench.predict.cards.model import CardPrediction, predict_card
from echobench.sweep.reproduce import card_settings, refusal, settings_problem
from echobench.tune.loop import Measured, kendall_tau, measured_winner
from echobench.tune.space import MICRO_BATCHES, TuneError, TuneFile, capacity

CARD_AXES = ("layout", "micro_batch", "ac")


@dataclass
class CardCandidate:
    layout: Layout
    memory_gib: float
    pruned: str | None = None
    prediction: CardPrediction | None = None
    card: ModelCard | None = None
    settings: dict | None = None  # the card run the tune would measure (None: ranked only)
    cfg: RunConfig | None = None
    unmeasured: str | None = None  # why it is ranked only (not measured as a card run)

    @property
    def family(self) -> str:
        return self.layout.layout

    @property
    def run_id(self) -> str:
        """The card run's id in the tune's sweep; the layout's name where it is ranked only."""
        return run_id(self.cfg) if self.cfg is not None else self.name

    def rate_on(self, profile: HardwareProfile) -> float:
        """Predicted samples/s on `profile` (the loop's recalibration)."""
        return self.layout.global_batch / self.priced(profile).step_time_s

    def priced(self, profile: HardwareProfile) -> CardPrediction:
        return predict_card(self.card, self.layout, profile)

    @property
    def name(self) -> str:
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
    card: ModelCard | None = None

    @property
    def key(self) -> str:
        return f"{self.name}@{self.nodes}x{self.gpus_per_node}"

    @property
    def ranked(self) -> list[CardCandidate]:
        kept = [c for c in self.candidates if c.prediction is not None]
        return sorted(kept, key=lambda c: (-c.samples_per_s, c.memory_gib, c.name))

    @property
    def measurable(self) -> list[CardCandidate]:
        """The ranked candidates the tune can measure as card runs, in rank order."""
        return [c for c in self.ranked if c.cfg is not None]

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
    problem = CardProblem(name, nodes, spec.gpus_per_node, gib, profile, card=card)
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
        c = CardCandidate(lay, 0.0, card=card)
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
    problems = [card_problem(spec, spec.card.stem, card, base, n, prof) for n in spec.nodes]
    for problem in problems:
        card_runs(spec, problem)
    return problems


def card_runs(spec: TuneFile, problem: CardProblem) -> None:
    """Each ranked candidate's card run (its settings over the tune file's defaults, as
    `echobench reproduce` maps a layout), or why it is ranked only: what echobench cannot run of the
    layout (reproduce.refusal), the executor's and the card's checks (`echobench run --card`'s), or the
    same run as a better-ranked candidate's (on one GPU, DDP and FSDP are both `single`)."""
    card_file = str(spec.card.resolve())
    seen: dict[str, str] = {}
    for c in problem.ranked:
        settings = card_settings(c.layout, card_file, problem.nodes, problem.gpus_per_node)
        why = refusal(problem.card, c.layout) or settings_problem(spec.run_settings(settings), spec.executor)
        if why is None:
            cfg = RunConfig.from_dict(spec.run_settings(settings))
            if (same := seen.get(run_id(cfg))) is not None:
                why = f"the same echobench run as {same}"
            else:
                seen[run_id(cfg)] = c.name
                c.settings, c.cfg = settings, cfg
        c.unmeasured = why


def _beside(card_file: Path, named: str) -> Path | str:
    """A card file's profile: a shipped name, or a file relative to the card file."""
    path = card_file.parent / named
    return path if path.is_file() else named


def card_table(problem: CardProblem, measured: dict[str, Measured] | None = None, rows: int = 10) -> Table:
    """The console's view of a card problem: the top of the ranking and every measured layout."""
    measured = measured or {}
    t = Table(title=f"{esc(problem.key)} (model card, predicted on {esc(problem.profile.name)}): "
              f"{len(problem.ranked)} ranked, {len(problem.pruned)} pruned", title_justify="left")
    for col in ("rank", "layout", "memory GiB", "pred samples/s [interval]", "MFU", "measured", "resid"):
        t.add_column(col, justify="left" if col == "layout" else "right")
    for i, c in enumerate(problem.ranked):
        m = measured.get(c.run_id)
        if i >= rows and m is None:
            continue
        low, high = c.interval
        got = "" if m is None else (f"{m.samples_per_s:.4g}" if m.ok else m.status)
        t.add_row(str(i + 1), esc(c.name), f"{c.memory_gib:.1f}", f"{c.samples_per_s:.4g} [{low:.4g}, {high:.4g}]",
                  f"{c.prediction.mfu:.1%}", got, f"{m.samples_per_s / c.samples_per_s - 1:+.1%}" if m and m.ok else "")
    return t


def card_entry(problem: CardProblem, result=None) -> dict:
    """A card problem in tune.json: every ranked layout, its prediction (on the final profile) and,
    where the tune measured it (`result`: a loop.TuneResult), its card run's measured figures and
    residual; why a layout is ranked only; what was pruned."""
    ranked = problem.ranked
    measured = result.measured if result is not None else {}
    shipped = result.shipped_predictions if result is not None else {}
    rounds = result.rounds if result is not None else []
    winner = measured_winner(problem, measured)
    ok = [c for c in problem.measurable if c.run_id in measured and measured[c.run_id].ok]
    rates = [measured[c.run_id].samples_per_s for c in ok]

    def entry(rank: int, c: CardCandidate) -> dict:
        m = measured.get(c.run_id) if c.cfg is not None else None
        return {"name": c.name, "run_id": c.run_id if c.cfg is not None else None, "family": c.family, "rank": rank,
                "memory_gib": c.memory_gib, "samples_per_s": c.samples_per_s, "samples_per_s_low": c.interval[0],
                "samples_per_s_high": c.interval[1], "tokens_per_s": c.samples_per_s * c.layout.seq,
                "step_time_s": c.prediction.step_time_s, "mfu": c.prediction.mfu, "grad_accum": c.layout.grad_accum,
                "settings": c.settings, "unmeasured": c.unmeasured, "shipped_samples_per_s": shipped.get(c.run_id),
                "measured": None if m is None else {"status": m.status, "samples_per_s": m.samples_per_s,
                                                     "step_time_s": m.step_time_s, "mfu": m.mfu,
                                                     "peak_mem_gib": m.peak_mem_gib, "error": m.error},
                "residual": m.samples_per_s / c.samples_per_s - 1 if m is not None and m.ok else None,
                "round": next((r.number for r in rounds if c.run_id in r.run_ids), None) if m is not None else None}

    return {"key": problem.key, "card": problem.name, "profile": problem.profile.name, "nodes": problem.nodes,
            "gpus_per_node": problem.gpus_per_node, "capacity_gib": problem.capacity_gib, "measured": bool(ok),
            "stop": result.stops.get(problem.key) if result is not None else None,
            "winner": winner.name if winner else None, "predicted_winner": ranked[0].name,
            "predicted_measurable_winner": problem.measurable[0].name if problem.measurable else None,
            "kendall_tau": {"shipped": kendall_tau([shipped[c.run_id] for c in ok], rates) if shipped else None,
                            "final": kendall_tau([c.samples_per_s for c in ok], rates), "runs": len(ok)},
            "candidates": [entry(i + 1, c) for i, c in enumerate(ranked)],
            "pruned": [{"name": c.name, "reason": c.pruned} for c in problem.pruned]}
