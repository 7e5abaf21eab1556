"""What a planned run is expected to take, before it runs: the peak its MFU will use as far as the
plan can tell, its duration at the matrix's assumed MFU, and the time limit its job asks for.

The time limit is a run's include `time_limit` if it has one, else, with
`slurm.time_from_estimate`, the estimate times a factor (at least a floor, at most `slurm.time`),
else the executor's time. The estimate allows for what a job does before its steps: starting,
importing a container image, the setup lines, a cold compile (startup_parts). A limit near what a run needs lets the scheduler backfill the job into
gaps that a week-long request never fits.
"""

from __future__ import annotations

import math

from echobench.model.flops import hardware_flops, model_flops
from echobench.sweep.cluster import parse_time
from echobench.sweep.matrix import Matrix, PlannedRun
from echobench.records.peaks import table_peak
from echobench.records.run_figures import seconds_at_mfu

# What a job spends before its first measured step, beyond the steps themselves (assumed, not measured:
# generous, since a limit that is too short throws the run away).
STARTUP_S = 120  # allocation, the first-node check, Python and torch imports, model build, process group
COMPILE_S = 300  # a cold torch.compile of the block kinds, forward and backward (1-2 min for 3B on 16 cores)
PULL_S = 600  # a container image pulled from a registry onto each node (pyxis, apptainer docker://): GBs
LOCAL_IMAGE_S = 60  # an image already on the cluster: a squashfs or .sif file, an EDF, a uenv
SETUP_LINE_S = 30  # each setup line (module load, activating an environment on a shared filesystem)


def pulls_image(image: str) -> bool:
    """Whether a container image comes from a registry (docker://..., nvcr.io#..., a bare name) rather
    than a file on the cluster."""
    return not image.startswith(("/", "./", "~")) and not image.endswith((".sqsh", ".squashfs", ".sif"))


def startup_parts(matrix: Matrix, compile: bool = False) -> dict[str, int]:
    """The seconds a job of this matrix is allowed before its steps, by what takes them."""
    slurm = matrix.spec.slurm
    parts = {"start-up": STARTUP_S}
    if (c := slurm.container) is not None:
        parts["image"] = PULL_S if c.runtime != "ce" and pulls_image(c.image) else LOCAL_IMAGE_S
    elif slurm.uenv is not None:
        parts["image"] = LOCAL_IMAGE_S
    if slurm.setup:
        parts["setup lines"] = SETUP_LINE_S * len(slurm.setup)
    if compile:
        parts["compile"] = COMPILE_S
    return parts


def planned_peak(run: PlannedRun, matrix: Matrix) -> tuple[float | None, str | None]:
    """The peak TFLOP/s a run will use as far as the plan can tell, and where it comes from: the
    matrix, else the datasheet entry of hardware.device; (None, None) when only the node can tell."""
    if run.cfg.peak_tflops is not None:
        return run.cfg.peak_tflops, "matrix"
    device = matrix.spec.hardware.device
    if device:
        if hit := table_peak(device):
            return hit[0], hit[1]
    return None, None


def estimated_seconds(run: PlannedRun, matrix: Matrix, peak: float | None = None,
                      step_time_s: float | None = None) -> float | None:
    """The start-up allowance (startup_parts) plus all steps: each `step_time_s` long where given (a
    prediction), else at the matrix's assumed MFU of `peak` (default: planned_peak); None without either."""
    cfg, hw = run.cfg, matrix.spec.hardware
    startup, steps = sum(startup_parts(matrix, cfg.may_compile()).values()), cfg.steps + cfg.warmup_steps
    if step_time_s is not None:
        return startup + steps * step_time_s
    peak = planned_peak(run, matrix)[0] if peak is None else peak
    if peak is None:
        return None
    model = cfg.model_config()
    per_sample = hardware_flops(model, model_flops(model, cfg.audio_frames, cfg.text_tokens, cfg.speaker_frames), cfg.ac)
    return startup + seconds_at_mfu(steps * cfg.global_batch * per_sample, cfg.world_size, peak, hw.assumed_mfu)


def format_time(seconds: int) -> str:
    """Seconds as a SLURM time limit, D-HH:MM:SS (whole minutes, rounded up)."""
    minutes = math.ceil(seconds / 60)
    days, minutes = divmod(minutes, 24 * 60)
    text = f"{minutes // 60:02d}:{minutes % 60:02d}:00"
    return f"{days}-{text}" if days else text


def time_limit(matrix: Matrix, executor: str, run: PlannedRun | None = None) -> str:
    """A run's time limit as written in its job (see the module docstring); without a run, the
    executor's time (the most any run asks for)."""
    if run is not None and run.time_limit:
        return run.time_limit
    if executor != "slurm":
        return matrix.spec.local.time
    slurm = matrix.spec.slurm
    rule = slurm.time_from_estimate
    if run is None or rule is None or (est := estimated_seconds(run, matrix)) is None:
        return slurm.time
    limit = max(parse_time(rule.floor), est * rule.factor)
    return slurm.time if limit >= parse_time(slurm.time) else format_time(int(limit))


def time_limit_s(matrix: Matrix, executor: str, run: PlannedRun | None = None) -> int:
    """time_limit in seconds."""
    return parse_time(time_limit(matrix, executor, run))
