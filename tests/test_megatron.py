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

from conftest import counted_model_flops, one_gloo_rank, run_cli
from echobench.config import RunConfig
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
                       plain["blocks.0.attn.wq.weight"][(tp - 1) * rows:])
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
    from echobench.model.megatron import TECoreAttention, pack_valid_keys

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

    torch.testing.assert_close(te_reads_padding_mask(*TECoreAttention.te_inputs(q, k, v, key_mask)), plain)
    _, _, packed = pack_valid_keys(k, v, key_mask)
    assert torch.equal(packed, torch.arange(la + lt + ls) < key_mask.sum(1, keepdim=True))


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


def _tp_worker(rank: int, world: int, store: str, out_path: str) -> None:
    """One of 2 gloo ranks: plain model vs TP=2 model on the same weights and batch. The ranks meet
    through a file store (no port to race for)."""
    warnings.filterwarnings("ignore")
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    import datetime

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    from megatron.core import parallel_state

    from echobench.model.echo import EchoTTS
    from echobench.backends.megatron import allreduce_partial_grads, tp_grad_norm, tp_partial_grad_params
    from echobench.model.dit import DiTBlock, joint_attention
    from echobench.model.megatron import TPStateDictAdapter, build_tp_dit, tp_state_dict

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    group = parallel_state.get_tensor_model_parallel_group()
    cfg = get_preset("tiny")
    torch.manual_seed(0)
    plain = EchoTTS(cfg)
    plain.dit = perturbed_plain_dit()
    torch.manual_seed(0)
    tp_model = EchoTTS(cfg)  # same seed: same encoders
    tp_model.dit = build_tp_dit(cfg, plain.dit, parallel_state.get_tensor_model_parallel_rank(), world,
                                te=False, sequence_parallel=False, device=torch.device("cpu"))
    batch = make_batch()

    # Loss and output of the whole model (same noise: same generator seed on both).
    losses, outputs = [], []
    for model in (plain, tp_model):
        captured = []
        handle = model.dit.register_forward_hook(lambda m, i, o: captured.append(o.detach()))
        loss = model(batch, generator=torch.Generator().manual_seed(7))
        handle.remove()
        loss.backward()
        losses.append(loss.detach())
        outputs.append(captured[0])

    params = tp_model.trainable_parameters()
    allreduce_partial_grads(tp_partial_grad_params(tp_model), group)
    tp_norm = tp_grad_norm(params, group)
    plain_norm = torch.nn.utils.get_total_norm([p.grad for p in plain.trainable_parameters()])
    grads = {name: p.grad for name, p in tp_model.dit.named_parameters()}
    all_grads = [None] * world
    dist.all_gather_object(all_grads, grads)
    all_weights = [None] * world
    dist.all_gather_object(all_weights, tp_state_dict(tp_model.dit))
    if rank == 0:
        plain_grads = {name: p.grad for name, p in plain.dit.named_parameters()}
        gathered = TPStateDictAdapter(world).from_tp(all_grads)
        grad_err = {k: (gathered[k] - plain_grads[k]).abs().max().item() for k in plain_grads
                    if not torch.allclose(gathered[k], plain_grads[k], rtol=GRAD_RTOL, atol=GRAD_ATOL)}
        weights_back = TPStateDictAdapter(world).from_tp(all_weights)
        result = {
            "loss": [float(x) for x in losses],
            "out_max_err": (outputs[0] - outputs[1]).abs().max().item(),
            "out_close": torch.allclose(outputs[0], outputs[1], rtol=OUT_RTOL, atol=OUT_ATOL),
            "grad_mismatch": grad_err,
            "grad_keys_match": set(gathered) == set(plain_grads),
            "norms": [float(plain_norm), float(tp_norm)],
            "weights_exact": all(torch.equal(weights_back[k], v) for k, v in plain.dit.state_dict().items()),
            # One block forward for both: the TP blocks are the plain DiTBlock given megatron's layers.
            "same_block": all(type(blk) is DiTBlock and type(blk.attn).forward is joint_attention
                              for dit in (plain.dit, tp_model.dit) for blk in dit.blocks),
        }
        with open(out_path, "w") as f:
            json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


def test_tp2_matches_plain_model(tmp_path):
    import torch.multiprocessing as mp

    out = tmp_path / "result.json"
    mp.spawn(_tp_worker, args=(2, str(tmp_path / "store"), str(out)), nprocs=2, join=True)
    r = json.loads(out.read_text())
    assert r["weights_exact"]  # the loaded shards gather back to the plain weights, bit for bit
    assert r["same_block"]
    assert r["out_close"], f"DiT output differs by {r['out_max_err']}"
    assert r["loss"][1] == pytest.approx(r["loss"][0], rel=OUT_RTOL, abs=OUT_ATOL)
    assert r["grad_keys_match"] and r["grad_mismatch"] == {}, r["grad_mismatch"]
    # TP-aware gradient norm: each element counted once (and the clip would act: norm > 1).
    assert r["norms"][1] == pytest.approx(r["norms"][0], rel=GRAD_RTOL)
    assert r["norms"][0] > 1.0


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
    assert "GPU only" in problem(parallelism="tp2", gpus_per_node=2, sequence_parallel=True, device="cpu")
    assert "tp > 1" in problem(parallelism="tp1", sequence_parallel=True)
    assert problem(parallelism="tp1", precision="fp8").startswith("fp8 on megatron would need TransformerEngine")
    from echobench.backends.megatron import te_installed

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


def test_tp_run_writes_a_record(cli, tmp_path, tp2_run):
    """`echobench run --framework megatron --tp 2 --nproc 2`: a complete record, same figures as torchtitan's."""
    from echobench.flops import flops_report
    from echobench.results import Record

    r = tp2_run
    Record.parse(r)  # a complete, valid record
    assert r["status"] == "ok" and r["parallelism"] == "tp2"
    assert r["tp"] == 2 and r["dp"] == 1 and r["world_size"] == 2 and r["global_batch"] == 2
    assert r["te"] is False and r["backend"]["te"] is False and r["backend"]["backend"] == "megatron"
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
    # A single-process run of the plain model on the same seed and data trains the same way:
    # same weights, same batches, same optimizer and (TP-aware) clipping.
    single = tmp_path / "single"
    assert cli("run", *TINY, "--out", single, timeout=600).returncode == 0
    s = json.loads((single / "result.json").read_text())
    assert s["te"] is False
    assert r["losses"] == pytest.approx(s["losses"], rel=1e-4)


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
    from echobench.launch import child_env

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


def test_dead_rank_gives_an_error_record_not_a_hang(cli, tmp_path):
    out = tmp_path / "fail"
    proc = cli("run", "--framework", "megatron", "--tp", "2", "--nproc", "2", *TINY, "--fail-at-step", "1",
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
    from echobench.distributed import DistInfo

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
        result[ac] = {"flops": counted_model_flops(counter), "recompute": setup.info["recompute"]}
    with open(out_path, "w") as f:
        json.dump(result, f)
    torch.distributed.destroy_process_group()


def test_megatron_recompute_runs_what_hfu_counts(tmp_path):
    """--ac on megatron recomputes the TP blocks, and exactly the FLOPs that HFU adds."""
    import torch.multiprocessing as mp

    from echobench.flops import hardware_flops, model_flops

    out = tmp_path / "flops.json"
    mp.spawn(_recompute_worker, args=(str(out),), nprocs=1, join=True)
    r = json.loads(out.read_text())
    cfg = get_preset("tiny")
    f = model_flops(cfg, 60, 20, 40)
    assert {ac: v["flops"] for ac, v in r.items()} == {ac: hardware_flops(cfg, f, ac) for ac in r}
    assert r["full"]["flops"] > r["none"]["flops"] == f.total
    assert r["none"]["recompute"] == "nothing" and "re-run in backward" in r["full"]["recompute"]


def test_tp_run_with_recompute_and_compile_trains_as_without(cli, tmp_path, tp2_run, inductor_cache):
    """TP=2 with full recompute and compiled blocks: the same losses as the plain TP=2 run, and the
    record says what ran (HFU above MFU: the recompute is counted)."""
    out = tmp_path / "tp2-ac"
    proc = cli("run", "--framework", "megatron", "--tp", "2", "--nproc", "2", *TINY, "--ac", "full", "--compile",
               "--out", out, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads((out / "result.json").read_text())
    assert r["status"] == "ok" and r["ac"] == "full" and r["compile"] is True
    assert "re-run in backward" in r["backend"]["recompute"] and "torch.compile" in r["backend"]["compiled"]
    assert r["hfu"] > r["mfu"] and tp2_run["hfu"] == tp2_run["mfu"]
    assert r["losses"] == pytest.approx(tp2_run["losses"], rel=1e-5)
