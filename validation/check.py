"""Check validation/published-runs.yaml: it parses, ids are unique, and each row's published MFU agrees with
its published TFLOP/s per GPU over the H100's 989 TFLOP/s (and, where tokens/s are published, with the
source's own FLOP formula). Prints one line a row; exits 1 on a mismatch. Run: python validation/check.py"""
import sys
from pathlib import Path

import yaml

PEAK = 989.0  # TFLOP/s, H100 SXM bf16 dense
COMPOSER_PEAK = 989.5  # llm-foundry divides by composer's 1.979e15 / 2
# llm-foundry truncates its TFLOP column to an integer and divides by 989.5 (1/989 + rounding);
# Megatron-LM prints MFU to a whole percent.
TOLERANCE = {"lf-": 0.0016, "mlm-": 0.0051}

rows = yaml.safe_load((Path(__file__).parent / "published-runs.yaml").read_text())
ids = [r["id"] for r in rows]
bad = len(ids) != len(set(ids))
for r in rows:
    p, m, run = r["published"], r["model"], r["run"]
    tol = next(t for prefix, t in TOLERANCE.items() if r["id"].startswith(prefix))
    ratio = p["tflops_per_gpu"] / PEAK
    ok = abs(p["mfu"] - ratio) <= tol
    line = f"{r['id']:24s} mfu {p['mfu']:.4f}  tflops/989 {ratio:.4f}"
    if p.get("tokens_per_s_per_gpu") and r["id"].startswith("lf-"):
        # llm-foundry's formula: 6 x n_params + 12 L d s per token (collect_results.py)
        flops = 6 * m["params"] + 12 * m["layers"] * m["hidden"] * run["seq"]
        from_tokens = flops * p["tokens_per_s_per_gpu"] / (COMPOSER_PEAK * 1e12)
        ok = ok and abs(p["mfu"] - from_tokens) < 0.0005
        line += f"  from tokens/s {from_tokens:.4f}"
    print(line, "ok" if ok else "MISMATCH")
    bad = bad or not ok
print(f"{len(rows)} rows", "MISMATCH" if bad else "ok")
sys.exit(1 if bad else 0)
