"""The interval around a prediction: how far the model's predictions landed from published runs it
was not fitted to (crossval.py's leave-one-source-out log-residuals, their RESIDUAL_QUANTILES,
committed in validation/fit.json). Every prediction of predict, of a model card and of tune carries
it, beside the calibration's own spread; it is never zero width."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

from echobench.hardware.devicerates import FIT_FILE

RESIDUAL_QUANTILES = (0.1, 0.9)  # the interval: the 10th to 90th percentile of the LOSO log-residuals
UNFITTED = (-0.15, 0.15)  # where no fit is committed (an installed echobench without validation/): assumed


def committed_quantiles(path: Path = FIT_FILE) -> tuple[float, float]:
    """The committed fit's residual quantiles (UNFITTED where there is none), at least 1% each side."""
    if not path.is_file():
        lo, hi = UNFITTED
    else:
        lo, hi = json.loads(path.read_text())["residual_quantiles"]
    return min(lo, -0.01), max(hi, 0.01)


def interval(step: float, quantiles: Sequence[float] | None = None) -> tuple[float, float]:
    """The range the true step lies in as often as the LOSO residuals say (log(predicted /
    published) between the quantiles): step / exp(q_high) .. step / exp(q_low)."""
    lo, hi = committed_quantiles() if quantiles is None else quantiles
    return step / math.exp(hi), step / math.exp(lo)
