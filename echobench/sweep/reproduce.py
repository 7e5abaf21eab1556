"""`echobench reproduce`: published rows (a published-runs file, validation/published-runs.yaml's
format) as a matrix of card runs at their published layout, mapped to echobench's settings, or
scaled down to the nodes one has; the matrix is a file `echobench sweep` reads.

How a row's layout maps (plan_row):

    ddp                         torchtitan ddp (single on one GPU)
    fsdp full_shard             torchtitan fsdp2
    fsdp shard_grad_op          torchtitan fsdp2, reshard_after_forward false (ZeRO-2: weights kept after forward)
    fsdp hybrid_shard / hsdp    torchtitan hsdp (shard groups of a node)
    megatron / tpN              megatron tpN (distributed_optimizer and, for tp > 1, sequence_parallel as
                                the row says)

micro-batch, accumulation, precision, AC, compile and the gradient reduction's dtype as the row says.
What echobench cannot run (pipeline or context parallelism, FSDP with TP, fp16, TransformerEngine's
float8 recipes, ALiBi, ...) is refused in one line naming the row.

Scaled down (`scale_down` nodes): the row runs on that many nodes of the run's GPUs per node (the
site's, else the row's) instead of its published GPU count, at its micro-batch and accumulation:
each GPU's step takes the published tokens, so its step time, tokens/s per GPU and MFU compare with
the published ones; the global batch shrinks with the GPUs (said per row, in the output and the
matrix's comments), and the collectives span fewer ranks than they did.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from echobench import backends
from echobench.predict.cards.card import Layout, ModelCard, model_card, run_layout
from echobench.predict.errors import PredictError
from echobench.predict.validate import layout_text, load_rows
from echobench.records.config import RunConfig
from echobench.records.layout import Layout as RunLayout
from echobench.records.states import RunState
from echobench.sweep.matrix import MatrixError, card_run_problem

RECIPES = ("tensorwise", "rowwise")  # echobench's float8 (torchao); delayed / current are TransformerEngine's
AC = {"none": "none", "full": "full", "selective": "selective", "selective-op": "selective",
      "selective-layer-2": "selective"}
AC_NOTES = {  # where echobench's selective is not what the row's policy re-runs
    ("selective", False): "the row's selective (Megatron's: the core attention re-run) runs as echobench's eager "
                          "selective (every second block re-run whole)",
    ("selective", True): "the row's selective (Megatron's: the core attention re-run) runs as echobench's compiled "
                         "selective (element-wise ops re-run, every matmul and attention output saved)",
    ("selective-op", False): "the row's selective-op (torchtitan op SAC: every second matmul and the element-wise "
                             "ops re-run) runs as echobench's eager selective (every second block re-run whole)",
    ("selective-op", True): "the row's selective-op (torchtitan op SAC: every second matmul and the element-wise "
                            "ops re-run) runs as echobench's compiled selective (every matmul output saved)",
    ("selective-layer-2", True): "the row's selective-layer-2 (every second block) runs as echobench's compiled "
                                 "selective (op-level: element-wise ops re-run, matmul outputs saved)",
}


class ReproduceError(ValueError):
    """Bad input to reproduce (a row that is not there, a bad count): one line."""


@dataclass
class RowPlan:
    """One published row as a run of the matrix: its settings (the matrix's include entry), what
    changed from the published layout and how the layout maps; or why it cannot run."""

    id: str
    row: dict
    published: str = ""  # the published layout in a few words (validate.layout_text)
    settings: dict | None = None
    refused: str | None = None
    changes: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def select_rows(path: Path | str, ids: list[str]) -> list[dict]:
    """The rows of `ids` from a published-runs file, in the order given; ReproduceError for an id
    that is not there (naming the nearest ones) or given twice."""
    import difflib

    try:
        rows = {r["id"]: r for r in load_rows(path)}
    except PredictError as exc:
        raise ReproduceError(str(exc)) from None
    if not ids:
        raise ReproduceError("--rows: give at least one row id (e.g. --rows lf-mpt-1b-8gpu,mlm-gpt-1.7b-48gpu)")
    out = []
    for rid in ids:
        if rid not in rows:
            near = difflib.get_close_matches(rid, rows, n=3, cutoff=0.5)
            raise ReproduceError(f"{path}: no row {rid!r}" + (f": did you mean {', '.join(near)}?" if near else
                                 f" ({len(rows)} rows: `echobench validate published {path}` lists them)"))
        if rid in (r["id"] for r in out):
            raise ReproduceError(f"--rows: {rid} given twice: give each row once")
        out.append(rows[rid])
    return out


def refusal(card: ModelCard, layout: Layout) -> str | None:
    """What of a card's layout (a row's, or a tune's candidate) echobench has no setting for (None: it
    can run it)."""
    if layout.pp > 1:
        return f"pipeline parallelism (pp {layout.pp}): echobench has no pipeline layout"
    if layout.cp > 1:
        return f"context parallelism (cp {layout.cp}): echobench has no context-parallel layout"
    if card.positions == "alibi":
        return "ALiBi positions: echobench's decoder has learned, rotary or no positions"
    if layout.layout == "fsdp" and layout.tp > 1:
        return (f"FSDP with tensor parallelism (torchtitan 2D, tp {layout.tp}): echobench runs FSDP2 or megatron TP, "
                "not both")
    if layout.fsdp and layout.sharding == "no_shard":
        return "FSDP no_shard: no echobench layout replicates through FSDP (ddp is the same work: a row with ddp)"
    if layout.precision == "fp16":
        return "fp16: echobench trains in bf16, fp32 or fp8"
    if layout.precision == "fp8" and layout.fp8_recipe not in (None, *RECIPES):
        return (f"fp8 recipe {layout.fp8_recipe} (TransformerEngine's): echobench's float8 is torchao's "
                f"{' / '.join(RECIPES)}")
    if layout.ac not in AC:
        return f"ac {layout.ac}: echobench's AC is none, selective or full"
    if layout.hybrid and layout.shard_group not in (None, layout.gpus_per_node):
        return f"hsdp shard groups of {layout.shard_group} GPUs: echobench's HSDP shards within a node"
    return None


def echobench_layout(layout: Layout, gpus: int | None = None) -> tuple[str, str]:
    """(framework, parallelism) of a published layout in echobench's settings (the module docstring),
    on `gpus` GPUs (default: its own): DDP or FSDP on one GPU is single (RunLayout.of_card)."""
    ran = RunLayout.of_card(layout.layout, layout.tp, gpus or layout.gpus)
    return ran.framework, ran.name


def plan_row(row: dict, rows_path: Path, per_node: int | None, scale_down: int | None, executor: str) -> RowPlan:
    """The row as a run (the module docstring): settings, changes, notes, or why not."""
    layout = run_layout(row["run"], row["hardware"])
    plan = RowPlan(row["id"], row, layout_text(layout))
    if why := refusal(model_card(row["model"]), layout):
        plan.refused = why
        return plan
    per_node = per_node or layout.gpus_per_node
    gpus = layout.gpus
    if scale_down is not None and scale_down * per_node < gpus:
        gpus = scale_down * per_node
    if gpus % layout.tp:
        plan.refused = f"tp {layout.tp} does not divide {gpus} GPUs: give --scale-down so that it does"
        return plan
    if gpus > per_node and gpus % per_node:
        plan.refused = f"its {gpus} GPUs are not whole nodes of {per_node}: give --scale-down N (N nodes of {per_node})"
        return plan
    nodes, gpn = (1, gpus) if gpus <= per_node else (gpus // per_node, per_node)
    dp = gpus // layout.tp
    accum = layout.grad_accum
    global_batch = layout.micro_batch * accum * dp
    fw, parallelism = echobench_layout(layout, gpus)
    ran = RunLayout.parse(parallelism)
    if ran.single and layout.layout == "fsdp":
        plan.notes.append("FSDP on 1 GPU runs as single (nothing to shard over)")
    if ran.hybrid and nodes == 1:
        plan.refused = "hybrid_shard on 1 node: HSDP replicates across nodes: give --scale-down 2 or more"
        return plan
    compiled = bool(layout.compile)
    settings = card_settings(layout, f"{rows_path.resolve()}#{row['id']}", nodes, gpn)
    if note := AC_NOTES.get((layout.ac, compiled)):
        plan.notes.append(note)
    if layout.framework not in ("torchtitan", "") and fw == "torchtitan":
        plan.notes.append(f"published on {layout.framework}: runs on echobench's torchtitan backend")
    if layout.framework and layout.framework != "megatron-lm" and fw == "megatron":
        plan.notes.append(f"published on {layout.framework}: runs on echobench's megatron backend (megatron-core "
                          "layers, no TransformerEngine)")
    if layout.attention_kernel:
        plan.notes.append(f"attention: torch SDPA's kernel (the row's: {layout.attention_kernel})")
    if layout.overlap_grad_reduce is False or layout.overlap_param_gather is False or layout.tp_comm_overlap:
        plan.notes.append("the row's overlap flags are not settings of echobench's: its backends overlap as they do")
    if gpus != layout.gpus:
        plan.changes += [f"GPUs {layout.gpus} -> {gpus} ({nodes} node(s) x {gpn})",
                         f"global batch {layout.global_batch} -> {global_batch}",
                         f"accumulation {accum} kept (micro-batch {layout.micro_batch} per GPU kept: each GPU's "
                         f"step takes the published tokens)"]
    else:
        if gpn != layout.gpus_per_node and gpus > 1:
            plan.changes.append(f"{nodes} node(s) x {gpn} GPUs (published {layout.nodes} x {layout.gpus_per_node})")
        if scale_down is not None:
            plan.notes.append(f"--scale-down {scale_down}: its {layout.gpus} GPUs fit within {scale_down} node(s) of "
                              f"{per_node}: its GPU count and batch as published")
    if ran.hybrid and gpn != layout.gpus_per_node:
        plan.changes.append(f"HSDP shard groups of {gpn} GPUs (published {layout.gpus_per_node})")
    if problem := settings_problem(settings, executor):
        plan.refused = problem + (" (or --scale-down 1)" if executor == "local" and nodes > 1 else "")
        return plan
    plan.settings = settings
    return plan


def card_settings(layout: Layout, card: str, nodes: int, gpus_per_node: int) -> dict:
    """The settings of a card run (`card`: FILE or FILE#ROW) of `layout` on nodes x gpus_per_node, mapped
    as the module docstring says; its refusals (refusal) are the caller's to check first."""
    fw, parallelism = echobench_layout(layout, nodes * gpus_per_node)
    settings = {"card": card, "framework": fw, "parallelism": parallelism, "nodes": nodes,
                "gpus_per_node": gpus_per_node, "micro_batch": layout.micro_batch, "grad_accum": layout.grad_accum,
                "precision": layout.precision, "ac": AC[layout.ac], "compile": bool(layout.compile)}
    if layout.layout == "fsdp" and layout.sharding == "shard_grad_op":
        settings["reshard_after_forward"] = False
    if layout.grad_reduce_dtype is not None:
        settings["grad_reduce_dtype"] = layout.grad_reduce_dtype
    if layout.distributed_optimizer:
        settings["distributed_optimizer"] = True
    if fw == "megatron" and layout.tp > 1:  # as the row says (auto would turn it on on a GPU)
        settings["sequence_parallel"] = layout.sp
    if layout.precision == "fp8" and layout.fp8_recipe in RECIPES:
        settings["float8_recipe"] = layout.fp8_recipe
    return settings


def settings_problem(settings: dict, executor: str) -> str | None:
    """Why a card run of these settings cannot run on the executor (the backend's checks, then the
    card's: `echobench run --card`'s), None where it can."""
    try:
        cfg = RunConfig.from_dict(settings)
        return backends.layout_problem(cfg, executor) or card_run_problem(cfg)  # as `plan` checks a matrix's
    except (ValueError, PredictError) as exc:
        return str(exc)


def plan_rows(rows_path: Path | str, ids: list[str], per_node: int | None = None, scale_down: int | None = None,
              executor: str = "local") -> list[RowPlan]:
    """Each row of `ids` planned (plan_row); ReproduceError for bad input."""
    if scale_down is not None and scale_down < 1:
        raise ReproduceError(f"--scale-down {scale_down}: give a node count >= 1")
    rows_path = Path(rows_path)
    return [plan_row(row, rows_path, per_node, scale_down, executor) for row in select_rows(rows_path, ids)]


def matrix_name(rows_path: Path) -> str:
    """reproduce-STEM, within the matrix name's letters and length."""
    return ("reproduce-" + re.sub(r"[^A-Za-z0-9._-]+", "-", rows_path.stem))[:64]


def _comment(text: str) -> str:
    return "# " + " ".join(str(text).split())


def matrix_text(plans: list[RowPlan], name: str, executor: str, defaults: dict, site: dict, command: str) -> str:
    """The matrix file: a comment per row (its published layout, what changed, how it maps, or why it
    is refused), then name, executor, the site's sections, defaults and one include per runnable row."""
    lines = [_comment(f"Written by `{command}`: one card run per published row, at its published layout "
                      "mapped to echobench's settings (echobench/sweep/reproduce.py)."), "#"]
    for p in plans:
        if p.refused:
            lines.append(_comment(f"refused: row {p.id} ({p.published}): {p.refused}"))
            continue
        lines.append(_comment(f"row {p.id}: published {p.published}"))
        lines += [_comment(f"  changed: {c}") for c in p.changes] + [_comment(f"  note: {n}") for n in p.notes]
    body = {"name": name, "executor": executor, **site, "defaults": defaults,
            "include": [p.settings for p in plans if p.settings is not None]}
    return "\n".join(lines) + "\n" + yaml.safe_dump(body, sort_keys=False, width=200)


def site_sections(path: Path) -> dict:
    """The `slurm`, `local` and `hardware` sections of a site file, or of a matrix file over its own
    site (echobench.sweep.site.cluster_sections: partition, account, setup, fabric, processes per node,
    peak), to write into the reproduce matrix; ReproduceError with one line for a file not to be used."""
    from echobench.sweep.site import cluster_sections

    try:
        return cluster_sections(path)
    except MatrixError as exc:
        raise ReproduceError(f"--site {exc}") from None


def site_per_node(site: dict, executor: str) -> int | None:
    """The GPUs (processes) per node the site's sections give the executor (local.gpus_per_node on the
    local executor, else slurm.gpus_per_node), None where they give none."""
    for section in (("local", "slurm") if executor == "local" else ("slurm",)):
        value = (site.get(section) or {}).get("gpus_per_node")
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def settings_text(settings: dict) -> str:
    """A row's run settings in a few words: framework parallelism, nodes x GPUs, batch, precision, AC."""
    s = settings
    extra = [f"{k.replace('_', ' ')} {str(v).lower()}" for k, v in s.items()
             if k in ("reshard_after_forward", "distributed_optimizer", "float8_recipe", "compile") and v]
    return (f"{s['framework']} {s['parallelism']}, {s['nodes']} x {s['gpus_per_node']}, micro-batch {s['micro_batch']} x "
            f"accumulation {s['grad_accum']}, {s['precision']}, ac {s['ac']}" + "".join(f", {e}" for e in extra))


def reference_rows(plans: list[RowPlan], runs: dict[str, str], records: dict, profiles: list) -> tuple[list, list[str]]:
    """Each planned row's run (`runs`: card setting -> run id; `records`: run id -> Record) beside its
    published figures and its prediction (predict.against: at the layout it ran, on `profiles`, else
    on the profile of its device as `validate measured` finds it). Returns the predict.reference rows
    and the lines saying what was not predicted or not run, and which profiles priced the runs."""
    from echobench.predict import against, profile_lines
    from echobench.predict.profiles import profiles_for_records
    from echobench.predict.reference import reference_row
    from echobench.predict.validate import published_figures

    lines, rows = [], []
    ok = [r for r in records.values() if r.status == RunState.OK and r.step_time_s]
    each: dict = {r.run_id: list(profiles) for r in ok}
    if ok and not profiles:
        try:
            each, _ = profiles_for_records(ok)
        except PredictError as exc:
            each = {}
            lines.append(f"not predicted: {exc}")
    used = {}
    for p in (p for p in plans if p.settings is not None):
        rid = runs.get(p.settings["card"])
        record = records.get(rid)
        if record is None:
            lines.append(f"row {p.id}: no record of its run {rid} (not run: see the sweep's output above)")
            continue
        step = mfu = None
        if record.run_id in each:
            try:
                prediction = against(record, each[record.run_id]).prediction
                step, mfu = prediction.step_time_s, prediction.mfu_row
                used[prediction.profile] = next(q for q in each[record.run_id] if q.name == prediction.profile)
            except (PredictError, ValueError) as exc:
                lines.append(f"row {p.id}: not predicted: {exc}")
        elif record.status == RunState.OK:
            lines.append(f"row {p.id}: not predicted: no hardware profile for its device {record.env.device_name!r} "
                         "(--profile NAME|FILE)")
        card, layout = model_card(p.row["model"]), run_layout(p.row["run"], p.row["hardware"])
        rows.append(reference_row(record, published_figures(p.row, card, layout), step, mfu))
    return rows, lines + profile_lines(list(used.values()))
