"""A run's record from its ranks' figures (echobench.train.bench measures them): the step times at the
slowest rank, throughput and MFU over the measured window, memory, padding, attention paths,
compile and the profiled breakdown."""

from __future__ import annotations

import statistics
from collections import Counter

from echobench.train.breakdown import summary as breakdown_summary
from echobench.records.config import RunConfig
from echobench.data.format import FRAME_RATE
from echobench.hardware.device import env_info, precision_name
from echobench.records.peaks import peak_precision_of
from echobench.records.results import Record
from echobench.records.run_figures import padding_figures, peak_mem_figures, peak_mem_gib, step_figures, window_figures
from echobench.records.states import RunState


def start_record(cfg: RunConfig, device) -> Record:
    """The record of a run that starts on device (a torch.device): status error until the run's figures
    fill it (bench.summarize), so a run that dies at any point still has a complete record."""
    source = "flag" if cfg.peak_tflops else None
    resolved = {"compile": cfg.compiled_on(device.type), "sequence_parallel": cfg.sequence_parallel_on(device.type)}
    return Record.of_settings(cfg, resolved, status=RunState.ERROR, precision=precision_name(cfg.precision, device),
                              peak_tflops=cfg.peak_tflops, peak_source=source,
                              peak_precision=peak_precision_of(source), env=env_info(device))


def allocator_count(ranks: list[dict], key: str) -> int | None:
    """A CUDA allocator counter summed over ranks; None where no rank has it (CPU)."""
    counts = [r["memory"][key] for r in ranks if r["memory"].get(key) is not None]
    return sum(counts) if counts else None


def summarize(cfg: RunConfig, record: Record, ranks: list[dict]) -> Record:
    """Fills the record's figures from every rank's measurements.

    Throughput is over the whole measured window (stalls included, as a training run pays them):
    samples / total measured time, and MFU = model FLOPs of the measured samples /
    (total time x world size x peak). The median and p10 / p90 step are kept beside it.
    """
    n = min(len(r["step_times_s"]) for r in ranks)
    # Each step counts at its slowest rank.
    slowest = [max(r["step_times_s"][i] for r in ranks) for i in range(n)]
    steps = step_figures(slowest)
    # Tensor-parallel peers process the same samples: count data-parallel replicas only.
    dp_ranks = ranks[:: cfg.tp]
    samples = sum(r["samples"] for r in dp_ranks)
    flops = sum(r["model_flops"] for r in dp_ranks)
    hw_flops = sum(r["hardware_flops"] for r in dp_ranks)
    tokens = {s: [sum(r["tokens"][s][i] for r in dp_ranks) for i in (0, 1)] for s in dp_ranks[0]["tokens"]}
    slowest_rank = max(ranks, key=lambda r: r["median_step_time_s"])
    record.update(
        status=RunState.OK,
        error="",
        step_times_s=slowest,
        **steps,
        measured_samples=samples,
        measured_model_flops=flops,
        measured_hardware_flops=hw_flops,
        **window_figures(measured_time_s=steps["measured_time_s"], samples=samples, model_flops=flops,
                         hardware_flops=hw_flops,
                         audio_seconds=sum(r["audio_frames"] for r in dp_ranks) / FRAME_RATE,
                         world_size=cfg.world_size, peak_tflops=record.peak_tflops,
                         ceiling_tflops=record.ceiling_tflops, peak_fp8_tflops=record.peak_fp8_tflops),
        **padding_figures(padded_flops=sum(r["padded_flops"] for r in dp_ranks), hardware_flops=hw_flops,
                          tokens=tokens),
        # batching=bucket: measured steps per bucket (audio frames); every rank pads a step alike
        bucket_steps=(dict(sorted(Counter(ranks[0]["padded_audio_frames"]).items()))
                      if cfg.batching == "bucket" else None),
        num_alloc_retries=allocator_count(ranks, "num_alloc_retries"),
        num_ooms=allocator_count(ranks, "num_ooms"),
        **peak_mem_figures([r["memory"] for r in ranks]),
        data_wait_frac=max(r["data_wait_frac"] for r in ranks),
        data_wait_clock=ranks[0]["data_wait_clock"],  # what data_wait_frac measures (docs/explanation/mfu.md)
        slowest_rank=slowest_rank["rank"],
        # The step's loss over the global batch: each rank's loss is its error sum over the global
        # frame count x dp (run_loop), so their mean over data-parallel ranks is the global loss.
        losses=[statistics.fmean(r["losses"][i] for r in dp_ranks) for i in range(len(ranks[0]["losses"]))],
        skipped_samples=sum(r["skipped_samples"] for r in dp_ranks),
        backend=ranks[0]["backend_info"],
        te=bool(ranks[0]["backend_info"].get("te", False)),
        grad_accum=cfg.grad_accum,
        **attention_figures(dp_ranks),
        **compile_figures(ranks[0], bool(ranks[0]["backend_info"].get("compile"))),
        **window_compile_figures(ranks),
        per_rank=[
            {
                "rank": r["rank"],
                "hostname": r["hostname"],
                "median_step_time_s": r["median_step_time_s"],
                "data_wait_frac": r["data_wait_frac"],
                "peak_mem_gib": peak_mem_gib(r["memory"]),
                "memory": r["memory"],
                "losses": r["losses"],
            }
            for r in ranks
        ],
    )
    if cfg.trace:
        # Only the traces that were written (profiling stopped by its bound may leave a rank without one).
        record.update(profile_traces=[r["trace"] for r in ranks if r.get("trace")],
                      profiled_steps=ranks[0]["profiled_steps"], breakdown=breakdown_summary([r["breakdown"] for r in ranks]))
    if record.compiles_in_window:
        record.update(status=RunState.ERROR, error=compiled_in_window_error(record))
    return record


def window_compile_figures(ranks: list[dict]) -> dict:
    """Whether torch compiled inside the measured window: the compiles of the window the figures come
    from, summed over ranks (0 in an ok run), the windows measured again because torch compiled in
    them (bench.MAX_WINDOWS), the micro-batch variants warm-up ran (bench_warmup), and every compile
    of the run by what triggered it (kernels.CompileWatch), rank 0's."""
    return {"compiles_in_window": sum(r["compiles_in_window"] for r in ranks),
            "window_restarts": ranks[0]["window_restarts"], "warmup_variants": ranks[0]["warmup_variants"],
            "compiles": ranks[0]["compiles"]}


def compiled_in_window_error(record: Record) -> str:
    """The one line of a run in whose every measured window torch compiled."""
    return (f"torch compiled {record.compiles_in_window} time(s) inside the measured window, and in each of the "
            f"{len(record.window_restarts or []) or 1} window(s) measured: the step times include compiling; warm-up "
            f"ran {len(record.warmup_variants or [])} micro-batch variant(s) ({'; '.join(record.warmup_variants or [])}) "
            "and the window met another: report it with this record (window_restarts says where)")


def attention_figures(dp_ranks: list[dict]) -> dict:
    """The record's attention: per part, how many measured micro-batches took each path (no mask,
    split, flex, dense) and each path's share of the window's attention FLOPs, over the data-parallel ranks;
    the attention kernels each warm-up variant ran (a profiled pass on a GPU, rank 0's; None on a
    CPU) and the SDPA kernels torch would choose at the run's shapes (predicted, rank 0's: every
    rank has the same shapes)."""
    paths: dict[str, Counter] = {}
    flops: dict[tuple[str, str], int] = Counter()
    for r in dp_ranks:
        for part, counts in r.get("attention_paths", {}).items():
            paths.setdefault(part, Counter()).update(counts)
        for part, by_path in r.get("attention_flops", {}).items():
            for path, n in by_path.items():
                flops[part, path] += n
    whole = sum(flops.values())
    shares = {}
    for (part, path), n in flops.items():
        shares.setdefault(part, {})[path] = n / whole
    return {"attention_paths": {part: dict(counts) for part, counts in paths.items()} or None,
            "attention_flop_shares": shares or None, "attention_kernels": dp_ranks[0].get("attention_kernels"),
            "sdpa_backends_predicted": dp_ranks[0].get("sdpa_backends_predicted")}


def compile_figures(rank: dict, compiled: bool) -> dict:
    """What compile produced (kernels.compile_counts, rank 0's): graphs and graph breaks. `compiled`:
    whether the backend compiled the model (its info). A run set to compile whose compile produced
    no graph is not labelled compiled; an eager run in which torch compiled kernels of its own
    (FlexAttention's, megatron-core's fused SwiGLU) says so."""
    counts = rank.get("compile_counts")
    if counts is None:
        return {"compile": False}
    out = {"compile_graphs": counts["graphs"], "compile_graph_breaks": counts["graph_breaks"],
           "compile_break_reasons": counts["break_reasons"], "compile": compiled and counts["graphs"] > 0}
    if compiled and not counts["graphs"]:
        out["compile_note"] = "compile was asked for but produced no graph: the run ran eager"
    elif not compiled and counts["graphs"]:
        out["compile_note"] = (f"eager, but torch compiled {counts['graphs']} graph(s) of its own kernels "
                               "(FlexAttention's, megatron-core's fused SwiGLU), all in warm-up unless "
                               "compiles_in_window says otherwise")
    return out
