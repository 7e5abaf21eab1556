"""The measured training step: free of data-dependent ops (each one a host sync on a GPU),
and timed on one clock with its data wait.

A CPU cannot show a host sync, but it can show the ops that cause one: every op whose result
the host must read (an .item(), a boolean-mask index, nonzero...) makes the host wait for the
GPU when the tensors live there. The step runs here under a TorchDispatchMode that records them.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import one_gloo_rank
from echobench.records.config import RunConfig

# Ops whose output the host must read back, or whose shape depends on tensor values.
HOST_READ_OPS = {"nonzero", "_local_scalar_dense", "masked_select", "equal", "is_nonzero", "unique_dim",
                 "_unique", "_unique2", "unique_consecutive"}
BOOL_INDEX_OPS = {"index", "index_put", "index_put_", "_index_put_impl_"}
SHAPES = dict(scale="tiny", micro_batch=2, audio_frames=24, text_tokens=12, speaker_frames=20,
              precision="fp32", device="cpu")


class DataDependentOps(TorchDispatchMode):
    """Records every op that would make the host wait for a GPU."""

    def __init__(self):
        super().__init__()
        self.found: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        bool_index = name in BOOL_INDEX_OPS and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or ()))
        if name in HOST_READ_OPS or bool_index:
            self.found.append(str(func) + (" (boolean index)" if bool_index else ""))
        return func(*args, **(kwargs or {}))


def measured_step_ops(cfg: RunConfig, steps: int = 2) -> list[str]:
    """Builds the run's training setup and returns the data-dependent ops of `steps` training
    steps: the draws and the step exactly as bench.run_loop runs them (after the batch arrives)."""
    from echobench.backends import build_training
    from echobench.backends.master import MasterWeights
    from echobench.backends.torchtitan import build_optimizer
    from echobench.train.bench import resolve_dtype, train_step
    from echobench.data import build_tokenizer, make_loader
    from echobench.train.distributed import DistInfo
    from echobench.model.echo import diffusion_draws

    device = torch.device("cpu")
    setup = build_training(cfg, DistInfo(device=device), resolve_dtype(cfg.precision, device))
    # The optimizer a GPU run builds (fused AdamW keeps its step count on the device). The CPU's
    # foreach AdamW reads its step count from a CPU tensor (.item()), which is no device sync.
    # (megatron's runs fused AdamW inside megatron-core's optimizer on every device: kept.)
    if isinstance(setup.optimizer, torch.optim.Optimizer):
        setup.optimizer = build_optimizer(setup.model.trainable_parameters(), torch.device("cuda"))
    elif isinstance(setup.optimizer, MasterWeights):  # bf16-compute: the same, over the fp32 masters
        setup.optimizer.optimizer = build_optimizer(setup.optimizer.masters, torch.device("cuda"))
    model_cfg = cfg.model_config()
    loader = make_loader("synthetic", micro_batch=cfg.micro_batch, audio_frames=cfg.audio_frames,
                         text_tokens=cfg.text_tokens, speaker_frames=cfg.speaker_frames,
                         tokenizer=build_tokenizer(model_cfg.text_encoder.vocab, None), rank=0, world_size=1,
                         seed=0, skip_bad_samples=False)
    generator = torch.Generator(device)
    recorder = DataDependentOps()
    try:
        for _ in range(steps):
            batch = next(loader)
            sample_ids = batch.index.tolist()
            with recorder:
                draws = diffusion_draws(cfg.seed, sample_ids, cfg.audio_frames, model_cfg.latent_dim,
                                        model_cfg.cfg_dropout, device, generator)
                train_step(setup, [(batch, draws)], device.type, dp_size=1)
    finally:
        loader.close()
    return recorder.found


def test_recorder_catches_a_boolean_mask_write():
    """The recorder itself: transformers' way of writing the end-of-image embedding is caught."""
    x = torch.zeros(2, 3, 4)
    ids = torch.tensor([[1, 5, 2], [5, 0, 0]])
    with DataDependentOps() as rec:
        x[ids == 5] = torch.ones(4)
        torch.where((ids == 5)[..., None], torch.ones(4), x)
    assert rec.found == ["aten.index_put_.default (boolean index)"]


@pytest.mark.parametrize("encoder", [None, "tiny-t5"])
def test_torchtitan_step_has_no_data_dependent_ops(encoder):
    found = measured_step_ops(RunConfig(encoder_model=encoder, **SHAPES))
    assert found == []


def test_bf16_compute_step_has_no_data_dependent_ops():
    """bf16 weights with fp32 masters (master_weights bf16-compute): loading the gradients into the
    masters, clipping through the fused optimizer's grad_scale and copying back read nothing."""
    found = measured_step_ops(RunConfig(**{**SHAPES, "precision": "bf16"}, master_weights="bf16-compute"))
    assert found == []


def _megatron_worker(rank: int, out_path: str) -> None:
    """megatron initialises process groups: a process of its own (world size 1, gloo)."""
    one_gloo_rank()
    found = measured_step_ops(RunConfig(framework="megatron", parallelism="tp1", te="off", **SHAPES))
    with open(out_path, "w") as f:
        json.dump(found, f)
    torch.distributed.destroy_process_group()


def test_megatron_step_has_no_data_dependent_ops(tmp_path):
    pytest.importorskip("megatron.core")
    import torch.multiprocessing as mp

    out = tmp_path / "ops.json"
    mp.spawn(_megatron_worker, args=(str(out),), nprocs=1, join=True)
    assert json.loads(out.read_text()) == []


def test_data_wait_and_step_time_share_one_clock(monkeypatch, tmp_path):
    """data_wait_frac divides a wait by step time measured on the same clock (CUDA events on a GPU).

    The timer's clock is replaced by one that ticks once per reading: per measured step it is read
    before and after taking the batch (1 tick of wait) and at the step's end (3 ticks of step), so
    the fraction is exactly 1/3 whatever the host clock does, if both come from the timer's clock.
    """
    from echobench.train import bench
    from echobench.train.distributed import DistInfo

    ticks = iter(range(10**6))
    monkeypatch.setattr(bench.StepTimer, "stamp", lambda self: float(next(ticks)))
    cfg = RunConfig(steps=3, warmup_steps=1, peak_tflops=1.0, **SHAPES)
    mine = bench.run_loop(cfg, DistInfo(device=torch.device("cpu")), tmp_path, bench.EchoWorkload(cfg))
    assert mine["step_times_s"] == [3.0, 3.0, 3.0]
    assert mine["data_wait_s"] == [1.0, 1.0, 1.0]
    assert mine["data_wait_frac"] == pytest.approx(1 / 3) and mine["data_wait_clock"] == "host"
