"""Per-GPU memory estimate of one run, before running it: does it fit the device?

An estimate, not a measurement (expect +-30%); `plan` prints it and `sweep` skips runs that do
not fit unless --force. Parts, in bytes per GPU:
- weights:     fp32 master copy of the trainable parameters (autocast / FSDP mixed precision
               compute in bf16 from it), sharded by FSDP2 (world), HSDP (a node) or Megatron TP
               (the DiT's attention and MLP matrices; the rest is replicated).
- gradients:   fp32, sharded the same way; DDP adds its gradient buckets (another copy).
- optimizer:   AdamW's two fp32 moments.
- activations: what autograd saves per sample for the DiT and speaker-encoder blocks at the run's
               lengths (flash / efficient attention: no score matrix), times micro_batch;
               selective AC keeps ~60%, full AC only the block inputs plus one block's worth;
               Megatron TP splits the attention / MLP part (no sequence parallelism).
- encoder:     the frozen text encoder, stored in the compute dtype, replicated, no gradients
               (a trainable one counts as trainable parameters instead).
- transient:   FSDP2's all-gathered bf16 blocks (current + prefetched).
- overhead:    CUDA context, NCCL / cuBLAS workspaces (1.5 GiB) plus 10% allocator fragmentation.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from echobench.config import RunConfig
from echobench.flops import param_counts

GIB = 2**30

# Usable device memory in GiB, by device name (first match wins; specific names first).
DEVICE_MEMORY_GIB: list[tuple[str, float]] = [
    ("GH200", 95.0),  # 96 GB HBM3 (the 144 GB HBM3e variant: set hardware.memory_gib)
    ("GB200", 184.0),
    ("B200", 179.0),
    ("H200", 139.8),
    ("H100 NVL", 93.0),
    ("H100", 79.6),
    ("H800", 79.6),
    ("A100", 79.2),  # 80 GB; the 40 GB part: set hardware.memory_gib
    ("L40S", 44.4),
    ("MI300X", 191.5),
]


def device_memory_gib(memory_gib: float | None = None, device: str | None = None) -> float | None:
    """The device capacity for the fit check: the matrix's figure, else the table, else unknown."""
    if memory_gib is not None:
        return memory_gib
    if device:
        for pattern, gib in DEVICE_MEMORY_GIB:
            if pattern.lower() in device.lower():
                return gib
        raise ValueError(f"no memory size known for device {device!r}: set hardware.memory_gib in the matrix "
                         f"(known: {', '.join(p for p, _ in DEVICE_MEMORY_GIB)})")
    return None


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
    if cfg.parallelism == "fsdp2":
        return cfg.world_size
    if cfg.parallelism == "hsdp":
        return cfg.gpus_per_node
    return 1


def activation_elements_per_sample(cfg: RunConfig) -> tuple[float, float, float]:
    """(total, per-block inputs, largest single block) saved elements for one sample."""
    m = cfg.model_config()
    la, lt = cfg.audio_frames, cfg.text_tokens
    p = -(-cfg.speaker_frames // m.speaker_patch)
    d, ds = m.width, m.speaker_width
    # Per DiT block: norm/modulation inputs, q k v, attention out, gate, out-proj input (~12 x d per
    # frame), the gated MLP's three m-wide tensors, and the text / speaker keys and values.
    dit_block = la * (12 * d + 3 * m.mlp) + 4 * (lt + p) * d
    spk_block = p * (10 * ds + 3 * m.speaker_mlp)
    blocks = m.layers * dit_block + m.speaker_layers * spk_block
    inputs = m.layers * la * d + m.speaker_layers * p * ds
    io = la * (4 * d + 4 * m.latent_dim) + lt * (m.text_encoder.hidden + d)  # embeddings, head, loss, text
    if not m.frozen_encoder:  # a trained encoder saves its activations too
        enc = m.text_encoder
        blocks += enc.layers * lt * (10 * enc.hidden + 3 * enc.mlp)
    return blocks + io, inputs + io, max(dit_block, spk_block)


def estimate_memory(cfg: RunConfig) -> MemoryEstimate:
    model = cfg.model_config()
    counts = param_counts(model)
    b = compute_bytes(cfg.precision)
    trainable = float(counts.trainable)
    if cfg.tp > 1:
        split = counts.parts["dit_attention"] + counts.parts["dit_mlp"]
        trainable = trainable - split + split / cfg.tp
    trainable /= state_shards(cfg)
    weights, grads, optim = 4 * trainable, 4 * trainable, 8 * trainable
    if cfg.parallelism == "ddp":
        grads *= 2  # DDP's bucket copy of the gradients

    total, inputs, largest = activation_elements_per_sample(cfg)
    if cfg.ac == "full":
        saved = inputs + largest
    elif cfg.ac == "selective":
        saved = 0.6 * total
    else:
        saved = total
    if cfg.tp > 1:
        saved *= 0.25 + 0.75 / cfg.tp  # norms and residuals stay whole without sequence parallelism
    activations = saved * b * cfg.micro_batch

    encoder = counts.frozen * b
    transient = 0.0
    if cfg.parallelism in ("fsdp2", "hsdp"):
        per_block = (counts.parts["dit_attention"] + counts.parts["dit_mlp"]) / model.layers
        transient = 2 * per_block * 2  # two all-gathered bf16 blocks
    known = weights + grads + optim + activations + encoder + transient
    overhead = 1.5 * GIB + 0.1 * known
    return MemoryEstimate(weights, grads, optim, activations, encoder, transient, overhead)
