"""What the CPU cannot show of a run's kernels, measured on the device at the run's shapes: which
SDPA backend torch picks for the DiT's attention (no mask, a dense key mask) and which can run at
all, the attention's time per backend (FlexAttention with a key-padding block mask beside them),
one DiT block forward + backward eager and compiled, and one fused AdamW step over the model's
parameters, and the bandwidth of memory-bound kernels eager and as inductor generates them (their
kernels' own time on a GPU: memory_bound). Each result is written to the JSON file as soon as it
exists.

  python3 -m tools.device.kernel_probe --scale 3B --micro-batch 8 --json probe.json
  python3 -m tools.device.kernel_probe --scale tiny --micro-batch 2 --device cpu --json probe.json  # the dry pass

Times are CUDA events around `iters` repeats after `warmup` (the host clock on a CPU), on random
inputs (never all zeros). Attention TFLOP/s count the scores and values matmuls in full (4 B H Tq Tk D
forward, backward twice that: flops.py's convention).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
import traceback
from pathlib import Path

import torch
from torch.nn.attention import sdpa_kernel

from echobench.model.flops import speaker_patches
from echobench.train.kernels import SDPA_BACKENDS, sdpa_choices
from echobench.model.components import attention, key_mask
from echobench.model.config import get_preset


def timed(fn, device: torch.device, iters: int, warmup: int) -> float:
    """Median seconds of fn() over `iters` calls after `warmup`."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def kernel_seconds(fn, device: torch.device, iters: int, warmup: int) -> float | None:
    """The GPU's seconds in the kernels one call of fn() launches (torch.profiler's CUDA kernel events
    over `iters` calls after `warmup`, their durations summed, over `iters`): what the device spends,
    not the host's dispatch, guards and launch, which CUDA events around one call also catch (a
    compiled add moving 92 MB measured 90 us between events on the H200, 2.6 times the eager add's call).
    None on a CPU."""
    if device.type != "cuda":
        return None
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize(device)
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    if not kernels:
        raise RuntimeError("the profiler saw no CUDA kernel: no device time to report")
    return sum(e.time_range.elapsed_us() for e in kernels) / iters / 1e6


class Results:
    """The probe's results, rewritten to `path` after every one."""

    def __init__(self, path: Path, meta: dict):
        self.path, self.data = path, {**meta, "results": {}}
        self.save()

    def save(self) -> None:
        self.path.write_text(json.dumps(self.data, indent=1, default=str))

    def measure(self, name: str, fn) -> None:
        t = time.perf_counter()
        try:
            self.data["results"][name] = fn()
        except Exception as exc:  # noqa: BLE001 - one failed measurement must not end the others
            self.data["results"][name] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}",
                                          "traceback_tail": traceback.format_exc()[-1500:]}
        self.data["results"][name]["wall_s"] = round(time.perf_counter() - t, 2)
        self.save()
        print(f"{name}: {json.dumps(self.data['results'][name], default=str)[:400]}", flush=True)


def attention_inputs(cfg, b: int, frames: int, tokens: int, speaker_frames: int, device, dtype, padded: bool):
    """The DiT's joint attention at the run's shapes: q (B, H, T, D), keys [latent | text | speaker],
    and a key mask that pads the second half of the batch's text and a quarter of its audio."""
    g = torch.Generator(device).manual_seed(0)
    keys = frames + tokens + speaker_patches(cfg, speaker_frames)
    q = torch.randn(b, cfg.heads, frames, cfg.head_dim, device=device, dtype=dtype, generator=g, requires_grad=True)
    k, v = (torch.randn(b, cfg.heads, keys, cfg.head_dim, device=device, dtype=dtype, generator=g, requires_grad=True)
            for _ in range(2))
    mask = torch.ones(b, keys, dtype=torch.bool, device=device)
    if padded:
        mask[b // 2:, frames + tokens // 2:frames + tokens] = False
        mask[b // 2:, frames * 3 // 4:frames] = False
    return q, k, v, mask


def attention_times(cfg, args, device, dtype) -> dict:
    """Forward + backward of the DiT's attention per path: SDPA with no mask under each backend,
    SDPA with the dense mask under each backend, FlexAttention with the block mask."""
    out = {}
    for padded in (False, True):
        q, k, v, mask = attention_inputs(cfg, args.micro_batch, args.audio_frames, args.text_tokens,
                                         args.speaker_frames, device, dtype, padded)
        flops = 3 * 4 * q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2] * q.shape[3]
        grad = torch.randn_like(q)
        paths = [(name, backend) for name, backend in SDPA_BACKENDS.items() if name != "math"] + [("flex", None)]
        for name, backend in paths:
            label = f"{'padded' if padded else 'full'}-{name}"
            if name == "flex" and not padded:
                continue
            mask_obj = key_mask(mask, q.shape[2], "flex") if name == "flex" else (mask if padded else None)

            forward_only = device.type != "cuda" and name == "flex"  # no FlexAttention backward on a CPU
            inputs = [t.detach() for t in (q, k, v)] if forward_only else (q, k, v)

            def step(mask_obj=mask_obj, backend=backend, inputs=inputs, forward_only=forward_only):
                with sdpa_kernel([backend]) if backend is not None else contextlib.nullcontext():
                    out_ = attention(*inputs, mask_obj)
                if not forward_only:
                    out_.backward(grad)

            try:
                seconds = timed(step, device, args.iters, args.warmup)
                out[label] = {"ms": round(seconds * 1e3, 3), "tflops": float(f"{flops / seconds / 1e12:.4g}")}
            except Exception as exc:  # noqa: BLE001 - a backend that cannot run these shapes says why
                out[label] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
    return out


def block_times(cfg, args, device, dtype) -> dict:
    """One DiT block forward + backward, fp32 weights under autocast (as the runs), eager then
    compiled (the compile's own time apart), per path: no key mask, and the masked path a run takes
    where a sample drops its conditioning or a stream is padded (key_masking auto: FlexAttention's
    block mask on a GPU; a dense mask on a CPU, where FlexAttention has no backward)."""
    from echobench.model.components import rope_frequencies
    from echobench.model.dit import DiTBlock

    torch.manual_seed(0)
    block = DiTBlock(cfg).to(device)
    for m in block.modules():  # AdaLN's up-projection starts at zero; every path must do work
        if type(m).__name__ == "LowRankAdaLN":
            torch.nn.init.normal_(m.up.weight, std=0.02)
    b, t = args.micro_batch, args.audio_frames
    x = torch.randn(b, t, cfg.width, device=device, requires_grad=True)
    cond = torch.randn(b, cfg.width, device=device)
    text = torch.randn(b, args.text_tokens, cfg.width, device=device)
    speaker = torch.randn(b, speaker_patches(cfg, args.speaker_frames), cfg.speaker_width, device=device)
    freqs = rope_frequencies(t, cfg.head_dim, device=device)
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
    _, _, _, mask = attention_inputs(cfg, b, t, args.text_tokens, args.speaker_frames, device, dtype, padded=True)
    masking = "flex" if device.type == "cuda" else "dense"
    out = {}
    for path, keys in (("none", None), (masking, key_mask(mask, t, masking))):
        def step(fn, keys=keys):
            with autocast:
                y = fn(x, cond, text, speaker, freqs, keys)
            y.float().pow(2).mean().backward()

        row = {"eager_ms": round(timed(lambda: step(block), device, args.iters, args.warmup) * 1e3, 2)}
        compiled = torch.compile(block, fullgraph=True, dynamic=False)
        t0 = time.perf_counter()
        step(compiled)
        if device.type == "cuda":
            torch.cuda.synchronize()
        row["compile_s"] = round(time.perf_counter() - t0, 1)
        row["compiled_ms"] = round(timed(lambda: step(compiled), device, args.iters, args.warmup) * 1e3, 2)
        row["speedup"] = round(row["eager_ms"] / row["compiled_ms"], 2)
        out[path] = row
    return out


def memory_bound(cfg, args, device, dtype) -> dict:
    """The bandwidth of memory-bound work at the DiT's activation shape (micro_batch x audio_frames x
    width): an add eager (an ATen kernel, what the profiles' `add` figure is), the same add compiled
    and an RMSNorm + AdaLN modulation compiled (the Triton kernels inductor generates for the blocks:
    a row reduction, then a broadcast multiply-add; the profiles' `triton` figure), each in GB/s of
    the bytes it must move (its inputs read once, its output written once): `gb_per_s` over the
    kernels' own time on a GPU (kernel_seconds), `call_gb_per_s` over one call between CUDA events,
    launch and guards included (the host clock on a CPU, where both are the call's)."""
    from echobench.model.components import RMSNorm, modulate

    g = torch.Generator(device).manual_seed(0)
    b, t, w = args.micro_batch, args.audio_frames, cfg.width
    x, y = (torch.randn(b, t, w, device=device, dtype=dtype, generator=g) for _ in range(2))
    shift, scale = (torch.randn(b, 1, w, device=device, dtype=dtype, generator=g) for _ in range(2))
    norm = RMSNorm(w).to(device)
    size = x.numel() * x.element_size()

    def add(a, c):
        return a + c

    def norm_modulate(a, sh, sc):
        return modulate(norm(a), sh, sc)

    out = {"tensor_bytes": size}
    for name, fn, inputs, nbytes in (("add eager", add, (x, y), 3 * size),
                                     ("add compiled", torch.compile(add, dynamic=False), (x, y), 3 * size),
                                     ("rmsnorm+modulate compiled", torch.compile(norm_modulate, dynamic=False),
                                      (x, shift, scale), 2 * size)):
        with torch.no_grad():
            call = timed(lambda fn=fn, inputs=inputs: fn(*inputs), device, args.iters, args.warmup)
            kernel = kernel_seconds(lambda fn=fn, inputs=inputs: fn(*inputs), device, args.iters, args.warmup)
        seconds = kernel or call
        out[name] = {"us": round(seconds * 1e6, 1), "gb_per_s": round(nbytes / seconds / 1e9, 1),
                     "call_us": round(call * 1e6, 1), "call_gb_per_s": round(nbytes / call / 1e9, 1),
                     "timed": "kernels (profiler)" if kernel else "call (host clock)"}
    return out


def adamw_step(cfg, device) -> dict:
    """One optimizer step as the runs take it, over tensors shaped as the model's trainable parameters
    (fp32): the torchtitan backend's build_optimizer (fused AdamW on a GPU, foreach on a CPU) and its
    clip_grad_norm_ (the norm, its coefficient handed to the fused kernel's grad_scale: no pass of its
    own on a GPU), and the bytes it moves per parameter."""
    from echobench.backends.torchtitan import build_optimizer, clip_grad_norm_
    from echobench.model.echo import EchoTTS

    with torch.device("meta"):
        shapes = [p.shape for p in EchoTTS(cfg).trainable_parameters()]
    params = [torch.nn.Parameter(torch.randn(s, device=device) * 0.02) for s in shapes]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    opt = build_optimizer(params, device)
    fused = bool(opt.defaults.get("fused"))

    def step():
        clip_grad_norm_(params, 1.0, opt)
        opt.step()

    seconds = timed(step, device, iters=5, warmup=2)
    n = sum(p.numel() for p in params)
    # fused: AdamW reads p, g, m, v and writes p, m, v (28 bytes), the norm reads g (4); foreach: the
    # clipping's scale reads and writes g as well (8 more), and AdamW's foreach kernels read and write
    # their intermediates (counted by stepcount, not here)
    nbytes = 32 if fused else 40
    return {"params": n, "ms": round(seconds * 1e3, 2), "fused": fused, "bytes_per_param": nbytes,
            "gb_per_s": round(n * nbytes / seconds / 1e9, 1)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scale", default="3B")
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--audio-frames", type=int, default=750)
    p.add_argument("--text-tokens", type=int, default=256)
    p.add_argument("--speaker-frames", type=int, default=750)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--only", default="sdpa,attention,block,memory,adamw")
    p.add_argument("--json", type=Path, required=True)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = get_preset(args.scale)
    meta = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version() if device.type == "cuda" else None,
            "scale": args.scale, "micro_batch": args.micro_batch, "dtype": str(dtype).removeprefix("torch."),
            "lengths": [args.audio_frames, args.text_tokens, args.speaker_frames]}
    results = Results(args.json, meta)
    only = set(args.only.split(","))
    if "sdpa" in only:
        def choices():
            chosen = sdpa_choices(cfg, args.micro_batch, args.audio_frames, args.text_tokens, args.speaker_frames,
                                  device, dtype)
            return {**chosen, "enabled": {name: getattr(torch.backends.cuda, f"{flag}_sdp_enabled")()
                                          for name, flag in (("flash", "flash"), ("efficient", "mem_efficient"),
                                                             ("cudnn", "cudnn"), ("math", "math"))}}
        results.measure("sdpa_choice", choices)
    if "attention" in only:
        results.measure("attention", lambda: attention_times(cfg, args, device, dtype))
    if "block" in only:
        results.measure("dit_block", lambda: block_times(cfg, args, device, dtype))
    if "memory" in only:
        results.measure("memory_bound", lambda: memory_bound(cfg, args, device, dtype))
    if "adamw" in only:
        results.measure("adamw", lambda: adamw_step(cfg, device))
    return 0


if __name__ == "__main__":
    sys.exit(main())
