"""Per-GPU memory estimate of one Echo run, before running it: does it fit the device (whose
capacity is echobench.hardware.devicememory's)?

An estimate, not a measurement (expect +-30% on the whole); `plan` prints it and `sweep` skips runs
that do not fit unless --force. Parts, in bytes per GPU (state_bytes has the why of the first three;
tests/test_memory_estimate.py holds them and the activations against counts of real steps):
- weights:     torchtitan: the fp32 trainable parameters (autocast / FSDP mixed precision compute
               in bf16 from them), sharded by FSDP2 (world) or HSDP (a node); master_weights
               bf16-compute: bf16 parameters and fp32 masters (2 + 4; gradients in grad_accum_dtype,
               bf16_compute_state). megatron: its TP shard
               (the DiT's attention and MLP matrices split, their norms and the rest replicated); on
               a GPU bf16 parameters plus the optimizer's fp32 main parameters (2 + 4 bytes; the
               distributed optimizer shards the 4 over dp), on a CPU fp32 (4).
- gradients:   one fp32 copy, sharded as the weights: torch DDP's gradients are views of its buckets
               (gradient_as_bucket_view), megatron's main_grad views of its grad buffer (allocated at
               any dp, dp 1 included; bf16 with grad_reduce_dtype bf16). No layout holds a second copy.
- optimizer:   AdamW's two fp32 moments (the distributed optimizer shards them over dp).
- activations: what the forward leaves alive for backward, per sample at the run's lengths, times
               micro_batch (saved_elements: counted per tensor on a bf16-autocast step and itemised
               per block; RMSNorm's fp32 copies are a third of it; flash attention: no score matrix):
               full AC keeps the block inputs, layer-level selective (eager) every second block
               whole, op-level selective (compiled) the matmul and attention outputs, each plus one
               block's recompute in backward; Megatron TP splits the heads' and MLP's share
               (sequence parallelism the rest of the blocks'); plus autocast's bf16 weight copies
               that backward keeps (autocast_weight_bytes: single / DDP, 2 bytes per parameter of
               the uncheckpointed blocks). Compiled runs are counted as eager (inductor may save less).
- encoder:     the frozen text encoder, stored in the compute dtype, replicated, no gradients
               (a trainable one counts as trainable parameters instead).
- transient:   FSDP2's all-gathered bf16 blocks (current + prefetched).
- overhead:    on a GPU the CUDA context, NCCL / cuBLAS workspaces (CUDA_CONTEXT, 1.5 GiB), on a CPU nothing
               here: a CPU process's resident baseline (the interpreter, torch and the libraries a rank
               imports) is measured by the run once its model is built (baseline_rss_gib in its memory
               stats) and added by the report; plus 10% allocator fragmentation.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from echobench.records.config import RunConfig
from echobench.model.flops import LAYER_SELECTIVE, param_counts

GIB = 2**30
CUDA_CONTEXT = 1.5 * GIB  # a GPU process's CUDA context and NCCL / cuBLAS workspaces


@dataclass
class MemoryEstimate:
    weights: float
    gradients: float
    optimizer: float
    activations: float
    encoder: float
    transient: float
    overhead: float

    @property
    def total(self) -> float:
        return sum(asdict(self).values())

    @property
    def total_gib(self) -> float:
        return self.total / GIB

    @property
    def tensors(self) -> float:
        """What the allocator hands out (the measured allocated peak's counterpart): all but the overhead,
        whose context and workspaces lie outside it and whose fragmentation is in its cache."""
        return self.total - self.overhead

    def as_gib(self) -> dict:
        return {k: v / GIB for k, v in asdict(self).items()} | {"total": self.total_gib, "tensors": self.tensors / GIB}


def compute_bytes(precision: str) -> int:
    # auto is bf16 on a GPU, which is what the fit check is for.
    return 4 if precision == "fp32" else 2


def state_shards(cfg: RunConfig) -> int:
    """How many ways the parameters / gradients / optimizer state are split."""
    return cfg.layout.shard_ranks(cfg.nodes, cfg.gpus_per_node)


def on_gpu(cfg: RunConfig) -> bool:
    """Whether the run is sized for a GPU (device auto: the fit check's case)."""
    return cfg.device != "cpu"


def rank_parameters(cfg: RunConfig) -> float:
    """Trainable parameters one rank holds before any FSDP sharding: Megatron TP splits the DiT's
    attention and MLP matrices; their norms (block RMSNorms, per-head QK-norms) stay whole."""
    model = cfg.model_config()
    counts = param_counts(model)
    trainable = float(counts.trainable)
    if cfg.tp > 1:
        norms = model.layers * (2 * model.width + 2 * model.head_dim)
        split = counts.parts["dit_attention"] + counts.parts["dit_mlp"] - norms
        trainable += split / cfg.tp - split
    return trainable


def adam_state_bytes(params: float, *, bf16_params: bool = False, main_shards: int = 1,
                     grad_bytes: int = 4) -> dict[str, float]:
    """The training state of `params` parameters under AdamW, in bytes by part: the parameters
    (weights), the fp32 main copy of bf16 parameters (main), the gradients (grad_bytes each) and
    Adam's two fp32 moments (moments); main and moments sharded over main_shards (a distributed
    optimizer's data-parallel ranks). fp32 parameters: 4 + 4 + 8 per parameter; bf16 ones:
    2 + 4 / s + grad_bytes + 8 / s. Echo's runs (state_bytes) and a card's (predict.cards.memory)
    both count their state here."""
    if not bf16_params:
        return {"weights": 4 * params, "main": 0.0, "gradients": grad_bytes * params, "moments": 8 * params}
    return {"weights": 2 * params, "main": 4 * params / main_shards, "gradients": grad_bytes * params,
            "moments": 8 * params / main_shards}


def state_bytes(cfg: RunConfig) -> tuple[float, float, float]:
    """(weights, gradients, optimizer) bytes per rank.

    torchtitan (single, DDP, FSDP2, HSDP): fp32 parameters (autocast / FSDP's mixed precision compute
    in bf16 from them), fp32 gradients, AdamW's two fp32 moments: 4 + 4 + 8 bytes per parameter, FSDP2
    / HSDP sharded. DDP adds no copy: gradient_as_bucket_view makes each .grad a view of its bucket
    (counted: tests/test_memory_estimate.py).

    megatron (tpN, DDP over dp = world / tp, any dp, dp 1 included): megatron-core's
    DistributedDataParallel allocates one contiguous grad buffer per dtype at any dp; each
    parameter's main_grad is a view of it, autograd's .grad is added into it and dropped by DDP's hook
    (a transient), and the FP32Optimizer hands main_grad itself to Adam (.grad = main_grad): one
    gradient copy. On the CPU (fp32 parameters, counted): 4 + 4 + 8. On a GPU (megatron-core 0.16's
    source: param_and_grad_buffer, Float16OptimizerWithFloat16Params): bf16 parameters (2) plus the
    optimizer's fp32 main parameters (4), the fp32 grad buffer (4; 2 with grad_reduce_dtype bf16,
    whose fp32 copy for Adam lives from the clip to the step's zero_grad only, outside the activation
    peak) and Adam's fp32 moments (8): 18 bytes per parameter. The distributed optimizer keeps the
    parameters in the buffer (param_data, the same 2 bytes) and shards the main parameters and
    moments over dp; the grad buffer stays whole.
    """
    n = rank_parameters(cfg) / state_shards(cfg)
    if cfg.framework != "megatron" and recipe_of(cfg) == "bf16-compute":
        return bf16_compute_state(cfg, n)
    # megatron's params_dtype (backends.megatron.tp_options); in fp32 its FP32Optimizer steps the
    # parameters, main_grad being .grad
    bf16_params = cfg.framework == "megatron" and on_gpu(cfg) and cfg.precision != "fp32"
    state = adam_state_bytes(n, bf16_params=bf16_params,
                             main_shards=cfg.dp if bf16_params and cfg.distributed_optimizer else 1,
                             grad_bytes=2 if bf16_params and cfg.grad_reduce_dtype == "bf16" else 4)
    return state["weights"] + state["main"], state["gradients"], state["moments"]


def recipe_of(cfg: RunConfig) -> str:
    """The run's master_weights recipe on the device it is sized for (on_gpu)."""
    return cfg.master_weights_on("cuda" if on_gpu(cfg) else "cpu")


def bf16_compute_state(cfg: RunConfig, n: float) -> tuple[float, float, float]:
    """(weights, gradients, optimizer) of master_weights bf16-compute (backends.master), n parameters:
    bf16 parameters and their fp32 masters (2 + 4); the step's gradients as backward sums them, in
    grad_accum_dtype: bf16 (2; cast into fp32 master gradients after the last backward, outside the
    activation peak) or fp32 (4, in the masters; each micro-batch's bf16 gradient freed as it is
    added); AdamW's two fp32 moments (8). No bf16 copy of a weight is saved for backward
    (autocast_weight_bytes: none)."""
    fp32_sums = cfg.grad_accum_dtype_on("cuda" if on_gpu(cfg) else "cpu") == "fp32"
    state = adam_state_bytes(n, bf16_params=True, grad_bytes=4 if fp32_sums else 2)
    return state["weights"] + state["main"], state["gradients"], state["moments"]


# ---- activations: what the forward leaves alive for backward ----
#
# Counted per storage on one bf16-autocast step of the real model, on FakeTensors with a GPU's
# attention dispatch (tests/test_memory_estimate.py), and itemised here in bf16 element equivalents
# (an fp32 tensor counts 2). d: width, m: MLP width, h: heads; per latent frame of a DiT block:
#   attn_norm and mlp_norm, each: its fp32 input copy and fp32 normalised product (RMSNorm computes
#     in fp32; 2d + 2d), its bf16 output (d) and the modulated input of the next GEMM (d): 2 x 6d;
#   q_norm: 4d fp32 + its bf16 output d; k_norm: 4d; the joint key and value concatenations: 2d
#     (latent part); attention output d, its merged-heads copy d, sigmoid(gate) d, the gated
#     product d, the out-projection's output d (the residual gate's input): 15d;
#   MLP: gate_up's output 2m, silu m, the product m: 4m; the down projection's output d;
#   fp32 rsqrt per norm row and attention's logsumexp per head: ~6h + 4;
#   so 29d + 4m + 6h + 4 per frame, of which 14d + 2 stay whole under TP without sequence parallelism
#   (the block norms, modulations and the two row-parallel outputs);
# per text / speaker key (k_norm in fp32, key and value): 6d + 2h; per sample the AdaLN's
#   silu, low-rank and 6d modulations: 7d + rank.
# Speaker block, per patch (no modulation, its own q/k/v projection output kept whole):
#   25 ds + 4 sm + 6 hs + 4.
# Outside the blocks, per frame: the final norm (6d), the latent input (latent_dim), the loss's fp32
#   difference (2 latent_dim), RoPE's fp32 table (2 head_dim); per text token: the encoder output and
#   the projected text; per speaker patch: its latent patch, the final norm (5 ds), RoPE.
# Selective AC as compiled runs apply it (the policy: matmul and attention outputs saved): per frame
#   the block input and in_proj, wo, gate_up, down, attention outputs: 8d + 2m + 2h; per key 2d;
#   speaker 7 ds + 2 sm + 2 hs. Full AC keeps each block's input (d per frame, ds per patch).
# A trained text encoder's activations are the earlier estimate's (not counted: 10 hidden + 3 mlp).


def dit_block_elements(m, la: int, keys: int, tp: int = 1, sequence_parallel: bool = False) -> float:
    """Saved elements of one DiT block for one sample (no AC) on a rank of a TP group of `tp`."""
    d, h = m.width, m.heads
    whole = la * (14 * d + 2)
    split = la * (15 * d + 4 * m.mlp + 6 * h + 2) + keys * (6 * d + 2 * h)
    return whole / (tp if sequence_parallel else 1) + split / tp + 7 * d + m.adaln_rank


def speaker_block_elements(m, p: int) -> float:
    return p * (25 * m.speaker_width + 4 * m.speaker_mlp + 6 * m.speaker_heads + 4)


def outside_block_elements(m, la: int, lt: int, p: int) -> float:
    d, ds = m.width, m.speaker_width
    io = la * (6 * d + 3 * m.latent_dim + 2 * m.head_dim) + lt * (m.text_encoder.hidden + d)
    io += p * (m.speaker_patch * m.latent_dim + 5 * ds + 2 * (ds // m.speaker_heads))
    if not m.frozen_encoder:  # a trained encoder saves its activations too (not counted)
        enc = m.text_encoder
        io += enc.layers * lt * (10 * enc.hidden + 3 * enc.mlp)
    return io


def lengths(cfg: RunConfig) -> tuple[int, int, int]:
    m = cfg.model_config()
    return cfg.audio_frames, cfg.text_tokens, -(-cfg.speaker_frames // m.speaker_patch)


def activation_elements_per_sample(cfg: RunConfig) -> tuple[float, float, float]:
    """(total, per-block inputs, largest single block) saved elements for one sample, in bf16
    element equivalents (an fp32 tensor counts twice), on one rank without TP: total is what the
    forward leaves without AC, per-block inputs what full AC leaves (the blocks' inputs and
    everything outside the blocks), largest the biggest block (what a recompute rebuilds)."""
    m = cfg.model_config()
    la, lt, p = lengths(cfg)
    dit, spk = dit_block_elements(m, la, lt + p), speaker_block_elements(m, p)
    io = outside_block_elements(m, la, lt, p)
    total = m.layers * dit + m.speaker_layers * spk + io
    inputs = m.layers * la * m.width + m.speaker_layers * p * m.speaker_width + io
    return total, inputs, max(dit, spk)


def ac_run_mode(cfg: RunConfig) -> str:
    """The checkpointing that runs (backends.torchtitan.ac_mode): selective is op-level where the
    blocks compile, layer-level (every second block whole) where they run eager."""
    if cfg.ac == "selective" and not cfg.may_compile():
        return LAYER_SELECTIVE
    return cfg.ac


def checkpointed_blocks(cfg: RunConfig, layers: int) -> int:
    """How many of a stack's `layers` blocks are checkpointed (apply_ac: layer-level wraps the odd ones)."""
    mode = ac_run_mode(cfg)
    if mode == "none":
        return 0
    return layers // 2 if mode == LAYER_SELECTIVE else layers


def saved_elements(cfg: RunConfig) -> tuple[float, float]:
    """(after forward, recompute) saved elements per sample on one rank: what the forward leaves for
    backward under the run's AC, and what backward's recompute of one checkpointed block adds
    on top of it (that block's saved set, less what its checkpoint kept; 0 without AC)."""
    m = cfg.model_config()
    la, lt, p = lengths(cfg)
    tp, sp = cfg.tp, cfg.tp > 1 and cfg.sequence_parallel_on("cuda" if on_gpu(cfg) else "cpu")
    dit, spk = dit_block_elements(m, la, lt + p, tp, sp), speaker_block_elements(m, p)
    d, ds = m.width, m.speaker_width
    if ac_run_mode(cfg) == "selective":  # op-level: matmul and attention outputs kept
        # whole under TP: the block input and the two row-parallel outputs (3d per frame)
        dit_kept = (la * 3 * d / (tp if sp else 1) + (la * (5 * d + 2 * m.mlp + 2 * m.heads) + (lt + p) * 2 * d) / tp
                    + 7 * d + m.adaln_rank)
        spk_kept = p * (7 * ds + 2 * m.speaker_mlp + 2 * m.speaker_heads)
    else:  # full or layer-level: the block's input
        dit_kept, spk_kept = la * d / (tp if sp else 1), p * ds
    ckpt_dit, ckpt_spk = checkpointed_blocks(cfg, m.layers), checkpointed_blocks(cfg, m.speaker_layers)
    after = ((m.layers - ckpt_dit) * dit + ckpt_dit * dit_kept + (m.speaker_layers - ckpt_spk) * spk
             + ckpt_spk * spk_kept + outside_block_elements(m, la, lt, p))
    recompute = max(dit - dit_kept if ckpt_dit else 0.0, spk - spk_kept if ckpt_spk else 0.0)
    return after, recompute


def autocast_weight_bytes(cfg: RunConfig) -> float:
    """autocast's bf16 copies of fp32 weights that backward keeps (each matmul saves its cast weight),
    per rank: where fp32 parameters compute in bf16 under autocast (torchtitan single / DDP; megatron
    on a CPU), 2 bytes per block parameter outside the checkpointed blocks (a checkpointed block
    recasts in its recompute; counted, tests/test_memory_estimate.py). Not FSDP2 / HSDP (their mixed precision gathers bf16 parameters and frees them)
    nor megatron on a GPU nor master_weights bf16-compute (bf16 parameters)."""
    if compute_bytes(cfg.precision) == 4:
        return 0.0
    if cfg.layout.shards_parameters or (cfg.framework == "megatron" and on_gpu(cfg)):
        return 0.0
    if cfg.framework != "megatron" and recipe_of(cfg) == "bf16-compute":  # bf16 parameters: nothing cast
        return 0.0
    m = cfg.model_config()
    counts = param_counts(m)
    norms = m.layers * (2 * m.width + 2 * m.head_dim)
    dit_blocks = (counts.parts["dit_attention"] + counts.parts["dit_mlp"] - norms) / cfg.tp + norms
    dit_blocks += m.layers * (m.width * m.adaln_rank + m.adaln_rank * 6 * m.width + 6 * m.width)
    sh = m.speaker_width // m.speaker_heads
    spk_blocks = m.speaker_layers * (4 * m.speaker_width ** 2 + 2 * sh + 3 * m.speaker_width * m.speaker_mlp
                                     + 2 * m.speaker_width)
    # Outside the blocks only the matmuls whose input needs a gradient keep their cast (the others'
    # backward needs the input, not the weight): the time MLP's second layer, the final AdaLN, out_proj.
    d, r = m.width, m.adaln_rank
    outside = d * d + 3 * d * r + d * m.latent_dim
    kept_dit = 1 - checkpointed_blocks(cfg, m.layers) / m.layers
    kept_spk = 1 - checkpointed_blocks(cfg, m.speaker_layers) / max(m.speaker_layers, 1)
    return 2 * (outside + kept_dit * dit_blocks + kept_spk * spk_blocks)


def estimate_memory(cfg: RunConfig) -> MemoryEstimate:
    model = cfg.model_config()
    counts = param_counts(model)
    b = compute_bytes(cfg.precision)
    weights, grads, optim = state_bytes(cfg)

    after, recompute = saved_elements(cfg)
    activations = (after + recompute) * b * cfg.micro_batch + autocast_weight_bytes(cfg)

    encoder = counts.frozen * b
    transient = 0.0
    if cfg.layout.shards_parameters:
        per_block = (counts.parts["dit_attention"] + counts.parts["dit_mlp"]) / model.layers
        transient = 2 * per_block * 2  # two all-gathered bf16 blocks
    known = weights + grads + optim + activations + encoder + transient
    return MemoryEstimate(weights, grads, optim, activations, encoder, transient,
                          overhead_bytes(known, on_gpu(cfg)))


def overhead_bytes(tensors: float, gpu: bool = True) -> float:
    """The overhead beside `tensors` bytes of tensors (the module docstring's): on a GPU its CUDA_CONTEXT,
    on a CPU none (the run measures its resident baseline), plus 10% fragmentation."""
    return (CUDA_CONTEXT if gpu else 0.0) + 0.1 * tensors
