"""The memory estimate's parts held against counts of what a real step holds (issue 34).

State (weights, gradients, optimizer): the bytes every tensor a rank's parameters, gradient buffers
(megatron-core's contiguous grad buffer and main_grad, torch DDP's buckets as gradient_as_bucket_view
exposes them through .grad) and optimizer (main parameters, Adam moments) hold, each storage counted
once (by data_ptr), counted when the step's gradients exist (at the clip). Built by the backends'
own build_training on the CPU over gloo, fp32 (the CPU's parameters: megatron's bf16 parameters and
mixed-precision optimizer need a GPU); the estimate is asked for the same device and precision.
Tolerance: exact up to 0.1% (the estimate's parameter count is analytic; megatron pads nothing
without the distributed optimizer).

Activations: what one step's forward leaves alive for backward, counted on FakeTensors (no data;
stepcount's model and batch, bf16 autocast and the GPU's attention dispatch, as a GPU run saves):
every storage an op of the forward creates that is still alive when the loss is made, each once;
autocast's bf16 copies of the fp32 weights counted apart. Tolerance: +-3% per configuration (the
itemised formula lands within 1% of every count here).
"""

from __future__ import annotations

import datetime
import json
import os
import warnings
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from echobench.predict import stepcount
from echobench.records.config import RunConfig
from echobench.predict.memory import activation_elements_per_sample, autocast_weight_bytes, estimate_memory, saved_elements
from echobench.predict.stepcount_ops import gpu_attention

STATE_SHAPES = dict(scale="tiny", micro_batch=2, audio_frames=24, text_tokens=12, speaker_frames=20,
                    precision="fp32", device="cpu")
STATE_RTOL = 1e-3
ACTIVATION_RTOL = 0.03


# ---- state: weights, gradients, optimizer ----

def held_bytes(setup) -> dict[str, int]:
    """Bytes of the trainable parameters, gradients and optimizer state one rank holds, by part,
    each storage once (the first part that reaches it: weights, then gradients, then optimizer)."""
    seen: dict[int, tuple[str, int]] = {}

    def add(t, part):
        if t is not None:
            s = t.untyped_storage()
            seen.setdefault(s.data_ptr(), (part, s.nbytes()))

    inner = getattr(setup.model, "module", setup.model)
    params = [p for p in inner.parameters() if p.requires_grad]
    optimizers = [setup.optimizer]
    if hasattr(setup.optimizer, "masters"):  # backends.master.MasterWeights: its fp32 masters and their optimizer
        optimizers = [setup.optimizer.optimizer]
    if hasattr(setup.optimizer, "ddp"):  # backends.megatron.MegatronStep
        for buffer in setup.optimizer.ddp.buffers:
            add(buffer.param_data, "weights")
            add(buffer.grad_data, "gradients")
        optimizers = [c.optimizer for c in setup.optimizer.optimizer.chained_optimizers]
    for p in params:
        add(p, "weights")
    for opt in optimizers:  # main parameters (a mixed-precision optimizer's fp32 copies)
        for group in opt.param_groups:
            for p in group["params"]:
                add(p, "weights")
    for p in params:
        add(p.grad, "gradients")
        add(getattr(p, "main_grad", None), "gradients")
    for opt in optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                add(p.grad, "gradients")
        for state in opt.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor) and v.numel() > 1:  # not the step counter
                    add(v, "optimizer")
    out = {"weights": 0, "gradients": 0, "optimizer": 0}
    for part, nbytes in seen.values():
        out[part] += nbytes
    return out


STATE_LAYOUTS = (("megatron", "tp2"), ("megatron", "tp1"), ("torchtitan", "ddp"))  # on 2 ranks: tp2 x dp1, dp2, dp2


def _state_worker(rank: int, world: int, store: str, out_path: str) -> None:
    """One of 2 gloo ranks: each layout of STATE_LAYOUTS built by build_training, one step, its state
    counted at the clip (the step's gradients all there)."""
    warnings.filterwarnings("ignore")
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    from megatron.core import parallel_state

    from echobench.backends import build_training
    from echobench.train.bench import train_step
    from echobench.train.distributed import DistInfo
    from test_megatron import step_batches

    (micro,) = step_batches(1, 1)
    counts = {}
    for framework, parallelism in STATE_LAYOUTS:
        cfg = RunConfig(framework=framework, parallelism=parallelism, gpus_per_node=world, **STATE_SHAPES)
        setup = build_training(cfg, DistInfo(rank=rank, world_size=world, device=torch.device("cpu")), torch.float32)
        clip, seen = setup.clip_grad, []
        setup.clip_grad = lambda s=setup: (clip(), seen.append(held_bytes(s)))[0]
        train_step(setup, micro, "cpu", cfg.dp)
        counts[f"{framework}-{parallelism}"] = {"at_clip": seen[0], "after_step": held_bytes(setup), "dp": cfg.dp}
        del setup
        if framework == "megatron":
            parallel_state.destroy_model_parallel()
    gathered = [None] * world
    dist.all_gather_object(gathered, counts)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(gathered, f)
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def state_counts(tmp_path_factory):
    pytest.importorskip("megatron.core")
    import torch.multiprocessing as mp

    tmp = tmp_path_factory.mktemp("state")
    mp.spawn(_state_worker, args=(2, str(tmp / "store"), str(tmp / "out.json")), nprocs=2, join=True)
    return json.loads((tmp / "out.json").read_text())


def test_state_bytes_match_what_each_layout_holds(state_counts):
    """weights + gradients + optimizer of the estimate = the count, per part, on every rank, for
    megatron tp2 (dp 1), megatron tp1 x dp2 and torch DDP (dp 2), all fp32 on the CPU."""
    for rank_counts in state_counts:
        for key, c in rank_counts.items():
            framework, parallelism = key.split("-")
            e = estimate_memory(RunConfig(framework=framework, parallelism=parallelism, gpus_per_node=2,
                                          **STATE_SHAPES))
            # Adam's moments exist from the first step on: counted after it (steady state: all three at once)
            held = {"weights": c["at_clip"]["weights"], "gradients": c["at_clip"]["gradients"],
                    "optimizer": c["after_step"]["optimizer"]}
            for part, nbytes in held.items():
                assert getattr(e, part) == pytest.approx(nbytes, rel=STATE_RTOL), (key, part, c)


def test_one_gradient_copy_at_any_data_parallel_size(state_counts):
    """No layout holds a second, bucket copy of the gradients: torch DDP's gradients are views of its
    buckets (gradient_as_bucket_view), megatron's main_grad are views of its grad buffer, which it
    allocates at dp 1 as at dp 2 and keeps between steps (zeroed, not freed)."""
    for rank_counts in state_counts:
        for key, c in rank_counts.items():
            assert c["at_clip"]["gradients"] == c["at_clip"]["weights"], key  # fp32 both: one copy
        tp1 = rank_counts["megatron-tp1"]
        assert tp1["dp"] == 2 and rank_counts["megatron-tp2"]["dp"] == 1
        for key in ("megatron-tp1", "megatron-tp2"):
            assert rank_counts[key]["after_step"]["gradients"] == rank_counts[key]["at_clip"]["gradients"]
        # DDP's buckets outlive .grad (set to None after the step), out of Python's sight.
        assert rank_counts["torchtitan-ddp"]["after_step"]["gradients"] == 0


@pytest.mark.parametrize("accum", ["bf16", "fp32"])
def test_bf16_compute_state_is_what_its_step_holds(accum):
    """master_weights bf16-compute, one process, 2 micro-batches: bf16 parameters and fp32 masters
    (weights), the gradients as the last backward leaves them (bf16 in the parameters, or fp32 in
    the masters), AdamW's moments after the step: the estimate's parts, counted on a real step."""
    from echobench.backends import build_training
    from echobench.train.bench import train_step
    from echobench.train.distributed import DistInfo
    from test_megatron import step_batches

    shapes = {**STATE_SHAPES, "precision": "bf16"}
    cfg = RunConfig(master_weights="bf16-compute", grad_accum=2, grad_accum_dtype=accum, **shapes)
    setup = build_training(cfg, DistInfo(device=torch.device("cpu")), torch.bfloat16)
    assert setup.info["master_weights"] == "bf16-compute" and setup.info["grad_accum_dtype"] == accum
    clip, seen = setup.clip_grad, []
    setup.clip_grad = lambda: (seen.append(held_bytes(setup)), clip())[1]  # before the clip casts bf16 sums
    (micro,) = step_batches(1, 2)
    train_step(setup, micro, "cpu", 1)
    held = {"weights": seen[0]["weights"], "gradients": seen[0]["gradients"],
            "optimizer": held_bytes(setup)["optimizer"]}
    e = estimate_memory(cfg)
    for part, nbytes in held.items():
        assert getattr(e, part) == pytest.approx(nbytes, rel=STATE_RTOL), (part, held)
    n = sum(p.numel() for p in setup.model.trainable_parameters())
    assert held["weights"] == 6 * n and held["gradients"] == (4 if accum == "fp32" else 2) * n
    assert autocast_weight_bytes(cfg) == 0  # nothing cast, nothing saved (test_master_weights counts the casts)


def tp_rank_parameters(cfg: RunConfig) -> int:
    """TP rank 0's trainable parameters, counted on the model (meta device): the DiT's shards as the
    backend loads them (TPStateDictAdapter), every other trainable parameter whole."""
    pytest.importorskip("megatron.core")  # model.megatron imports it
    from echobench.backends.torchtitan import build_model
    from echobench.model.megatron import TPStateDictAdapter

    model = build_model(cfg, torch.device("meta"), torch.bfloat16)
    dit = TPStateDictAdapter(cfg.tp).to_tp(dict(model.dit.named_parameters()), 0)
    rest = [p for name, p in model.named_parameters() if p.requires_grad and not name.startswith("dit.")]
    return sum(t.numel() for t in dit.values()) + sum(p.numel() for p in rest)


def test_megatron_gpu_state_follows_its_mixed_precision():
    """On a GPU (megatron-core's layout, not countable here): bf16 parameters, the fp32 grad buffer
    (grad_reduce_in_fp32), fp32 main parameters and two fp32 Adam moments per parameter; the
    distributed optimizer shards the main parameters and moments over dp; a bf16 grad buffer
    (grad_reduce_dtype bf16). The rank's parameters counted on the model, the bytes from the dtypes."""
    kw = dict(framework="megatron", scale="tiny", parallelism="tp2", gpus_per_node=8, precision="bf16",
              device="cuda")
    n = tp_rank_parameters(RunConfig(**kw))
    bf16, fp32 = torch.bfloat16.itemsize, torch.float32.itemsize
    dp = 8 // 2
    gpu = estimate_memory(RunConfig(**kw))
    assert (gpu.weights, gpu.gradients, gpu.optimizer) == pytest.approx(
        (n * (bf16 + fp32), n * fp32, n * 2 * fp32), rel=STATE_RTOL)
    dist_opt = estimate_memory(RunConfig(distributed_optimizer=True, **kw))
    assert (dist_opt.weights, dist_opt.gradients, dist_opt.optimizer) == pytest.approx(
        (n * bf16 + n * fp32 / dp, n * fp32, n * 2 * fp32 / dp), rel=STATE_RTOL)
    assert estimate_memory(RunConfig(grad_reduce_dtype="bf16", **kw)).gradients == pytest.approx(n * bf16, rel=STATE_RTOL)


# ---- activations ----

class AliveStorages(TorchDispatchMode):
    """Every storage an op creates (not the ones in `before`), weakly: which are alive, with their bytes,
    and which are autocast's casts of a parameter."""

    def __init__(self, before: set[int]):
        super().__init__()
        self.before, self.refs = before, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        cast = func is torch.ops.aten._to_copy.default and isinstance(args[0], torch.nn.Parameter)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                s = t.untyped_storage()
                key = s._cdata
                if key in self.before or (key in self.refs and not self.refs[key][0].expired()):
                    continue  # a view of a storage already counted (or of a parameter, the batch)
                self.refs[key] = (StorageWeakRef(s), s.nbytes(), cast)
        return out

    def alive(self) -> tuple[int, int]:
        """(activation bytes, weight-cast bytes) alive now."""
        live = [(b, cast) for ref, b, cast in self.refs.values() if not ref.expired()]
        return sum(b for b, cast in live if not cast), sum(b for b, cast in live if cast)


def saved_by_forward(cfg: RunConfig, op_level_selective: bool = False) -> tuple[int, int]:
    """What one forward of `cfg` leaves alive for backward: (activation bytes, autocast weight-cast
    bytes), on FakeTensors as a GPU run computes (stepcount's model, batch and attention dispatch;
    bf16 autocast). op_level_selective: selective AC as a compiled run applies it (the policy, eager
    here); else as the run's own compile setting (eager: layer-level)."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    dtype = stepcount.compute_dtype(cfg)
    model = stepcount.fake_model(cfg, mode, dtype or torch.float32, op_level_selective)
    batch, draws = stepcount.fake_batch(cfg, mode)
    before = {t.untyped_storage()._cdata for t in [*model.parameters(), *model.buffers()]}
    before |= {v.untyped_storage()._cdata for obj in (batch, draws) for v in vars(obj).values()
               if isinstance(v, torch.Tensor)}
    counter = AliveStorages(before)
    with mode, counter, mock.patch.object(F, "scaled_dot_product_attention", gpu_attention(False)):
        with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
            err = model(batch, draws=draws, reduction="sum")  # noqa: F841 - its graph holds what is counted
        return counter.alive()


# (scale, audio frames, text tokens, speaker frames, ac, compiled, micro-batch): compiled only picks
# selective's op-level policy (the blocks run eager here; compiled blocks may save less).
ACTIVATION_CASES = [
    ("tiny", 200, 32, 160, "none", False, 1),
    ("tiny", 200, 32, 160, "none", False, 2),
    ("tiny", 96, 16, 64, "full", False, 1),
    ("tiny", 96, 16, 64, "full", False, 2),
    ("tiny", 200, 32, 160, "selective", False, 1),
    ("tiny", 200, 32, 160, "selective", True, 1),
    ("800M", 64, 16, 32, "none", False, 1),
    ("800M", 64, 16, 32, "full", False, 1),
    ("800M", 64, 16, 32, "selective", True, 1),
]


@pytest.mark.parametrize("scale, la, lt, ls, ac, compiled, mb", ACTIVATION_CASES)
def test_activations_match_what_the_forward_saves(scale, la, lt, ls, ac, compiled, mb):
    cfg = RunConfig(scale=scale, audio_frames=la, text_tokens=lt, speaker_frames=ls, ac=ac, compile=compiled,
                    micro_batch=mb, precision="bf16", master_weights="fp32-autocast")  # autocast casts the weights
    saved, casts = saved_by_forward(cfg, op_level_selective=compiled)
    after, _ = saved_elements(cfg)
    assert after * 2 * mb == pytest.approx(saved, rel=ACTIVATION_RTOL)
    # casts: every matmul weight outside the checkpointed blocks, once
    assert autocast_weight_bytes(cfg) == pytest.approx(casts, rel=ACTIVATION_RTOL)
    if ac == "none":
        assert activation_elements_per_sample(cfg)[0] * 2 * mb == pytest.approx(saved, rel=ACTIVATION_RTOL)


def test_activations_of_the_old_estimate_read_low():
    """The count that made the formula: without AC, the 800M forward saves about twice what the old
    per-block terms (12 d + 3 m per frame) priced; the difference is mostly RMSNorm's fp32 copies."""
    cfg = RunConfig(scale="800M", audio_frames=64, text_tokens=16, speaker_frames=32, ac="none", micro_batch=1,
                    precision="bf16")
    m = cfg.model_config()
    old_block = 64 * (12 * m.width + 3 * m.mlp) + 4 * (16 + 8) * m.width
    new_total = activation_elements_per_sample(cfg)[0]
    assert m.layers * old_block < 0.55 * new_total


class LiveTimeline(AliveStorages):
    """AliveStorages that also notes, after each op while `recording`, which storages are alive."""

    recording = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if self.recording:
            self.snapshots.append([(k, b) for k, (ref, b, _) in self.refs.items() if not ref.expired()])
        return out


@pytest.mark.parametrize("ac", ["full", "selective"])
def test_checkpointed_backward_peaks_at_one_recomputed_block(ac):
    """With AC, backward's activation peak (every storage the step made, alive, not a parameter's
    gradient) is what the forward left plus one block rebuilt by its recompute: saved_elements'
    (after + recompute), within +-5% (tiny, eager: full, layer-level selective). Without AC the peak
    lies ~10% above what the forward saved (the activations' gradients in flight): not estimated
    apart, the overhead's 10% stands for it."""
    cfg = RunConfig(scale="tiny", audio_frames=200, text_tokens=32, speaker_frames=160, ac=ac, compile=False,
                    micro_batch=1, precision="bf16", master_weights="fp32-autocast")
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    model = stepcount.fake_model(cfg, mode, torch.float32, False)
    batch, draws = stepcount.fake_batch(cfg, mode)
    before = {t.untyped_storage()._cdata for t in [*model.parameters(), *model.buffers()]}
    before |= {v.untyped_storage()._cdata for obj in (batch, draws) for v in vars(obj).values()
               if isinstance(v, torch.Tensor)}
    timeline = LiveTimeline(before)
    timeline.snapshots = []
    with mode, timeline, mock.patch.object(F, "scaled_dot_product_attention", gpu_attention(False)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            err = model(batch, draws=draws, reduction="sum")
        timeline.recording = True
        err.backward()
    grads = {p.grad.untyped_storage()._cdata for p in model.parameters() if p.grad is not None}
    peak = max(sum(b for k, b in snap if k not in grads) for snap in timeline.snapshots)
    after, recompute = saved_elements(cfg)
    assert recompute > 0
    assert (after + recompute) * 2 + autocast_weight_bytes(cfg) == pytest.approx(peak, rel=0.05)


def test_the_gh200_memory_variants_are_hardware_choices():
    """hardware.device GH200 is the 96 GB HBM3 part, `GH200 144G` the HBM3e one; a GPU's own name
    picks its row too; the docs name each row of the table."""
    from conftest import ROOT
    from echobench.hardware.devicememory import DEVICE_MEMORY_GIB, device_memory_gib

    assert device_memory_gib(None, "GH200") == device_memory_gib(None, "NVIDIA GH200 120GB") == 95.0
    assert device_memory_gib(None, "GH200 144G") == device_memory_gib(None, "NVIDIA GH200 144G HBM3e") == 141.0
    assert device_memory_gib(100.0, "GH200") == 100.0  # hardware.memory_gib wins
    page = (ROOT / "docs" / "reference" / "matrix.md").read_text()
    assert all(f"`{name}`" in page for name, _ in DEVICE_MEMORY_GIB)


def test_the_cuda_context_is_a_gpu_runs_overhead_only():
    """A GPU run's overhead is the CUDA context and workspaces (1.5 GiB) plus 10% of its tensors, as
    before; a CPU run's is the 10% alone (its process's resident baseline is measured by the run)."""
    from echobench.predict.memory import GIB, estimate_memory

    gpu, cpu = (estimate_memory(RunConfig(scale="tiny", device=d)) for d in ("cuda", "cpu"))
    assert gpu.overhead == pytest.approx(1.5 * GIB + 0.1 * gpu.tensors)
    assert cpu.overhead == pytest.approx(0.1 * cpu.tensors)
