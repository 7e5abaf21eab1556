"""What one training step of Echo runs on one rank, before any pricing: its GEMMs and attentions
(step_work), its element-wise bytes, the optimizer's bytes per parameter, the parameters a rank
updates, and the ATen ops its host dispatches (host_ops). pricing.py turns this work into seconds
on a hardware profile; another model's work list can stand beside this one and be priced the same."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from echobench.records.config import RunConfig
from echobench.model.flops import param_counts, speaker_patches
from echobench.predict.memory import activation_elements_per_sample, state_shards

# Element-wise bytes per byte of saved activations (the package's docstring), where a step is not
# counted. Eager: counted as (6.0, 9.5) against an earlier activation estimate, which the count of
# memory.activation_elements_per_sample found 1.82x too small on the tiny steps they were counted on:
# divided by 1.82. Compiled:
# 3B's count of inductor's kernels at micro-batch 8, bf16 (`tools/trace_elementwise.py --ratios 800M 3B`; 800M's 1.43 /
# 2.01), in place of the 1.1 / 1.65 once assumed, which the H200's profiled 3B compiled step (its
# element-wise time twice what those bytes priced) and the count both found too few.
ELEMENTWISE = {"eager": (3.3, 5.22), "compiled": (1.68, 2.23)}
ADAMW_BYTES = {"foreach": 56, "fused": 28}  # per parameter (float32 p, g, m, v and temporaries)
CLIP_BYTES = 8  # per parameter: the norm reads each gradient, the scale reads and writes it (counted)
# ATen ops dispatched per step (views included), counted on real tiny steps on the CPU (one gloo
# process per rank; tools/count_host_ops.py): phase -> (fixed, per DiT layer, per speaker layer,
# per text-encoder layer). torchtitan single / ddp / fsdp2 (fsdp2 stands for hsdp) and megatron tp2
# (stands for any TP).
HOST_OPS = {
    "single": {"forward": (131, 139, 87, 100), "backward": (124, 266, 155, 0), "optimizer": (56, 26, 16, 0)},
    "ddp": {"forward": (160, 152, 95, 100), "backward": (159, 292, 171, 0), "optimizer": (56, 26, 16, 0)},
    "fsdp2": {"forward": (164, 169, 109, 100), "backward": (137, 321, 200, 0), "optimizer": (57, 26, 16, 0)},
    "tp": {"forward": (135, 148, 87, 100), "backward": (130, 272, 157, 0), "optimizer": (62, 32, 16, 0)},
}
# Activation checkpointing adds, per DiT / speaker layer, these backward ops (single, counted):
# full re-runs the block's forward; selective, eager, every second block's (half of full's per
# layer; compiled, COMPILED_BLOCK_OPS stand); the forward changes by views only.
AC_BACKWARD_OPS = {"none": (0, 0), "full": (263, 152), "selective": (132, 76)}
# Float8 bytes per element (TransformerEngine's cast-transpose and torchao's dynamic scaling): a
# linear's input and its output gradient are each read in bf16 and written in float8 twice (the
# tensor and its transpose, the layouts the forward and the two backward GEMMs take): 2 + 1 + 1; a
# weight likewise once per micro-batch; an amax reduction (current / tensorwise scaling: computed
# before the cast; delayed: from the cast itself) reads the tensor again: + 2. Compiled (torchao
# under torch.compile): the cast fuses into the kernel that makes the tensor, the amax does not.
FP8_BYTES = {"cast": 4, "amax": 2, "compiled_cast": 2}
# The parts of Echo whose linears torchtitan's float8 conversion turns to Float8Linear
# (backends/torchtitan.float8_plan: the token-axis linears but the latent in / out projections, and
# not the text encoder's).
FP8_PARTS = ("dit_attention", "dit_mlp", "speaker_encoder", "text_projection")
# A compiled block dispatches its matmuls, attention and about as many fused kernels (assumed):
# forward / backward ops per DiT and per speaker layer.
COMPILED_BLOCK_OPS = {"forward": (30, 16), "backward": (58, 30)}


@dataclass(frozen=True)
class Matmul:
    """`count` GEMMs x (m, k) @ W^T (k, n) of one part in one phase on one rank."""

    part: str  # a flops.PARTS name
    phase: str  # forward, backward, recompute
    m: int
    n: int
    k: int
    count: int = 1
    precision: str = "bf16"  # the GEMM's operands: bf16 (the compute dtype) or fp8 (float8, at the device's float8 rate)

    @property
    def flops(self) -> int:
        return 2 * self.m * self.n * self.k * self.count


@dataclass(frozen=True)
class AttentionWork:
    """Attention scores and values of one part in one phase on one rank: `flops` as flops.py counts
    them (forward 4 seq_q seq_k width per sample and layer, backward 2x), at seq_q x seq_k."""

    part: str
    phase: str
    seq_q: int
    seq_k: int
    flops: int
    calls: int
    head_dim: int
    causal: bool = False  # a causal kernel skips about half the scores (flops counts them all)


def _linear(out: list, part: str, rows: int, n: int, k: int, count: int = 1, input_grad: bool = True,
            backward: bool = True, recompute: bool = False) -> None:
    """One nn.Linear's GEMMs in commbench's layout: forward (rows, n, k); backward the weight gradient
    (n, k, rows) and, where its input has a gradient, the input gradient (rows, k, n); recompute: the
    forward again in backward (activation checkpointing)."""
    out.append(Matmul(part, "forward", rows, n, k, count))
    if backward:
        out.append(Matmul(part, "backward", n, k, rows, count))
        if input_grad:
            out.append(Matmul(part, "backward", rows, k, n, count))
    if recompute:
        out.append(Matmul(part, "recompute", rows, n, k, count))


@lru_cache(maxsize=4096)
def step_work(model_cfg, framework: str, tp: int, micro_batch: int, audio_frames: int, text_tokens: int,
              speaker_frames: int, ac: str) -> tuple[tuple[Matmul, ...], tuple[AttentionWork, ...]]:
    """The GEMMs and attentions of one step of one rank: flops.model_flops' matmuls at rows =
    micro_batch x tokens (its conventions: backward 2x, 1x for a first layer, the frozen encoder
    forward only), AC full's recompute (flops.recompute_flops' blocks), with q/k/v/gate, text and
    speaker k/v and the MLP's gate/up each one GEMM (both backends), and megatron's layout: those
    column-parallel (n / tp), the attention and MLP outputs row-parallel (k / tp), heads split;
    everything else replicated."""
    m, b, la, lt = model_cfg, micro_batch, audio_frames, text_tokens
    d, ds, p = m.width, m.speaker_width, speaker_patches(m, speaker_frames)
    keys, full = la + lt + p, ac == "full"
    mm: list[Matmul] = []
    att: list[AttentionWork] = []
    latent, text, spk = b * la, b * lt, b * p
    L = m.layers
    # Both backends fuse the same projections (megatron's column-parallel ones split n by tp).
    _linear(mm, "dit_attention", latent, 4 * d // tp, d, L, recompute=full)  # q, k, v, gate
    _linear(mm, "dit_attention", latent, d, d // tp, L, recompute=full)  # out (row-parallel)
    _linear(mm, "dit_attention", text, 2 * d // tp, d, L, recompute=full)  # text k, v
    _linear(mm, "dit_attention", spk, 2 * d // tp, ds, L, recompute=full)  # speaker k, v
    _linear(mm, "dit_mlp", latent, 2 * m.mlp // tp, d, L, recompute=full)  # gate + up
    _linear(mm, "dit_mlp", latent, d, m.mlp // tp, L, recompute=full)  # down (row-parallel)
    fwd = 4 * b * la * keys * d * L // tp
    att.append(AttentionWork("dit_attention", "forward", la, keys, fwd, L, m.head_dim))
    att.append(AttentionWork("dit_attention", "backward", la, keys, 2 * fwd, L, m.head_dim))
    if full:
        att.append(AttentionWork("dit_attention", "recompute", la, keys, fwd, L, m.head_dim))
    _linear(mm, "dit_conditioning", b, m.adaln_rank, d, L, recompute=full)  # adaln down
    _linear(mm, "dit_conditioning", b, 6 * d, m.adaln_rank, L, recompute=full)  # adaln up
    _linear(mm, "dit_conditioning", b, m.adaln_rank, d)  # final adaln
    _linear(mm, "dit_conditioning", b, 2 * d, m.adaln_rank)
    _linear(mm, "dit_conditioning", b, d, m.timestep_dim, input_grad=False)  # timestep MLP
    _linear(mm, "dit_conditioning", b, d, d)
    _linear(mm, "dit_io", latent, d, m.latent_dim, input_grad=False)
    _linear(mm, "dit_io", latent, m.latent_dim, d)
    # Speaker encoder: full AC re-runs all of a block but its MLP down projection (flops.recompute_flops).
    S = m.speaker_layers
    _linear(mm, "speaker_encoder", spk, ds, m.latent_dim * m.speaker_patch, input_grad=False)
    _linear(mm, "speaker_encoder", spk, 3 * ds, ds, S, recompute=full)  # q, k, v
    _linear(mm, "speaker_encoder", spk, ds, ds, S, recompute=full)  # out
    _linear(mm, "speaker_encoder", spk, 2 * m.speaker_mlp, ds, S, recompute=full)  # gate + up
    _linear(mm, "speaker_encoder", spk, ds, m.speaker_mlp, S)
    fwd = 4 * b * p * p * ds * S
    att.append(AttentionWork("speaker_encoder", "forward", p, p, fwd, S, ds // m.speaker_heads))
    att.append(AttentionWork("speaker_encoder", "backward", p, p, 2 * fwd, S, ds // m.speaker_heads))
    if full:
        att.append(AttentionWork("speaker_encoder", "recompute", p, p, fwd, S, ds // m.speaker_heads))
    enc, trains = m.text_encoder, not m.frozen_encoder
    _linear(mm, "text_projection", text, d, enc.hidden, input_grad=trains)
    q_dim, kv_dim, E = enc.heads * enc.head_dim, enc.kv_heads * enc.head_dim, enc.layers
    for n, k, count in ((q_dim, enc.hidden, E), (kv_dim, enc.hidden, 2 * E), (enc.hidden, q_dim, E),
                        (enc.mlp, enc.hidden, (2 if enc.gated_mlp else 1) * E), (enc.hidden, enc.mlp, E)):
        _linear(mm, "text_encoder", text, n, k, count, backward=trains)
    fwd = 4 * b * lt * lt * q_dim * E
    att.append(AttentionWork("text_encoder", "forward", lt, lt, fwd, E, enc.head_dim))
    if trains:
        att.append(AttentionWork("text_encoder", "backward", lt, lt, 2 * fwd, E, enc.head_dim))
    return tuple(mm), tuple(att)


def run_work(cfg: RunConfig) -> tuple[tuple[Matmul, ...], tuple[AttentionWork, ...]]:
    """step_work of a run."""
    return step_work(cfg.model_config(), cfg.framework, cfg.tp, cfg.micro_batch, cfg.audio_frames, cfg.text_tokens,
                     cfg.speaker_frames, cfg.ac)


def float8_work(mm, compiled: bool, amax: bool = True) -> tuple[tuple[Matmul, ...], tuple[float, float]]:
    """A float8 run's GEMMs: those of FP8_PARTS in float8 (the rest as they were), and the bytes
    their casts move, forward and backward (FP8_BYTES: each forward GEMM's input and weight, each
    backward's output gradient; amax: dynamic scaling's extra read, torchao's tensorwise)."""
    per = (FP8_BYTES["compiled_cast"] if compiled else FP8_BYTES["cast"]) + (FP8_BYTES["amax"] if amax else 0)
    out, fwd, bwd = [], 0.0, 0.0
    for m in mm:
        if m.part not in FP8_PARTS:
            out.append(m)
            continue
        out.append(Matmul(m.part, m.phase, m.m, m.n, m.k, m.count, "fp8"))
        if m.phase == "forward":
            fwd += per * m.count * (m.m * m.k + m.n * m.k)  # the input and the weight
            bwd += per * m.count * m.m * m.n  # the output gradient (its transpose written with it)
    return tuple(out), (fwd, bwd)


def host_ops(cfg: RunConfig) -> dict[str, int]:
    """ATen ops one rank dispatches per step, by phase (HOST_OPS; AC and compile as noted there)."""
    m = cfg.model_config()
    layout = cfg.layout.within_node  # a hybrid layout's ranks dispatch FSDP2's ops
    kind = "tp" if layout.tensor_parallel else layout.name
    table = HOST_OPS["single" if kind == "tp" and cfg.tp == 1 and cfg.dp == 1 else kind]
    out = {}
    for phase, (fixed, dit, speaker, encoder) in table.items():
        if cfg.compile is True and phase in COMPILED_BLOCK_OPS:  # priced(): compile auto resolved
            dit, speaker = COMPILED_BLOCK_OPS[phase]
        elif phase == "backward":
            dit, speaker = dit + AC_BACKWARD_OPS[cfg.ac][0], speaker + AC_BACKWARD_OPS[cfg.ac][1]
        if phase == "backward" and not m.frozen_encoder:
            encoder = 2 * table["forward"][3]  # a trained encoder's backward: assumed twice its forward
        out[phase] = fixed + dit * m.layers + speaker * m.speaker_layers + encoder * m.text_encoder.layers
    if kind == "tp" and cfg.dp > 1:  # torch DDP over the data-parallel group adds ddp's backward ops
        extra = [a - b for a, b in zip(HOST_OPS["ddp"]["backward"], HOST_OPS["single"]["backward"])]
        out["backward"] += extra[0] + extra[1] * m.layers + extra[2] * m.speaker_layers
    return out


def rank_params(cfg: RunConfig) -> float:
    """Trainable parameters one rank holds and updates: TP splits the DiT's attention and MLP
    matrices, FSDP2 / HSDP shard everything (as memory.estimate_memory)."""
    counts = param_counts(cfg.model_config())
    params = float(counts.trainable)
    if cfg.tp > 1:
        split = counts.parts["dit_attention"] + counts.parts["dit_mlp"]
        params += split / cfg.tp - split
    return params / state_shards(cfg)


def tp_share(cfg: RunConfig) -> float:
    """The share of a replica's element-wise bytes one TP rank moves: as memory.estimate_memory, norms
    and residuals stay whole (a quarter, assumed), the rest splits."""
    return 0.25 + 0.75 / cfg.tp if cfg.tp > 1 else 1.0


def ratios_saved(cfg: RunConfig, eb: int) -> float:
    """The bytes of what autograd saves per step of one replica (at `eb` bytes per element)."""
    return activation_elements_per_sample(cfg)[0] * cfg.micro_batch * eb


def elementwise_bytes(cfg: RunConfig, eb: int) -> tuple[float, float]:
    """The bytes one rank's element-wise ops read and write per step, forward and backward (AC
    re-runs the forward's in backward), at the ratios: ELEMENTWISE x the bytes of what autograd saves
    (at `eb` bytes per element, the compute dtype's). predict's GPU profiles count them instead
    (predict.elementwise); these stand on CPU profiles, for compiled runs and where counting fails."""
    saved = ratios_saved(cfg, eb) * tp_share(cfg)
    fwd, bwd = ELEMENTWISE["compiled" if cfg.compile else "eager"]
    return fwd * saved, (bwd + (fwd if cfg.ac != "none" else 0)) * saved
