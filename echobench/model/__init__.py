"""Echo TTS in plain PyTorch (no parallelism inside: backends apply it from outside).

    config.py        EchoConfig and the presets (tiny, 800M, 3B, 8B), text encoders
    echo.py          the whole model: text projection, speaker encoder, DiT, diffusion loss
    dit.py           the DiT block: low-rank AdaLN, joint self + cross attention, QK-norm, RoPE, gated SiLU
    speaker.py       the speaker encoder (patching + transformer)
    text_encoder.py  the text encoder from transformers, built from a config (T5Gemma2 or T5), frozen by default
    components.py    the DiT's building blocks
    megatron.py      the same DiT from megatron-core's parallel layers (TP)
    flops.py         exact FLOPs and parameters per part (held against FlopCounterMode)
    decoder.py       a plain decoder from a model card (`run --card`), its FLOPs; decoder_tp.py: its TP form

Imports nothing else of echobench: the bottom layer.
"""
