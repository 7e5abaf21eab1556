"""A run's `card` setting read into what `echobench run` trains (model.config.CardWorkload): a card
file (card.load_card_file) or FILE#ROW, a row of a published-runs file (validate.load_rows), with
the row's own FLOP convention (validate.row_convention) so that the record can state the measured
MFU under it beside echobench's, and the figures the row publishes (validate.published_figures).
The other way, measured_layout: what a card run ran, as the Layout predict_card prices."""

from __future__ import annotations

from dataclasses import fields

from echobench.model.config import CardWorkload
from echobench.predict.cards.card import Layout, ModelCard, load_card_file, model_card, run_layout
from echobench.predict.errors import PredictError
from echobench.predict.pricing import SDPA_SETTINGS, sdpa_kernel
from echobench.predict.validate import load_rows, published_figures, row_convention
from echobench.records.config import RunConfig, card_label


def published_layout(layout: Layout) -> dict:
    """The layout a card or row publishes, as the record keeps it: the fields it sets (defaults left out)."""
    return {f.name: getattr(layout, f.name) for f in fields(layout) if getattr(layout, f.name) != f.default}


def run_card(spec: str) -> CardWorkload:
    """The workload of setting card=SPEC; PredictError (one line) for a file, row or card that is not there
    or not valid."""
    path, _, row_id = spec.partition("#")
    if not row_id:
        card, layout, _ = load_card_file(path)
        return CardWorkload(card, layout.seq, card_label(spec), spec, published_layout(layout))
    rows = load_rows(path)
    row = next((r for r in rows if r["id"] == row_id), None)
    if row is None:
        raise PredictError(f"{path}: no row {row_id!r}: give one of {', '.join(r['id'] for r in rows)}")
    card = model_card(row["model"], f"{path}: row {row_id}: model")
    layout = run_layout(row["run"], row["hardware"], f"{path}: row {row_id}: run")
    formula, _ = row_convention(row)
    return CardWorkload(card, layout.seq, row_id, spec, published_layout(layout),
                        row_convention=str(row["published"]["convention"]),
                        row_flops_per_token=formula(card, layout) if formula else None,
                        published=published_figures(row, card, layout))



def measured_card(card: dict) -> ModelCard:
    """The ModelCard of a record's `card` section (its `model`, as run_card wrote it)."""
    try:
        return ModelCard(**card["model"])
    except (KeyError, TypeError) as exc:
        raise PredictError(f"the record's card section has no model card ({exc}): a record of an older echobench") from None


def measured_attention_kernel(sdpa_backends: dict | None, device_type: str | None) -> str | None:
    """The profile's attention kernel a card run's record names: torch's SDPA choice for its decoder
    (sdpa_backends_predicted["decoder"], through pricing.SDPA_SETTINGS and sdpa_kernel) on a GPU. None where it names
    none: a record from before card runs recorded it, a CPU run (its names are the CPU's kernels), a
    backend no profile prices."""
    if device_type != "cuda":
        return None
    setting = SDPA_SETTINGS.get((sdpa_backends or {}).get("decoder"))
    return sdpa_kernel(setting) if setting else None


def measured_layout(cfg: RunConfig, seq: int, precision: str, compiled: bool,
                    attention_kernel: str | None = None) -> Layout:
    """The layout a card run ran (its settings, the precision and compile it ran with), as predict_card
    prices it: single and ddp are DDP, fsdp2 FSDP (full_shard, shard_grad_op without resharding after
    forward), hsdp shard groups of a node, tpN Megatron TP. Priced as framework torchtitan: its eager
    Llama-style block's element-wise work (the decoder's blocks are alike), gradient reduction and
    parameter prefetch overlapped with backward and forward as echobench's DDP, FSDP2 and megatron DDP
    run them. AC selective is echobench's: op-level where compiled (every matmul and attention output
    saved, element-wise ops re-run: recompute policy maxtext-minimal), every second block where eager
    (selective-layer-2). attention_kernel: the one the record names (measured_attention_kernel; None:
    the framework's default)."""
    ran, extra = cfg.layout, {}
    if ran.hybrid:
        extra = {"shard_group": cfg.gpus_per_node}
    elif ran.shards_parameters:
        extra = {"sharding": "full_shard" if cfg.reshard_after_forward else "shard_grad_op"}
    elif ran.tensor_parallel:
        extra = {"tp": cfg.tp, "distributed_optimizer": cfg.distributed_optimizer}
    ac = {"selective": "maxtext-minimal" if compiled else "selective-layer-2"}.get(cfg.ac, cfg.ac)
    return Layout(gpus=cfg.world_size, gpus_per_node=cfg.gpus_per_node, seq=seq, micro_batch=cfg.micro_batch,
                  grad_accum=cfg.grad_accum, global_batch=cfg.global_batch, layout=ran.card_layout, ac=ac, compile=compiled,
                  precision=precision, fp8_recipe=cfg.float8_recipe if precision == "fp8" else None,
                  grad_reduce_dtype=cfg.grad_reduce_dtype, framework="torchtitan", attention_kernel=attention_kernel,
                  autocast=precision != "fp32", **extra)
