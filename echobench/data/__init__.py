"""Training data: the tar-shard format, synthetic shards, the tokenizer and the batch loader.

May import: records.
"""
from .dataset import (
    STAND_IN, Batch, BatchLoader, LocalTarDataset, SyntheticSource, collate, make_loader, make_source,
)
from .format import (
    FRAME_RATE, LATENT_DIM, DataError, decode_sample, iter_shard, read_shard,
)
from .writer import write_shard
from .synth import synth_shards
from .tokenizer import CONDITIONING_TOKENS, TextTokenizer, build_tokenizer

__all__ = [
    "STAND_IN", "Batch", "BatchLoader", "LocalTarDataset", "SyntheticSource", "collate", "make_loader",
    "make_source", "FRAME_RATE", "LATENT_DIM", "DataError", "decode_sample", "iter_shard", "read_shard",
    "write_shard",
    "synth_shards", "CONDITIONING_TOKENS", "TextTokenizer", "build_tokenizer",
]
