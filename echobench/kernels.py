"""Which kernels a run's attention and compile produced: the SDPA backend pinned or chosen, the
dynamo graphs compiled and the graph breaks, and the recompile limit sized to the run's shapes.

Read by the benchmark loop (echobench.bench) for the record; the model and the backends decide
what runs, this module only pins, asks and counts.
"""

from __future__ import annotations

import torch
from torch.nn.attention import SDPBackend

from echobench.flops import speaker_patches

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
                 device: torch.device, dtype: torch.dtype, tp: int = 1) -> dict[str, str]:
    """The SDPA backend torch picks at this run's attention shapes (torch._fused_sdp_choice, under
    the flags pin_sdpa_backend set): the DiT's joint attention without a mask and with a dense key
    mask, and the speaker encoder's. On a CPU the names are the CPU kernels'. `tp` splits the DiT's
    heads as megatron's TP does."""
    b, dit_heads = micro_batch, model_cfg.heads // tp
    keys = audio_frames + text_tokens + speaker_patches(model_cfg, speaker_frames)
    p = speaker_patches(model_cfg, speaker_frames)

    def choice(heads, q_len, k_len, head_dim, masked) -> str:
        q = torch.zeros(b, heads, q_len, head_dim, device=device, dtype=dtype)
        k = torch.zeros(b, heads, k_len, head_dim, device=device, dtype=dtype)
        mask = torch.ones(b, 1, 1, k_len, device=device, dtype=torch.bool) if masked else None
        return SDPBackend(torch._fused_sdp_choice(q, k, k, attn_mask=mask)).name

    return {"dit": choice(dit_heads, audio_frames, keys, model_cfg.head_dim, False),
            "dit_dense_mask": choice(dit_heads, audio_frames, keys, model_cfg.head_dim, True),
            "speaker_encoder": choice(model_cfg.speaker_heads, p, p, model_cfg.speaker_width // model_cfg.speaker_heads,
                                      False)}


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
