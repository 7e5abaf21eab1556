"""`echobench plan`: what a matrix's runs will take before any runs. Time limits, the peak each
run's MFU will use as far as the plan can tell, GPU-hour estimates and limits, and the settings
that tell the runs apart."""

from __future__ import annotations

import re
from pathlib import Path

from echobench.estimate import estimated_seconds, planned_peak, time_limit, time_limit_s
from echobench.executors import comm_size, make_executor
from echobench.matrix import Matrix, Plan, PlannedRun
from echobench.nodecheck import RUN_PATH
from echobench.predict import Prediction, predict_runs
from echobench.preflight import preflight_spec


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
            f"SWEEP/profile.yaml, which `echobench predict --against SWEEP` prices them with")


def plan_rows(plan: Plan, executor: str, profiles: list | None = None) -> list[dict]:
    """One row per run (`plan --json`): settings, memory estimate, whether it fits, the planned
    peak, GPU-hours estimated (None without a peak) and at most (its time limit); with hardware
    profiles, the predicted step time and MFU (echobench.predict; None without a profile or where
    the model cannot price the run)."""
    predicted = {}
    if profiles:
        predicted = {run.id: p for run, p in zip(plan.runs, predict_runs([r.cfg for r in plan.runs], profiles))
                     if isinstance(p, Prediction)}
    rows = []
    for run in plan.runs:
        peak, peak_source = planned_peak(run, plan.matrix)
        est, gpus = estimated_seconds(run, plan.matrix, peak), run.cfg.world_size
        rows.append({"run_id": run.id, "settings": run.settings, "memory_gib": run.memory.as_gib(), "fits": run.fits,
                     "peak_tflops": peak, "peak_source": peak_source,
                     "gpu_hours_estimate": None if est is None else est / 3600 * gpus,
                     "time_limit": time_limit(plan.matrix, executor, run),
                     "gpu_hours_limit": time_limit_s(plan.matrix, executor, run) / 3600 * gpus,
                     "predicted_step_time_s": predicted[run.id].step_time_s if run.id in predicted else None,
                     "predicted_mfu": predicted[run.id].mfu if run.id in predicted else None,
                     "predicted_profile": predicted[run.id].profile if run.id in predicted else None})
    return rows


def render_job_script(run: PlannedRun, rd: Path, matrix: Matrix, executor: str, log: Path | None = None) -> str:
    """`plan --script`: the exact job.sh the sweep would write into `rd`. `log` (SLURM): its output
    elsewhere than RUN_DIR/logs, for a script to submit by hand (`plan --write-scripts`)."""
    return make_executor(executor, matrix).job_script(run, rd, matrix, time_limit(matrix, executor, run), log)


def preflight_note(runs: list[PlannedRun], matrix: Matrix, executor: str) -> str | None:
    """What the SLURM sweep's preflight job checks before any run (echobench.preflight)."""
    if executor != "slurm" or not runs:
        return None
    spec = preflight_spec(matrix, runs, executor)
    what = ["imports of the run path" + (" and backends" if len(spec["imports"]) > len(RUN_PATH) else ""),
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
               "(README: TransformerEngine on GH200)" if grace else ""))


def varying_keys(plan: Plan) -> list[str]:
    keys = list(plan.matrix.axes)
    for inc in plan.matrix.include:
        keys += [k for k in inc if k not in keys]
    return keys


def settings_label(plan: Plan, settings: dict) -> str:
    """A skipped combination by the settings that tell the matrix's runs apart."""
    return " ".join(f"{k}={settings[k]}" for k in varying_keys(plan) if k in settings)
