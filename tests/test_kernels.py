"""What a record says ran: SDPA's backend pinned or chosen, and what compile produced."""

import pytest
import torch

from echobench.train.bench_record import compile_figures
from echobench.train.kernels import SDPA_BACKENDS, pin_sdpa_backend, sdpa_choices
from echobench.model.config import PRESETS

FLAGS = ("flash", "mem_efficient", "cudnn", "math")


@pytest.fixture
def sdpa_flags():
    """torch's SDPA switches are process-wide: put them back after the test."""
    before = {f: getattr(torch.backends.cuda, f"{f}_sdp_enabled")() for f in FLAGS}
    yield
    for f, on in before.items():
        getattr(torch.backends.cuda, f"enable_{f}_sdp")(on)


def test_a_pinned_sdpa_backend_is_the_one_torch_chooses(sdpa_flags):
    shapes = dict(micro_batch=2, audio_frames=24, text_tokens=8, speaker_frames=16, device=torch.device("cpu"),
                  dtype=torch.float32)
    assert sdpa_choices(PRESETS["tiny"], **shapes)["dit"] == "FLASH_ATTENTION"  # the CPU's fused kernel
    pin_sdpa_backend("math")
    assert set(sdpa_choices(PRESETS["tiny"], **shapes).values()) == {"MATH"}
    assert not torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.math_sdp_enabled()
    pin_sdpa_backend("auto")  # leaves the flags as they are
    assert not torch.backends.cuda.flash_sdp_enabled()
    assert set(SDPA_BACKENDS) == {"flash", "efficient", "cudnn", "math"}


def test_a_compile_that_produced_no_graph_is_not_labelled_compiled():
    assert compile_figures({"compile_counts": None}, False) == {"compile": False}
    none = compile_figures({"compile_counts": {"graphs": 0, "graph_breaks": 3, "break_reasons": ["x"]}}, True)
    assert none["compile"] is False and "produced no graph" in none["compile_note"]
    some = compile_figures({"compile_counts": {"graphs": 7, "graph_breaks": 0, "break_reasons": []}}, True)
    assert some["compile"] is True and some["compile_graphs"] == 7 and "compile_note" not in some
    # an eager run in which torch compiled kernels of its own (FlexAttention's) is eager, and says so
    eager = compile_figures({"compile_counts": {"graphs": 2, "graph_breaks": 0, "break_reasons": []}}, False)
    assert eager["compile"] is False and eager["compile_graphs"] == 2 and "compiled 2 graph(s)" in eager["compile_note"]


def test_predicted_sdpa_kernels_only_for_the_paths_that_go_through_sdpa():
    """No entry for a FlexAttention path, nor for the DiT under TransformerEngine's attention."""
    shapes = dict(micro_batch=2, audio_frames=24, text_tokens=8, speaker_frames=16, device=torch.device("cpu"),
                  dtype=torch.float32)
    met = {("dit", "none"), ("dit", "flex"), ("speaker_encoder", "none"), ("text_encoder", "dense")}
    assert set(sdpa_choices(PRESETS["tiny"], **shapes, paths=met)) == {"dit", "speaker_encoder",
                                                                        "text_encoder_dense_mask"}
    assert set(sdpa_choices(PRESETS["tiny"], **shapes, paths=met, te=True)) == {"speaker_encoder",
                                                                                 "text_encoder_dense_mask"}


def test_compile_watch_counts_each_compile_as_it_starts():
    import torch._dynamo

    from echobench.train.kernels import CompileWatch

    torch._dynamo.reset()
    watch = CompileWatch().start()
    try:
        f = torch.compile(lambda x: (x * 2).sin(), backend="eager", dynamic=False)
        f(torch.ones(3))
        f(torch.ones(3))  # cached: no compile
        assert watch.total == 1 and watch.events == {"dynamo": 1}
        f(torch.ones(4))  # a new shape: a recompile
        assert watch.total == 2
    finally:
        watch.stop()
        torch._dynamo.reset()
    f = torch.compile(lambda x: x.cos(), backend="eager", dynamic=False)
    f(torch.ones(2))
    assert watch.total == 2  # stopped: no longer counting


def test_attention_kernel_names_are_picked_from_a_profiled_stretch():
    from echobench.train.kernels import attention_kernels

    names = ["void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128>>(...)", "ampere_bf16_s16816gemm",
             "triton_tem_fused_flex_attention_0", "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128>>(...)",
             "fmha_cutlassF_bf16_aligned_64x64_rf_sm80", "triton_poi_fused_add_0"]
    assert attention_kernels(names) == {names[0]: 2, "triton_tem_fused_flex_attention_0": 1,
                                        "fmha_cutlassF_bf16_aligned_64x64_rf_sm80": 1}
