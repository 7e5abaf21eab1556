"""Which kernels a run's attention and compile produced: the SDPA backend pinned or predicted, the
attention kernels a profiled micro-batch ran, the dynamo graphs compiled and the graph breaks, what
compiled when (CompileWatch), and the recompile limit sized to the run's shapes.

Read by the benchmark loop (echobench.train.bench) for the record; the model and the backends decide
what runs, this module only pins, asks and counts.
"""

from __future__ import annotations

import re
from collections import Counter

import torch
from torch.nn.attention import SDPBackend

from echobench.model.decoder import decoder_sdpa_options
from echobench.model.flops import speaker_patches

# The settings' names for torch's SDPA backends (config.RunConfig.sdpa_backend).
SDPA_BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                 "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}
_ENABLE = {"flash": torch.backends.cuda.enable_flash_sdp, "efficient": torch.backends.cuda.enable_mem_efficient_sdp,
           "cudnn": torch.backends.cuda.enable_cudnn_sdp, "math": torch.backends.cuda.enable_math_sdp}


def pin_sdpa_backend(name: str) -> None:
    """Lets SDPA use only the backend `name` for the rest of the process (auto: leaves torch's
    choice alone). torch's flags, global on purpose: every attention of the run, forward and
    backward, compiled or not, takes the pinned kernel or fails saying why it cannot."""
    if name == "auto":
        return
    for backend, enable in _ENABLE.items():
        enable(backend == name)


def sdpa_choices(model_cfg, micro_batch: int, audio_frames: int, text_tokens: int, speaker_frames: int,
                 device: torch.device, dtype: torch.dtype, tp: int = 1, paths=None, te: bool = False) -> dict[str, str]:
    """The SDPA backend torch would pick (torch._fused_sdp_choice under the flags pin_sdpa_backend set)
    for each attention path a run met that goes through SDPA: `paths`, its (attention, path) pairs
    (None: the DiT's and speaker encoder's unmasked and dense-masked paths). A prediction, asked of
    torch at the run's shapes, not the kernels that ran (bench_warmup.profile_variants profiles those
    on a GPU); none for FlexAttention paths or TransformerEngine's attention (te: the DiT's). On a CPU
    the names are the CPU kernels'. `tp` splits the DiT's heads as megatron's TP does."""
    b, dit_heads = micro_batch, model_cfg.heads // tp
    p = speaker_patches(model_cfg, speaker_frames)
    keys = audio_frames + text_tokens + p
    enc = model_cfg.text_encoder
    paths = set(paths) if paths is not None else {(a, m) for a in ("dit", "speaker_encoder") for m in ("none", "dense")}

    def choice(heads, q_len, k_len, head_dim, masked) -> str:
        q = torch.zeros(b, heads, q_len, head_dim, device=device, dtype=dtype)
        k = torch.zeros(b, heads, k_len, head_dim, device=device, dtype=dtype)
        mask = torch.ones(b, 1, 1, k_len, device=device, dtype=torch.bool) if masked else None
        return sdpa_choice(q, k, attn_mask=mask)

    shapes = {"dit": (dit_heads, audio_frames, keys, model_cfg.head_dim),
              "speaker_encoder": (model_cfg.speaker_heads, p, p, model_cfg.speaker_width // model_cfg.speaker_heads),
              "text_encoder": (enc.heads, text_tokens, text_tokens, enc.head_dim)}
    out = {}
    for attention, path in sorted(paths):
        if path not in ("none", "dense") or (te and attention == "dit"):
            continue
        out[attention + ("_dense_mask" if path == "dense" else "")] = choice(*shapes[attention], path == "dense")
    return out


def card_sdpa_choices(card, micro_batch: int, seq: int, device: torch.device, dtype: torch.dtype,
                      tp: int = 1) -> dict[str, str]:
    """sdpa_choices for a card run: torch's choice for the decoder's attention (model.decoder's call and
    options: causal where the card is, GQA where it has fewer key / value heads) at the run's shapes,
    {"decoder": name}. `tp` splits the query and key / value heads as the TP decoder does
    (model.decoder_tp); sequence parallelism leaves the attention the whole sequence."""
    head_dim = card.hidden // card.heads
    q = torch.zeros(micro_batch, card.heads // tp, seq, head_dim, device=device, dtype=dtype)
    k = torch.zeros(micro_batch, card.kv_heads // tp, seq, head_dim, device=device, dtype=dtype)
    return {"decoder": sdpa_choice(q, k, **decoder_sdpa_options(q, k, card.causal))}


def sdpa_choice(q: torch.Tensor, k: torch.Tensor, **options) -> str:
    """The SDPBackend name torch picks for queries q over keys (and values shaped as) k with SDPA's options."""
    return SDPBackend(torch._fused_sdp_choice(q, k, k, **options)).name


def compile_graphs(buckets: list[int] | None) -> int:
    """How many graphs one compiled code object may need in this run. nn.Module.compile compiles
    the module's call, one code object shared by every compiled block (DiT, speaker, text
    encoder, their checkpoint wrappers): the DiT's latent shapes (one, or one per bucket) with and
    without a key mask, the speaker and text blocks' (masked or not; full or sliding window), and
    a margin."""
    return 2 * (len(buckets) if buckets else 1) + 8


def size_recompile_limit(graphs: int) -> None:
    """Raises dynamo's per-code-object recompile limit (8 by default) to what the run's shapes need,
    so that a run with several buckets never ends in FailOnRecompileLimitHit."""
    import torch._dynamo  # lazy: dynamo takes seconds to import; only a compiled run needs it

    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, graphs)
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, 4 * graphs)


def compile_counts() -> dict:
    """What dynamo compiled in this process so far: graphs, graph breaks and their reasons."""
    from torch._dynamo.utils import counters  # lazy: dynamo takes seconds to import; only a compiled run needs it

    breaks = counters["graph_break"]
    return {"graphs": int(counters["stats"]["unique_graphs"]), "graph_breaks": int(sum(breaks.values())),
            "break_reasons": [reason.splitlines()[0][:200] for reason, _ in breaks.most_common(5)]}


class CompileWatch:
    """Counts, from start(), every compile torch runs in this process, by what triggered it: dynamo
    tracing a frame (a first compile or a recompile), AOT autograd compiling a backward graph on its
    first backward (lazy_backward), inductor recording a CUDA graph (cudagraph_recording); each
    reported by torch._dynamo's compile callbacks as it starts. Compiles torch runs on its own in an
    eager run count too (FlexAttention's kernel, megatron-core's fused SwiGLU). Read on the host
    (`total`): the measured loop reads it after every step without a device sync."""

    def __init__(self):
        self.events: Counter = Counter()

    def start(self) -> "CompileWatch":
        import torch._dynamo  # lazy: dynamo takes seconds to import; every run needs it here

        torch._dynamo.callback_handler.register_start_callback(self._started)
        return self

    def stop(self) -> None:
        import torch._dynamo  # lazy (start)

        if self._started in torch._dynamo.callback_handler.start_callbacks:
            torch._dynamo.callback_handler.remove_start_callback(self._started)

    def _started(self, args) -> None:
        self.events[args.callback_trigger.name.lower()] += 1

    @property
    def total(self) -> int:
        return sum(self.events.values())


# Kernel names of the attention kernels torch, cuDNN, TransformerEngine and inductor launch: SDPA's
# FlashAttention-2 (flash_fwd / flash_bwd), memory-efficient (fmha_cutlass, cutlassF / cutlassB),
# cuDNN (cudnn_generated_fort_native_sdpa, sm90_flash / fmha kernels), TE's fused attention, and
# inductor's FlexAttention templates (triton_tem_fused_...flex_attention / flex_decoding).
ATTENTION_KERNEL = re.compile(r"flash|fmha|cutlass[fb]|attention|attn|sdpa|flex", re.IGNORECASE)


def attention_kernels(kernel_names) -> dict[str, int]:
    """The attention kernels among a profiled stretch's device kernels (their names, one per launch),
    with their launch counts, names shortened to 120 characters."""
    return dict(Counter(name[:120] for name in kernel_names if ATTENTION_KERNEL.search(name)).most_common())
