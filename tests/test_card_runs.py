"""Card runs (setting card): a plain decoder from a model card, trained through echobench's harness.

Its FLOPs against FlopCounterMode (exact, as tests/test_flops.py holds Echo's) and against the
conventions of the published rows; a single-process run's record; DDP and FSDP2 over 2 gloo
processes against one process at the same global batch (as tests/test_torchtitan.py does for Echo);
the refusals. The card is tiny (2 blocks of width 64, 32 tokens): each run takes seconds.
"""

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import yaml
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import FlopCounterMode

from conftest import ONE_THREAD, ROOT, TINY_CARD, cli_env, record, run_cli, two_launchers
from echobench.model.decoder import Decoder, decoder_flops, recompute_flops
from echobench.predict.cards.card import ModelCard, card_params, load_card_file
from echobench.predict.cards.run import run_card
from echobench.predict.cards.work import model_flops_per_token
from echobench.predict.frameworks import framework
from echobench.records.config import RunConfig, run_id, upgraded

# The suite's tiny card (tests/fixtures/tiny-card.yaml); write_card writes it with changes.
TINY = yaml.safe_load(Path(TINY_CARD).read_text())
MODEL, RUN, HARDWARE = TINY["model"], TINY["run"], TINY["hardware"]
SEQ = RUN["seq"]
# As tests/test_torchtitan.py's: the ranks see the same samples and only the order of the floating-point
# reductions differs (measured ~1e-7 relative over 3 steps, one thread per process).
RTOL = 5e-6


def card(**changes) -> ModelCard:
    return ModelCard(**{**MODEL, **changes})


def write_card(path, model: dict | None = None, run: dict | None = None):
    path.write_text(yaml.safe_dump({"model": {**MODEL, **(model or {})}, "run": {**RUN, **(run or {})},
                                    "hardware": HARDWARE}))
    return path


def counted(model: Decoder, batch: int = 3) -> int:
    """FlopCounterMode's count of one forward and backward (attention under the math SDPA backend:
    scores and values as bmm), on the meta device."""
    with torch.device("meta"):
        tokens = torch.zeros(batch, model.seq + 1, dtype=torch.long)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(tokens, reduction="sum").backward()
    return counter.get_total_flops()


def meta_decoder(c: ModelCard, seq: int = SEQ) -> Decoder:
    with torch.device("meta"):
        return Decoder(c, seq)


# ---- FLOPs ----

@pytest.mark.parametrize("activation", ["gelu", "swiglu", "relu2"])
@pytest.mark.parametrize("kv_heads,tied,positions,norm,bias", [(4, True, "learned", "layernorm", True),
                                                                (2, False, "rotary", "rmsnorm", False),
                                                                (1, True, "none", "layernorm", False)])
def test_flops_equal_the_flop_counter(activation, kv_heads, tied, positions, norm, bias):
    """MHA, GQA and MQA, tied and untied, each activation: decoder_flops is what the counter counts,
    exactly, and the modules hold card.card_params's parameters (predict's count)."""
    c = card(activation=activation, kv_heads=kv_heads, tied_embeddings=tied, positions=positions, norm=norm, bias=bias)
    model = meta_decoder(c)
    assert sum(p.numel() for p in model.parameters()) == card_params(c, SEQ)
    per_sample = sum(p.total for p in decoder_flops(c, SEQ).values())
    assert counted(model) == 3 * per_sample


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_full_checkpointing_re_runs_what_hardware_flops_count(activation):
    c = card(activation=activation)
    model = meta_decoder(c)
    plain = counted(model)
    for block in model.blocks:
        block.forward = (lambda f: lambda *a: checkpoint(f, *a, use_reentrant=False))(block.forward)
    assert counted(model) - plain == 3 * recompute_flops(c, SEQ, "full") > 0
    assert recompute_flops(c, SEQ, "selective-layer") == recompute_flops(c, SEQ, "full") // 2


@pytest.mark.parametrize("path", ["tunes/card-small.yaml", "tunes/card-1b.yaml"])
def test_measured_numerator_is_the_predicted_one(path):
    """The MFU a card run measures and the one `predict` gives a card share their numerator."""
    c, layout, _ = load_card_file(ROOT / path)
    per_token = sum(p.total for p in decoder_flops(c, layout.seq).values()) / layout.seq
    assert per_token == model_flops_per_token(c, layout, framework(layout.framework or "torchtitan"))


def test_numerator_against_the_published_rows_conventions():
    """Megatron-LM's 72 L h^2 + 12 L h s + 6 h V is echobench's count for its GPT (MHA, ffn 4h, GELU);
    llm-foundry's 6 N + 12 L d s counts beside the matmuls the norms, biases and position table (N):
    a fraction of a percent more at seq 2048."""
    rows = ROOT / "validation/published-runs.yaml"
    mlm = run_card(f"{rows}#mlm-gpt-1.7b-48gpu")
    assert sum(p.total for p in decoder_flops(mlm.card, mlm.seq).values()) / mlm.seq == mlm.row_flops_per_token
    mpt = run_card(f"{rows}#lf-mpt-1b-8gpu")
    ours = sum(p.total for p in decoder_flops(mpt.card, mpt.seq).values()) / mpt.seq
    assert mpt.label == "lf-mpt-1b-8gpu" and mpt.seq == 2048 and mpt.row_convention.startswith("6N + 12 L d s")
    assert 0.99 < ours / mpt.row_flops_per_token < 1


# ---- runs ----

def run_card_cli(tmp_path, name, card_path, *args, env=ONE_THREAD):
    out = tmp_path / name
    proc = run_cli("run", "--card", card_path, "--steps", "3", "--warmup-steps", "0", "--peak-tflops", "1", *args,
                   "--out", out, tmp_path=tmp_path, timeout=300, env=env)
    return proc, out


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """The reference: one process, micro-batch 4 (the global batch of 2 ranks x micro-batch 2)."""
    tmp = tmp_path_factory.mktemp("card")
    path = write_card(tmp / "tiny.yaml")
    proc, out = run_card_cli(tmp, "single", path, "--micro-batch", "4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return path, record(out), proc.stdout


def test_single_process_record(single):
    path, r, stdout = single
    assert r["status"] == "ok", r["error"]
    assert r["scale"] == "tiny" and r["run_id"].startswith("tiny-torchtitan-single-n1x1-mb4-")
    per_sample = sum(p.total for p in decoder_flops(card(), SEQ).values())
    assert r["flops_breakdown"]["model_flops_per_sample"] == r["model_flops_per_sample"] == per_sample
    assert r["measured_samples"] == 3 * 4 and r["measured_model_flops"] == per_sample * 12
    assert r["mfu"] == pytest.approx(per_sample * 12 / (r["measured_time_s"] * 1e12), rel=1e-12)
    assert r["card"]["source"] == str(path) and r["card"]["seq"] == SEQ and r["card"]["model"]["kv_heads"] == 2
    assert r["card"]["published_layout"]["micro_batch"] == 2  # what the card publishes, beside what ran
    assert r["card"]["flops_convention"].startswith("echobench: every matmul")
    assert r["card"]["tokens_per_s_per_gpu"] == pytest.approx(12 * SEQ / r["measured_time_s"])
    assert r["card"]["row_convention"] is None and "row_mfu" not in r["card"]
    assert r["audio_seconds_per_s"] is None and r["backend"]["model"].startswith("decoder from card tiny")
    assert len(r["losses"]) == 3 and r["losses"][1] != r["losses"][0]
    assert "card" in stdout and "tokens/s per device" in stdout
    assert r["sdpa_backends_predicted"] == {"decoder": sdpa_choice(r, heads=4, kv_heads=2)}
    assert r["attention_kernels"] is None  # profiled on a GPU only


def sdpa_choice(r: dict, heads: int, kv_heads: int) -> str:
    """torch's SDPA choice for the tiny card's causal GQA attention at the record's micro-batch and
    dtype, with `heads` query and `kv_heads` key / value heads on a rank."""
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[r["precision"]]
    q = torch.zeros(r["micro_batch"], heads, SEQ, MODEL["hidden"] // MODEL["heads"], dtype=dtype)
    k = torch.zeros(r["micro_batch"], kv_heads, SEQ, MODEL["hidden"] // MODEL["heads"], dtype=dtype)
    return SDPBackend(torch._fused_sdp_choice(q, k, k, is_causal=True, enable_gqa=True)).name


LAYOUTS = {"ddp": None,  # the suite's traced card DDP run (conftest.card_ddp_run: this file's settings)
           "fsdp2": ["--micro-batch", "2", "--parallelism", "fsdp2"],
           "tp2": ["--micro-batch", "4", "--framework", "megatron", "--tp", "2"]}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_two_processes_match_single_process(tmp_path, single, card_ddp_run, layout):
    """DDP and FSDP2 (2 data-parallel ranks of micro-batch 2) and megatron TP=2 (one replica of micro-batch
    4) train on the single process's samples and follow its losses."""
    path, ref, _ = single
    if LAYOUTS[layout] is None:
        out = card_ddp_run  # its fixture asserted its exit code; --trace's steps follow the losses'
    else:
        proc, out = run_card_cli(tmp_path, layout, path, "--nproc", "2", *LAYOUTS[layout])
        assert proc.returncode == 0, record(out)["error"] + proc.stderr[-3000:]
    r = record(out)
    assert (r["parallelism"], r["micro_batch"]) == (layout, 4 if layout == "tp2" else 2)
    assert r["world_size"] == 2 and r["global_batch"] == 4 and r["measured_samples"] == 12
    # data-parallel ranks each see their own samples; TP peers the same ones
    same = r["per_rank"][0]["losses"][0] == r["per_rank"][1]["losses"][0]
    assert same == (layout == "tp2")
    assert r["losses"] == pytest.approx(ref["losses"], rel=RTOL, abs=0)
    assert r["measured_model_flops"] == ref["measured_model_flops"]
    if layout == "fsdp2":
        assert r["backend"]["sharding"] == "FSDP2 per block + root"
    if layout == "tp2":
        assert r["backend"]["backend"] == "megatron" and r["backend"]["tp"] == 2 and r["tp"] == 2
        assert r["sdpa_backends_predicted"] == {"decoder": sdpa_choice(r, heads=2, kv_heads=1)}  # a rank's heads


def test_hsdp_on_two_nodes_matches_single_process(tmp_path, single):
    """Two launchers on this machine stand in for two nodes: a 2x1 (replicate x shard) mesh."""
    path, ref, _ = single
    out = tmp_path / "hsdp"
    codes, logs = two_launchers(["--card", path, "--steps", "3", "--warmup-steps", "0", "--peak-tflops", "1",
                                 "--micro-batch", "2", "--parallelism", "hsdp", "--out", out],
                                cli_env(tmp_path) | ONE_THREAD, timeout=300)
    r = record(out)
    assert codes[0] == 0, r["error"] + logs[0][-3000:]
    assert r["backend"]["mesh"] == {"dp_replicate": 2, "dp_shard": 1} and r["global_batch"] == 4
    assert r["losses"] == pytest.approx(ref["losses"], rel=RTOL, abs=0)


def test_fp8_emulated_run_converts_the_block_linears(tmp_path, single):
    """On a CPU torchao emulates float8: the block linears convert, the LM head stays; it trains."""
    path, ref, _ = single
    proc, out = run_card_cli(tmp_path, "fp8", path, "--micro-batch", "4", "--precision", "fp8")
    r = record(out)
    assert proc.returncode == 0, r["error"] + proc.stderr[-3000:]
    assert r["backend"]["float8"] == "emulated" and r["backend"]["float8_linears"] == 2 * 4  # qkv, out, up, down
    assert r["losses"] == pytest.approx(ref["losses"], rel=1e-3) and r["losses"] != ref["losses"]


def test_accumulated_micro_batches_train_as_one_batch(tmp_path, single):
    path, ref, _ = single
    proc, out = run_card_cli(tmp_path, "accum", path, "--micro-batch", "2", "--grad-accum", "2")
    r = record(out)
    assert proc.returncode == 0, r["error"] + proc.stderr[-3000:]
    assert r["losses"] == pytest.approx(ref["losses"], rel=RTOL, abs=0)


def test_full_ac_counts_its_recompute_and_trains_alike(tmp_path, single):
    path, ref, _ = single
    proc, out = run_card_cli(tmp_path, "ac", path, "--micro-batch", "4", "--ac", "full")
    r = record(out)
    assert proc.returncode == 0, r["error"] + proc.stderr[-3000:]
    assert r["losses"] == pytest.approx(ref["losses"], rel=RTOL, abs=0)
    assert r["measured_hardware_flops"] - r["measured_model_flops"] == 12 * recompute_flops(card(), SEQ, "full")


def _tp_worker(rank: int, world: int, store: str, out_path: str, cases: dict[str, list]) -> None:
    """One of 2 gloo ranks: for each case (a card file, with or without sequence parallelism), the
    card's TP=2 decoder as the megatron backend builds it against the plain decoder of the same seed,
    on the same tokens, two steps each: loss and gradient norm. The ranks meet through a file store
    (no port to race for); the cases run one after the other in the same two processes."""
    import datetime
    import os
    import warnings

    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    from megatron.core import parallel_state

    from echobench.backends import build_training
    from echobench.backends.torchtitan import ADAMW, build_decoder, clip_grad_norm_
    from echobench.model.decoder import synthetic_tokens
    from echobench.train.bench import train_step
    from echobench.train.bench_card import CardLoss
    from echobench.train.distributed import DistInfo

    results = {}
    for name, (card_path, sequence_parallel) in cases.items():
        cfg = RunConfig(card=card_path, framework="megatron", parallelism="tp2", gpus_per_node=2, micro_batch=4,
                        sequence_parallel=sequence_parallel)
        workload = run_card(card_path)
        setup = build_training(cfg, DistInfo(rank=rank, world_size=world, device=torch.device("cpu")), torch.float32,
                               workload)
        plain = build_decoder(cfg, workload, torch.device("cpu"))
        optimizer = torch.optim.AdamW(plain.parameters(), **ADAMW)
        tokens = synthetic_tokens(0, list(range(4)), workload.card.vocab, workload.seq)
        block = setup.model.module.blocks[0]
        norms, clip = [], setup.clip_grad
        setup.clip_grad = lambda clip=clip, norms=norms: norms.append(float(clip())) or norms[-1]
        steps = []
        for _ in range(2):  # a step of each: TP (megatron's clip and AdamW), plain (torch's)
            tp_loss = float(train_step(setup, [tokens], "cpu", 1, CardLoss(4 * workload.seq)))
            plain_loss = plain(tokens, reduction="mean")
            plain_loss.backward()
            plain_norm = float(clip_grad_norm_(list(plain.parameters()), 1.0))
            optimizer.step()
            optimizer.zero_grad()
            steps.append([tp_loss, float(plain_loss), norms[-1], plain_norm])
        results[name] = {"shapes": [list(block.attn.qkv.linear.weight.shape), list(block.mlp.down.linear.weight.shape)],
                         "steps": steps, "sequence_parallel": setup.info["sequence_parallel"]}
        del setup
        parallel_state.destroy_model_parallel()  # the next case's build initialises its own
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


TP_CASES = {"tp": (False, {}),  # rmsnorm, no biases, rotary, swiglu
            "sp-layernorm-bias": (True, {"norm": "layernorm", "bias": True, "positions": "learned", "activation": "gelu"})}


@pytest.fixture(scope="module")
def tp2_steps(tmp_path_factory) -> dict:
    """TP_CASES' two steps each, in one pair of spawned gloo ranks (_tp_worker)."""
    import torch.multiprocessing as mp

    pytest.importorskip("megatron.core")
    tmp = tmp_path_factory.mktemp("card-tp2")
    cases = {name: (str(write_card(tmp / f"{name}.yaml", model=model)), sp) for name, (sp, model) in TP_CASES.items()}
    out = tmp / "result.json"
    mp.spawn(_tp_worker, args=(2, str(tmp / "store"), str(out), cases), nprocs=2, join=True)
    return json.loads(out.read_text())


@pytest.mark.parametrize("case", TP_CASES)
def test_megatron_tp2_trains_as_the_plain_decoder(tp2_steps, case):
    """TP=2 on megatron-core's layers, DDP, optimizer and clip: each rank holds half of every block's
    q / k / v and MLP rows and of the output and down projections' columns; the loss equals the plain
    decoder's, as do the gradient norm and the loss after one AdamW step of each. With sequence
    parallelism each rank's blocks see half the sequence between the TP regions: their norms' (and
    the row-parallel biases') gradients are partial, summed over TP before the clip."""
    r = tp2_steps[case]
    assert r["sequence_parallel"] is TP_CASES[case][0]
    d, kv, f = 64, 2 * 16, 128
    assert r["shapes"] == [[(d + 2 * kv) // 2, d], [d, f // 2]]
    for tp_loss, plain_loss, tp_norm, plain_norm in r["steps"]:  # the TP-aware norm counts each element once
        assert [tp_loss, tp_norm] == pytest.approx([plain_loss, plain_norm], rel=1e-5)
    assert r["steps"][1][0] != r["steps"][0][0]


def published_rows(tmp_path):
    """A published-runs file of one tiny row in llm-foundry's convention."""
    row = {"id": "tiny-mpt", "source": {"name": "test", "repo": "none/none", "commit": "0"},
           "hardware": {"profile": "h100-hgx-ib", "gpus": 2, "gpus_per_node": 2},
           "model": {**MODEL, "activation": "gelu", "kv_heads": 4, "positions": "learned", "norm": "layernorm",
                     "bias": True},
           "run": {**RUN, "layout": "fsdp", "framework": "llm-foundry"},
           "published": {"tflops_per_gpu": 100, "convention": "6N + 12 L d s per token [red], peak 989.5"}}
    path = tmp_path / "rows.yaml"
    path.write_text(yaml.safe_dump([row]))
    return path


def test_a_published_row_runs_and_states_its_mfu_under_the_row_s_convention(tmp_path):
    rows = published_rows(tmp_path)
    proc, out = run_card_cli(tmp_path, "row", f"{rows}#tiny-mpt", "--micro-batch", "2")
    r = record(out)
    assert proc.returncode == 0, r["error"] + proc.stderr[-3000:]
    c = card(activation="gelu", kv_heads=4, positions="learned", norm="layernorm", bias=True)
    n = card_params(c, SEQ)
    assert r["scale"] == "tiny-mpt" and r["card"]["row_flops_per_token"] == 6 * n + 12 * 2 * 64 * SEQ
    tokens = r["measured_samples"] * SEQ
    assert r["card"]["row_mfu"] == pytest.approx((6 * n + 12 * 2 * 64 * SEQ) * tokens / (r["measured_time_s"] * 1e12))
    assert r["card"]["published_layout"]["framework"] == "llm-foundry"
    # the row's convention, text from a file, printed as written (no rich markup)
    assert "MFU (row's convention)" in proc.stdout and "(6N + 12 L d s per token [red])" in proc.stdout


# ---- settings and refusals ----

def test_an_echo_run_keeps_its_id():
    """card is a later key: at its default it leaves a stored run's id as it was."""
    stored = json.loads((ROOT / "tests/fixtures/record-v2.json").read_text())
    cfg = RunConfig.from_dict(upgraded(stored["config"]))
    assert cfg.card is None and run_id(cfg) == stored["run_id"]
    assert run_id(replace(cfg, card="tunes/card-small.yaml")).startswith("card-small-torchtitan-single-")


@pytest.mark.parametrize("settings,why", [({"data": "/shards"}, "synthetic token batches"),
                                          ({"card": "rows.yaml#"}, "give a card file, or FILE#ROW")])
def test_settings_a_card_run_refuses(settings, why):
    with pytest.raises(ValueError, match=why):
        RunConfig.from_dict({"card": "tunes/card-small.yaml", **settings})


@pytest.mark.parametrize("case,why", [
    ("alibi", "card positions alibi: echobench's decoder has learned, rotary, none positions"),
    ("megatron", "tp=3 does not divide the card's heads 4: give a tp that does"),
    ("fp8", "fp8: the card's linears see micro_batch 3 x seq 30 = 90 rows"),
    ("sp", "sequence parallelism splits the card's seq 31 over tp=2, which does not divide it"),
    ("row", "no row 'nope': give one of tiny-mpt"),
    ("missing", "missing.yaml"),
])
def test_what_cannot_run_is_refused_in_one_line_before_launch(tmp_path, case, why):
    args = {"alibi": [write_card(tmp_path / "a.yaml", model={"positions": "alibi"})],
            "megatron": [write_card(tmp_path / "m.yaml"), "--framework", "megatron", "--tp", "3", "--nproc", "3"],
            "fp8": [write_card(tmp_path / "f.yaml", run={"seq": 30}), "--precision", "fp8", "--micro-batch", "3"],
            "sp": [write_card(tmp_path / "s.yaml", run={"seq": 31}), "--framework", "megatron", "--tp", "2",
                   "--nproc", "2", "--sequence-parallel"],
            "row": [f"{published_rows(tmp_path)}#nope"],
            "missing": [tmp_path / "missing.yaml"]}[case]
    proc = run_cli("run", "--card", *args, "--out", tmp_path / "out", tmp_path=tmp_path, timeout=120)
    assert proc.returncode == 2 and why in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out" / "result.json").exists()
