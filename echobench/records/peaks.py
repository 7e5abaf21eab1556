"""The datasheet peak table and what a peak's source says about it. Plain data, no torch: the
plan, the SLURM executor and the record read it without importing a device stack."""

from __future__ import annotations

import re

# Dense (no sparsity) tensor-core peaks per device in TFLOP/s: (name, bf16, fp8 or None).
# NVIDIA's datasheets print the 2:4-sparsity figure with a footnote; dense is half of it.
# A name matches as a whole word of the device name ("H200" is not in "GH200", "L4" not in
# "L40"); the first match wins, so more specific names come first ("H200 NVL" before "H200").
PEAK_TFLOPS: list[tuple[str, float, float | None]] = [
    ("GH200", 990.0, 1979.0),  # GH200 datasheet: bf16 1,979 / fp8 3,958 sparse; 990 is what the published GH200 tables use
    ("GB200", 2500.0, 5000.0),  # GB200 NVL72 datasheet: bf16 360 / fp8 720 PFLOP/s sparse for 72 GPUs
    ("B200", 2250.0, 4500.0),  # HGX B200 datasheet: bf16 36 / fp8 72 PFLOP/s sparse for 8 GPUs
    ("H200 NVL", 835.5, 1670.5),  # H200 NVL datasheet: bf16 1,671 / fp8 3,341 sparse
    ("H200", 989.5, 1979.0),  # H200 SXM datasheet: bf16 1,979 / fp8 3,958 sparse
    ("H100 NVL", 835.5, 1670.5),  # H100 NVL datasheet: bf16 1,671 / fp8 3,341 sparse
    ("H100 PCIe", 756.5, 1513.0),  # H100 PCIe datasheet: bf16 1,513 / fp8 3,026 sparse
    ("H100", 989.5, 1979.0),  # H100 SXM datasheet: bf16 1,979 / fp8 3,958 sparse
    ("H800 PCIe", 756.5, 1513.0),  # H800 PCIe datasheet: bf16 1,513 / fp8 3,026 sparse
    ("H800", 989.5, 1979.0),  # H800 SXM datasheet: bf16 1,979 / fp8 3,958 sparse
    ("A100", 312.0, None),  # A100 datasheet: bf16 312 dense (624 sparse); no fp8 tensor cores
    ("A800", 312.0, None),  # A800 datasheet: as A100
    ("L40S", 362.05, 733.0),  # L40S datasheet: bf16 362.05 / fp8 733 dense (733 / 1,466 sparse)
    ("L40", 181.05, 362.05),  # L40 datasheet: bf16 181.05 / fp8 362 dense (362.1 / 724 sparse)
    ("L4", 121.0, 242.5),  # L4 datasheet: bf16 242 / fp8 485 sparse
    ("MI300X", 1307.4, 2614.9),  # AMD Instinct MI300X datasheet: bf16 1,307.4 / fp8 2,614.9 dense
    ("MI300A", 980.6, 1961.2),  # AMD Instinct MI300A datasheet: bf16 980.6 / fp8 1,961.2 dense
]
PEAK_PRECISIONS = ("bf16", "fp8")


def _names(pattern: str) -> re.Pattern:
    return re.compile(rf"(?<![A-Za-z0-9]){re.escape(pattern)}(?![A-Za-z0-9])", re.IGNORECASE)


PEAK_PATTERNS = [(_names(name), name, peaks) for name, *peaks in PEAK_TFLOPS]


def table_peak(name: str, precision: str = "bf16") -> tuple[float, str] | None:
    """(dense peak TFLOP/s, "datasheet:NAME") of the first row whose name is in the device name;
    None when no row matches or the device has no peak for that precision."""
    for pattern, row, peaks in PEAK_PATTERNS:
        if pattern.search(name):
            peak = peaks[PEAK_PRECISIONS.index(precision)]
            return None if peak is None else (peak, f"datasheet:{row}")
    return None


def peak_precision_of(source: str | None) -> str | None:
    """The precision a peak is for, from its peak_source: a flag or the datasheet table give the
    dense bf16 peak; a calibration is for its GEMM's dtype."""
    if not source:
        return None
    if source == "flag" or source.startswith("datasheet:"):
        return "bf16"
    if source.startswith("calibrated:"):
        dtype = source.removeprefix("calibrated:").split()[0]
        return {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(dtype, dtype)
    return None
