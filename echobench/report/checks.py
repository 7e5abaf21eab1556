"""Values a run cannot have, or should not have without a second look, each with the reason.

`value_flags` checks one row (a run of the report's frame, or a configuration's medians); `run_flags`
and `config_flags` apply it to the successful runs and the configurations, with each one's scaling
efficiency (`efficiencies`). The dashboard marks every flagged value where it is shown: in the
tables (a marker, the reason as its title, and a numbered list under the table) and in the figures.
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

# Above this, per-GPU throughput that grows with the GPU count is taken as suspicious, not as
# measurement noise: 10% more per GPU than at the smallest count.
SUPERLINEAR_TOLERANCE = 1.10


@dataclass(frozen=True)
class Flag:
    column: str  # the frame column whose value is flagged: mfu, step_time_s, samples_per_s, peak_mem_gib, efficiency
    reason: str


def _number(row, key: str) -> float | None:
    value = row.get(key) if hasattr(row, "get") else None
    value = pd.to_numeric(value, errors="coerce")
    return None if value is None or pd.isna(value) else float(value)


def value_flags(row, efficiency: float | None = None, base_gpus: int | None = None) -> list[Flag]:
    """What is impossible or suspicious in one row (a mapping with the frame's columns: mfu,
    step_time_s, samples_per_s, peak_mem_gib, device_memory_gib, world_size), and why; `efficiency`:
    its per-GPU samples/s over that of the same configuration at `base_gpus`, its smallest GPU count."""
    flags = []
    mfu = _number(row, "mfu")
    if mfu is not None and mfu > 1:
        flags.append(Flag("mfu", f"MFU {mfu:.0%} is above 100%: more model FLOPs per second than the peak allows. "
                                 "The peak (the denominator) is likely not this device's, or the FLOP count or "
                                 "the measured time is wrong"))
    elif mfu is not None and mfu <= 0:
        flags.append(Flag("mfu", f"MFU {mfu:.3g} is not positive: no model FLOPs counted or no time measured"))
    step = _number(row, "step_time_s")
    if step is not None and step <= 0:
        flags.append(Flag("step_time_s", f"step time {step:.3g} s is not positive: the step clock is wrong"))
    samples = _number(row, "samples_per_s")
    if samples is not None and samples <= 0:
        flags.append(Flag("samples_per_s", f"samples/s {samples:.3g} is not positive: no samples counted"))
    memory, device = _number(row, "peak_mem_gib"), _number(row, "device_memory_gib")
    if memory is not None and device is not None and memory > device:
        flags.append(Flag("peak_mem_gib", f"peak memory {memory:.3g} GiB is above the device's {device:.3g} GiB: "
                                          "the memory statistics are from another device or in another unit"))
    if efficiency is not None and efficiency > SUPERLINEAR_TOLERANCE:
        gpus = _number(row, "world_size")
        at = f" at {gpus:.0f} GPUs" if gpus is not None else ""
        against = f" of {base_gpus} GPUs" if base_gpus else ""
        flags.append(Flag("efficiency", f"scaling efficiency {efficiency:.0%}{at}: per-GPU throughput "
                                        f"{efficiency - 1:.0%} above that{against}, beyond the "
                                        f"{SUPERLINEAR_TOLERANCE - 1:.0%} that noise explains. Superlinear scaling "
                                        "usually means the runs differ in more than their GPU count (per-GPU batch, "
                                        "lengths, a slow run at the smallest count), not a real speed-up"))
    return flags


def baselines(configs: pd.DataFrame) -> pd.DataFrame:
    """Per configuration across node counts (`layout`): its smallest GPU count and the median per-GPU
    samples/s there (configs: ReportInput.configurations), indexed by layout."""
    gpus = pd.to_numeric(configs["world_size"], errors="coerce")
    rows = configs.assign(_g=gpus, _r=pd.to_numeric(configs["samples_per_s_per_gpu"], errors="coerce"))
    rows = rows.dropna(subset=["_g"]).sort_values("_g")
    first = rows.groupby("layout", sort=False).first()
    counts = rows.groupby("layout", sort=False)["_g"].nunique()
    return pd.DataFrame({"gpus": first["_g"], "per_gpu": first["_r"], "counts": counts})


def efficiencies(rows: pd.DataFrame, configs: pd.DataFrame) -> pd.Series:
    """Per row (runs or configurations): per-GPU samples/s over the median of its configuration at
    that configuration's smallest GPU count; NaN at that count itself and where the configuration ran
    at one GPU count only (no scaling to judge)."""
    base = baselines(configs)
    out = []
    for layout, gpus, rate in zip(rows["layout"], pd.to_numeric(rows["world_size"], errors="coerce"),
                                  pd.to_numeric(rows["samples_per_s_per_gpu"], errors="coerce")):
        b = base.loc[layout] if layout in base.index else None
        usable = b is not None and b["counts"] > 1 and gpus > b["gpus"] and b["per_gpu"] > 0
        out.append(rate / b["per_gpu"] if usable else float("nan"))
    return pd.Series(out, index=rows.index, dtype=float)


def _flags_of(rows: pd.DataFrame, configs: pd.DataFrame) -> dict:
    if rows.empty:
        return {}
    eff = efficiencies(rows, configs)
    base = baselines(configs)
    out = {}
    for index, row in rows.iterrows():
        e = eff.loc[index]
        base_gpus = int(base.loc[row["layout"], "gpus"]) if row["layout"] in base.index else None
        flags = value_flags(row, None if pd.isna(e) else float(e), base_gpus)
        if flags:
            out[index] = flags
    return out


def run_flags(ok: pd.DataFrame, configs: pd.DataFrame) -> dict:
    """Frame index -> flags, for the successful runs (`ok`) that have any; efficiency against their
    configuration's medians (`configs`: ReportInput.configurations)."""
    return _flags_of(ok, configs)


def config_flags(configs: pd.DataFrame) -> dict:
    """Configurations index -> flags, for the configurations (their medians) that have any."""
    return _flags_of(configs, configs)
