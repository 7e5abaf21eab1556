"""Where the time goes: classification, the sweep rule, the waterfall, real CPU traces, `explain`.

GPU kernels are tested on their names and on events built with torch.profiler's own event type
(no GPU trace is stored yet); the CPU path runs on real traces of the tiny model.
"""

import inspect
import json

import pytest
from torch.autograd import DeviceType
from torch.autograd.profiler_util import EventList, FunctionEvent

from echobench.train.breakdown import (CATEGORIES, DATA_WAIT, breakdown_from_events, classify_kernel, classify_op,
                                 short_name, summary, waterfall)
from echobench.records.results import Record

# Names as profilers print them (cuBLAS / CUTLASS / cuDNN / flash / NCCL / inductor / ATen).
KERNELS = [
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel__5x_cublas", "gemm"),
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTT", "gemm"),
    ("nvjet_tss_64x8_64x16_2x1_v_bz_splitK_TNT", "gemm"),
    ("void splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float, __nv_bfloat16, true, false, false>(cublasSplitKParams<float>, float const*, __nv_bfloat16 const*, __nv_bfloat16*, float const*, float const*, __nv_bfloat16 const*, float const*, __nv_bfloat16*, void*, long, float*, int*)", "gemm"),
    ("cutlass3x_sm90_tensorop_gemm_bf16_bf16_f32_bf16_bf16_128x256x64_1x2x1_0_tnn_align8_warpspecialized_cooperative_epi_tma", "gemm"),
    ("void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_32x6_tn_align8>(cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_32x6_tn_align8::Params)", "gemm"),
    ("ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_64x3_nn", "gemm"),
    ("void gemv2T_kernel_val<int, int, float, float, float, float, 128, 16, 4, 4, false, false, cublasGemvParamsEx<int, cublasGemvTensorStridedBatched<float const>, cublasGemvTensorStridedBatched<float const>, cublasGemvTensorStridedBatched<float>, float> >(cublasGemvParamsEx<int, cublasGemvTensorStridedBatched<float const>, cublasGemvTensorStridedBatched<float const>, cublasGemvTensorStridedBatched<float>, float>, float, float)", "gemm"),
    ("triton_tem_fused_mm_0", "gemm"),
    ("void flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, false, cutlass::bfloat16_t, Flash_kernel_traits<128, 128, 64, 4, cutlass::bfloat16_t> >, false, false, false, false, true, true, false, false>(Flash_fwd_params)", "attention"),
    ("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<pytorch_flash::Flash_bwd_kernel_traits<128, 64, 128, 8, 2, 4, 2, false, false, cutlass::bfloat16_t, pytorch_flash::Flash_kernel_traits<128, 64, 128, 8, cutlass::bfloat16_t> >, true, false, false, false, false, false>(pytorch_flash::Flash_bwd_params)", "attention"),
    ("void pytorch_flash::flash_bwd_dot_do_o_kernel<true, pytorch_flash::Flash_bwd_kernel_traits<128, 64, 128, 8, 2, 4, 2, false, false, cutlass::bfloat16_t, pytorch_flash::Flash_kernel_traits<128, 64, 128, 8, cutlass::bfloat16_t> > >(pytorch_flash::Flash_bwd_params)", "attention"),
    ("fmha_cutlassF_bf16_aligned_64x128_rf_sm80(PyTorchMemEffAttention::AttentionKernel<cutlass::bfloat16_t, cutlass::arch::Sm80, true, 64, 128, 128, true, true>::Params)", "attention"),
    ("fmha_cutlassB_bf16_aligned_128x64_k128_sm80(PyTorchMemEffAttention::AttentionBackwardKernel<cutlass::arch::Sm80, cutlass::bfloat16_t, true, false, true, 128, 64, 128, false>::Params)", "attention"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x128_4x1x1_kernel0_0", "attention"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x128_4x1x1_kernel0_0", "attention"),
    ("void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<cute::tuple<cute::C<128>, cute::C<176>, cute::C<128> >, 2, 2, true> > >(flash::FlashAttnFwdSm90<cute::tuple<cute::C<128> > >::Params)", "attention"),
    ("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "communication"),
    ("ncclKernel_AllGather_RING_LL_Sum_int8_t(ncclDevComm*, unsigned long, ncclWork*)", "communication"),
    ("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "communication"),
    ("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", "communication"),
    ("Memcpy HtoD (Pageable -> Device)", "memcpy"),
    ("Memcpy DtoD (Device -> Device)", "memcpy"),
    ("Memset (Device)", "memcpy"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>, std::array<char*, 3ul> >(int, at::native::CUDAFunctor_add<c10::BFloat16>, std::array<char*, 3ul>)", "other_compute"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MeanOps<float, float, float, float>, unsigned int, c10::BFloat16, 4, 4> >(at::native::ReduceOp<float, at::native::MeanOps<float, float, float, float>, unsigned int, c10::BFloat16, 4, 4>)", "other_compute"),
    ("triton_poi_fused_add_addmm_gelu_0", "other_compute"),  # an addmm epilogue: element-wise, not a GEMM
    ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_1", "other_compute"),
    ("triton_per_fused__scaled_dot_product_attention_mask_2", "other_compute"),
    ("void (anonymous namespace)::softmax_warp_forward<c10::BFloat16, c10::BFloat16, float, 10, false, false>(c10::BFloat16*, c10::BFloat16 const*, int, int, int, bool const*, int, bool)", "other_compute"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::FusedOptimizerTensorListMetadata<4>, at::native::(anonymous namespace)::FusedAdamMathFunctor<float, 4, (at::native::ADAM_MODE)1, false>, double*, double, double, double, double, double, bool, float*, float*>(at::native::(anonymous namespace)::FusedOptimizerTensorListMetadata<4>, at::native::(anonymous namespace)::FusedAdamMathFunctor<float, 4, (at::native::ADAM_MODE)1, false>, double*, double, double, double, double, double, bool, float*, float*)", "optimizer"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::TensorListMetadata<2>, at::native::(anonymous namespace)::BinaryOpScalarFunctor<float, 2, 1, 1>, std::multiplies<float>, float>(at::native::(anonymous namespace)::TensorListMetadata<2>, at::native::(anonymous namespace)::BinaryOpScalarFunctor<float, 2, 1, 1>, std::multiplies<float>, float)", "optimizer"),
]


@pytest.mark.parametrize("name, category", KERNELS, ids=[short_name(n, 40) for n, _ in KERNELS])
def test_gpu_kernel_names_are_classified(name, category):
    assert classify_kernel(name) == category


def test_host_op_names_are_classified():
    expected = {
        "aten::mm": "gemm", "aten::linear": "gemm", "aten::addmm": "gemm", "aten::bmm": "gemm",
        "aten::scaled_dot_product_attention": "attention",
        "aten::_scaled_dot_product_flash_attention_for_cpu_backward": "attention",
        "aten::_scaled_dot_product_efficient_attention": "attention",
        "aten::mul": "other_compute", "aten::native_layer_norm": "other_compute", "aten::_softmax": "other_compute",
        "## Call CompiledFxGraph fr6zw3znssfqozsb5pcqm2tlasg3lxh65exffcrhizaq5ckf5qwa ##": "other_compute",
        "Torch-Compiled Region: 0/0": None, "CompiledFunction": None,
        "Optimizer.step#AdamW.step": "optimizer", "Optimizer.zero_grad#AdamW.zero_grad": "optimizer",
        "aten::_foreach_norm": "optimizer",
        "gloo:all_reduce": "communication", "c10d::allreduce_": "communication",
        "c10d::_reduce_scatter_base_": "communication", "_c10d_functional::all_reduce": "communication",
        "nccl:all_reduce": "communication", "record_param_comms": "communication",
        "aten::copy_": "memcpy", "torch.distributed.ddp.reducer::copy_bucket_to_grad": "memcpy",
        "fsdp::all_gather_copy_in": "memcpy", "FSDP::all_gather_copy_out (dit.blocks.0)": "memcpy",
        DATA_WAIT: "data_wait",
        # containers: their children say what ran
        "autograd::engine::evaluate_function: MmBackward0": None, "MmBackward0": None,
        "FSDP::pre_forward (dit.blocks.0)": None, "FSDP::all_gather (dit.blocks.0)": None, "ProfilerStep#4": None,
    }
    assert {name: classify_op(name) for name in expected} == expected


def ev(eid, name, start, end, thread=1, **kw):
    return FunctionEvent(id=eid, name=name, thread=thread, start_us=start, end_us=end, trace_name=name, **kw)


# torch >= 2.13's events link a kernel to its host op (linked_correlation_id); torch 2.11's do not.
LINKED = "linked_correlation_id" in inspect.signature(FunctionEvent).parameters


def kernel(eid, name, start, end, stream=7, corr=0):
    linked = {"linked_correlation_id": corr, "activity_type": "kernel"} if LINKED else {}
    return ev(eid, name, start, end, thread=stream, device_type=DeviceType.CUDA, device_resource_id=stream, **linked)


def test_gpu_breakdown_follows_the_priority_rule_on_profiler_events():
    """Events of torch.profiler's own type, two profiled steps, times in microseconds:
    a GEMM overlapping an NCCL kernel on another stream, a Triton kernel launched inside
    Optimizer.step, host data waits while the device idles, a memset trailing the host."""
    events = EventList([
        ev(1, "ProfilerStep#5", 0, 100), ev(2, "ProfilerStep#6", 100, 200),
        ev(3, DATA_WAIT, 0, 10), ev(4, DATA_WAIT, 100, 110),
        ev(5, "Optimizer.step#AdamW.step", 80, 96), ev(42, "aten::_foreach_add_", 82, 84),
        ev(14, "cudaLaunchKernel", 83, 83.5),  # kernel 14's launch: its correlation id is the kernel's
        kernel(10, "Memcpy HtoD (Pageable -> Device)", 12, 18),
        kernel(11, "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTT", 20, 50),
        kernel(12, "ncclDevKernel_AllReduce_Sum_f32_RING_LL", 40, 70, stream=20),
        kernel(13, "void at::native::vectorized_elementwise_kernel<4>(int)", 70, 75),
        kernel(14, "triton_poi_fused_add_mul_0", 85, 95, corr=42),  # optimizer: launched inside Optimizer.step
        kernel(15, "flash_fwd_kernel", 115, 145),
        kernel(16, "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", 150, 170),
        kernel(17, "Memset (Device)", 195, 210),
        # a record_function's range drawn on the GPU: not work
        ev(18, "ProfilerStep#5", 0, 100, thread=7, device_type=DeviceType.CUDA, is_user_annotation=True),
    ])
    events._build_tree()
    b = breakdown_from_events(events, rank=3)
    assert b["rank"] == 3 and b["timeline"] == "GPU streams" and b["steps"] == 2
    us = {c: round(s * 1e6 * 2, 6) for c, s in b["seconds"].items()}  # both steps, in microseconds
    assert us == {"gemm": 50, "attention": 30, "optimizer": 10, "other_compute": 5, "memcpy": 21,
                  "communication": 20, "data_wait": 20, "idle": 54}
    assert b["step_time_s"] == pytest.approx(105e-6)  # window 0..210 (the memset trails the last host step)
    assert sum(b["seconds"].values()) == pytest.approx(b["step_time_s"], rel=1e-12)
    assert b["communication"]["total_s"] * 2e6 == pytest.approx(30)
    assert b["communication"]["overlapped_s"] * 2e6 == pytest.approx(10)  # 40..50 under the GEMM


def test_cpu_breakdown_nested_ops_and_a_gloo_thread():
    """Main-thread op tree: a classified op claims its subtree, a container's own gaps are idle,
    an other-compute op keeps what its children leave; gloo's collective runs on its own thread."""
    events = EventList([
        ev(1, "ProfilerStep#5", 0, 100),
        ev(2, DATA_WAIT, 0, 8),
        ev(3, "autograd::engine::evaluate_function: MmBackward0", 10, 40),
        ev(4, "MmBackward0", 12, 38), ev(5, "aten::mm", 15, 35), ev(6, "aten::t", 16, 17),
        ev(7, "aten::layer_norm", 40, 70), ev(8, "aten::native_layer_norm", 45, 60), ev(9, "aten::linear", 60, 65),
        ev(10, "Optimizer.step#AdamW.step", 70, 90), ev(11, "aten::mul_", 72, 88),
        ev(12, "gloo:all_reduce", 30, 95, thread=2, is_async=True),
    ])
    events._build_tree()
    b = breakdown_from_events(events)
    assert b["timeline"] == "main thread" and b["steps"] == 1
    us = {c: round(s * 1e6, 6) for c, s in b["seconds"].items()}
    assert us == {"gemm": 25, "attention": 0, "optimizer": 20, "other_compute": 25, "memcpy": 0,
                  "communication": 10, "data_wait": 8, "idle": 12}
    assert b["communication"]["total_s"] * 1e6 == pytest.approx(65)
    assert b["communication"]["overlapped_s"] * 1e6 == pytest.approx(55)
    assert dict((n, round(s * 1e6)) for n, s in b["top"]["other_compute"]) == {"aten::native_layer_norm": 15,
                                                                             "aten::layer_norm": 10}


def profiled_record(fractions, mfu=0.38, peak=990.0, ceiling=None, source="datasheet:GH200"):
    from test_report import record

    return record("r", mfu=mfu, peak_tflops=peak, ceiling_tflops=ceiling, peak_source=source,
                  breakdown={"fractions": fractions})


def test_waterfall_steps_sum_exactly_from_the_peak_to_the_mfu():
    f = {"gemm": 0.5, "attention": 0.1, "optimizer": 0.05, "other_compute": 0.15, "memcpy": 0.02,
         "communication": 0.08, "data_wait": 0.03, "idle": 0.07}
    steps = waterfall(profiled_record(f, ceiling=742.5).update(**padding(10**15, 10**15)))  # no padding
    assert [s["kind"] for s in steps] == ["absolute"] + ["relative"] * 8 + ["total"]
    assert steps[0]["pp"] == 100 and steps[-1]["pp"] == pytest.approx(38.0)
    assert 100 + sum(s["pp"] for s in steps[1:-1]) == pytest.approx(38.0, abs=1e-9)
    by_label = {s["short"]: s["pp"] for s in steps}
    assert by_label["GEMM ceiling"] == pytest.approx(-25.0)  # 742.5 / 990 = 75%
    assert by_label["non-GEMM compute"] == pytest.approx(-75 * 0.20)
    assert by_label["exposed comm"] == pytest.approx(-75 * 0.08)
    assert by_label["idle / launch"] == pytest.approx(-75 * 0.07)
    assert by_label["data wait"] == pytest.approx(-75 * 0.03)
    assert by_label["matmul shortfall / other"] == pytest.approx(-(75 * 0.6 - 38))
    # without a calibration the ceiling is the peak; a run above what its parts explain shows a gain
    steps = waterfall(profiled_record(f, mfu=0.9).update(**padding(10**15, 10**15)))
    assert steps[1]["pp"] == 0 and steps[-2]["pp"] == pytest.approx(90 - 60) and steps[-1]["pp"] == pytest.approx(90)
    assert waterfall(profiled_record(f).update(breakdown=None)) is None


def padding(padded_flops, hardware_flops):
    """The record's padding figures for set counts (run_figures.padding_figures; the streams' shares set too)."""
    from echobench.records.run_figures import padding_figures

    return padding_figures(padded_flops=padded_flops, hardware_flops=hardware_flops,
                           tokens={"latent": [60, 100], "text": [30, 40], "speaker": [9, 10]})


def test_waterfall_takes_padding_out_of_the_matmul_shortfall():
    """Padding costs C x (GEMM + attention fraction) x (padded - hardware FLOPs) / padded FLOPs; the
    matmul shortfall keeps the rest; the steps still sum exactly from the peak to the MFU."""
    f = {"gemm": 0.5, "attention": 0.1, "optimizer": 0.05, "other_compute": 0.15, "memcpy": 0.02,
         "communication": 0.08, "data_wait": 0.03, "idle": 0.07}
    rec = profiled_record(f, ceiling=742.5).update(measured_hardware_flops=2 * 10**15,
                                                   **padding(3 * 10**15, 2 * 10**15))
    assert (rec.padded_flops_frac, rec.padded_frac_latent, rec.padded_frac_text) == (pytest.approx(1 / 3), 0.4, 0.25)
    steps = waterfall(rec)
    assert [s["short"] for s in steps][-3:] == ["padding", "matmul shortfall / other", "achieved MFU"]
    by_label = {s["short"]: s["pp"] for s in steps}
    share = (rec.measured_padded_flops - rec.measured_hardware_flops) / rec.measured_padded_flops
    assert by_label["padding"] == pytest.approx(-75 * 0.6 * share)  # C = 75%, GEMM + attention 60% of the step
    assert by_label["matmul shortfall / other"] == pytest.approx(-(75 * 0.6 * (1 - share) - 38))
    assert 100 + sum(s["pp"] for s in steps[1:-1]) == pytest.approx(38.0, abs=1e-9)
    without = waterfall(profiled_record(f, ceiling=742.5))  # every other step as before
    assert [s for s in without if s["short"] not in ("padding", "matmul shortfall / other")] == \
        [s for s in steps if s["short"] not in ("padding", "matmul shortfall / other")]
    # no padding at all: nothing moves out of the shortfall
    steps = waterfall(profiled_record(f).update(**padding(10**15, 10**15)))
    assert {s["short"]: s["pp"] for s in steps}["padding"] == 0


def test_a_record_without_padded_flops_shows_padding_unknown():
    """A record written before padding was counted (tests/fixtures/record-v2.json, a real one) loads;
    its waterfall has a padding step of unknown size, its padding left in the shortfall, not 0."""
    from conftest import FIXTURES

    f = {"gemm": 0.5, "attention": 0.1, "optimizer": 0.05, "other_compute": 0.15, "memcpy": 0.02,
         "communication": 0.08, "data_wait": 0.03, "idle": 0.07}
    old = Record.load(FIXTURES / "record-v2.json")
    assert old.measured_padded_flops is None and old.padded_flops_frac is None and old.padded_frac_text is None
    steps = waterfall(old.update(breakdown={"fractions": f}, ceiling_tflops=None))
    pad = next(s for s in steps if s["short"] == "padding")
    assert pad["pp"] is None and "unknown" in pad["label"]
    known = [s["pp"] for s in steps[1:-1] if s["pp"] is not None]
    assert 100 + sum(known) == pytest.approx(100 * old.mfu, abs=1e-9)
    assert steps[-2]["pp"] == pytest.approx(-(100 * 0.6 - 100 * old.mfu))  # padding stays in the shortfall


def test_summary_takes_the_busiest_rank_and_keeps_errors():
    def rank(r, gemm, idle):
        seconds = dict.fromkeys(CATEGORIES, 0.0) | {"gemm": gemm, "idle": idle}
        return {"rank": r, "timeline": "GPU streams", "steps": 3, "step_time_s": gemm + idle, "seconds": seconds,
                "communication": {"total_s": 0.0, "exposed_s": 0.0, "overlapped_s": 0.0}, "top": {}}

    s = summary([rank(0, 0.2, 0.8), rank(1, 0.6, 0.4), {"rank": 2, "error": "ValueError: x"}])
    assert s["rank"] == 1 and s["fractions"]["gemm"] == pytest.approx(0.6)
    assert summary([{"rank": 0, "error": "ValueError: x"}]) == {"error": "rank 0: ValueError: x"}


# ---- real traces of the tiny model on the CPU ----

def profiled_step_us(trace_path):
    """The profiled window per step, from the first ProfilerStep's start to the last one's end, as
    the exported chrome trace shows it (an independent reading). The window, not the mean step: a
    pause between two steps (the machine busy elsewhere) is in the window the parts divide."""
    steps = [(e["ts"], e["ts"] + e["dur"]) for e in json.loads(trace_path.read_text())["traceEvents"]
             if str(e.get("name", "")).startswith("ProfilerStep#") and e.get("ph") == "X"]
    assert len(steps) == 3
    return (max(end for _, end in steps) - min(start for start, _ in steps)) / len(steps)


@pytest.mark.parametrize("name", ["single", "ddp"])
def test_real_cpu_runs_parts_add_up_to_the_step(profiled_runs, name):
    assert_parts_add_up_to_the_step(profiled_runs[name], communicates=name != "single")


def test_a_card_run_s_parts_add_up_to_the_step(card_ddp_run):
    assert_parts_add_up_to_the_step(card_ddp_run, communicates=True)


def assert_parts_add_up_to_the_step(out, communicates: bool) -> None:
    """A traced run's parts, per rank, add up to the trace's step; a data-parallel run's communication
    is seen on every rank."""
    record = json.loads((out / "result.json").read_text())
    bd = json.loads((out / "breakdown.json").read_text())
    assert len(bd["ranks"]) == record["world_size"] and bd["busiest_rank"] == record["breakdown"]["rank"]
    for rank in bd["ranks"]:
        assert rank["timeline"] == "main thread" and rank["steps"] == 3
        parts = sum(rank["seconds"].values())
        trace_step = profiled_step_us(out / f"trace-rank{rank['rank']}.json") / 1e6
        assert parts == pytest.approx(trace_step, rel=0.02)
        assert rank["seconds"]["gemm"] > 0 and rank["seconds"]["attention"] > 0 and rank["seconds"]["optimizer"] > 0
        assert rank["seconds"]["data_wait"] > 0  # the loader's record_function is seen
    fractions = record["breakdown"]["fractions"]
    assert set(fractions) == set(CATEGORIES) and sum(fractions.values()) == pytest.approx(1.0)
    comm = [r["communication"]["total_s"] for r in bd["ranks"]]
    if not communicates:
        assert comm == [0.0] and fractions["communication"] == 0
    else:  # DDP's gradient all-reduce on gloo's threads, on both ranks
        assert all(c > 0 for c in comm)
        assert any(n.startswith("gloo:all_reduce") for r in bd["ranks"] for n, _ in r["top"]["communication"])


def test_explain_prints_the_breakdown_and_the_waterfall(profiled_runs, cli, tmp_path):
    out = profiled_runs["ddp"]
    record = json.loads((out / "result.json").read_text())
    proc = cli("explain", out)
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    assert "Where the time goes" in text and "MFU waterfall" in text and "per rank" in text
    assert "communication (exposed)" in text and "gloo:all_reduce" in text and "achieved MFU" in text
    # the attention paths the measured window ran, beside the profiled steps' time
    flat = " ".join(text.split())
    assert "attention paths of the measured window" in flat and "dit " in flat
    assert all(f"{path} {n} ({record['attention_flop_shares']['dit'][path]:.0%} of FLOPs)" in flat
               for path, n in record["attention_paths"]["dit"].items())
    proc = cli("explain", out, "--json")
    proc_json = proc.stdout
    data = json.loads(proc.stdout)
    steps = data["waterfall"]
    assert 100 + sum(s["pp"] for s in steps[1:-1]) == pytest.approx(100 * record["mfu"], abs=1e-9)
    # a run without a profile, and a directory that is not a run: one line each, naming the fix
    plain = tmp_path / "plain"
    Record.load(out / "result.json").update(breakdown=None).save(plain)
    proc = cli("explain", plain)
    assert proc.returncode == 2 and "no breakdown.json" in proc.stderr and "--trace" in proc.stderr
    proc = cli("explain", tmp_path)
    assert proc.returncode == 2 and "give one run's directory" in proc.stderr and len(proc.stderr.splitlines()) == 1
    assert cli("explain", out / "result.json", "--json").stdout == proc_json  # the record names its run
    proc = cli("explain", tmp_path / "nope")
    assert proc.returncode == 2 and "no such file or directory" in proc.stderr


def test_explain_shows_padding_from_the_record(profiled_runs, cli, tmp_path):
    """explain's padding step is the figure computed from the record's counts (set here: a third of
    the matmul FLOPs executed padded), taken out of the matmul shortfall; the waterfall still sums to
    the MFU and the parts of the step to the step. A record without padded FLOPs shows it unknown."""
    import shutil

    from test_breakdown import padding

    run = tmp_path / "run"
    shutil.copytree(profiled_runs["ddp"], run)
    rec = Record.load(run / "result.json")
    hardware = rec.measured_hardware_flops
    assert rec.measured_padded_flops >= hardware and rec.padded_flops_frac is not None  # counted by the run
    rec.update(**padding(hardware * 3 // 2, hardware)).save(run)
    data = json.loads(cli("explain", run, "--json").stdout)
    raw = json.loads((run / "result.json").read_text())
    f = raw["breakdown"]["fractions"]
    c = raw["ceiling_tflops"] / raw["peak_tflops"] if raw.get("ceiling_tflops") else 1.0  # none: the ceiling is the peak
    share = (raw["measured_padded_flops"] - raw["measured_hardware_flops"]) / raw["measured_padded_flops"]
    by_label = {s["short"]: s["pp"] for s in data["waterfall"]}
    assert by_label["padding"] == pytest.approx(-100 * c * (f["gemm"] + f["attention"]) * share, rel=1e-12)
    assert by_label["matmul shortfall / other"] == pytest.approx(
        -(100 * c * (f["gemm"] + f["attention"]) * (1 - share) - 100 * raw["mfu"]), rel=1e-9, abs=1e-12)
    assert 100 + sum(s["pp"] for s in data["waterfall"][1:-1]) == pytest.approx(100 * raw["mfu"], abs=1e-9)
    assert data["padding"]["padded_flops_frac"] == pytest.approx(share)
    busiest = next(r for r in data["breakdown"]["ranks"] if r["rank"] == data["breakdown"]["busiest_rank"])
    assert sum(busiest["seconds"].values()) == pytest.approx(busiest["step_time_s"], rel=1e-9)
    text = cli("explain", run).stdout
    padded_ms = (busiest["seconds"]["gemm"] + busiest["seconds"]["attention"]) * share * 1e3
    assert "padded tokens, within matmul" in text and f"{padded_ms:.3f}" in text and "33.3% of the matmul" in text
    assert f"{by_label['padding']:+.2f}" in text
    # an older record: padding unknown, in the table and the waterfall
    rec.update(measured_padded_flops=None, padded_flops_frac=None, padded_frac_latent=None, padded_frac_text=None,
               padded_frac_speaker=None).save(run)
    text = cli("explain", run).stdout
    assert "padding (unknown" in text and "the record has no padded FLOPs" in text
    assert next(s for s in json.loads(cli("explain", run, "--json").stdout)["waterfall"]
                if s["short"] == "padding")["pp"] is None


def test_padding_text_names_the_buckets_that_ran():
    from echobench.train.breakdown import padding_text

    rec = profiled_record({"gemm": 1.0}).update(**padding(3 * 10**15, 2 * 10**15))
    assert "bucket" not in padding_text(rec)
    rec = Record.model_validate({**rec.model_dump(), "bucket_steps": {"144": 2, "500": 3}})  # as a record file has it
    assert rec.bucket_steps == {144: 2, 500: 3}
    assert padding_text(rec).endswith("; audio buckets (frames: steps) 144: 2, 500: 3")
