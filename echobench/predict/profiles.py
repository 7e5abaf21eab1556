"""Which hardware profile a run takes: profiles by name or file (load_profiles), by device name
(profile_for_device: a sweep's own, a shipped one, this machine's calibrated one), this machine's
device (machine_device), the best of several for a run (choose_profile), and the lines that say
which profiles were used (profile_lines) or why none could be (no_profile_message, other_device_lines)."""

from __future__ import annotations

import math
from collections.abc import Sequence

from echobench.records.config import RunConfig
from echobench.records.paths import measured_profile
from echobench.records.results import cpu_device_name
from echobench.hardware.profile import (
    HardwareProfile,
    ProfileError,
    calibrated_profile_path,
    find_profile,
    load_profile,
    shipped_profiles,
)
from echobench.hardware.devicerates import _log_distance
from echobench.records.peaks import PEAK_PATTERNS
from echobench.predict.errors import PredictError
from echobench.predict.pricing import Rates


def profile_processes(profile: HardwareProfile) -> int:
    """How many processes a profile was measured on: its largest collective group (1 without links)."""
    return max((pt.group_size for ops in profile.links.values() for fit in ops.values() for pt in fit.points),
               default=1 if not profile.links else 0)


def choose_profile(cfg: RunConfig, profiles: Sequence[HardwareProfile]) -> HardwareProfile:
    """Of several profiles, the one measured most like the run: with the link classes its
    collectives need (inter across nodes), the same processes per node and in all (on a CPU they
    decide the threads and cores each process has), then the GEMM point nearest the run's biggest
    GEMM (the DiT's q projection at its rows), then the first given."""
    rows, width = cfg.micro_batch * cfg.audio_frames, cfg.model_config().width
    needs = ({"inter"} if cfg.nodes > 1 else set()) | ({"intra"} if cfg.gpus_per_node > 1 else set())

    def key(item):
        i, p = item
        lacks = len(needs - set(p.links))
        per_node = p.gpus_per_node is not None and p.gpus_per_node != cfg.gpus_per_node
        world = profile_processes(p) not in (0, cfg.world_size)  # 0: published fits without points
        near = min((_log_distance((g.m, g.n, g.k), (rows, width, width)) for g in p.gemm), default=math.inf)
        return (lacks, per_node, world, round(near, 6), i)

    return min(enumerate(profiles), key=key)[1]


def load_profiles(names: Sequence[str]) -> list[HardwareProfile]:
    """Profiles from shipped names or files (hwprofile.find_profile); PredictError on a bad one."""
    try:
        return [load_profile(find_profile(n)) for n in names]
    except ProfileError as exc:
        raise PredictError(str(exc)) from None


def profile_for_device(device: str | None, near: str | None = None,
                       fabric: str | None = None) -> HardwareProfile | None:
    """The profile to use for a device name without --profile: the one the sweep that `near` (a
    record's file) lies in measured for that device (hardware.calibrate_comm: SWEEP/profile.yaml,
    named after its file); else the shipped profile of the same datasheet row (peaks.PEAK_TFLOPS
    names: a whole word of both names; of several, the device's own name first, then one at its
    datasheet's power limit (no `clock`), and the first of those whose inter link is the matrix's
    `fabric`, slurm.fabric: gh200-quad-ib for infiniband, gh200-quad-slingshot for slingshot); else,
    for this machine's own device, the profile `calibrate --comm` left in echobench's cache; None
    without any. PredictError when the sweep's cannot be read."""
    if not device:
        return None
    if near is not None and (path := measured_profile(near)) is not None:
        try:
            profile = load_profile(path)
        except ProfileError as exc:
            raise PredictError(str(exc)) from None
        if profile.device == device:  # another device (a sweep over mixed nodes): the lookups below
            return profile.model_copy(update={"name": f"{profile.name} ({path})"})
    row = next((pattern for pattern, _, _ in PEAK_PATTERNS if pattern.search(device)), None)
    same = [p for p in map(load_profile, shipped_profiles().values()) if row is not None and row.search(p.device)]
    # the device's own name first, then a device at its datasheet's power (no `clock` term: not a
    # 500 W H100 standing in for the 700 W SXM)
    same.sort(key=lambda p: (p.device != device, p.clock is not None))
    if same:
        return next((p for p in same if fabric and fabric.lower() in p.link_notes.get("inter", "").lower()), same[0])
    for dtype in ("float32", "bfloat16"):
        path = calibrated_profile_path(device, dtype)
        if path.is_file():
            return load_profile(path)
    return None


def machine_device(cfgs: Sequence[RunConfig]) -> str:
    """This machine's device name, for runs whose matrix names no hardware.device: its GPU where
    the runs may use one (device cuda or auto), else its CPU; profile_for_device then finds the
    profile `calibrate --comm` measured here."""
    if all(c.device == "cpu" for c in cfgs):
        return cpu_device_name()  # without torch's import: seconds, for a CPU matrix
    import torch  # lazy: seconds to import, and only this function of the module needs it

    from echobench.hardware.device import device_name  # imports torch

    return device_name(torch.device("cuda" if torch.cuda.is_available() else "cpu"))


def other_device_lines(records, profiles: Sequence[HardwareProfile]) -> list[str]:
    """For `validate measured ... --profile P`: one line per device the records ran on that none of
    the profiles given is of (their errors then say how two machines differ, not how good the
    model is)."""
    have = {p.device for p in profiles}
    counts: dict[str, int] = {}
    for r in records:
        device = r.env.device_name
        if device and device not in have:
            counts[device] = counts.get(device, 0) + 1
    return [f"{n} run(s) measured on {device!r}, predicted from a profile of another device "
            f"({', '.join(sorted(have))}): give that device's profile to judge the model"
            for device, n in counts.items()]


def no_profile_message(what: str) -> str:
    """Why `what` (a run, a matrix) has no profile, and the two ways to give it one."""
    return (f"no hardware profile for {what}: pass --profile NAME|FILE (shipped: {', '.join(shipped_profiles())}), "
            f"or measure this machine's with `echobench calibrate --comm`")


def profile_lines(profiles: Sequence[HardwareProfile]) -> list[str]:
    """One line per profile used: what it is and where its numbers come from."""
    lines = []
    for p in profiles:
        kind = "measured" if p.measured else "NOT MEASURED: datasheets and published figures"
        factor = Rates(p).compute_factor
        lines.append(f"profile {p.name}: {p.device}, {p.dtype}, {kind}, {p.date}"
                     + (f", {p.gpus_per_node} per node" if p.gpus_per_node else "")
                     + (f", in-situ factor {factor:.3g}" if factor != 1.0 else ""))
    return lines


def profiles_for_records(records: Sequence) -> tuple[dict[str, list[HardwareProfile]], list[str]]:
    """`validate measured` without --profile: run id -> [its profile], profile_for_device of the
    record's device and file (its sweep's own profile first), and a line for each record without
    one (left out). None with one is a PredictError."""
    found, missing, looked = {}, [], {}
    for record in records:
        near = str(record.path) if record.path else None
        key = (record.env.device_name, near and measured_profile(near))  # one lookup (and object) per sweep
        if key not in looked:
            looked[key] = profile_for_device(record.env.device_name, near)
        if looked[key] is None:
            missing.append(record)
        else:
            found[record.run_id] = [looked[key]]
    if not found:
        raise PredictError(no_profile_message(f"device {records[0].env.device_name!r}"))
    return found, [f"{record.run_id}: {no_profile_message(f'device {record.env.device_name!r}')}"
                   for record in missing]
