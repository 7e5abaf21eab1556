"""A card run's attention kernel: the record names torch's SDPA choice for the decoder
(sdpa_backends_predicted["decoder"], tests/test_card_runs.py holds a CPU run's to torch's), and
`validate measured` prices the run's attention at that kernel's profile points; a record that names
none (before card runs recorded it) is priced as before, at the framework's default. The record is
the H200 pass's MPT-1B seq 8192 card run (reports/h200-2026-12-04), a copy of it hand-edited."""

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from echobench.hardware.profile import find_profile, load_profile
from echobench.predict.cards.model import predict_card
from echobench.predict.cards.run import measured_attention_kernel, measured_card, measured_layout
from echobench.records.config import RunConfig
from echobench.records.console import attention_text
from echobench.records.results import Record, record_settings
from tools.device import summary as device_summary

ROOT = Path(__file__).resolve().parents[1]

RUN = "card-mpt-1b-h100-s8192"
PROFILE = "h200-hgx-ib"


@pytest.fixture(scope="module")
def card_records(tmp_path_factory):
    """The committed record as it is (plain/) and naming cuDNN's kernel (named/), each in its own directory."""
    tmp = tmp_path_factory.mktemp("card-kernel")
    device_summary.main(["unpack", str(ROOT / "reports/h200-2026-12-04/records-call1.jsonl"), str(tmp / "all")])
    raw = json.loads((tmp / "all" / RUN / "result.json").read_text())
    assert raw["sdpa_backends_predicted"] is None  # recorded before card runs named it
    paths = {}
    for name, backends in (("plain", None), ("named", {"decoder": "CUDNN_ATTENTION"})):
        path = tmp / name / RUN / "result.json"
        path.parent.mkdir(parents=True)
        path.write_text(json.dumps({**raw, "sdpa_backends_predicted": backends}))
        paths[name] = path
    return paths


def against(path: Path) -> dict:
    proc = subprocess.run([sys.executable, "-m", "echobench", "validate", "measured", str(path.parent.parent),
                           "--profile", PROFILE, "--json"], capture_output=True, text=True, timeout=300, cwd=ROOT,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(proc.stdout)
    assert len(rows) == 1
    return rows[0]


def priced_at(path: Path, kernel: str | None):
    """predict_card at the layout the run ran, its attention at `kernel` (None: the framework's default)."""
    record = Record.load(path)
    cfg = RunConfig.from_dict({**record_settings(record), "repeat": 0})
    layout = measured_layout(cfg, record.card["seq"], record.precision, bool(record.compile))
    assert layout.attention_kernel is None
    return predict_card(measured_card(record.card), replace(layout, attention_kernel=kernel),
                        load_profile(find_profile(PROFILE)))


def test_predict_against_prices_the_kernel_the_card_record_names(card_records):
    named, plain = against(card_records["named"]), against(card_records["plain"])
    cudnn, default = priced_at(card_records["named"], "cudnn"), priced_at(card_records["plain"], None)
    assert named["parts"]["attention"] == pytest.approx(cudnn.parts["attention"], rel=1e-12)
    assert named["step_time_s"] == pytest.approx(cudnn.step_time_s, rel=1e-12)
    assert any("the cudnn kernel the record names" in n for n in named["notes"])
    # without the field: as before, the framework's default (torchtitan: flash2), said so
    assert plain["parts"] == pytest.approx(default.parts, rel=1e-12)
    assert plain["step_time_s"] == pytest.approx(default.step_time_s, rel=1e-12)
    assert any("torchtitan's default kernel flash2: the record does not name one" in n for n in plain["notes"])
    # cuDNN's causal points at seq 8192 are the faster ones on this profile
    assert named["parts"]["attention"] < plain["parts"]["attention"]


def test_the_record_names_the_decoder_s_predicted_kernel(card_records):
    assert attention_text(Record.load(card_records["named"])) == "decoder SDPA, predicted: CUDNN_ATTENTION"
    assert attention_text(Record.load(card_records["plain"])) == "-"


@pytest.mark.parametrize("backends, device_type, kernel", [
    ({"decoder": "CUDNN_ATTENTION"}, "cuda", "cudnn"),
    ({"decoder": "FLASH_ATTENTION"}, "cuda", "flash2"),
    ({"decoder": "EFFICIENT_ATTENTION"}, "cuda", "efficient"),
    ({"decoder": "MATH"}, "cuda", "math"),
    ({"decoder": "FLASH_ATTENTION"}, "cpu", None),  # the CPU's flash kernel, not a GPU's
    ({"decoder": "OVERRIDEABLE"}, "cuda", None),  # no profile kernel stands for it
    ({"dit": "CUDNN_ATTENTION"}, "cuda", None),  # an Echo run's
    (None, "cuda", None),  # an older card record
])
def test_measured_attention_kernel(backends, device_type, kernel):
    assert measured_attention_kernel(backends, device_type) == kernel
