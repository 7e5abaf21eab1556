"""`echobench plan`: what a matrix's runs will take before any runs. Time limits, the peak each
run's MFU will use as far as the plan can tell, GPU-hour estimates and limits, the settings that
tell the runs apart, and what `plan` prints of them all (plan_summary, plan_report)."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

from rich.table import Table
from rich.text import Text

from echobench.records.console import esc, fmt
from echobench.sweep.estimate import estimated_seconds, planned_peak, startup_parts, time_limit, time_limit_s
from echobench.sweep.executors import comm_size, make_executor
from echobench.sweep.matrix import Matrix, Plan, PlannedRun
from echobench.hardware.devicememory import device_memory_gib
from echobench.predict.memory import on_gpu
from echobench.train.nodecheck import ECHO_IMPORTS, RUN_PATH
from echobench.predict import Prediction, predict_runs
from echobench.sweep.preflight import preflight_spec
from echobench.sweep.site import settings_origins


def default_out(matrix: Matrix) -> Path:
    return Path("runs") / matrix.name


def peak_note(runs: list[PlannedRun], matrix: Matrix, executor: str) -> str | None:
    """Which runs have no peak in the plan, and where theirs will come from."""
    missing = [r.id for r in runs if planned_peak(r, matrix)[0] is None]
    if not missing:
        return None
    which = f"all {len(runs)} runs" if len(missing) == len(runs) else f"{len(missing)} of {len(runs)} runs ({', '.join(missing)})"
    where = "on a compute node, in a job the runs wait for" if executor == "slurm" else "on this machine"
    return (f"no peak known for {which}: each takes its node's datasheet peak when the device is in the table, "
            f"else the GEMM rate the sweep calibrates once {where} (SWEEP/cache); "
            f"set hardware.peak_tflops or hardware.device to fix it in the matrix")


def comm_note(runs: list[PlannedRun], matrix: Matrix, executor: str) -> str | None:
    """hardware.calibrate_comm: that the sweep measures a hardware profile first, where and how big."""
    if not matrix.spec.hardware.calibrate_comm or not runs:
        return None
    nodes, nproc = comm_size(runs)
    where = (f"in a job on {nodes} node(s) x {nproc} processes that the runs wait for" if executor == "slurm"
             else f"on this machine, {nproc} process(es)")
    return (f"calibrate_comm: a hardware profile is measured once before the runs ({where}) into "
            f"SWEEP/profile.yaml, which `echobench validate measured SWEEP` prices them with")


def plan_rows(plan: Plan, executor: str, profiles: list | None = None) -> list[dict]:
    """One row per run (`plan --json`): settings, the global batch and the accumulation that makes
    it, memory estimate, whether it fits, the planned peak, GPU-hours estimated (None without a peak) and at most (its time limit); with hardware
    profiles, the predicted step time and MFU (echobench.predict; None without a profile or where
    the model cannot price the run)."""
    predicted = {}
    if profiles:
        predicted = {run.id: p for run, p in zip(plan.runs, predict_runs([r.cfg for r in plan.runs], profiles))
                     if isinstance(p, Prediction)}
    rows = []
    for run in plan.runs:
        peak, peak_source = planned_peak(run, plan.matrix)
        pred = predicted.get(run.id)
        step_s = pred.step_time_s if pred else None
        est, gpus = estimated_seconds(run, plan.matrix, peak, step_s), run.cfg.world_size
        # the range over the prediction's interval (the model's cross-validated error): faster .. slower
        est_range = None if pred is None else [estimated_seconds(run, plan.matrix, peak, t) / 3600 * gpus
                                               for t in (pred.step_time_low_s, pred.step_time_high_s)]
        rows.append({"run_id": run.id, "settings": run.settings, "global_batch": run.cfg.global_batch,
                     "grad_accum": run.cfg.grad_accum, "memory_gib": run.memory.as_gib(), "fits": run.fits,
                     "peak_tflops": peak, "peak_source": peak_source,
                     "gpu_hours_estimate": None if est is None else est / 3600 * gpus,
                     "gpu_hours_estimate_range": est_range,
                     # what the estimate's steps are priced at: the run's prediction, else the assumed MFU
                     "gpu_hours_basis": None if est is None else "predicted" if step_s is not None else "assumed_mfu",
                     "time_limit": time_limit(plan.matrix, executor, run),
                     "gpu_hours_limit": time_limit_s(plan.matrix, executor, run) / 3600 * gpus,
                     "predicted_step_time_s": step_s,
                     "predicted_step_time_range_s": None if pred is None else [pred.step_time_low_s,
                                                                               pred.step_time_high_s],
                     "predicted_mfu": pred.mfu if pred else None,
                     # MFU goes as 1 / step time: the slow end of the interval is the low MFU
                     "predicted_mfu_range": None if pred is None else [pred.mfu * step_s / pred.step_time_high_s,
                                                                       pred.mfu * step_s / pred.step_time_low_s],
                     "predicted_profile": pred.profile if pred else None})
    return rows


def render_job_script(run: PlannedRun, rd: Path, matrix: Matrix, executor: str, log: Path | None = None) -> str:
    """`plan --script`: the exact job.sh the sweep would write into `rd`. `log` (SLURM): its output
    elsewhere than RUN_DIR/logs, for a script to submit by hand (`plan --write-scripts`)."""
    return make_executor(executor, matrix).job_script(run, rd, matrix, time_limit(matrix, executor, run), log)


def preflight_note(runs: list[PlannedRun], matrix: Matrix, executor: str) -> str | None:
    """What the SLURM sweep's preflight job checks before any run (echobench.sweep.preflight)."""
    if executor != "slurm" or not runs:
        return None
    spec = preflight_spec(matrix, runs, executor)
    backends = set(spec["imports"]) - {*RUN_PATH, *ECHO_IMPORTS}
    what = ["imports of the run path" + (" and backends" if backends else ""),
            f"{spec['nproc']} GPU(s) per node" if spec["expect_gpus"] else "CPUs per task",
            "an all-reduce across the nodes" + (f" and NCCL's network against fabric {spec['fabric']}"
                                                if spec["expect_gpus"] and spec["nodes"] > 1 else "")]
    what += ["numactl"] * bool(spec["numa_binding"]) + ["a tiny compile"] * spec["compile"]
    return (f"preflight: before any run, one job on {spec['nodes']} node(s) x {spec['nproc']} process(es) in the "
            f"runs' environment checks {', '.join(what)} (`echobench preflight MATRIX` runs it alone)")


def te_note(runs: list[PlannedRun], matrix: Matrix) -> str | None:
    """megatron runs with te: auto take TransformerEngine's kernels only where it imports on the nodes;
    on aarch64 (GH200, GB200) scripts/setup.sh installs none."""
    auto = [r for r in runs if r.cfg.framework == "megatron" and r.cfg.te == "auto"]
    if not auto:
        return None
    grace = matrix.spec.hardware.device and re.search(r"\bG[HB]200\b", matrix.spec.hardware.device, re.IGNORECASE)
    return (f"te: auto: {len(auto)} megatron run(s) use TransformerEngine where it imports on the nodes, else "
            f"megatron-core's local layers (the record's te says which; preflight with te: on requires it)"
            + ("; on GH200 (aarch64) scripts/setup.sh installs no TransformerEngine: they would run on local layers "
               "(docs/guides/route-1-gh200-infiniband.md: TransformerEngine on GH200)" if grace else ""))


def varying_keys(plan: Plan) -> list[str]:
    keys = list(plan.matrix.axes)
    for inc in [*plan.matrix.configs, *plan.matrix.include]:
        keys += [k for k in inc if k not in keys]
    return keys


def settings_label(plan: Plan, settings: dict) -> str:
    """A skipped combination by the settings that tell the matrix's runs apart."""
    return " ".join(f"{k}={settings[k]}" for k in varying_keys(plan) if k in settings)


def plan_summary(plan: Plan, executor: str, profiles: list) -> dict:
    """`plan --json`: the matrix's runs (plan_rows), the device memory they are held against, the
    notes (peak, calibrate_comm, preflight, te) and what the expansion skipped, excluded or merged."""
    hw = plan.matrix.spec.hardware
    return {"name": plan.matrix.name, "executor": executor,
            "device_memory_gib": device_memory_gib(hw.memory_gib, hw.device),
            "runs": plan_rows(plan, executor, profiles), "no_peak": peak_note(plan.runs, plan.matrix, executor),
            "calibrate_comm": comm_note(plan.runs, plan.matrix, executor),
            "preflight": preflight_note(plan.runs, plan.matrix, executor), "te": te_note(plan.runs, plan.matrix),
            "skipped": [{"settings": s.settings, "reason": s.reason} for s in plan.skipped],
            "excluded": plan.excluded, "duplicates": plan.duplicates,
            "site": None if plan.matrix.site is None else str(plan.matrix.site),
            "settings": [{"setting": k, "value": v, "from": origin} for k, v, origin in settings_rows(plan.matrix, executor)]}


def settings_rows(matrix: Matrix, executor: str) -> list[tuple[str, str, str]]:
    """(setting, value, where it came from: the site file, the matrix, a default) for the executor's
    settings and hardware's: slurm's on the slurm executor, local's on the local one."""
    keep = ("executor", "hardware.", "slurm." if executor == "slurm" else "local.")
    return [row for row in settings_origins(matrix.spec, matrix.origins) if row[0].startswith(keep)]


def plan_report(plan: Plan, executor: str, profiles: list) -> list:
    """What `echobench plan` prints, part by part: the runs' table (with profiles, the predicted step
    time and MFU), the skipped combinations, the totals and GPU-hours, then the notes. A str part is
    rich markup, highlighted as console.print does; a Text one is not highlighted."""
    summary, matrix, runs = plan_summary(plan, executor, profiles), plan.matrix, plan.runs
    rows, capacity, hw = summary["runs"], summary["device_memory_gib"], matrix.spec.hardware
    rule = matrix.spec.slurm.time_from_estimate if executor == "slurm" else None
    limits = (f"time limits {rule.factor:g} x the estimate, {rule.floor} .. {matrix.spec.slurm.time}" if rule else
              f"time limit {time_limit_s(matrix, executor) / 3600:.2f} h per run")
    table = Table(title=f"{matrix.name}: {len(runs)} runs ({executor}; {limits}; "
                        f"device memory {fmt(capacity, '.1f')} GiB)")
    table.add_column("run id", no_wrap=True)
    for col in ("tp x dp", "mb x accum / global", "mem GiB", "fits", "limit", "GPU-h est", "GPU-h limit"):
        table.add_column(col, justify="right")
    if profiles:  # the predicted step time and MFU (echobench predict)
        table.add_column("pred s / MFU (range)", justify="right", no_wrap=True)
    for run, row in zip(runs, rows):
        c, est_h = run.cfg, row["gpu_hours_estimate"]
        predicted = [] if not profiles else ["-" if row["predicted_mfu"] is None else
                                             f"{row['predicted_step_time_s']:.3g} / {row['predicted_mfu']:.0%} "
                                             "({:.0f}-{:.0f}%)".format(*(100 * m for m in row["predicted_mfu_range"]))]
        table.add_row(run.id, f"{c.tp} x {c.dp}", f"{c.micro_batch} x {c.grad_accum} / {c.global_batch}",
                      fmt(run.memory.total_gib, ".1f"),
                      {True: "yes", False: "[red]NO[/]", None: "?"}[run.fits], row["time_limit"],
                      "-" if est_h is None else f"{est_h:.2f}",
                      f"{row['gpu_hours_limit']:.2f}", *predicted)
    parts: list = [table]
    if profiles:
        parts.append(Text.from_markup(f"predicted (echobench predict): {esc(', '.join(p.name for p in profiles))}"
                                      + ("" if all(p.measured for p in profiles)
                                         else ", a profile not measured here (datasheets)")))
    if plan.skipped:
        skipped = Table(title=f"skipped: {len(plan.skipped)}")
        skipped.add_column("settings")
        skipped.add_column("reason")
        for s in plan.skipped:
            skipped.add_row(esc(settings_label(plan, s.settings)), esc(s.reason))
        parts.append(skipped)
    too_big = [r for r in runs if r.fits is False]
    parts.append(f"{len(runs)} runs, {len(plan.skipped)} skipped, {plan.excluded} excluded"
                 + (f", {plan.duplicates} duplicates" if plan.duplicates else "")
                 + (f"; {len(too_big)} would not fit in {fmt(capacity, '.1f')} GiB (sweep skips them unless --force)"
                    if too_big else ""))
    if runs:
        est_total = sum(r["gpu_hours_estimate"] or 0 for r in rows)
        basis = Counter(r["gpu_hours_basis"] for r in rows if r["gpu_hours_basis"])
        how = ", ".join(([f"{basis['predicted']} run(s) at their predicted step time"] if basis["predicted"] else [])
                        + ([f"{basis['assumed_mfu']} at an assumed {hw.assumed_mfu:.0%} MFU (hardware.assumed_mfu)"]
                           if basis["assumed_mfu"] else []))
        ranged = [r["gpu_hours_estimate_range"] or [r["gpu_hours_estimate"] or 0] * 2 for r in rows]
        spread = (f", {sum(lo for lo, _ in ranged):.2f}-{sum(hi for _, hi in ranged):.2f} over the model's "
                  "cross-validated error" if basis["predicted"] else "")
        parts.append(f"GPU-hours: {sum(r['gpu_hours_limit'] for r in rows):.2f} at most (time limits), "
                     + (f"~{est_total:.2f} estimated ({how}{spread})" if est_total else "no estimate"))
    if any(not on_gpu(r.cfg) for r in runs):
        parts.append("mem GiB of a run on the CPU: its tensors only; its process's resident baseline (the interpreter, "
                     "torch and the libraries a rank imports) is measured by the run once its model is built, and the "
                     "report holds the two together against the measured peak")
    if summary["no_peak"]:
        parts.append(Text.from_markup(f"[yellow]{esc(summary['no_peak'])}[/]"))
    if summary["calibrate_comm"]:
        parts.append(Text.from_markup(esc(summary["calibrate_comm"])))
    if rule:
        allowed = startup_parts(matrix, any(r.cfg.may_compile() for r in runs))
        allowed_text = ", ".join(f"{k} {v} s" for k, v in allowed.items())
        parts.append(Text.from_markup(f"estimates allow for the job's start: {esc(allowed_text)} "
                                      "(echobench/sweep/estimate.py)"))
    parts += [Text.from_markup(esc(n)) for n in (summary["preflight"], summary["te"]) if n]
    parts.append(settings_table(summary))
    return parts


def settings_table(summary: dict) -> Table:
    """The cluster settings the files set, each with the file it came from; the others by name, at
    their defaults (`plan --json` has every value)."""
    given = [row for row in summary["settings"] if row["from"] != "default"]
    defaults = [row["setting"] for row in summary["settings"] if row["from"] == "default"]
    table = Table(title="settings: " + (f"site {esc(summary['site'])} under the matrix's own" if summary["site"]
                                        else "the matrix's (no site file)"),
                  caption=f"at their defaults: {esc(', '.join(defaults))}" if defaults else None)
    for col in ("setting", "value", "from"):
        table.add_column(col)
    for row in given:
        table.add_row(esc(row["setting"]), esc(row["value"]), esc(row["from"]))
    return table
