"""An Echo step's element-wise (memory-bound) bytes, forward and backward, counted: echobench.predict.stepcount's
count of the run's own configuration (width, lengths, micro-batch, precision, AC, attention path),
every memory-bound ATen op's bytes read + written, the optimizer and clipping left out (stepcount's
phase "optimizer"; predict prices them apart), AC's recompute in the backward as counted.

A full-depth count of 800M / 3B / 8B takes minutes, so the configuration is counted at reduced depth:
every stack (DiT blocks, speaker-encoder blocks, text-encoder layers) at 1 layer, then at 2, and each
part's bytes extrapolated linearly in its own stack's layers: part(L) = part(1) + (part(2) - part(1))
x (L - 1). The DiT and speaker blocks are exactly per layer, the text encoder per layer plus its
embedding and final norm, the top level (embeddings, projections, DiT input and output, the loss)
the same at every depth: the extrapolation equals a full count exactly (tests/test_elementwise_count.py
holds it; the top level's difference, zero where counted, would go with the DiT's layers).

Results are cached in memory and on disk (echobench.hardware.device.cache_dir()/elementwise/), keyed by the
fields the count depends on and a hash of the sources that make it (stepcount, the model, this file).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from functools import lru_cache
from pathlib import Path
from unittest import mock

from echobench.records.atomic import write_json_atomic
from echobench.records.config import RunConfig
from echobench.predict.work import ELEMENTWISE, elementwise_bytes, ratios_saved, tp_share

PARTS = ("dit_blocks", "speaker_blocks", "text_encoder", "top")
PHASES = ("forward", "backward")
_ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("predict/stepcount.py", "predict/stepcount_ops.py", "model/config.py", "model/components.py", "model/dit.py",
           "model/echo.py", "model/speaker.py", "model/text_encoder.py", "backends/torchtitan.py",
           "predict/elementwise.py")
# Compiled runs: stepcount's inductor proxy takes 40 .. 90 s per reduced-depth count (800M .. 8B on 2
# CPU cores, measured: its compile of each unit does not shrink with depth), two counts per
# configuration, so a matrix's first predict takes minutes and the tests' many tiny runs would too: opt
# in with ECHOBENCH_COUNT_COMPILED=1; else compiled runs keep work.ELEMENTWISE's assumed ratios.
COMPILED_ENV = "ECHOBENCH_COUNT_COMPILED"
_FAILED: dict[str, Exception] = {}  # count keys whose count failed, and why


@dataclasses.dataclass(frozen=True)
class CountedBytes:
    """The element-wise bytes of one step of one (unsplit) model replica: forward, backward, and the
    reduced-depth tallies they come from: {phase/part: bytes} at 1 and at 2 layers per stack."""

    forward: float
    backward: float
    depth1: dict
    depth2: dict


def count_config(cfg: RunConfig, eb: int) -> RunConfig:
    """The configuration the count takes: the run's fields the step's ops depend on (everything else
    at its default: a single process, synthetic data; precision auto at the dtype of `eb` bytes)."""
    precision = cfg.precision if cfg.precision != "auto" else ("fp32" if eb == 4 else "bf16")
    return RunConfig(scale=cfg.scale, encoder_model=cfg.encoder_model, frozen_encoder=cfg.frozen_encoder,
                     micro_batch=cfg.micro_batch, audio_frames=cfg.audio_frames, text_tokens=cfg.text_tokens,
                     speaker_frames=cfg.speaker_frames, precision=precision, ac=cfg.ac,
                     sdpa_backend=cfg.sdpa_backend, key_masking=cfg.key_masking)


@lru_cache(maxsize=1)
def source_hash() -> str:
    digest = hashlib.sha256()
    for name in SOURCES:
        digest.update(name.encode() + (_ROOT / name).read_bytes())
    return digest.hexdigest()[:16]


def cache_key(cfg: RunConfig, compiled: bool) -> str:
    fields = {k: getattr(cfg, k) for k in ("scale", "encoder_model", "frozen_encoder", "micro_batch", "audio_frames",
                                           "text_tokens", "speaker_frames", "precision", "ac", "sdpa_backend",
                                           "key_masking")}
    return json.dumps({**fields, "compiled": compiled, "sources": source_hash()}, sort_keys=True)


def count_at_depth(cfg: RunConfig, compiled: bool, depth: int) -> dict[str, int]:
    """stepcount's memory-bound bytes by phase/part of one step of `cfg` with every stack at `depth` layers."""
    from echobench.predict import stepcount  # lazy: torch; predict does not import torch at start-up

    m = cfg.model_config()
    reduced = dataclasses.replace(m, layers=depth, speaker_layers=depth,
                                  text_encoder=dataclasses.replace(m.text_encoder, layers=depth))
    with mock.patch.object(RunConfig, "model_config", lambda self: reduced):
        count = stepcount.count_step(cfg, compiled=compiled, prefer_cudnn=cfg.sdpa_backend == "cudnn")
    return {f"{ph}/{pa}": count.total(ph, pa, "memory").bytes for ph in PHASES for pa in PARTS}


def extrapolate(cfg: RunConfig, depth1: dict, depth2: dict) -> tuple[float, float]:
    """Forward and backward bytes at the run's layers from the counts at 1 and 2 layers per stack."""
    m = cfg.model_config()
    layers = {"dit_blocks": m.layers, "speaker_blocks": m.speaker_layers, "text_encoder": m.text_encoder.layers,
              "top": m.layers}
    out = []
    for ph in PHASES:
        out.append(float(sum(depth1[f"{ph}/{pa}"] + (depth2[f"{ph}/{pa}"] - depth1[f"{ph}/{pa}"]) * (layers[pa] - 1)
                             for pa in PARTS)))
    return out[0], out[1]


def _cache_file(key: str) -> Path:
    from echobench.records.paths import cache_dir  # lazy: echobench.hardware.device imports torch

    return cache_dir() / "elementwise" / (hashlib.sha256(key.encode()).hexdigest()[:24] + ".json")


@lru_cache(maxsize=256)
def _counted(key: str) -> tuple[dict, dict]:
    path = _cache_file(key)
    if path.exists():
        saved = json.loads(path.read_text())
        if saved.get("key") == key:
            return saved["depth1"], saved["depth2"]
    fields = json.loads(key)
    compiled = fields.pop("compiled")
    fields.pop("sources")
    cfg = RunConfig(**fields)
    depth1, depth2 = count_at_depth(cfg, compiled, 1), count_at_depth(cfg, compiled, 2)
    write_json_atomic(path, {"key": key, "depth1": depth1, "depth2": depth2})
    return depth1, depth2


def counted_bytes(cfg: RunConfig, eb: int, compiled: bool = False) -> CountedBytes:
    """The counted element-wise bytes of one step of the run's configuration on one unsplit replica
    (cached; counts on a miss, which needs torch)."""
    run = count_config(cfg, eb)
    depth1, depth2 = _counted(cache_key(run, compiled))
    return CountedBytes(*extrapolate(run, depth1, depth2), depth1, depth2)


def count_compiled() -> bool:
    """Whether compiled runs are counted too (COMPILED_ENV)."""
    return os.environ.get(COMPILED_ENV, "") not in ("", "0")


def echo_elementwise(cfg: RunConfig, eb: int) -> tuple[tuple[float, float], str]:
    """One rank's element-wise bytes of an Echo step (forward, backward) and the note saying how they
    were had: counted (counted_bytes, TP's split as work.elementwise_bytes), for a CPU profile as for
    a GPU's (the tiny preset's eager fp32 step at micro-batch 4 counts 0.80 x / 0.95 x the ratios); the
    ratios of work.ELEMENTWISE for compiled runs unless COMPILED_ENV, and where counting fails (a
    failure is remembered: not counted again in this process)."""
    ratios = elementwise_bytes(cfg, eb)
    if cfg.compile and not count_compiled():
        return ratios, (f"element-wise bytes of the compiled blocks: {ELEMENTWISE['compiled'][0]:g} x forward and "
                        f"{ELEMENTWISE['compiled'][1]:g} x backward the bytes autograd saves, ASSUMED: 3B's count at micro-"
                        f"batch 8 (a count of this run's compiled step takes minutes: {COMPILED_ENV}=1 counts it)")
    key = cache_key(count_config(cfg, eb), bool(cfg.compile))
    try:
        if key in _FAILED:
            raise _FAILED[key]
        counted = counted_bytes(cfg, eb, bool(cfg.compile))
    except Exception as exc:  # no torch, fp8 (stepcount does not emulate float8 linears), a failed count
        _FAILED[key] = exc
        return ratios, (f"element-wise bytes at the assumed ratios of the bytes autograd saves (counting the step "
                        f"failed: {type(exc).__name__}: {str(exc)[:120]})")
    share = tp_share(cfg)
    fwd, bwd = counted.forward * share, counted.backward * share
    saved = ratios_saved(cfg, eb)
    how = "inductor's generated kernels" if cfg.compile else "eager ATen ops"
    return (fwd, bwd), (f"element-wise bytes COUNTED (echobench.predict.stepcount, {how}, torchtitan's model, the step at 1 "
                        f"and 2 layers per stack extrapolated per layer): {counted.forward / saved:.3g} x forward "
                        f"and {counted.backward / saved:.3g} x backward the bytes autograd saves"
                        + ("; TP splits them as memory.estimate_memory (assumed)" if cfg.tp > 1 else ""))

