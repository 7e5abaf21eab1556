"""Text tokenizer for the frozen text encoder, with the conditioning tags as single tokens.

Either a local Hugging Face tokenizer (the encoder's own), or, without one, a byte-level fallback:
pad=0, eos=1, bos=2, the conditioning tags, then the 256 byte values.
"""
import re
from typing import Callable

CONDITIONING_TOKENS = ("[S1]", "[S2]", "[S3]", "[S4]")  # speaker tags
_TAG_SPLIT = re.compile("(" + "|".join(re.escape(t) for t in CONDITIONING_TOKENS) + ")")
# Spare vocabulary entries that tokenizers reserve; tags go there before growing the vocabulary.
_UNUSED_PATTERNS = ("<unused{}>", "[unused{}]", "<|reserved_special_token_{}|>")


class TextTokenizer:
    def __init__(self, encode_plain: Callable[[str], list[int]], tag_ids: dict[str, int],
                 vocab_size: int, pad_id: int, bos_id: int | None, eos_id: int | None, name: str):
        self._encode_plain = encode_plain  # text without tags -> ids
        self.tag_ids = tag_ids
        self.vocab_size, self.pad_id, self.bos_id, self.eos_id = vocab_size, pad_id, bos_id, eos_id
        self.name = name

    def encode(self, text: str) -> list[int]:
        """bos, the text with each conditioning tag as its own id, eos."""
        ids = [] if self.bos_id is None else [self.bos_id]
        for i, part in enumerate(_TAG_SPLIT.split(text)):  # odd parts are the tags themselves
            if i % 2:
                ids.append(self.tag_ids[part])
            elif part:
                ids.extend(self._encode_plain(part))
        if self.eos_id is not None:
            ids.append(self.eos_id)
        return ids

    def __repr__(self):
        return f"TextTokenizer({self.name}, vocab_size={self.vocab_size})"


def byte_tokenizer() -> TextTokenizer:
    pad, eos, bos = 0, 1, 2
    tag_ids = {t: 3 + i for i, t in enumerate(CONDITIONING_TOKENS)}
    offset = 3 + len(CONDITIONING_TOKENS)
    return TextTokenizer(lambda s: [offset + b for b in s.encode("utf-8")], tag_ids,
                         vocab_size=offset + 256, pad_id=pad, bos_id=bos, eos_id=eos, name="bytes")


def hf_tokenizer(path: str) -> TextTokenizer:
    from transformers import AutoTokenizer  # slow import: only when a tokenizer is given

    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    vocab = tok.get_vocab()
    tag_ids = {t: vocab[t] for t in CONDITIONING_TOKENS if t in vocab}
    missing = [t for t in CONDITIONING_TOKENS if t not in tag_ids]
    for pattern in _UNUSED_PATTERNS:  # reuse spare entries, so the embedding table need not grow
        spare = [pattern.format(i) for i in range(len(missing))]
        if missing and all(s in vocab for s in spare):
            tag_ids.update({t: vocab[s] for t, s in zip(missing, spare)})
            missing = []
    if missing:
        tok.add_tokens(missing, special_tokens=True)
        tag_ids.update({t: tok.convert_tokens_to_ids(t) for t in missing})
    vocab_size = max(len(tok), max(vocab.values()) + 1, max(tag_ids.values()) + 1)
    eos = tok.eos_token_id
    pad = tok.pad_token_id if tok.pad_token_id is not None else (eos if eos is not None else 0)
    return TextTokenizer(lambda s: tok.encode(s, add_special_tokens=False), tag_ids, vocab_size,
                         pad_id=pad, bos_id=tok.bos_token_id, eos_id=eos, name=str(path))


def build_tokenizer(encoder_vocab_size: int, path: str | None = None) -> TextTokenizer:
    """The tokenizer at path (a local Hugging Face directory), else the byte-level fallback.

    Raises ValueError if its ids do not all fit the text encoder's embedding table.
    """
    tok = hf_tokenizer(path) if path else byte_tokenizer()
    if tok.vocab_size > encoder_vocab_size:
        raise ValueError(
            f"tokenizer {tok.name} needs {tok.vocab_size} token ids but the text encoder's "
            f"vocabulary has only {encoder_vocab_size}; use a larger encoder vocabulary")
    return tok
