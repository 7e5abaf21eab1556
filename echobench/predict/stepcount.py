"""One training step counted, not timed: its GPU kernels, FLOPs and bytes, by part, eager and compiled,
and what they would take on one H200.

No model is allocated. The model is built on the meta device and its parameters become FakeTensors
(torch._subclasses.FakeTensorMode: shapes, dtypes and strides, no data); a TorchDispatchMode then
sees every ATen op of one step as the GPU would run it: forward under bf16 autocast, backward,
gradient clipping and fused AdamW. Each op gets
- its part: the DiT blocks, the speaker-encoder blocks, the text encoder, or the top level (every
  other op of the forward: embeddings, text projection, speaker patching, DiT input and output, the
  loss), in the forward or the backward (a backward op belongs to the part whose forward made its
  autograd node), or the optimizer (clipping included);
- its kind: GEMM, attention, memory-bound (every other kernel), or view (no kernel: views, reshapes
  that alias, detach, allocation, metadata);
- its FLOPs (GEMM and attention; torch.utils.flop_counter's formulas, attention under
  echobench.model.flops' convention: backward 2x forward) and bytes: each distinct input element read
  once and each output element written once (an input broadcast by a stride-0 dimension counts its
  distinct elements; a lookup reads the rows it gathers).

What is emulated rather than seen, because the counter runs on a CPU build of torch:
- autocast is the CPU's (torch.autocast("cpu", bf16)); for this model it casts what CUDA's would
  (matmuls and attention to bf16; the ops CUDA keeps in fp32 already run on fp32 tensors here);
- scaled_dot_product_attention goes through gpu_attention(), the CUDA dispatch of torch 2.11: no
  mask -> FlashAttention-2; a mask -> the memory-efficient kernel (its bias made from the boolean
  mask, padded to 8-aligned strides, expanded), or cuDNN where torch prefers it (cuDNN > 9.15 on
  sm90): the same ATen ops a GPU run dispatches;
- fused AdamW's and the foreach ops' kernel launches follow multi_tensor_apply's limits.

Compiled: what the backend compiles (its apply_compile, with torch.compile recorded rather than run)
is compiled again by inductor on the CPU, on FakeTensors at the run's shapes, forward and backward as
AOT autograd splits them; the generated kernels are counted (their C++ is never built) and their
bytes are inductor's own estimate (the buffers each fused kernel reads and writes). A compiled unit's
memory-bound kernels are replaced by these, times its calls; its GEMMs and attention stay as they
are (extern calls: cuBLAS and the attention kernel on a GPU). The proxy's limits: inductor's C++
backend fuses differently from Triton (no epilogue or prologue fusion into GEMMs, different
reduction and loop fusion), and the CPU lowers some ops differently; kernel counts and bytes are
a proxy for the GPU's, which only a GPU shows.

Not counted: the host (launch overhead, Python), the batch's copy to the device, the per-sample
diffusion draws (2 tiny kernels per sample, made before the step), communication.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import re
from collections import Counter, defaultdict
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from unittest import mock

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from echobench.model import flops as flops_model
from echobench.backends import torchtitan
from echobench.records.config import RunConfig
from echobench.data import build_tokenizer, collate, make_source
from echobench.model import components
from echobench.model.echo import diffusion_draws, loss_frames
from echobench.predict.stepcount_ops import (Tally, attention_shape, gemm_precision, gemm_shape, gpu_attention,
                                     gpu_flex_attention,
                                     op_tally, tensors)

PARTS = ("dit_blocks", "speaker_blocks", "text_encoder", "top")
PHASES = ("forward", "backward", "optimizer")
KINDS = ("gemm", "attention", "memory", "view")
# Where a module's ops belong, by its name in EchoTTS (a checkpoint wrapper's inner module too).
PART_ROOTS = {"dit_blocks": r"dit\.blocks\.\d+", "speaker_blocks": r"speaker_encoder\.blocks\.\d+",
              "text_encoder": r"text_encoder"}


# ---- the counter ----

def part_root(name: str) -> str | None:
    """The part whose root module this is (a checkpoint wrapper's inner module too), else None."""
    name = name.removesuffix("._checkpoint_wrapped_module")
    return next((part for part, pattern in PART_ROOTS.items() if re.fullmatch(pattern, name)), None)


def part_of(name: str) -> str:
    """The part a module's ops belong to: that of its innermost enclosing part root, else the top level."""
    prefixes = [".".join(name.split(".")[:k]) for k in range(len(name.split(".")), 0, -1)] if name else []
    return next((part for prefix in prefixes if (part := part_root(prefix))), "top")


class StepCounter(TorchDispatchMode):
    """Tallies every dispatched op by (phase, part, kind, compiled unit).

    Forward: the part is the innermost part module running (module hooks keep the stack). Backward
    (the autograd engine running a graph task): the part and unit of the autograd node being
    executed, each node labelled when its forward left a part module or compiled unit (every
    unlabelled ancestor of the outputs is that part's; of the inputs, the enclosing one's); ops
    recomputed by activation checkpointing run inside the block's hooks again. `phase` overrides
    both (the optimizer)."""

    def __init__(self):
        super().__init__()
        self.tallies: dict[tuple, Tally] = defaultdict(Tally)
        self.attention: dict[str, Tally] = defaultdict(Tally)
        self.gemms: dict[tuple, Tally] = defaultdict(Tally)  # (phase, m, n, k, precision): each shape, priced apart
        self.attention_calls: dict[tuple, Tally] = defaultdict(Tally)  # (kernel, queries, keys, head_dim)
        self.parts: list[str] = []
        self.units: list[str] = []
        self.labels: dict = {}  # autograd node -> (part, unit)
        self.phase: str | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        kind, kernel, tally = op_tally(func, args, kwargs, out)
        phase, part, unit = self.where()
        self.tallies[phase, part, kind, unit].add(tally)
        if kernel:
            self.attention[kernel].add(tally)
            self.attention_calls[(kernel, *attention_shape(func, args))].add(tally)
        elif kind == "gemm":
            self.gemms[(phase, *gemm_shape(func, args), gemm_precision(func, args))].add(tally)
        return out

    def where(self) -> tuple[str, str, str | None]:
        if self.phase:
            return self.phase, "optimizer", None
        if torch._C._current_graph_task_id() == -1:
            return ("forward", *self.enclosing())
        part, unit = self.labels.get(torch._C._current_autograd_node(), ("top", None))
        return "backward", self.parts[-1] if self.parts else part, unit

    def label(self, tree, part: str, unit: str | None) -> None:
        todo = [t.grad_fn for t in tensors(tree) if t.grad_fn is not None]
        while todo:
            node = todo.pop()
            if node is not None and node not in self.labels:
                self.labels[node] = (part, unit)
                todo.extend(fn for fn, _ in node.next_functions)

    def enclosing(self) -> tuple[str, str | None]:
        """The innermost part and the outermost compiled unit running (dynamo inlines a unit's inner ones)."""
        return (self.parts[-1] if self.parts else "top"), (self.units[0] if self.units else None)

    @contextmanager
    def inside(self, part: str | None, unit: str | None, args):
        """Runs a part module or compiled unit's call: labels what came before, then what it made."""
        if torch._C._current_graph_task_id() == -1:  # not an activation-checkpoint recompute
            self.label(args, *self.enclosing())
        self.parts.extend([part] if part else [])
        self.units.extend([unit] if unit else [])
        out = []
        try:
            yield out
        finally:
            if part:
                self.parts.pop()
            if unit:
                self.units.pop()
        if torch._C._current_graph_task_id() == -1:
            outer_part, outer_unit = self.enclosing()
            self.label(out, part or outer_part, outer_unit or unit)

    def hook_parts(self, model: torch.nn.Module) -> list:
        """Forward hooks on the part modules: (pre, post) pairs push and pop the part."""
        handles = []
        for name, module in model.named_modules():
            if (part := part_root(name)) is None:
                continue
            state = {}

            def pre(mod, args, kwargs, part=part, state=state):
                state["cm"] = self.inside(part, None, (args, kwargs))
                state["out"] = state["cm"].__enter__()

            def post(mod, args, kwargs, output, state=state):
                state["out"].append(output)
                state.pop("cm").__exit__(None, None, None)

            handles += [module.register_forward_pre_hook(pre, with_kwargs=True),
                        module.register_forward_hook(post, with_kwargs=True, always_call=True)]
        return handles


# ---- what the backend compiles ----

@dataclass
class Unit:
    """A compiled callable of the backend, by its owner module's name with block indices as '*'
    (one per group of identical blocks) and the attribute compiled (None: the module's call)."""

    name: str
    owner: str | None  # the first instance's module name (None: a function of no module)
    attr: str | None
    fullgraph: bool
    fn: object = None  # the function compiled, where it belongs to no module
    calls: int = 0
    inputs: tuple | None = None  # (args, kwargs, grad enabled, autocast dtype) of its first call


def record_compiles(counter: StepCounter, model: torch.nn.Module, units: dict[str, Unit]):
    """A stand-in for torch.compile while the backend applies it: the callable runs eagerly, inside
    `counter.inside(None, unit)`, and its first call's inputs are kept for the inductor proxy."""
    names = {id(m): n for n, m in model.named_modules()}

    def compile_(fn=None, *args, **kwargs):
        if fn is None:  # used as a decorator factory: torch.compile(fullgraph=True)(fn)
            return lambda f: compile_(f, *args, **kwargs)
        owner_name = names.get(id(getattr(fn, "__self__", None)))  # None: a function of no module of the model
        attr = None if owner_name is None or fn.__name__ == "_call_impl" else fn.__name__
        base = fn.__qualname__ if owner_name is None else re.sub(r"\.\d+(?=\.|$)", ".*", owner_name) or "model"
        name = base + (f".{attr}" if attr else "")
        unit = units.setdefault(name, Unit(name, owner_name, attr, kwargs.get("fullgraph", False),
                                           fn if owner_name is None else None))

        @functools.wraps(fn)
        def run(*a, **k):
            if counter.units or torch._C._current_graph_task_id() != -1:  # inside another unit, or a recompute
                return fn(*a, **k)
            unit.calls += 1
            if unit.inputs is None:
                cast = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None
                unit.inputs = (a, k, torch.is_grad_enabled(), cast)
            with counter.inside(None, name, (a, k)) as out:
                out.append(fn(*a, **k))
            return out[0]

        return run

    return mock.patch.object(torch, "compile", compile_)


# ---- building and running the step ----

def fake_model(cfg: RunConfig, mode: FakeTensorMode, dtype: torch.dtype, compiled: bool) -> torch.nn.Module:
    """The backend's model as a GPU run builds it (built on the meta device: no init kernels run;
    FlexAttention for padded keys, key_masking auto's GPU choice) with FakeTensor parameters and
    buffers on the CPU, activation checkpointing applied as the backend applies it (ac_mode)."""
    model = torchtitan.build_model(cfg, torch.device("meta"), dtype)
    model.key_masking = "flex" if cfg.key_masking == "auto" else cfg.key_masking
    if cfg.precision == "fp8":  # torchao's float8 linears as on an sm90 GPU: real float8 GEMMs (_scaled_mm)
        torchtitan.apply_float8(model, torchtitan.float8_plan(cfg), emulate=False, fsdp=False, compiled=compiled,
                                recipe=cfg.float8_recipe)
    fakes: dict[int, torch.Tensor] = {}  # a tensor two modules share stays shared

    def fake(t):
        if id(t) not in fakes:
            f = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")
            fakes[id(t)] = torch.nn.Parameter(f, t.requires_grad) if isinstance(t, torch.nn.Parameter) else f
        return fakes[id(t)]

    with mode:
        for module in model.modules():
            for store in (module._parameters, module._buffers):
                for name, t in store.items():
                    if t is not None:
                        store[name] = fake(t)
    torchtitan.apply_ac(model, torchtitan.ECHO_PARTS, torchtitan.ac_mode(cfg.ac, compiled))
    return model


def fake_batch(cfg: RunConfig, mode: FakeTensorMode, masked: bool = False):
    """The synthetic full-length batch of the run's first step and its diffusion draws, as the loader
    and the loop make them (on the CPU: small), then FakeTensors: every sample keeping its
    conditioning, or (masked) dropping it, the micro-batch whose DiT attends over a key mask."""
    model_cfg = cfg.model_config()
    source = make_source("synthetic", micro_batch=cfg.micro_batch, seed=cfg.seed, audio_frames=cfg.audio_frames,
                         text_tokens=cfg.text_tokens, speaker_frames=cfg.speaker_frames)
    samples = list(itertools.islice(iter(source), cfg.micro_batch))
    batch = collate(samples, build_tokenizer(model_cfg.text_encoder.vocab), cfg.audio_frames, cfg.text_tokens,
                    cfg.speaker_frames)
    draws = diffusion_draws(cfg.seed, batch.index.tolist(), batch.latent.shape[1], model_cfg.latent_dim,
                            1.0 if masked else 0.0, torch.device("cpu"))

    def fake(obj):
        return dataclasses.replace(obj, **{f.name: mode.from_tensor(getattr(obj, f.name))
                                           for f in dataclasses.fields(obj)
                                           if isinstance(getattr(obj, f.name), torch.Tensor)})

    return fake(batch), fake(draws)


def compute_dtype(cfg: RunConfig) -> torch.dtype | None:
    """The autocast dtype of a GPU run of this precision (None: fp32, no autocast); fp8 runs autocast
    to bf16 around their float8 linears."""
    return None if cfg.precision == "fp32" else torch.bfloat16


def run_step(cfg: RunConfig, counter: StepCounter, mode: FakeTensorMode, compiled: bool,
             prefer_cudnn: bool, masked: bool = False) -> dict[str, Unit]:
    """One step of micro-batch cfg.micro_batch under `counter`, as bench.train_step runs it on a GPU:
    the forward under autocast, the loss over the batch's frames, backward, clipping (the backend's
    clip_grad_norm_, its coefficient handed to the fused optimizer) and fused AdamW (the backend's
    build_optimizer on CUDA). The optimizer's state
    exists before the step, as in every step after the first. Returns the units the backend compiles."""
    dtype = compute_dtype(cfg)
    model = fake_model(cfg, mode, dtype or torch.float32, compiled)
    units: dict[str, Unit] = {}
    if compiled:
        with record_compiles(counter, model, units):
            torchtitan.apply_compile(model, torchtitan.ECHO_PARTS)
    batch, draws = fake_batch(cfg, mode, masked)
    params = model.trainable_parameters()
    with mode:
        optimizer = torchtitan.build_optimizer(params, torch.device("cuda"))
        for p in params:
            p.grad = torch.zeros_like(p)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    handles = counter.hook_parts(model)
    try:
        with mode, counter, mock.patch.object(F, "scaled_dot_product_attention", gpu_attention(prefer_cudnn)), \
                mock.patch.object(components, "flex_attention", gpu_flex_attention):
            frames = loss_frames(batch)
            with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
                err = model(batch, draws=draws, reduction="sum")
            loss = err / frames.clamp(min=1)
            loss.backward()
            counter.phase = "optimizer"
            torchtitan.clip_grad_norm_(params, 1.0, optimizer)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            counter.phase = None
    finally:
        for h in handles:
            h.remove()
    return units


# ---- the compiled proxy: inductor on the CPU ----

@dataclass
class Figures:
    """What inductor made of one graph: generated kernels and their bytes, extern calls by kind."""

    kernels: int = 0
    bytes: int = 0
    extern: Counter = field(default_factory=Counter)  # gemm, attention, memory (a fallback kernel)
    extern_bytes: Counter = field(default_factory=Counter)


def graph_figures(nodes) -> Figures:
    """Figures of inductor's scheduler nodes after fusion: a fused node is one generated kernel; an
    extern node is a library call, GEMM, attention or another (a fallback kernel) by its python
    kernel name (none: a view of a multi-output, no kernel)."""
    from torch._inductor.scheduler import NopKernelSchedulerNode  # lazy: inductor takes seconds to import

    out = Figures()
    for node in nodes:
        if isinstance(node, NopKernelSchedulerNode):
            continue
        nbytes = node.get_read_write_buffers_sizes()
        if not node.is_extern():
            out.kernels, out.bytes = out.kernels + 1, out.bytes + nbytes
            continue
        name = getattr(node.node, "python_kernel_name", None)
        if name is None:
            continue
        # an RNG-state wrapper (activation checkpointing replays attention's RNG) names the op it runs
        name = " ".join([name, *(str(a) for a in getattr(node.node, "constant_args", ())
                                 if isinstance(a, torch._ops.OpOverload))])
        kind = "attention" if "attention" in name else "gemm" if re.search(r"\b(addmm|mm|bmm|baddbmm)\b", name) \
            else "memory"
        out.extern[kind] += 1
        out.extern_bytes[kind] += nbytes
    return out


def inductor_figures(fn, args, kwargs, grad: bool, cast: torch.dtype | None, fullgraph: bool, mode,
                     prefer_cudnn: bool) -> dict[str, Figures]:
    """Compiles fn(*args, **kwargs) with inductor for the CPU on FakeTensors, forward and backward,
    without running it: {"forward": Figures, "backward": Figures} summed over its graphs."""
    import torch._functorch.config as functorch_config  # lazy: inductor takes seconds to import
    import torch._inductor.config as inductor_config  # lazy: as above
    from torch._inductor import metrics  # lazy: as above
    from torch._inductor.async_compile import AsyncCompile  # lazy: as above
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner, inductor_metrics_log  # lazy: as above

    figures = {"forward": Figures(), "backward": Figures()}

    def inner(gm, example_inputs, **kw):
        metrics.reset()
        compiled = compile_fx_inner(gm, example_inputs, **kw)
        part = graph_figures([node for node, _ in metrics.nodes_num_elem])
        total = figures["backward" if kw.get("is_backward") else "forward"]
        total.kernels, total.bytes = total.kernels + part.kernels, total.bytes + part.bytes
        total.extern.update(part.extern)
        total.extern_bytes.update(part.extern_bytes)
        return compiled

    def backend(gm, example_inputs):
        compile_fx(gm, example_inputs, inner_compile=inner)
        return gm.forward  # the step goes on eagerly on FakeTensors: the compiled code never runs

    def never_built(*a, **k):  # stands in for a C++ kernel's build: only its source is needed
        def kernel(*x):
            raise RuntimeError("stepcount's compiled kernels are never run")
        return kernel

    def leaf(obj):  # a fresh input, as a compiled call receives it (batches and draws are dataclasses)
        if isinstance(obj, torch.Tensor):
            return obj.detach().requires_grad_(obj.requires_grad)
        if dataclasses.is_dataclass(obj):
            return dataclasses.replace(obj, **{f.name: leaf(getattr(obj, f.name)) for f in dataclasses.fields(obj)})
        if isinstance(obj, (list, tuple)):
            return type(obj)(map(leaf, obj))
        return {k: leaf(v) for k, v in obj.items()} if isinstance(obj, dict) else obj

    args, kwargs = leaf(args), leaf(kwargs)
    level = inductor_metrics_log.level
    with ExitStack() as stack:
        # the backward is lowered with the forward (AOT autograd otherwise waits for its first call)
        stack.enter_context(functorch_config.patch(force_non_lazy_backward_lowering=True))
        # a cache hit would skip codegen and leave no scheduler nodes to count; nothing is built, so
        # no pool of compile workers
        stack.enter_context(inductor_config.patch(force_disable_caches=True, compile_threads=1))
        stack.enter_context(mock.patch.object(AsyncCompile, "cpp", never_built))  # the C++ is never built
        stack.enter_context(mock.patch.object(AsyncCompile, "cpp_pybinding", never_built))
        stack.enter_context(mock.patch.object(F, "scaled_dot_product_attention", gpu_attention(prefer_cudnn)))
        stack.enter_context(mock.patch.object(components, "flex_attention", gpu_flex_attention))
        stack.enter_context(mode)
        stack.enter_context(torch.set_grad_enabled(grad))
        stack.enter_context(torch.autocast("cpu", dtype=cast or torch.float32, enabled=cast is not None))
        inductor_metrics_log.setLevel(logging.INFO)  # inductor keeps its per-node bytes only then
        stack.callback(inductor_metrics_log.setLevel, level)
        torch._dynamo.reset()
        torch.compile(fn, backend=backend, fullgraph=fullgraph, dynamic=False)(*args, **kwargs)
    return figures


# ---- the result ----

@dataclass
class StepCount:
    """One step's tallies by (phase, part, kind); optimizer ops are part "optimizer"."""

    settings: dict
    tallies: dict[tuple[str, str, str], Tally]
    attention: dict[str, Tally]  # by GPU kernel
    units: list[dict] = field(default_factory=list)  # compiled: what inductor made of each unit
    gemms: dict[tuple[str, int, int, int, str], Tally] = field(default_factory=dict)  # (phase, m, n, k, precision)
    attention_calls: dict[tuple[str, int, int, int], Tally] = field(default_factory=dict)  # (kernel, q, k, head_dim)

    def total(self, phase: str | None = None, part: str | None = None, kind: str | None = None) -> Tally:
        out = Tally()
        for (ph, pa, ki), t in self.tallies.items():
            if phase in (None, ph) and part in (None, pa) and kind in (None, ki):
                out.add(t)
        return out

    def rows(self) -> list[tuple[str, str]]:
        """(phase, part) of the table: forward and backward by part, then the optimizer."""
        return [(ph, pa) for ph in PHASES[:2] for pa in PARTS] + [("optimizer", "optimizer")]

    @classmethod
    def from_dict(cls, data: dict) -> "StepCount":
        """The count as_dict wrote (a committed report's JSON), to be priced again."""
        tallies = {(row["phase"], row["part"], kind): Tally(**row[kind]) for row in data["rows"] for kind in KINDS}
        figures = ("ops", "kernels", "bytes", "flops")
        return cls(data["settings"], tallies, {k: Tally(**v) for k, v in data["attention"].items()}, data["units"],
                   {(g["phase"], g["m"], g["n"], g["k"], g["precision"]): Tally(*(g[f] for f in figures))
                    for g in data["gemms"]},
                   {(a["kernel"], a["queries"], a["keys"], a["head_dim"]): Tally(*(a[f] for f in figures))
                    for a in data["attention_calls"]})

    def as_dict(self) -> dict:
        return {"settings": self.settings,
                "rows": [{"phase": ph, "part": pa, **{k: dataclasses.asdict(self.total(ph, pa, k)) for k in KINDS}}
                         for ph, pa in self.rows()],
                "attention": {k: dataclasses.asdict(v) for k, v in self.attention.items()},
                "gemms": [{"phase": ph, "m": m, "n": n, "k": k, "precision": pr, **dataclasses.asdict(t)}
                          for (ph, m, n, k, pr), t in self.gemms.items()],
                "attention_calls": [{"kernel": ker, "queries": q, "keys": kv, "head_dim": d, **dataclasses.asdict(t)}
                                    for (ker, q, kv, d), t in self.attention_calls.items()],
                "units": self.units}


def count_step(cfg: RunConfig, compiled: bool = False, prefer_cudnn: bool = False, masked: bool = False) -> StepCount:
    """One training step of `cfg` (micro_batch, lengths, precision, ac), counted on FakeTensors.

    compiled: what the backend compiles is counted from inductor's CPU code instead (module
    docstring): memory-bound kernels and bytes of each compiled unit are its generated kernels
    (and any fallback kernels) times its calls; GEMM and attention stay as counted.
    prefer_cudnn: attention as torch runs it where it prefers cuDNN (gpu_attention).
    masked: the micro-batch drops its samples' conditioning (cfg_drop mask): the DiT attends over a
    key mask, FlexAttention's (key_masking auto on a GPU) or SDPA's dense mask."""
    counter, mode = StepCounter(), FakeTensorMode()
    units = run_step(cfg, counter, mode, compiled, prefer_cudnn, masked)
    tallies: dict[tuple, Tally] = defaultdict(Tally)
    for (phase, part, kind, unit), t in counter.tallies.items():
        if not (unit and kind == "memory"):
            tallies[phase, part, kind].add(t)
    described = []
    if units:
        plain = fake_model(cfg, mode, compute_dtype(cfg) or torch.float32, compiled)  # no counter hooks or compile stand-in
        modules = dict(plain.named_modules())
        for unit in units.values():
            args, kwargs, grad, cast = unit.inputs
            owner = None if unit.owner is None else modules[unit.owner]
            fn = unit.fn if owner is None else owner._call_impl if unit.attr is None else getattr(owner, unit.attr)
            figures = inductor_figures(fn, args, kwargs, grad, cast, unit.fullgraph, mode, prefer_cudnn)
            part = part_of(unit.owner or "")
            eager = {ph: Tally() for ph in ("forward", "backward")}
            for (phase, _, kind, name), t in counter.tallies.items():
                if name == unit.name and kind == "memory":
                    eager[phase].add(t)
            for phase, fig in figures.items():
                memory = Tally(0, fig.kernels + fig.extern["memory"], fig.bytes + fig.extern_bytes["memory"])
                tallies[phase, part, "memory"].add(memory, unit.calls)
            described.append({"unit": unit.name, "calls": unit.calls, "part": part,
                              **{ph: {"generated_kernels": fig.kernels, "generated_bytes": fig.bytes,
                                      "extern_calls": dict(fig.extern),
                                      "eager_memory_kernels": eager[ph].kernels // max(unit.calls, 1),
                                      "eager_memory_bytes": eager[ph].bytes // max(unit.calls, 1)}
                                 for ph, fig in figures.items()}})
    model_flops = flops_model.model_flops(cfg.model_config(), cfg.audio_frames, cfg.text_tokens, cfg.speaker_frames)
    settings = {"scale": cfg.scale, "micro_batch": cfg.micro_batch, "audio_frames": cfg.audio_frames,
                "text_tokens": cfg.text_tokens, "speaker_frames": cfg.speaker_frames, "precision": cfg.precision,
                "ac": cfg.ac, "compiled": compiled, "prefer_cudnn": prefer_cudnn, "masked": masked,
                "key_masking": cfg.key_masking, "model_flops_per_sample": model_flops.total}
    return StepCount(settings, dict(tallies), dict(counter.attention), described, dict(counter.gemms),
                     dict(counter.attention_calls))
