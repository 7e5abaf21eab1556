"""The element-wise evidence of reports/predict-cpu-2026-12-04.md: from a CPU run's trace (`echobench
run --trace`), the self time per step of its memory-bound ATen ops (not GEMM, attention, views or
the optimizer's), the bytes echobench.predict.stepcount counts for that run's configuration beside
the fixed ratios (work.ELEMENTWISE), and the bandwidth the ops ran at, their dispatch (a view's
self time per op) taken off. With --ratios SCALE...: each preset's counted element-wise bytes over
the bytes autograd saves, eager and compiled (inductor's kernels), at micro-batch 8, bf16.

    OMP_NUM_THREADS=1 echobench run --scale tiny --parallelism single --micro-batch 4 --audio-frames 200 \
        --text-tokens 64 --speaker-frames 160 --device cpu --steps 12 --warmup-steps 3 --trace --out OUT
    python3 tools/trace_elementwise.py OUT
    python3 tools/trace_elementwise.py --ratios 800M 3B       # minutes: the compiled counts
"""

import json
import sys
from collections import defaultdict
from pathlib import Path

GEMM = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"}
VIEWS = {"aten::view", "aten::as_strided", "aten::transpose", "aten::t", "aten::expand", "aten::slice",
         "aten::select", "aten::unsqueeze", "aten::squeeze", "aten::permute", "aten::reshape", "aten::_unsafe_view",
         "aten::split", "aten::chunk", "aten::unbind", "aten::alias", "aten::detach", "aten::empty",
         "aten::empty_strided", "aten::empty_like", "aten::narrow", "aten::to", "aten::contiguous", "aten::flatten"}


def self_times(trace: dict) -> tuple[dict, dict, int]:
    """Per kind (gemm, attention, view, memory, optimizer, other): self microseconds and op count, and
    the profiled steps."""
    events = trace["traceEvents"]
    ops = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") == "cpu_op"),
                 key=lambda e: (e["tid"], e["ts"], -e["dur"]))
    notes = [e for e in events if e.get("cat") == "user_annotation"]
    optimizer = [(a["ts"], a["ts"] + a["dur"]) for a in notes if a["name"].startswith("Optimizer")]
    steps = sum(a["name"].startswith("ProfilerStep") for a in notes)
    own, stack = {}, []
    for e in ops:  # self time: the op's span less its children's
        while stack and stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"]:
            stack.pop()
        if stack:
            own[id(stack[-1])] = own.get(id(stack[-1]), stack[-1]["dur"]) - e["dur"]
        own.setdefault(id(e), e["dur"])
        stack.append(e)
    us, count = defaultdict(float), defaultdict(int)
    for e in ops:
        kind = ("optimizer" if any(a <= e["ts"] < b for a, b in optimizer) else "gemm" if e["name"] in GEMM
                else "attention" if "scaled_dot_product" in e["name"] else "view" if e["name"] in VIEWS
                else "memory" if e["name"].startswith("aten::") else "other")
        us[kind] += own[id(e)]
        count[kind] += 1
    return us, count, steps


def run_check(out: Path) -> None:
    from echobench.predict.elementwise import counted_bytes
    from echobench.predict.work import elementwise_bytes
    from echobench.records.config import RunConfig
    from echobench.records.results import Record, record_settings

    record = Record.load(out / "result.json")
    cfg = RunConfig.from_dict({**record_settings(record), "repeat": 0})
    eb = 4 if record.precision == "fp32" else 2
    us, count, steps = self_times(json.loads((out / "trace-rank0.json").read_text()))
    for kind in sorted(us):
        print(f"{kind:10s} {us[kind] / steps:9.0f} us a step  {count[kind] // steps:5d} ops")
    counted = counted_bytes(cfg, eb)
    ratios = elementwise_bytes(cfg, eb)
    bytes_ = counted.forward + counted.backward
    print(f"stepcount's element-wise bytes: {bytes_ / 1e6:.0f} MB (forward {counted.forward / ratios[0]:.2f} x, "
          f"backward {counted.backward / ratios[1]:.2f} x the fixed ratios' {sum(ratios) / 1e6:.0f} MB)")
    dispatch = us["view"] / max(count["view"], 1)  # a view's self time: dispatch alone
    kernel_s = (us["memory"] - dispatch * count["memory"]) / steps / 1e6
    print(f"memory-bound ops' kernel time {kernel_s * 1e3:.1f} ms a step (dispatch {dispatch:.1f} us an op off): "
          f"{bytes_ / kernel_s / 1e9:.1f} GB/s")


def ratios(scales: list[str]) -> None:
    from echobench.predict.elementwise import counted_bytes
    from echobench.predict.work import ratios_saved
    from echobench.records.config import RunConfig

    for scale in scales:
        cfg = RunConfig(scale=scale, micro_batch=8, precision="bf16", compile=True, device="cuda")
        saved = ratios_saved(cfg, 2)
        for compiled in (False, True):
            c = counted_bytes(cfg, 2, compiled=compiled)
            print(f"{scale} {'compiled' if compiled else 'eager'}: forward {c.forward / saved:.2f} x, backward "
                  f"{c.backward / saved:.2f} x the bytes autograd saves")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--ratios"]:
        ratios(sys.argv[2:])
    else:
        run_check(Path(sys.argv[1]))
