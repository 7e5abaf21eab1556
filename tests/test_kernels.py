"""What a record says ran: SDPA's backend pinned or chosen, and what compile produced."""

import pytest
import torch

from echobench.bench_record import compile_figures
from echobench.kernels import SDPA_BACKENDS, pin_sdpa_backend, sdpa_choices
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
    assert compile_figures({"compile_counts": None}) == {"compile": False}
    none = compile_figures({"compile_counts": {"graphs": 0, "graph_breaks": 3, "break_reasons": ["x"]}})
    assert none["compile"] is False and "produced no graph" in none["compile_note"]
    some = compile_figures({"compile_counts": {"graphs": 7, "graph_breaks": 0, "break_reasons": []}})
    assert some["compile"] is True and some["compile_graphs"] == 7 and "compile_note" not in some
