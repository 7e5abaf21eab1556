"""The shipped GPU profiles' in_step factor: fitted to published runs by scripts/fit_in_step_factor.py
(so the number in the files is the fit's, not a hand-tuned one), held against rows it was not fitted
to, and applied to a GPU step's kernels only."""

import importlib.util

import pytest

from conftest import ROOT
from echobench.config import RunConfig
from echobench.hwprofile import InStepFactor, find_profile, load_profile
from echobench.predict import predict
from echobench.predict.validate import load_rows


def fit_script():
    spec = importlib.util.spec_from_file_location("fit_in_step_factor", ROOT / "scripts" / "fit_in_step_factor.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_shipped_factor_is_the_fit_and_the_rows_it_was_fitted_on_are_named():
    fit = fit_script()
    rows = load_rows(fit.ROWS)
    fit_rows = [r for r in rows if fit.fit_set(r)]
    best = min(fit.GRID, key=lambda k: sum(map(abs, fit.errors(fit_rows, k).values())))
    for name in ("h100-hgx-ib", "h200-hgx-ib", "gh200-quad-slingshot", "gh200-quad-ib"):
        shipped = load_profile(find_profile(name)).in_step
        assert shipped is not None and shipped.factor == pytest.approx(best, abs=5e-4), name
        assert shipped.fitted_on == sorted(r["id"] for r in fit_rows) and "FITTED" in shipped.source
    # Held out: every priced row it was not fitted to (multi-node llm-foundry, every Megatron-LM row).
    held = [r for r in rows if not fit.fit_set(r)]
    assert {r["source"]["repo"] for r in held} == {"mosaicml/llm-foundry", "NVIDIA/Megatron-LM"}
    assert not {r["id"] for r in held} & set(shipped.fitted_on)


def test_the_factor_scales_a_gpu_steps_kernels_and_not_its_optimizer_or_collectives():
    base = load_profile(find_profile("h100-hgx-ib"))
    one = base.model_copy(update={"in_step": None})
    half_again = base.model_copy(update={"in_step": InStepFactor(factor=1.5, source="test")})
    cfg = RunConfig(scale="800M", parallelism="fsdp2", nodes=1, gpus_per_node=8, device="cuda", precision="bf16",
                    micro_batch=4)
    a, b = predict(cfg, one), predict(cfg, half_again)
    for part in ("gemm", "attention", "elementwise"):
        assert b.parts[part] == pytest.approx(1.5 * a.parts[part]), part
    assert b.parts["optimizer"] == pytest.approx(a.parts["optimizer"])
    assert sum(c.seconds for c in b.collectives) == pytest.approx(sum(c.seconds for c in a.collectives))
    assert any("FITTED" in n for n in b.notes) and not any("FITTED" in n for n in a.notes)


def test_a_cpu_profile_keeps_its_own_in_situ_factor():
    """A CPU profile's factor comes from its two host steps (or is 1), times an in_step only where
    `echobench tune` fitted one; a GPU's is its in_step."""
    from echobench.predict import Rates

    base = load_profile(find_profile("h100-hgx-ib"))
    cpu = base.model_copy(update={"device": "CPU test", "in_step": InStepFactor(factor=2.0, source="test"),
                                  "host_steps": []})
    assert Rates(cpu).compute_factor == 2.0  # 1 from no host steps, x the fitted 2
    assert Rates(cpu.model_copy(update={"in_step": None})).compute_factor == 1.0
    assert Rates(base).compute_factor == base.in_step.factor
