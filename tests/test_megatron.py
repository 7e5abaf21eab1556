"""The megatron backend: TP layouts, equivalence with the plain model, validation, end-to-end runs.

Tolerance: fp32 on CPU. The TP model computes the same sums in a different order (row-parallel
partial sums, all-reduced), so outputs, loss and gradients agree to rounding: we allow
rtol 1e-5 / atol 1e-6 on outputs and loss, rtol 1e-4 / atol 1e-6 on gradients.
"""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch

from conftest import TINY_CARD, counted_model_flops, inductor_cache_dir, one_gloo_rank, run_cli
from echobench.records.config import RunConfig
from echobench.model.config import get_preset
from echobench.model.dit import EchoDiT

pytest.importorskip("megatron.core")

TINY = ["--scale", "tiny", "--steps", "3", "--warmup-steps", "1", "--micro-batch", "2",
        "--audio-frames", "50", "--text-tokens", "16", "--speaker-frames", "40", "--peak-tflops", "0.5"]
OUT_RTOL, OUT_ATOL = 1e-5, 1e-6
GRAD_RTOL, GRAD_ATOL = 1e-4, 1e-6


def perturbed_plain_dit(seed: int = 0) -> EchoDiT:
    """The tiny DiT with every weight random: AdaLN-zero would otherwise make each block the
    identity at init and hide a wrong attention or MLP."""
    torch.manual_seed(seed)
    dit = EchoDiT(get_preset("tiny"))
    with torch.no_grad():
        for p in dit.parameters():
            p.normal_(0.0, 0.2)
    return dit


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_state_dict_round_trip_is_exact(tp):
    from echobench.model.megatron import TPStateDictAdapter

    adapter = TPStateDictAdapter(tp)
    plain = perturbed_plain_dit().state_dict()
    shards = [adapter.to_tp(plain, r) for r in range(tp)]
    # Sharded weights hold 1/tp of the rows (column-parallel) or columns (row-parallel).
    qkvg = shards[0]["blocks.0.attn.linear_qkvg.weight"]
    assert qkvg.shape == (4 * 64 // tp, 64)
    assert shards[0]["blocks.0.attn.linear_proj.weight"].shape == (64, 64 // tp)
    assert shards[0]["blocks.1.mlp.linear_fc1.weight"].shape == (2 * 172 // tp, 64)
    # Rank r's fused q rows are the plain q rows of its heads.
    rows = 64 // tp
    assert torch.equal(shards[-1]["blocks.0.attn.linear_qkvg.weight"][:rows],
                       plain["blocks.0.attn.in_proj.weight"][:64][(tp - 1) * rows:])
    back = adapter.from_tp(shards)
    assert set(back) == set(plain)
    assert all(torch.equal(back[k], plain[k]) for k in plain)
    # ... and the other direction: shards -> plain -> shards.
    again = [adapter.to_tp(back, r) for r in range(tp)]
    assert all(torch.equal(a[k], s[k]) for a, s in zip(again, shards) for k in s)


def te_reads_padding_mask(q, k, v, masks):
    """TE's fused attention reading a padding mask, emulated on the CPU: each sample attends to its
    first n keys, n = its number of unmasked keys (the cu_seqlens TE derives from the mask).
    Inputs in TE's sbhd layout (T, B, H, D) with its (query, key) masks (True = masked)."""
    q, k, v = (x.permute(1, 2, 0, 3) for x in (q, k, v))  # -> (B, H, T, D)
    n = (~masks[1][:, 0, 0, :]).sum(-1)
    prefix = torch.arange(k.shape[2]) < n[:, None]
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=prefix[:, None, None, :])


def test_te_attention_gets_its_valid_keys_packed_to_the_front():
    """Variable lengths per stream ([latent | text | speaker], each padded, a CFG-dropped sample
    without text and speaker): the keys TE receives, read as TE reads a padding mask, give the
    plain model's attention."""
    from echobench.model.megatron import TECoreAttention, pack_keys

    torch.manual_seed(0)
    (la, lt, ls), heads, dim = (10, 6, 5), 2, 8
    lengths = torch.tensor([[10, 6, 5], [7, 2, 3], [4, 0, 0]])  # per sample: latent, text, speaker
    key_mask = torch.cat([torch.arange(n) < lengths[:, i, None] for i, n in enumerate((la, lt, ls))], dim=1)
    b = len(lengths)
    q = torch.randn(b, heads, la, dim)
    k, v = torch.randn(2, b, heads, la + lt + ls, dim)
    plain = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=key_mask[:, None, None, :])

    # The defect: handed the gapped mask as it is, TE attends to padded latent frames and drops
    # the last valid speaker keys.
    sbhd = [x.permute(2, 0, 1, 3) for x in (q, k, v)]
    unpacked = te_reads_padding_mask(*sbhd, (None, ~key_mask[:, None, None, :]))
    assert not torch.allclose(unpacked[1:], plain[1:], atol=1e-3)
    torch.testing.assert_close(unpacked[0], plain[0])  # no gaps in a full-length sample

    packed = pack_keys(key_mask, la)
    torch.testing.assert_close(te_reads_padding_mask(*TECoreAttention.te_inputs(q, k, v, packed)), plain)
    # TE's key mask is a prefix of each sample's keys, as many as it has valid ones; no query masked
    assert torch.equal(~packed.masks[1][:, 0, 0, :], torch.arange(la + lt + ls) < key_mask.sum(1, keepdim=True))
    assert packed.masks[0].shape == (b, 1, 1, la) and not packed.masks[0].any()


class EmulatedTEAttention(torch.nn.Module):
    """TECoreAttention on the CPU: its inputs (te_inputs) read as TE reads them (te_reads_padding_mask)."""

    def forward(self, q, k, v, packed):
        from echobench.model.megatron import TECoreAttention

        return te_reads_padding_mask(*TECoreAttention.te_inputs(q, k, v, packed))


def _packing_worker(rank: int, out_path: str) -> None:
    """One gloo rank: the TP=1 DiT as it runs with TE (keys packed, TE's attention emulated) on a
    batch with gapped keys, against the plain DiT; the sorts of its forward counted."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from megatron.core import parallel_state

    from echobench.backends.megatron_cpu import redirect_cuda_to_cpu
    from echobench.model.megatron import TPOptions, build_tp_dit

    class Sorts(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += func.overloadpacket is torch.ops.aten.sort
            return func(*args, **(kwargs or {}))

    one_gloo_rank()
    redirect_cuda_to_cpu()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    cfg = get_preset("tiny")
    plain = perturbed_plain_dit()
    dit = build_tp_dit(cfg, plain, 0, 1, TPOptions(), torch.device("cpu"))
    dit.packs_keys = True  # as with te (the TE layers themselves do not run on a CPU)
    for block in dit.blocks:
        block.attn.core_attention = EmulatedTEAttention()
    torch.manual_seed(1)
    (la, lt, ls), b = (10, 6, 5), 3
    lengths = torch.tensor([[10, 6, 5], [7, 2, 3], [4, 0, 0]])
    key_mask = torch.cat([torch.arange(n) < lengths[:, i, None] for i, n in enumerate((la, lt, ls))], dim=1)
    inputs = (torch.randn(b, la, cfg.latent_dim), torch.rand(b), torch.randn(b, lt, cfg.width),
              torch.randn(b, ls, cfg.speaker_width), key_mask)
    with torch.no_grad(), Sorts() as sorts:
        out = dit(*inputs)
    with torch.no_grad():
        expected = plain(*inputs)
    with open(out_path, "w") as f:
        json.dump({"sorts": sorts.count, "layers": len(dit.blocks),
                   "max_err": (out - expected).abs().max().item()}, f)
    torch.distributed.destroy_process_group()


def test_te_keys_are_packed_once_per_step(tmp_path):
    """With TE the DiT packs its keys once (one sort) and every layer gathers them in that order;
    the DiT computes the plain one's function."""
    import torch.multiprocessing as mp

    out = tmp_path / "packing.json"
    mp.spawn(_packing_worker, args=(str(out),), nprocs=1, join=True)
    r = json.loads(out.read_text())
    assert r["layers"] == 2 and r["sorts"] == 1
    assert r["max_err"] < 1e-5


def make_batch():
    from echobench.data import build_tokenizer, make_loader

    cfg = get_preset("tiny")
    loader = make_loader("synthetic", micro_batch=2, audio_frames=24, text_tokens=12, speaker_frames=20,
                         tokenizer=build_tokenizer(cfg.text_encoder.vocab, None), rank=0, world_size=1, seed=3,
                         skip_bad_samples=False)
    try:
        return next(loader)
    finally:
        loader.close()


# The TP layouts the equality test runs (model.megatron.TPOptions): megatron-core's linears as eager
# runs take them; with sequence parallelism (on by default for tp > 1 on a GPU); and as a GPU run's
# compiled blocks take them (TracedColumnParallelLinear, sequence parallel, fused SwiGLU), eager here.
TP_LAYOUTS = {
    "megatron-linears": {},
    "sequence-parallel": {"sequence_parallel": True},
    "gpu-layout": {"sequence_parallel": True, "traced": True, "fused_swiglu": True},
}


# Far under the perturbed tiny model's gradient norms (above 1; a tiny run's are ~0.36): every step
# clips, by a factor of 20 or more.
CLIP = 0.05
STEPS = 3


def _tp_worker(rank: int, world: int, store: str, out_dir: str) -> None:
    """One of 2 gloo ranks: every layout of TP_LAYOUTS in turn (_compare_layout), each result in
    OUT_DIR/LAYOUT.json. One pair of processes for the three: their start-up (torch, megatron-core,
    the process group) is most of a layout's CPU. The ranks meet through a file store (no port to
    race for)."""
    warnings.filterwarnings("ignore")
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    import datetime

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    from megatron.core import parallel_state

    from echobench.backends.megatron_cpu import redirect_cuda_to_cpu

    redirect_cuda_to_cpu()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    for layout in TP_LAYOUTS:
        _compare_layout(rank, world, layout, os.path.join(out_dir, f"{layout}.json"))
    dist.barrier()
    dist.destroy_process_group()


def _compare_layout(rank: int, world: int, layout: str, out_path: str) -> None:
    """Plain model vs TP=2 model (this layout) on the same weights and batch, the TP model under
    megatron-core's DDP, optimizer and clip (max norm CLIP), STEPS real optimizer steps each.
    References, on every rank: the plain model under torch's AdamW and clip_grad_norm_, and under
    the torchtitan backend's clip with a fused AdamW (the grad_scale path GPU runs take). Every
    model and optimizer is built here, from the same seeds for each layout."""
    import copy

    import torch.distributed as dist
    from megatron.core import parallel_state

    from echobench.backends.megatron import (MegatronStep, megatron_clip, megatron_ddp, megatron_optimizer,
                                             tp_partial_grad_params)
    from echobench.backends.torchtitan import ADAMW, clip_grad_norm_
    from echobench.model.dit import DiTBlock, joint_attention
    from echobench.model.echo import EchoTTS
    from echobench.model.megatron import TPOptions, TPStateDictAdapter, build_tp_dit, tp_state_dict

    group = parallel_state.get_tensor_model_parallel_group()
    cfg = get_preset("tiny")
    torch.manual_seed(0)
    plain = EchoTTS(cfg)
    plain.dit = perturbed_plain_dit()
    titan = copy.deepcopy(plain)
    torch.manual_seed(0)
    tp_model = EchoTTS(cfg)  # same seed: same encoders
    tp_model.dit = build_tp_dit(cfg, plain.dit, parallel_state.get_tensor_model_parallel_rank(), world,
                                TPOptions(**TP_LAYOUTS[layout]), torch.device("cpu"))
    weights_at_start = {k: v.clone() for k, v in tp_state_dict(tp_model.dit).items()}
    plain_at_start = {k: v.clone() for k, v in plain.dit.state_dict().items()}
    ddp = megatron_ddp(tp_model, tp_model.dit.config, grad_reduce_in_fp32=True, distributed_optimizer=False)
    optimizer = megatron_optimizer(ddp, torch.float32, distributed=False, device=torch.device("cpu"))
    (inner,) = optimizer.chained_optimizers
    fused = bool(inner.optimizer.defaults.get("fused"))  # its clip then goes through grad_scale
    clip = megatron_clip(ddp, optimizer, tp_partial_grad_params(tp_model), group, max_norm=CLIP)
    tp_step = MegatronStep(ddp, optimizer)
    plain_params, titan_params = plain.trainable_parameters(), titan.trainable_parameters()
    plain_opt = torch.optim.AdamW(plain_params, **ADAMW)  # torch's own: foreach, clipped in place
    titan_opt = torch.optim.AdamW(titan_params, **ADAMW, fused=True)
    batch = make_batch()

    losses, norms = [], []
    for step in range(STEPS):
        # Same noise on all three: same generator seed.
        step_losses, outputs = [], []
        for model, dit in ((plain, plain.dit), (titan, titan.dit), (ddp, tp_model.dit)):
            captured = []
            handle = dit.register_forward_hook(lambda m, i, o: captured.append(o.detach()))
            loss = model(batch, generator=torch.Generator().manual_seed(7 + step))
            handle.remove()
            loss.backward()
            step_losses.append(float(loss))
            outputs.append(captured[0])
        if step == 0:
            out_max_err = (outputs[0] - outputs[2]).abs().max().item()
            out_close = torch.allclose(outputs[0], outputs[2], rtol=OUT_RTOL, atol=OUT_ATOL)
            plain_grads = {name: p.grad.clone() for name, p in plain.dit.named_parameters()}
        step_norms = [float(torch.nn.utils.clip_grad_norm_(plain_params, CLIP)),
                      float(clip_grad_norm_(titan_params, CLIP, titan_opt))]
        step_norms.append(float(clip()))  # the norm before clipping, as torch's
        if step == 0:  # the reduced gradients, before the step (the fused path leaves them unscaled)
            tp_grads = {name: p.main_grad.clone() for name, p in tp_model.dit.named_parameters()}
        plain_opt.step()
        plain_opt.zero_grad()
        titan_opt.step()
        titan_opt.zero_grad()
        tp_step.step()
        tp_step.zero_grad()
        losses.append(step_losses)
        norms.append(step_norms)

    def after_steps(model, opt) -> dict:
        """name -> the parameter, its AdamW moments and step count, after the steps."""
        return {name: {"param": p.detach(), **{k: v for k, v in opt.state[p].items()}}
                for name, p in model.named_parameters() if p.requires_grad}

    tp_after = after_steps(tp_model, inner.optimizer)
    gathered = [None] * world
    dist.all_gather_object(gathered, (tp_grads, weights_at_start, tp_after))
    if rank == 0:
        adapter = TPStateDictAdapter(world)

        def plain_layout(shards: list[dict]) -> dict:
            """The TP ranks' whole-model dicts in the plain model's names and shapes."""
            dit = adapter.from_tp([{k.removeprefix("dit."): v for k, v in s.items() if k.startswith("dit.")}
                                   for s in shards])
            return {**{k: v for k, v in shards[0].items() if not k.startswith("dit.")},
                    **{"dit." + k: v for k, v in dit.items()}}

        tp_grads_all = adapter.from_tp([g for g, _, _ in gathered])
        grad_err = {k: (tp_grads_all[k] - plain_grads[k]).abs().max().item() for k in plain_grads
                    if not torch.allclose(tp_grads_all[k], plain_grads[k], rtol=GRAD_RTOL, atol=GRAD_ATOL)}
        weights_back = adapter.from_tp([w for _, w, _ in gathered])
        reference = after_steps(plain, plain_opt)
        compared = {"megatron": {}, "torchtitan": {}}
        titan_after = after_steps(titan, titan_opt)
        steps_counted = sorted({float(v["step"]) for after in (reference, titan_after, *(a for _, _, a in gathered))
                                for v in after.values()})
        for what in ("param", "exp_avg", "exp_avg_sq"):
            tp_what = plain_layout([{k: v[what] for k, v in a.items()} for _, _, a in gathered])
            for name, got in (("megatron", tp_what),
                              ("torchtitan", {k: v[what] for k, v in titan_after.items()})):
                compared[name][what] = {"keys_match": set(got) == set(reference),
                                        "errors": {k: [(got[k] - reference[k][what]).abs().max().item(),
                                                       reference[k][what].abs().max().item()]
                                                   for k in reference}}
        result = {
            "loss": losses,
            "norms": norms,
            "fused": fused,
            "out_max_err": out_max_err,
            "out_close": out_close,
            "grad_mismatch": grad_err,
            "grad_keys_match": set(tp_grads_all) == set(plain_grads),
            "weights_exact": all(torch.equal(weights_back[k], v) for k, v in plain_at_start.items()),
            "after_steps": compared,
            "steps_counted": steps_counted,
            # One block forward for both: the TP blocks are the plain DiTBlock given megatron's layers.
            "same_block": all(type(blk) is DiTBlock and type(blk.attn).forward is joint_attention
                              for dit in (plain.dit, tp_model.dit) for blk in dit.blocks),
            "swiglu_fused": tp_model.dit.config.bias_activation_fusion,
        }
        with open(out_path, "w") as f:
            json.dump(result, f)
    dist.barrier()


@pytest.fixture(scope="module")
def tp2_layouts(tmp_path_factory) -> dict[str, dict]:
    """layout -> the result of _compare_layout: the three layouts on one pair of ranks (the gpu
    layout's fused SwiGLU compiles with inductor, in conftest's kept cache)."""
    import torch.multiprocessing as mp

    out = tmp_path_factory.mktemp("tp2-layouts")
    with pytest.MonkeyPatch.context() as patch:  # the spawned ranks take this process's environment
        patch.setenv("TORCHINDUCTOR_CACHE_DIR", inductor_cache_dir(tmp_path_factory))
        mp.spawn(_tp_worker, args=(2, str(out / "store"), str(out)), nprocs=2, join=True)
    return {layout: json.loads((out / f"{layout}.json").read_text()) for layout in TP_LAYOUTS}


@pytest.mark.parametrize("layout", TP_LAYOUTS)
def test_tp2_matches_plain_model(layout, tp2_layouts):
    """Output, loss and gradients of the TP=2 model on megatron-core's DDP equal the plain model's;
    after STEPS real optimizer steps clipped at CLIP (which every step's norm exceeds), its
    parameters and AdamW state equal those of the plain model stepped by torch's AdamW after torch's
    clip_grad_norm_, as do the torchtitan backend's clip with a fused AdamW (the gpu layout's fused
    SwiGLU compiles with inductor)."""
    r = tp2_layouts[layout]
    assert r["weights_exact"]  # the loaded shards gather back to the plain weights, bit for bit
    assert r["same_block"] and r["swiglu_fused"] == (layout == "gpu-layout")
    assert r["out_close"], f"DiT output differs by {r['out_max_err']}"
    for plain_loss, titan_loss, tp_loss in r["loss"]:
        assert [tp_loss, titan_loss] == pytest.approx([plain_loss] * 2, rel=OUT_RTOL, abs=OUT_ATOL)
    assert r["grad_keys_match"] and r["grad_mismatch"] == {}, r["grad_mismatch"]
    # Every step clips (the norm before clipping 20x CLIP or more), and the TP-aware norm counts each
    # element once: the plain model's.
    for plain_norm, titan_norm, tp_norm in r["norms"]:
        assert plain_norm > 20 * CLIP and [tp_norm, titan_norm] == pytest.approx([plain_norm] * 2, rel=GRAD_RTOL)
    assert r["fused"]  # megatron's clip went through the fused AdamW's grad_scale, as on a GPU
    assert r["steps_counted"] == [STEPS]
    # AdamW's moments are linear (exp_avg) and quadratic (exp_avg_sq) in the clipped gradients, so
    # they carry the gradients' relative tolerance, twice it for the square; measured against each
    # tensor's largest element (sums cancel near zero). A clip coefficient off by that much or more
    # (the coefficient here is CLIP / norm, under 1 / 20) fails them. Parameters: Adam's update is
    # nearly invariant to the gradients' scale, so they bound the update itself; within 1e-6, 1% of
    # one step's move (lr 1e-4), the steps' rounding some 30x below it.
    bounds = {"exp_avg": lambda top: GRAD_RTOL * top, "exp_avg_sq": lambda top: 2 * GRAD_RTOL * top,
              "param": lambda top: 1e-6}
    for path, after in r["after_steps"].items():
        for what, c in after.items():
            assert c["keys_match"], (path, what)
            off = {k: e for k, (e, top) in c["errors"].items() if e > bounds[what](top)}
            assert off == {}, (path, what, off)


def problem(**kw):
    from echobench.backends import parallelism_problem

    return parallelism_problem(RunConfig(framework="megatron", **kw))


def test_validation_errors_are_clear():
    assert problem(parallelism="tp2", gpus_per_node=2) is None
    assert problem(parallelism="tp1") is None
    assert problem(parallelism="tp2", gpus_per_node=4, nodes=2) is None  # tp2 x dp4
    assert "does not divide the 4 attention heads" in problem(parallelism="tp3", gpus_per_node=3)
    assert "MLP width 3456" in problem(scale="800M", parallelism="tp5", gpus_per_node=5)
    assert "world size 3" in problem(parallelism="tp2", gpus_per_node=3)
    assert "tp4 needs 4 GPUs in one node" in problem(parallelism="tp4", gpus_per_node=2, nodes=2)
    assert "processes per node" in problem(parallelism="tp2", gpus_per_node=3, nodes=2)
    assert "no parallelism ddp" in problem(parallelism="ddp")
    # sequence parallelism runs on the CPU too (backends/megatron_cpu.py); auto keeps it to GPUs
    assert problem(parallelism="tp2", gpus_per_node=2, sequence_parallel=True, device="cpu") is None
    assert "tp > 1" in problem(parallelism="tp1", sequence_parallel=True)
    assert problem(parallelism="tp2", gpus_per_node=2, distributed_optimizer=True, device="cuda") is None
    assert problem(parallelism="tp2", gpus_per_node=2, distributed_optimizer=True, device="cpu").startswith(
        "distributed_optimizer runs on a GPU only")
    assert problem(parallelism="tp1", grad_reduce_dtype="bf16", device="cpu").startswith("grad_reduce_dtype bf16")
    assert problem(parallelism="tp1", grad_reduce_dtype="bf16", device="cuda", precision="bf16") is None
    from echobench.backends import parallelism_problem

    assert "use --framework megatron" in parallelism_problem(RunConfig(distributed_optimizer=True))
    assert problem(parallelism="tp1", precision="fp8").startswith("fp8 on megatron would need TransformerEngine")
    from echobench.backends.checks import te_installed

    if not te_installed():
        assert "transformer_engine is not installed" in problem(parallelism="tp1", te="on")
    with pytest.raises(ValueError, match="te='maybe'"):
        RunConfig(te="maybe")


@pytest.fixture(scope="module")
def tp2_launch(tmp_path_factory):
    """`echobench run --framework megatron --tp 2 --nproc 2` on the tiny model: (its record, its output)."""
    out = tmp_path_factory.mktemp("tp2")
    proc = run_cli("run", "--framework", "megatron", "--tp", "2", "--nproc", "2", *TINY, "--out", out,
                   tmp_path=out, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "result.json").read_text()), proc.stdout


@pytest.fixture(scope="module")
def tp2_run(tp2_launch):
    return tp2_launch[0]


def test_a_launched_run_prints_its_record_once(tp2_launch):
    """The launcher prints the record; rank 0 under it does not print it again (nor `wrote ...`)."""
    record, stdout = tp2_launch
    assert stdout.count("wrote ") == 1 and stdout.count("step time (median") == 1, stdout


def test_tp_run_writes_a_record(tp2_run):
    """`echobench run --framework megatron --tp 2 --nproc 2`: a complete record, same figures as torchtitan's."""
    from echobench.model.flops import flops_report
    from echobench.records.results import Record

    r = tp2_run
    Record.parse(r)  # a complete, valid record
    assert r["status"] == "ok" and r["parallelism"] == "tp2"
    assert r["tp"] == 2 and r["dp"] == 1 and r["world_size"] == 2 and r["global_batch"] == 2
    assert r["te"] is False and r["backend"]["te"] is False and r["backend"]["backend"] == "megatron"
    # What of Megatron-LM's practice ran (on the CPU: fp32 parameters, no sequence parallelism by
    # default, SwiGLU unfused, no TE), megatron-core's DDP and optimizer in every case.
    b = r["backend"]
    assert b["param_dtype"] == b["main_grad_dtype"] == "float32" and b["sequence_parallel"] is False
    assert b["data_parallel"].startswith("megatron-core DistributedDataParallel") and "overlap_grad_reduce" in \
        b["data_parallel"]
    assert b["optimizer"] == "megatron-core CPUFP32Optimizer over torch.optim.adamw.AdamW (fused)"
    assert b["fused_swiglu"].startswith("off") and b["tp_comm_overlap"].startswith("off")
    assert b["distributed_optimizer"] is False and b["gradient_accumulation_fusion"] is False
    assert b["clipping"].endswith("fused AdamW (grad_scale)") and "overlapped" in b["tp_linears"]
    assert r["env"]["megatron_core"] and r["backend"]["megatron_core"] == r["env"]["megatron_core"]
    # The launcher gives TP > 1 one CUDA hardware queue (megatron's overlap needs it); env says so.
    assert r["env"]["cuda_device_max_connections"] == "1"
    # Same FLOP model as every backend; TP peers process one batch, so it counts once.
    report = flops_report(get_preset("tiny"), 50, 16, 40, "none")
    assert r["model_flops_per_sample"] == report["model_flops_per_sample"]
    assert r["measured_samples"] == 2 * r["measured_steps"]  # global batch 2 a step
    assert r["samples_per_s"] == r["measured_samples"] / sum(r["step_times_s"])
    assert r["mfu"] == pytest.approx(r["model_flops_per_sample"] * r["samples_per_s"] / 2 / 0.5e12)
    # TP peers computed the same loss every step.
    assert len(r["per_rank"]) == 2 and r["per_rank"][0]["losses"] == r["per_rank"][1]["losses"]
    # That a launched TP=2 run trains as one process of the plain model (same weights, batches,
    # optimizer and TP-aware clipping): tests/test_layouts_on_shards.py, its tp2 and tp2xdp2 rows.


def test_megatron_makes_no_gloo_groups(monkeypatch):
    """Nothing uses them, and gloo binds to the host name's address (127.0.1.1 on common Ubuntu hosts),
    which other nodes cannot reach: initialize_model_parallel is asked for none."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from echobench.backends import megatron

    asked = {}
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    monkeypatch.setattr(parallel_state, "model_parallel_is_initialized", lambda: False)
    monkeypatch.setattr(parallel_state, "initialize_model_parallel", lambda **kw: asked.update(kw))
    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_rank", lambda: 0)
    megatron.init_model_parallel(1, 0, torch.device("cpu"))
    assert asked == {"tensor_model_parallel_size": 1, "create_gloo_process_groups": False}


def test_launcher_sets_one_cuda_queue_for_megatron_tp(monkeypatch):
    from echobench.train.launch import child_env

    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    assert child_env(2, RunConfig(framework="megatron", parallelism="tp2", gpus_per_node=2))[
        "CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    for cfg in (RunConfig(framework="megatron", parallelism="tp1"),
                RunConfig(framework="torchtitan", parallelism="ddp", gpus_per_node=2)):
        assert "CUDA_DEVICE_MAX_CONNECTIONS" not in child_env(2, cfg)


def test_bad_tp_is_a_one_line_error_before_launch(cli, tmp_path):
    proc = cli("run", "--framework", "megatron", "--tp", "3", "--nproc", "3", *TINY, "--out", tmp_path / "x")
    assert proc.returncode == 2 and "does not divide the 4 attention heads" in proc.stderr
    assert not (tmp_path / "x").exists()  # no process started
    proc = cli("run", "--framework", "megatron", "--tp", "2", "--parallelism", "ddp", *TINY, "--out", tmp_path / "y")
    assert proc.returncode == 2 and "conflicts with --parallelism ddp" in proc.stderr
    for args in (["--distributed-optimizer"],  # torchtitan
                 ["--framework", "megatron", "--tp", "1", "--distributed-optimizer", "--device", "cpu"]):
        proc = cli("run", *args, *TINY, "--out", tmp_path / "z")
        assert proc.returncode == 2 and "distributed_optimizer" in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "z").exists()


def test_dead_rank_gives_an_error_record_not_a_hang(cli, tmp_path):
    """A rank of a TP run fails in the loop: its peer is stopped, not left in a collective. The loop's,
    whatever it trains: a model card's tiny decoder."""
    out = tmp_path / "fail"
    proc = cli("run", "--framework", "megatron", "--tp", "2", "--nproc", "2", "--card", TINY_CARD, "--steps", "3",
               "--warmup-steps", "1", "--micro-batch", "2", "--peak-tflops", "0.5", "--fail-at-step", "1",
               "--fail-rank", "1", "--out", out, timeout=600)
    assert proc.returncode == 1
    r = json.loads((out / "result.json").read_text())
    assert r["status"] == "error" and r["tp"] == 2
    # The dead rank's own failure is in the record (the headline may be its peer's lost connection).
    assert 1 in r["failed_ranks"]
    assert any(p["rank"] == 1 and "injected failure at step 1" in p["error"] for p in r["per_rank"])


def _recompute_worker(rank: int, out_path: str) -> None:
    """The megatron backend at tp=1 (one gloo process): FLOPs of one training step per AC mode."""
    from types import SimpleNamespace

    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from echobench.backends import build_training
    from echobench.train.distributed import DistInfo

    one_gloo_rank()
    batch = SimpleNamespace(latent=torch.randn(1, 60, 128), latent_mask=torch.ones(1, 60, dtype=torch.bool),
                            ref=torch.randn(1, 40, 128), ref_mask=torch.ones(1, 40, dtype=torch.bool),
                            text_ids=torch.ones(1, 20, dtype=torch.long), text_mask=torch.ones(1, 20, dtype=torch.bool))
    result = {}
    for ac in ("none", "full", "selective"):
        cfg = RunConfig(framework="megatron", parallelism="tp1", te="off", ac=ac, precision="fp32", device="cpu")
        setup = build_training(cfg, DistInfo(), torch.float32)
        with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
            setup.model(batch, generator=torch.Generator().manual_seed(0)).backward()
        result[ac] = {"flops": counted_model_flops(counter), "recompute": setup.info["recompute"],
                      "mode": setup.info["ac_mode"]}
    with open(out_path, "w") as f:
        json.dump(result, f)
    torch.distributed.destroy_process_group()


def test_megatron_recompute_runs_what_hfu_counts(tmp_path):
    """--ac on megatron recomputes the TP blocks, and exactly the FLOPs that HFU adds."""
    import torch.multiprocessing as mp

    from echobench.model.flops import hardware_flops, model_flops

    out = tmp_path / "flops.json"
    mp.spawn(_recompute_worker, args=(str(out),), nprocs=1, join=True)
    r = json.loads(out.read_text())
    cfg = get_preset("tiny")
    f = model_flops(cfg, 60, 20, 40)
    # selective runs eager here: layer-level (every second block re-run whole)
    assert r["selective"]["mode"] == "selective-layer" and r["full"]["mode"] == "full"
    assert {ac: v["flops"] for ac, v in r.items()} == {ac: hardware_flops(cfg, f, v["mode"]) for ac, v in r.items()}
    assert r["full"]["flops"] > r["none"]["flops"] == f.total
    assert r["none"]["recompute"] == "nothing" and "re-run in backward" in r["full"]["recompute"]


def test_tp_run_with_recompute_and_compile_trains_as_without(cli, tmp_path, tp2_run, inductor_cache):
    """TP=2 with sequence parallelism, full recompute and compiled blocks (inductor, as on a GPU): the
    blocks built with their group and traceable linears compile without a graph break, train with the
    same losses as the plain TP=2 run, and the record says what ran (HFU above MFU: the recompute is
    counted)."""
    out = tmp_path / "tp2-ac"
    proc = cli("run", "--framework", "megatron", "--tp", "2", "--nproc", "2", *TINY, "--ac", "full", "--compile",
               "--sequence-parallel", "--out", out, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads((out / "result.json").read_text())
    assert r["status"] == "ok" and r["ac"] == "full" and r["compile"] is True
    assert r["backend"]["sequence_parallel"] is True and tp2_run["backend"]["sequence_parallel"] is False
    assert "re-run in backward" in r["backend"]["recompute"] and "fullgraph=True" in r["backend"]["compiled"]
    # What compiled, from dynamo's counters: graphs, and no break (the TP blocks are one graph each).
    assert r["compile_graphs"] > 0 and r["compile_graph_breaks"] == 0, r["compile_break_reasons"]
    assert "TracedColumnParallelLinear" in r["backend"]["tp_linears"]
    assert r["hfu"] > r["mfu"] and tp2_run["hfu"] == tp2_run["mfu"]
    assert r["losses"] == pytest.approx(tp2_run["losses"], rel=1e-5)


SHAPES = dict(scale="tiny", micro_batch=2, audio_frames=24, text_tokens=12, speaker_frames=20, precision="fp32",
              device="cpu")


def step_batches(steps: int, micro: int):
    """steps x micro (batch, draws) pairs of the synthetic data at SHAPES, as bench.run_loop makes them."""
    from echobench.data import build_tokenizer, make_loader
    from echobench.model.echo import diffusion_draws

    cfg = get_preset("tiny")
    loader = make_loader("synthetic", micro_batch=SHAPES["micro_batch"], audio_frames=SHAPES["audio_frames"],
                         text_tokens=SHAPES["text_tokens"], speaker_frames=SHAPES["speaker_frames"],
                         tokenizer=build_tokenizer(cfg.text_encoder.vocab, None), rank=0, world_size=1, seed=0,
                         skip_bad_samples=False)
    try:
        out = []
        for _ in range(steps):
            batches = [next(loader) for _ in range(micro)]
            out.append([(b, diffusion_draws(0, b.index.tolist(), SHAPES["audio_frames"], cfg.latent_dim,
                                            cfg.cfg_dropout, torch.device("cpu"))) for b in batches])
        return out
    finally:
        loader.close()


def _sync_worker(rank: int, world: int, store: str, out_path: str) -> None:
    """One of 2 gloo ranks, tp1 x dp2: 2 steps of 2 accumulated micro-batches through megatron-core's
    DDP; which phase of the step each of its gradient reductions started in."""
    import datetime

    import torch.distributed as dist
    from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup

    warnings.filterwarnings("ignore")
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    from echobench.backends import build_training
    from echobench.train.bench import train_step
    from echobench.train.distributed import DistInfo

    cfg = RunConfig(framework="megatron", parallelism="tp1", gpus_per_node=2, grad_accum=2, **SHAPES)
    setup = build_training(cfg, DistInfo(rank=rank, world_size=world, device=torch.device("cpu")), torch.float32)
    phase, started = ["?"], []
    switch, clip = setup.gradient_sync, setup.clip_grad
    setup.gradient_sync = lambda on: (phase.__setitem__(0, "last micro-batch" if on else "earlier micro-batch"),
                                      switch(on))
    setup.clip_grad = lambda: (phase.__setitem__(0, "clip"), clip())[1]
    start = _ParamAndGradBucketGroup.start_grad_sync

    def record(self, *args, **kwargs):
        started.append(phase[0])
        return start(self, *args, **kwargs)

    _ParamAndGradBucketGroup.start_grad_sync = record
    steps = []
    for micro in step_batches(2, 2):
        started.clear()
        train_step(setup, micro, "cpu", 2)
        steps.append(sorted(set(started)))
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(steps, f)
    dist.barrier()
    dist.destroy_process_group()


def test_accumulated_micro_batches_reduce_gradients_on_the_last_only(tmp_path):
    """megatron-core's DDP under gradient accumulation: no reduction starts before the last
    micro-batch's backward; in the first step megatron starts them all when the step finishes its
    sync (it learns the buckets' order then), afterwards while the last backward runs."""
    import torch.multiprocessing as mp

    out = tmp_path / "sync.json"
    mp.spawn(_sync_worker, args=(2, str(tmp_path / "store"), str(out)), nprocs=2, join=True)
    assert json.loads(out.read_text()) == [["clip"], ["last micro-batch"]]
