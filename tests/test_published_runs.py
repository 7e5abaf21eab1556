"""validation/published-runs.yaml and held-out-runs.yaml (the published runs predict is held against) stay self-consistent
with its sources: ids unique, and each row's published MFU agrees with its published TFLOP/s per
GPU over the peak its source divides by, and where a source gives its own FLOP formula, with that
formula applied to its published tokens/s, so that a figure mistyped while transcribing fails here."""

import pytest
import yaml

from conftest import ROOT

# the committed fit's rows and the rows held out from it
ROWS = [row for name in ("published-runs.yaml", "held-out-runs.yaml")
        for row in yaml.safe_load((ROOT / "validation" / name).read_text())]


def rows_of(source: str) -> list[dict]:
    return [r for r in ROWS if r["source"]["name"] == source]


def peak(row) -> float:
    return float(row["published"]["convention"].rsplit("peak ", 1)[1].split()[0])


def test_unique_ids_from_pinned_commits():
    ids = [r["id"] for r in ROWS]
    assert len(ids) == len(set(ids)) and all(len(str(r["source"]["commit"])) == 40 for r in ROWS)


@pytest.mark.parametrize("row", rows_of("llm-foundry"), ids=lambda r: r["id"])
def test_llm_foundry_mfu_is_its_tflops_and_its_formula_from_tokens(row):
    """collect_results.py: MFU = (6 n_params + 12 L d s) x tokens/s per GPU / peak (989.5 for H100 bf16,
    1979 fp8, 312 A100); the Model TFLOP column is truncated to an integer."""
    p, m, run = row["published"], row["model"], row["run"]
    assert abs(p["mfu"] - p["tflops_per_gpu"] / peak(row)) <= 1.01 / peak(row) + 0.0001
    flops = 6 * m["params"] + 12 * m["layers"] * m["hidden"] * run["seq"]
    per_gpu = p["tokens_per_s"] / row["hardware"]["gpus"]  # the per-GPU column is truncated
    assert abs(p["mfu"] - flops * per_gpu / (peak(row) * 1e12)) < 0.0006
    assert p["tokens_per_s"] // row["hardware"]["gpus"] == p["tokens_per_s_per_gpu"]


@pytest.mark.parametrize("row", rows_of("megatron-lm-2024") + rows_of("megatron-lm-2021"), ids=lambda r: r["id"])
def test_megatron_mfu_is_its_tflops_over_the_peak_and_the_aggregate_its_tflops_times_gpus(row):
    """Whole percents in both tables; the aggregate PFLOP/s to its 0.1 and the per-GPU figure's rounding
    (2021: whole TFLOP/s, 2024: tenths) times the GPUs."""
    p, gpus = row["published"], row["hardware"]["gpus"]
    assert abs(p["mfu"] - p["tflops_per_gpu"] / peak(row)) <= 0.0051
    step = 0.05 if row["source"]["name"] == "megatron-lm-2024" else 0.5
    assert abs(p["aggregate_pflops"] - p["tflops_per_gpu"] * gpus / 1000) <= 0.05 + step * gpus / 1000


@pytest.mark.parametrize("row", [r for r in rows_of("megatron-lm-2024") if r["run"]["pp"] > 1], ids=lambda r: r["id"])
def test_megatron_2024_pipelined_rows_assume_only_the_interleavings_megatron_runs(row):
    """The README overlaps pipeline-parallel communication, which megatron/training/arguments.py at
    f2e5db40 allows only in the interleaved schedule, and that schedule splits a stage's layers
    evenly into its vp chunks: every vp the row takes is > 1 and divides layers / pp."""
    layers, pp = row["model"]["layers"], row["run"]["pp"]
    taken = {row["run"]["vp"]} | {v for e in row["assumed"] if e["field"] == "run.vp" for v in e["values"]}
    assert layers % pp == 0 and all(v > 1 and (layers // pp) % v == 0 for v in taken), taken
    assert any(e["field"] == "run.vp" for e in row["assumed"])  # unstated: listed as assumed, never silent


@pytest.mark.parametrize("row", [r for r in rows_of("torchtitan") if r["published"].get("mfu")], ids=lambda r: r["id"])
def test_torchtitan_mfu_is_its_flop_formula_from_its_tokens(row):
    """torchtitan's num_flop_per_token: 6 x every parameter + 12 L h s, over the A100's 312."""
    m, run, p = row["model"], row["run"], row["published"]
    d, f, kv, L, V = m["hidden"], m["ffn"], m["kv_heads"] * m["hidden"] // m["heads"], m["layers"], m["vocab"]
    params = L * (d * (d + 2 * kv) + d * d + 3 * d * f + 2 * d) + 2 * V * d + d
    assert p["mfu"] == pytest.approx((6 * params + 12 * L * d * run["seq"]) * p["tokens_per_s_per_gpu"] / 312e12, abs=0.006)


@pytest.mark.parametrize("row", rows_of("nemo"), ids=lambda r: r["id"])
def test_nemo_tokens_and_tflops_agree_within_its_flop_formulas(row):
    """NeMo's model TFLOP/s over its tokens/s is the model's FLOPs per token: between 6N and 6N + 12 L h s."""
    m, run, p = row["model"], row["run"], row["published"]
    d, f, kv, L, V = m["hidden"], m["ffn"], m["kv_heads"] * m["hidden"] // m["heads"], m["layers"], m["vocab"]
    up = 2 * f if m["activation"] == "swiglu" else f
    n = L * (d * (d + 2 * kv) + d * d + up * d + f * d) + 2 * V * d
    per_token = p["tflops_per_gpu"] * 1e12 / p["tokens_per_s_per_gpu"]
    assert 0.97 * 6 * n <= per_token <= 1.03 * (6 * n + 12 * L * d * run["seq"])


@pytest.mark.parametrize("row", rows_of("korthikanti-2022"), ids=lambda r: r["id"])
def test_korthikanti_rows_are_calculons_table_5_times(row):
    """Selective recompute + sequence parallelism is 29-32% faster than full recompute (Table 5)."""
    other = next(r for r in rows_of("korthikanti-2022") if r["model"] == row["model"] and r["id"] != row["id"])
    full, sel = sorted((row, other), key=lambda r: r["run"]["ac"] != "full")
    assert 1.28 <= full["published"]["step_s"] / sel["published"]["step_s"] <= 1.33


# The one cell of the DGX Cloud recipes' tables that breaks their own arithmetic: its tokens/s and MFU
# are the 1024-GPU column's step (14.92 s), its step 14.98 s (validation/SOURCES.md, source 7).
DGXC_INCONSISTENT = {"dgxc-llama31-70b-bf16-2048gpu": 14.92}
DGXC_FLOPS_PER_SAMPLE = {"8b": 4.74e14, "70b": 3.94e15, "405b": 2.17e16}


@pytest.mark.parametrize("row", rows_of("dgxc-benchmarking"), ids=lambda r: r["id"])
def test_dgxc_tokens_and_mfu_are_its_step_under_its_readmes_formulas(row):
    """tokens/s = sequence x global batch / step (rounded), MFU = global batch x the README's model
    FLOPs per sample / step / GPUs / peak (to its hundredth of a percent, the FLOPs' three digits);
    the global batch grows with the GPUs (each README's rule)."""
    p, run, gpus = row["published"], row["run"], row["hardware"]["gpus"]
    step = DGXC_INCONSISTENT.get(row["id"], p["step_s"])
    assert abs(p["tokens_per_s"] - run["seq"] * run["global_batch"] / step) <= 1
    size = row["id"].split("-")[2]
    mfu = run["global_batch"] * DGXC_FLOPS_PER_SAMPLE[size] / step / gpus / (peak(row) * 1e12)
    assert p["mfu"] == pytest.approx(mfu, abs=0.0005)
    per_gpu = {"8b": (16, 1), "70b": (2, 1), "405b": (252, 576)}[size]  # the global batch per GPU, a fraction
    assert run["global_batch"] * per_gpu[1] == per_gpu[0] * gpus
