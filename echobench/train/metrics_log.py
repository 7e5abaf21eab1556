"""Optional logging of a run's progress figures to the tools teams already watch (`log_metrics`):
TensorBoard (OUT/tensorboard, event files) or Weights & Biases (a run named by the run id; project
from WANDB_PROJECT, default "echobench"; WANDB_MODE=offline keeps it on disk). Rank 0 logs what its
progress lines print (echobench.train.progress), at their rate, and at the end the record's
figures. The record stays the source of truth: these are for watching a run, not for quoting.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}  # log_metrics -> the package it needs


def metrics_log_problem(kind: str) -> str | None:
    """Why `log_metrics: kind` cannot log here (its package is missing), in one line; else None."""
    package = PACKAGES.get(kind)
    if package is None or importlib.util.find_spec(package) is not None:
        return None
    return (f"log_metrics={kind} needs the {package} package, which is not installed: "
            f"pip install 'echobench[{package}]' (or {package}), or log_metrics none")


class TensorBoardLog:
    def __init__(self, out_dir: Path, run_id: str, settings: dict):
        from torch.utils.tensorboard import SummaryWriter  # lazy: imports tensorboard

        self.writer = SummaryWriter(log_dir=str(out_dir / "tensorboard"))
        self.writer.add_text("settings", "\n".join(f"    {k}: {v}" for k, v in sorted(settings.items())))
        self.writer.add_text("run_id", run_id)

    def log(self, step: int, figures: dict) -> None:
        for name, value in figures.items():
            self.writer.add_scalar(f"progress/{name}", value, step)
        self.writer.flush()  # a crashed run keeps what it logged

    def finish(self, figures: dict) -> None:
        for name, value in figures.items():
            self.writer.add_scalar(f"result/{name}", value, 0)
        self.writer.close()


class WandbLog:
    def __init__(self, out_dir: Path, run_id: str, settings: dict):
        try:  # optional: guarded, so that no image needs it
            import wandb
        except ImportError as exc:
            raise RuntimeError(metrics_log_problem("wandb") or str(exc)) from exc

        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "echobench"), name=run_id, config=settings,
                              dir=str(out_dir))

    def log(self, step: int, figures: dict) -> None:
        self.run.log({f"progress/{k}": v for k, v in figures.items()}, step=step)

    def finish(self, figures: dict) -> None:
        self.run.summary.update({f"result/{k}": v for k, v in figures.items()})
        self.run.finish()


LOGGERS = {"tensorboard": TensorBoardLog, "wandb": WandbLog}


def open_metrics_log(kind: str, out_dir: Path, run_id: str, settings: dict):
    """The logger `log_metrics` names (None for none); a missing package raises its one line."""
    if kind == "none":
        return None
    if problem := metrics_log_problem(kind):
        raise RuntimeError(problem)
    return LOGGERS[kind](out_dir, run_id, settings)


def finish(metrics, figures: dict) -> None:
    """Ends the logger (None: none); a logger that fails says so in one line and fails nothing: the
    run's record is written already."""
    if metrics is None:
        return
    try:
        metrics.finish(figures)
    except Exception as exc:  # noqa: BLE001 - logging must not turn a measured run into a failed one
        print(f"[echobench] log_metrics: the logger did not finish: {type(exc).__name__}: {exc}".splitlines()[0],
              flush=True)


def result_figures(record) -> dict:
    """The record's headline figures, for the logger's end of run (those the record has)."""
    names = {"mfu": record.mfu, "samples_per_s": record.samples_per_s, "step_time_s": record.step_time_s,
             "tflops_per_gpu": record.tflops_per_gpu, "peak_mem_gib": record.peak_mem_gib}
    return {k: float(v) for k, v in names.items() if v is not None}
