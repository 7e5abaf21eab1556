"""Site files: a cluster's settings written once (docs/reference/matrix.md#site-files).

A site file holds the sections of a matrix that belong to the cluster, not to the comparison:
`executor`, `slurm` (partition, account, setup, fabric, env, container / uenv / venv, rendezvous,
...), `local` and `hardware`. A matrix names it with `site: FILE` (relative to the matrix file) or a
command with `--site FILE` (which takes the place of the matrix's own `site:`); a tune file and
`reproduce --site` take it the same way. The matrix's own values win (merge_site):

    executor                   the matrix's, else the site's
    slurm / local / hardware   key by key: a key the matrix sets replaces the site's, whole (a list
                               such as setup, a mapping such as container or rendezvous); a key
                               the matrix leaves out or sets to null keeps the site's
    slurm.env                  variable by variable: the matrix's variables are added to the
                               site's, and one both set takes the matrix's value
    slurm's interpreter        venv, python, container and uenv are one choice: a matrix that
                               sets any of them replaces all of the site's

Every setting's origin (the site file, the matrix, else a default) is kept for `plan` to say.
"""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import ValidationError

from echobench.records.yamltext import read_yaml
from echobench.sweep.cluster import (INTERPRETER_KEYS, ExecutorName, HardwareSettings, LocalSettings, MatrixError,
                                     SlurmSettings, Strict, UniqueKeyLoader, format_pydantic)

SECTIONS = ("slurm", "local", "hardware")  # a site's sections besides `executor`, merged key by key
MERGED_BY_KEY = ("env",)  # slurm's mappings merged key by key; every other key is replaced whole


class SiteFile(Strict):
    """The keys a site file may hold: those of a matrix that belong to the cluster."""
    executor: ExecutorName | None = None
    slurm: SlurmSettings = SlurmSettings()
    local: LocalSettings = LocalSettings()
    hardware: HardwareSettings = HardwareSettings()


def read_site(path: Path) -> dict:
    """The site file's mapping, checked as a matrix's sections are (SiteFile: an unknown key is one
    line naming it and the nearest valid key); MatrixError with one line otherwise."""
    data = read_yaml(path, "site file", MatrixError, missing="no site file there (a matrix's site: is read from the "
                     "matrix's folder)", loader=UniqueKeyLoader)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise MatrixError(f"{path}: a site file is a mapping with executor, slurm, local, hardware")
    try:
        SiteFile.model_validate(data)
    except ValidationError as exc:
        raise MatrixError(format_pydantic(path, exc, SiteFile)) from None
    return data


def site_path(matrix_path: Path, data: dict, flag: Path | None) -> Path | None:
    """The site file a matrix (or tune file) takes: --site FILE as given, else its `site:` key read from
    the file's own folder; None for neither."""
    if flag is not None:
        return Path(flag)
    named = data.get("site")
    if named is None:
        return None
    if not isinstance(named, str) or not named.strip():
        raise MatrixError(f"{matrix_path}: site: the path of a site file (relative to this file), e.g. "
                          f"site: ../sites/my-cluster.yaml")
    # normpath: plan names it as sites/x.yaml, not matrices/../sites/x.yaml
    return Path(os.path.normpath(Path(named) if Path(named).is_absolute() else matrix_path.parent / named))


def merge_site(site: dict, data: dict, site_label: str, data_label: str = "matrix") -> tuple[dict, dict[str, str]]:
    """(the matrix's mapping `data` over the site's, as the module says; where each setting came from:
    "slurm.partition" -> site_label or data_label, "slurm.env.NAME" for env's variables). Keys
    neither sets are left out of the origins: they take their defaults."""
    merged = {k: v for k, v in data.items() if k != "site"}
    origins: dict[str, str] = {}
    if "executor" in data:
        origins["executor"] = data_label
    elif "executor" in site:
        merged["executor"], origins["executor"] = site["executor"], site_label
    for section in SECTIONS:
        theirs = data.get(section)
        if section in data and not isinstance(theirs, dict):
            continue  # not a mapping: the matrix's validation names it
        out = _merge_section(section, site.get(section) or {}, theirs or {}, (site_label, data_label), origins)
        if out or section in data:
            merged[section] = out
    return merged, origins


def _merge_section(section: str, ours: dict, theirs: dict, labels: tuple[str, str], origins: dict) -> dict:
    site_label, data_label = labels
    theirs = {k: v for k, v in theirs.items() if v is not None}  # null: not set here
    if section == "slurm" and any(k in theirs for k in INTERPRETER_KEYS):
        ours = {k: v for k, v in ours.items() if k not in INTERPRETER_KEYS}
    out = dict(ours)
    origins.update({f"{section}.{key}": site_label for key in ours})
    for key, value in theirs.items():
        both = key in MERGED_BY_KEY and isinstance(value, dict) and isinstance(ours.get(key), dict)
        out[key] = {**ours[key], **value} if both else value
        origins[f"{section}.{key}"] = f"{site_label} + {data_label}" if both else data_label
    for key in MERGED_BY_KEY:
        if isinstance(out.get(key), dict):
            own = theirs.get(key) if isinstance(theirs.get(key), dict) else {}
            origins.update({f"{section}.{key}.{k}": data_label if k in own else site_label for k in out[key]})
    return out


def settings_origins(spec, origins: dict[str, str]) -> list[tuple[str, str, str]]:
    """(setting, value, origin) for every setting of the matrix's executor, slurm, local and hardware
    sections: what `plan` shows. A setting neither file sets says "default"."""
    rows = [("executor", str(spec.executor), origins.get("executor", "default"))]
    for section in SECTIONS:
        model = getattr(spec, section)
        for key in type(model).model_fields:
            value = getattr(model, key)
            if key in MERGED_BY_KEY and value:
                rows += [(f"{section}.{key}.{k}", str(v), origins.get(f"{section}.{key}.{k}", "default"))
                         for k, v in value.items()]
                continue
            shown = value.model_dump(exclude_defaults=True) if hasattr(value, "model_dump") else value
            rows.append((f"{section}.{key}", str(shown), origins.get(f"{section}.{key}", "default")))
    return rows


def cluster_sections(path: Path) -> dict:
    """The slurm, local and hardware sections a file gives: a site file's, or a matrix file's own over
    its site file (its `site:` key), as the matrix would run with them; MatrixError with one line."""
    data = read_yaml(path, "site file", MatrixError)
    if isinstance(data, dict) and "name" in data:  # a matrix (or tune) file: its sections over its site
        site_file = site_path(path, data, None)
        data, _ = merge_site(read_site(site_file) if site_file else {}, data, f"site {site_file}")
        return {k: data[k] for k in SECTIONS if k in data}
    return {k: v for k, v in read_site(path).items() if k in SECTIONS}
