"""A device's memory in GiB, for the fit check of a run's memory estimate (echobench.predict.memory,
predict.cards.memory): the datasheet table by device name, a matrix's hardware.memory_gib over it, and
the size a device's name gives (device_capacity_gib)."""

from __future__ import annotations

import re

# Usable device memory in GiB, by device name (first match wins; specific names first).
DEVICE_MEMORY_GIB: list[tuple[str, float]] = [
    ("GH200 144G", 141.0),  # the 144 GB HBM3e variant (hardware.device: GH200 144G; torch sees 141 GiB)
    ("GH200", 95.0),  # the 96 GB HBM3 variant (its name says 120GB: the LPDDR5X beside it)
    ("GB200", 184.0),
    ("B200", 179.0),
    ("H200", 139.8),
    ("H100 NVL", 93.0),
    ("H100", 79.6),
    ("H800", 79.6),
    ("A100", 79.2),  # 80 GB; the 40 GB part: set hardware.memory_gib
    ("L40S", 44.4),
    ("MI300X", 191.5),
]


def device_memory_gib(memory_gib: float | None = None, device: str | None = None) -> float | None:
    """The device capacity for the fit check: the matrix's figure, else the table, else unknown."""
    if memory_gib is not None:
        return memory_gib
    if device:
        for pattern, gib in DEVICE_MEMORY_GIB:
            if pattern.lower() in device.lower():
                return gib
        raise ValueError(f"no memory size known for device {device!r}: set hardware.memory_gib in the matrix "
                         f"(known: {', '.join(p for p, _ in DEVICE_MEMORY_GIB)})")
    return None


# Devices whose name's size is not their HBM's: torch names the 96 GB GH200 "NVIDIA GH200 120GB".
NAME_NOT_HBM = ("GH200",)
USABLE = 0.995  # the share of its nominal size a part reports usable: 79.6 GiB of an 80 GB H100


def device_capacity_gib(device: str) -> float | None:
    """A device's memory in GiB: the size its name gives ("A100-SXM4-40GB", "H100 96GB") at USABLE,
    the table's figure (device_memory_gib) where that is the same part (within 5%) or the name gives
    none (NAME_NOT_HBM: never); None where neither knows it."""
    try:
        table = device_memory_gib(device=device)
    except ValueError:
        table = None
    named = re.search(r"(\d+)\s*GB", device)
    if named is None or any(n.lower() in device.lower() for n in NAME_NOT_HBM):
        return table
    size = int(named.group(1)) * USABLE
    return table if table is not None and abs(size / table - 1) < 0.05 else size
