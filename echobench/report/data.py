"""What the report is built from: stored result records (and a sweep's skipped list), as one frame.

Only files on disk are read: `result.json` records through `echobench.records.results.load_records`
(typed records: newest per run id, corrupt ones reported), the `plan.json` a sweep writes beside
each (its memory estimate), the sweep's `sweep.json` (its matrix name) and `skipped.json` files,
and the `tune.json` of a tune directory (echobench tune) given as a path or at a path's top level.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import pandas as pd

from echobench.predict.memory import GIB, overhead_bytes
from echobench.records.config import configuration
from echobench.records.paths import SWEEP_FILE
from echobench.predict import PredictError, against
from echobench.records.results import (Record, configuration_key, load_records, over_repeats, peak_mem_for_estimate,
                               peak_notes, read_plan, record_settings, records_frame, slower_p_value)
from echobench.records.run_figures import max_of
from echobench.sweep.matrix import settings_match
from echobench.sweep.state import CorruptSweepState, SweepState
from echobench.records.paths import TUNE_FILE
from echobench.records.states import RunState

# Labels: framework and parallelism always name a configuration (echobench.records.config.configuration);
# then the settings that differ between the configurations of that framework and parallelism,
# these first, in this order. Scale and nodes are not in labels: figures are per scale, x is GPUs.
CONFIG_KEYS = ("framework", "parallelism")
VARYING_CONFIG_KEYS = ("gpus_per_node", "micro_batch", "precision", "compile", "ac", "encoder_model",
                       "frozen_encoder", "audio_frames", "text_tokens", "speaker_frames")
SHORT_NAMES = {"gpus_per_node": "gpn", "micro_batch": "mb", "precision": "", "compile": "compile",
               "ac": "ac", "encoder_model": "enc", "audio_frames": "audio", "text_tokens": "text", "speaker_frames": "spk"}


@dataclass
class ReportInput:
    paths: list[Path]
    records: list[Record]
    frame: pd.DataFrame
    skipped: list[dict] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    predicted_by: list[str] = field(default_factory=list)  # the profiles' names, once predictions are in
    profile_line: str = ""  # which profile the predictions are from and how it was chosen, or why there are none
    margin: float | None = None  # runs this far below their prediction are flagged (a fraction)
    tunes: list[TuneDoc] = field(default_factory=list)  # the tune.json files among the paths (load_tunes)
    skipped_files: list[str] = field(default_factory=list)  # the skipped.json files read (load_skipped)

    @property
    def ok(self) -> pd.DataFrame:
        return successful(self.frame)

    @property
    def failed(self) -> pd.DataFrame:
        return self.frame[self.frame["status"] != RunState.OK]

    @cached_property
    def configurations(self) -> pd.DataFrame:
        """One row per configuration of the successful runs: medians over its repeats."""
        return over_configurations(self.ok)

    @cached_property
    def crowns(self) -> dict:
        """configurations index -> Crown: the best at each scale and node count, or a tie (crowns)."""
        return crowns(self.configurations, self.records)


@dataclass
class Crown:
    """The mark of a configuration at its scale and node count: "best" where its MFU is the highest
    and its steps are significantly faster than every other's there; "tie" for the highest and
    each it cannot be told from (`tied_with`: the others' labels, each with why)."""

    mark: str
    tied_with: list[str] = field(default_factory=list)


def step_mfus(row, by_id: dict[str, Record]) -> list[float]:
    """Each measured step's MFU over a configuration's runs: its run's MFU, scaled by the run's mean
    step time over the step's."""
    out = []
    for rid in row["run_ids"]:
        r = by_id.get(rid)
        if r is None or not r.step_times_s or not r.mfu:
            continue
        mean = sum(r.step_times_s) / len(r.step_times_s)
        out += [r.mfu * mean / t for t in r.step_times_s if t > 0]
    return out


def behind_by(best: list[float], other: list[float]) -> str | None:
    """Why a configuration of these step MFUs cannot be told from the best's, or None when it is
    significantly behind: `compare`'s test (one-sided Mann-Whitney U on the steps, at its alpha,
    MIN_STEPS a side at least), on each step's work time (1 / its MFU)."""
    from echobench.report.compare import DEFAULT_ALPHA, MIN_STEPS  # lazy: compare's constants, rich

    if min(len(best), len(other)) < MIN_STEPS:
        return f"too few steps stored to tell ({len(best)} / {len(other)}, need {MIN_STEPS} a side)"
    p = slower_p_value([1 / m for m in best], [1 / m for m in other])
    return f"not significantly behind (p={p:.2g} >= {DEFAULT_ALPHA:g})" if p >= DEFAULT_ALPHA else None


def crowns(configs: pd.DataFrame, records: list[Record]) -> dict[object, Crown]:
    """Per scale and node count, the configuration of the highest median MFU: "best" where every
    other there is significantly behind it (behind_by), else "tie", with every one it ties with."""
    by_id = {r.run_id: r for r in records}
    out = {}
    for _, at in configs.groupby(["scale", pd.to_numeric(configs["nodes"], errors="coerce")]):
        top = pd.to_numeric(at["mfu"], errors="coerce").idxmax()
        best = step_mfus(at.loc[top], by_id)
        tied = {i: why for i in at.index if i != top and (why := behind_by(best, step_mfus(at.loc[i], by_id)))}
        if not tied:
            out[top] = Crown("best")
            continue
        out[top] = Crown("tie", [f"{at.at[i, 'config']}: {why}" for i, why in tied.items()])
        for i in tied:
            out[i] = Crown("tie", [f"{at.at[top, 'config']} (the highest MFU)"])
    return out


def successful(frame: pd.DataFrame) -> pd.DataFrame:
    """The rows of runs that ended ok with an MFU: what figures and tables are drawn from."""
    return frame[(frame["status"] == RunState.OK) & frame["mfu"].notna()]


def sweep_matrix_names(paths) -> tuple[dict[Path, str], list[str]]:
    """(sweep directory -> matrix name, from the `sweep.json` state file a sweep keeps at its root;
    the unreadable state files: their runs are reported from their records alone, without a matrix)."""
    names, problems = {}, []
    for p in map(Path, paths):
        for state_file in sorted(p.rglob(SWEEP_FILE)) if p.is_dir() else []:
            try:
                name = SweepState.load(state_file.parent).matrix
            except CorruptSweepState as exc:
                problems.append(f"{exc} (reported from the runs' records alone)")
                continue
            if name:
                names[state_file.parent.resolve()] = name
    return names, problems


def load_report_input(paths, only: dict[str, list] | None = None) -> ReportInput:
    """The records under paths (with `only`, those whose settings have those values: --only) and
    what the report reads beside them: skipped runs, the matrices' names, tunes."""
    paths = [Path(p) for p in paths]
    records, problems = load_records(paths)
    if only:
        records = [r for r in records if settings_match(record_settings(r), only)]
    skipped, skip_problems, skip_files = load_skipped(paths)
    sweeps, sweep_problems = sweep_matrix_names(paths)
    tunes, tune_problems = load_tunes(paths)
    frame = report_frame(records, sweeps)
    return ReportInput(paths, records, frame, skipped, problems + skip_problems + sweep_problems + tune_problems,
                       tunes=tunes, skipped_files=skip_files)


# ---- the frame: records_frame plus what the report needs ----

def _device_memory(record: Record) -> float | None:
    """Total memory of one device, from the ranks' memory stats (GPU runs record it)."""
    totals = [r.memory.get("device_total_gib") for r in record.per_rank]
    totals = [t for t in totals if t]
    return min(totals) if totals else None


MEMORY_ESTIMATE_ERROR = 0.30  # the error echobench.predict.memory states for its estimate (+-30%)
CPU_MEMORY_CAVEAT = ("a CPU run's measured peak is its process's resident set (the interpreter and libraries "
                     "included), and a record without the resident baseline its run measured (records written before "
                     "baseline_rss_gib) is held against the plan's total, which counts a GPU's CUDA context and "
                     "workspaces (1.5 GiB): at small scales the two are not comparable")


def memory_baseline(record: Record) -> float | None:
    """A CPU run's resident baseline (train.bench.baseline_gib: the process besides its tensors once the
    model was built), the largest over its ranks; None on a GPU or in an older record."""
    return max_of([r.memory for r in record.per_rank], "baseline_rss_gib")


def held_estimate(record: Record) -> float | None:
    """The plan's memory estimate held against the measured peak (peak_mem_for_estimate): on a GPU
    run its tensors (the allocated peak's counterpart); on a CPU run with a measured baseline its
    tensors, their fragmentation (predict.memory.overhead_bytes) and that baseline; elsewhere its
    total; None without both."""
    plan = read_plan(record)
    if plan.get("memory_estimate_gib") is None or peak_mem_for_estimate(record) is None:
        return None
    tensors = (plan.get("memory_estimate") or {}).get("tensors")
    if tensors is None:
        return plan["memory_estimate_gib"]
    if _device_memory(record) is not None:
        return tensors
    baseline = memory_baseline(record)
    if baseline is None:
        return plan["memory_estimate_gib"]
    return tensors + overhead_bytes(tensors * GIB, gpu=False) / GIB + baseline


def _trainable_params(record: Record) -> float | None:
    params = (record.flops_breakdown or {}).get("params") or {}
    return params.get("trainable")


def _matrix_name(record: Record, sweeps: dict[Path, str]) -> str | None:
    """The matrix of the sweep whose directory holds the record (its sweep.json)."""
    if record.path is None:
        return None
    return next((sweeps[d] for d in record.path.resolve().parents if d in sweeps), None)


def report_frame(records: list[Record], sweeps: dict[Path, str] | None = None) -> pd.DataFrame:
    frame = records_frame(records)
    settings = [configuration(record_settings(r), with_nodes=False) for r in records]
    extra = pd.DataFrame({
        "memory_estimate_gib": [read_plan(r).get("memory_estimate_gib") for r in records],
        # what the estimate is compared with: the allocated peak where there is one (GPU)
        "memory_vs_estimate_gib": [peak_mem_for_estimate(r) for r in records],
        "memory_estimate_held_gib": [held_estimate(r) for r in records],
        "memory_baseline_gib": [memory_baseline(r) for r in records],  # CPU runs: their measured baseline
        "device_memory_gib": [_device_memory(r) for r in records],
        "trainable_params": [_trainable_params(r) for r in records],
        "matrix": [_matrix_name(r, sweeps or {}) for r in records],
        "configuration": [configuration_key(r) for r in records],
        "settings": settings,  # the configuration across node counts: one line of the scaling views
        "layout": [json.dumps(c, sort_keys=True, default=str) for c in settings],
        "notes": [tuple(peak_notes(r)) for r in records],
    }, index=frame.index)
    frame = pd.concat([frame, extra], axis=1)
    for column in PREDICTED_COLUMNS:  # filled by with_predictions (report --profile)
        frame[column] = None
    ws = pd.to_numeric(frame["world_size"], errors="coerce")
    # the estimate's error against the measured peak (a fraction: +1.3 is 2.3x), where both exist
    frame["memory_estimate_error"] = (pd.to_numeric(frame["memory_estimate_held_gib"], errors="coerce")
                                      / pd.to_numeric(frame["memory_vs_estimate_gib"], errors="coerce") - 1)
    frame["audio_seconds_per_s_per_gpu"] = pd.to_numeric(frame["audio_seconds_per_s"], errors="coerce") / ws
    ok = [r.status == RunState.OK for r in records]
    frame["config"] = config_labels(settings, among=[s for s, good in zip(settings, ok) if good] or settings)
    return frame


# ---- predictions beside the measurements (report --profile) ----

PREDICTED_COLUMNS = ("predicted_step_time_s", "predicted_mfu", "prediction_error", "below_prediction",
                     "predicted_row_mfu")  # the last: a card run's, under its row's FLOP convention


def flagged(value) -> bool:
    """A below_prediction cell that says yes (None / NaN: no prediction)."""
    return value is not None and not pd.isna(value) and bool(value)


def with_predictions(data: ReportInput, profiles: list | dict[str, list], margin: float) -> ReportInput:
    """The successful runs' predictions (echobench.predict.against, on these profiles, or on each run
    id's own where `profiles` is a dict) in the frame: predicted step time and MFU, error = (predicted -
    measured) / measured step time, and below_prediction where the run reached less than (1 - margin)
    of its predicted throughput (measured step > predicted step / (1 - margin)). Runs the model cannot
    price, or without a profile, stay empty; why is added to data.problems."""
    frame = data.frame.copy()
    by_id = {r.run_id: r for r in data.records}
    used = {}  # the names of the profiles that priced a run, in order
    for index, row in frame.iterrows():
        record = by_id.get(row["run_id"])
        if record is None or record.status != RunState.OK or not record.step_time_s:
            continue
        mine = profiles.get(record.run_id) if isinstance(profiles, dict) else profiles
        if not mine:
            continue
        try:
            c = against(record, mine)
        except (PredictError, ValueError) as exc:
            data.problems.append(f"{row['run_id']}: not predicted: {exc}")
            continue
        used[c.prediction.profile] = True
        frame.at[index, "predicted_step_time_s"] = c.prediction.step_time_s
        frame.at[index, "predicted_mfu"] = c.prediction.mfu
        frame.at[index, "predicted_row_mfu"] = getattr(c.prediction, "mfu_row", None)  # card runs (CardPrediction)
        frame.at[index, "prediction_error"] = c.error
        frame.at[index, "below_prediction"] = bool(record.step_time_s * (1 - margin) > c.prediction.step_time_s)
    data.frame = frame
    data.__dict__.pop("configurations", None)  # the cached medians: computed again with the predictions
    data.predicted_by, data.margin = list(used), margin
    return data


def with_device_predictions(data: ReportInput, margin: float) -> ReportInput:
    """`report` without --profile: each successful run predicted on the hardware profile of its device
    (echobench.predict.profiles.profiles_for_records: its sweep's own, else the shipped one of its
    datasheet row, else this machine's calibrated one); data.profile_line says which profile was used
    for which device, or, in one line, that none matches."""
    from echobench.predict.profiles import profiles_for_records  # lazy: hardware profiles, yaml

    ok = [r for r in data.records if r.status == RunState.OK and r.step_time_s]
    if not ok:
        return data
    devices = sorted({r.env.device_name or "an unnamed device" for r in ok})
    try:
        each, _ = profiles_for_records(ok)
    except PredictError as exc:
        unreadable = "" if str(exc).startswith("no hardware profile") else f" ({exc})"
        data.profile_line = (f"No hardware profile matches the records' device ({', '.join(devices)}){unreadable}: "
                             "no predicted figures; give one with report --profile NAME|FILE.")
        return data
    data = with_predictions(data, each, margin)
    names = sorted({p.name for ps in each.values() for p in ps})
    if not data.predicted_by:
        data.profile_line = (f"Hardware profile {', '.join(names)} matches the records' device ({', '.join(devices)}), "
                             "but no run could be priced on it (why: the problems listed below).")
        return data
    by_profile: dict[str, set] = {}
    device_of = {r.run_id: r.env.device_name or "an unnamed device" for r in ok}
    for run_id, ps in each.items():
        by_profile.setdefault(ps[0].name, set()).add(device_of[run_id])
    unmatched = sorted(set(devices) - {d for ds in by_profile.values() for d in ds})
    data.profile_line = ("Predicted figures from hardware profile "
                         + "; ".join(f"{name} (matched to the records' device {', '.join(sorted(ds))})"
                                     for name, ds in by_profile.items())
                         + (f"; no profile matches {', '.join(unmatched)}: those runs are not predicted"
                            if unmatched else "")
                         + ". report --profile NAME|FILE overrides.")
    return data


# ---- repeats: one row per configuration and node count ----

# Figures reported as the median over a configuration's repeats (MFU and samples/s with min-max).
REPEAT_FIGURES = ("step_time_s", "step_time_p10_s", "step_time_p90_s", "step_time_mean_s", "step_time_mean_vs_median",
                  "samples_per_s", "samples_per_s_per_gpu", "audio_seconds_per_s", "audio_seconds_per_s_per_gpu",
                  "tflops_per_gpu", "mfu", "hfu", "mfu_fp8_peak", "mfu_vs_ceiling", "peak_mem_gib", "predicted_mfu",
                  "predicted_step_time_s")
RANGE_FIGURES = ("mfu", "samples_per_s")


def over_configurations(ok: pd.DataFrame) -> pd.DataFrame:
    """The successful runs grouped by configuration at a node count (configuration_key): repeats,
    and runs of other sweeps that measured the same thing for another number of steps. Per group:
    the first run's settings, the median over the runs of each figure, min and max of MFU and
    samples/s, the number of runs (`repeats`), the most allocator retries any run had, the run
    ids and each run's step count."""
    rows = []
    for _, group in ok.groupby("configuration", sort=False):
        group = group.assign(_r=pd.to_numeric(group["repeat"], errors="coerce").fillna(0)).sort_values(["_r", "run_id"])
        row = group.iloc[0].drop("_r").to_dict()
        for c in REPEAT_FIGURES:
            stats = over_repeats(pd.to_numeric(group[c], errors="coerce"))
            row[c] = stats["median"] if stats else None
            if c in RANGE_FIGURES:
                row[f"{c}_min"], row[f"{c}_max"] = (stats["min"], stats["max"]) if stats else (None, None)
        retries = pd.to_numeric(group["num_alloc_retries"], errors="coerce").dropna()
        row["num_alloc_retries"] = retries.max() if len(retries) else None
        row["repeats"] = len(group)
        row["run_ids"] = list(group["run_id"])
        row["run_steps"] = list(group["steps"])
        rows.append(row)
    columns = (list(ok.columns) + [f"{c}_{m}" for c in RANGE_FIGURES for m in ("min", "max")]
               + ["repeats", "run_ids", "run_steps"])
    return pd.DataFrame(rows, columns=columns)


def setting_text(key: str, value) -> str:
    """One setting as a label shows it: `mb=4`, `compile` / `eager`, `bf16`."""
    if key == "compile":
        return {True: "compile", False: "eager"}.get(value, f"compile={value}")
    if key == "frozen_encoder":
        return {True: "enc-frozen", False: "enc-trained"}.get(value, f"frozen={value}")
    if key == "precision":
        return str(value)
    return f"{SHORT_NAMES.get(key, key)}={'default' if value is None else value}"


def varying_keys(settings: list[dict], ignore=("scale", "nodes")) -> list[str]:
    """The keys whose values differ between these settings (VARYING_CONFIG_KEYS' order first)."""
    keys = {k for s in settings for k in s if k not in ignore}
    varying = {k for k in keys if len({json.dumps(s.get(k), default=str) for s in settings}) > 1}
    return [k for k in VARYING_CONFIG_KEYS if k in varying] + sorted(varying - set(VARYING_CONFIG_KEYS))


def config_labels(settings: list[dict], among: list[dict] | None = None) -> list[str]:
    """A label per configuration: framework and parallelism, then only the settings that differ
    between the configurations of that framework and parallelism `among` (the successful runs':
    those the figures draw; default all) on the whole page, so a label, and its colour, is the same
    in every figure."""
    groups: dict[tuple, list[dict]] = {}
    for s in settings if among is None else among:
        groups.setdefault(tuple(str(s.get(k)) for k in CONFIG_KEYS), []).append(s)
    varying = {fp: varying_keys(group, ignore=("scale", "nodes", *CONFIG_KEYS)) for fp, group in groups.items()}
    labels = []
    for s in settings:
        fp = tuple(str(s.get(k)) for k in CONFIG_KEYS)
        labels.append(" ".join([*fp, *(setting_text(k, s.get(k)) for k in varying.get(fp, []))]))
    return labels


# ---- scales, by size ----

_SIZE = re.compile(r"^(\d+(?:\.\d+)?)\s*([KMBT])$", re.IGNORECASE)
_UNIT = {"K": 1e3, "M": 1e6, "B": 1e9, "T": 1e12}


def scale_size(name: str) -> float:
    """800M -> 8e8, 3B -> 3e9; names without a size (tiny) sort first."""
    match = _SIZE.match(str(name))
    return float(match.group(1)) * _UNIT[match.group(2).upper()] if match else 0.0


def scale_order(frame: pd.DataFrame) -> list[str]:
    """Scales from smallest to largest: by trainable parameters where recorded, else by name."""
    sizes = {}
    for scale, group in frame.groupby("scale", dropna=True):
        params = pd.to_numeric(group["trainable_params"], errors="coerce").dropna()
        sizes[scale] = float(params.max()) if len(params) else scale_size(scale)
    return sorted(sizes, key=lambda s: (sizes[s], str(s)))


# ---- a sweep's skipped runs ----

def _skipped_entries(obj) -> list:
    if isinstance(obj, dict):
        for key in ("skipped", "runs"):
            if isinstance(obj.get(key), list):
                return obj[key]
        return [obj]
    return obj if isinstance(obj, list) else []


def load_skipped(paths) -> tuple[list[dict], list[str], list[str]]:
    """Entries of every `skipped.json` under paths: the run's settings and the reason it was skipped;
    the problems; the files read (an empty list in one says the plan skipped nothing).

    Accepts a list of entries or {"skipped": [...]}; an entry's settings may sit at its top level or
    under "run" / "spec" / "config" / "settings". A missing file is normal (not every sweep skips runs).
    """
    entries, problems, seen, read = [], [], set(), []
    files = []
    for p in map(Path, paths):
        if p.is_dir():
            files.extend(sorted(p.rglob("skipped.json")))
        elif p.name == "skipped.json":
            files.append(p)
    for path in files:
        try:
            obj = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            problems.append(f"{path}: unreadable skipped list ({exc})")
            continue
        read.append(str(path))
        for entry in _skipped_entries(obj):
            if not isinstance(entry, dict):
                entry = {"reason": str(entry)}
            settings = dict(entry)
            for key in ("run", "spec", "config", "settings"):
                if isinstance(entry.get(key), dict):
                    settings = {**entry[key], **{k: v for k, v in entry.items() if k != key}}
            row = {k: settings.get(k) for k in ("run_id", "scale", "framework", "parallelism", "nodes")}
            row["reason"] = str(settings.get("reason") or settings.get("why") or settings.get("error") or "")
            row["source"] = str(path)
            key = json.dumps({k: row[k] for k in row if k != "source"}, sort_keys=True, default=str)
            if key not in seen:
                seen.add(key)
                entries.append(row)
    return entries, problems, read


# ---- a tune's tune.json (echobench.tune.output.write_outputs) ----

# The searched settings a tune candidate's row shows: (key, column header).
TUNE_SETTINGS = (("micro_batch", "mb"), ("grad_accum", "accum"), ("ac", "ac"), ("compile", "compile"),
                 ("reshard_after_forward", "reshard"), ("precision", "precision"))


@dataclass
class TuneDoc:
    path: Path
    doc: dict  # tune.json as written
    header: dict  # what the dashboard shows of the whole tune (tune_header)
    problems: list[dict]  # per scale and node count, what the dashboard shows (tune_problem)


def tune_files(paths) -> list[Path]:
    """The tune.json of each path that is one, or is a tune directory, or holds tune directories at
    its top level (a tune's sweep records lie deeper: the records' own search finds those)."""
    found = []
    for p in map(Path, paths):
        if p.is_file():
            found += [p] if p.name == TUNE_FILE else []
        elif p.is_dir():
            found += [f for f in [p / TUNE_FILE, *sorted(p.glob(f"*/{TUNE_FILE}"))] if f.is_file()]
    return list({f.resolve(): f for f in found}.values())  # a tune given twice is shown once


def tune_candidate(c: dict) -> dict:
    """One ranked candidate, its figures as numbers (a wrong type raises here, on load, not while
    drawing); measured_ok as echobench.tune.loop.Measured.ok has it."""
    p, m = c["predicted"], c["measured"]
    ok = m is not None and m["status"] == RunState.OK and bool(m["samples_per_s"])
    return {"rank": int(c["rank"]), "run_id": str(c["run_id"]), "family": str(c["family"]),
            "settings": {k: c["settings"].get(k) for k, _ in TUNE_SETTINGS},
            "layout": f"{c['settings'].get('framework')} {c['settings'].get('parallelism')}",
            "predicted": float(p["samples_per_s"]), "low": float(p["samples_per_s_low"]),
            "high": float(p["samples_per_s_high"]), "measured": m is not None, "measured_ok": ok,
            "status": None if m is None else str(m["status"]),
            "samples_per_s": float(m["samples_per_s"]) if ok else None,
            "error": "" if m is None else str(m.get("error") or ""),
            "residual": None if c.get("residual") is None else float(c["residual"]), "round": c.get("round")}


def tune_problem(p: dict) -> dict:
    tau = p["kendall_tau"]
    return {"key": str(p["key"]), "scale": str(p["scale"]), "nodes": p["nodes"], "gpus_per_node": p["gpus_per_node"],
            "winner": p["winner"], "predicted_winner": p["predicted_winner"], "stop": p.get("stop"),
            "tau": {"shipped": tau.get("shipped"), "final": tau.get("final"), "runs": tau.get("runs")},
            "pruned_counts": {str(k): int(n) for k, n in p["pruned_counts"].items()},
            "ties": [(str(t["run_id"]), float(t["p"])) for t in p.get("ties", [])],
            "candidates": sorted(map(tune_candidate, p["candidates"]), key=lambda c: c["rank"])}


def tune_header(doc: dict) -> dict:
    profile = doc["profile"]
    hours = doc.get("device_hours")
    return {"name": str(doc.get("name")), "date": str(doc.get("date")), "tune_file": str(doc.get("tune_file")),
            "executor": str(doc.get("executor")), "device_hours": None if hours is None else float(hours),
            "interrupted": bool(doc.get("interrupted")), "shipped": str(profile["shipped"]),
            "final": str(profile["final"]), "fit_note": profile.get("fit_note")}


def load_tunes(paths) -> tuple[list[TuneDoc], list[str]]:
    """The tune.json files among paths; an unreadable or malformed one is a line of the problems."""
    tunes, problems = [], []
    for path in tune_files(paths):
        try:
            doc = json.loads(path.read_text())
            tunes.append(TuneDoc(path, doc, tune_header(doc), [tune_problem(p) for p in doc["problems"]]))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            problems.append(f"{path}: unreadable tune file ({type(exc).__name__}: {exc})")
    return tunes, problems
