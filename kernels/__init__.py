"""kvrun.kernels — one op per module: the Triton kernel, its launcher and the torch
implementation (used on CPU and as the test oracle). Nothing here imports kvrun."""
from .codecs import COMPONENTS, METHODS, Codec, Slot, make_codec, method_family
from .decode_attention import decode_attention
from .dense_attention import causal_mask, dense_attention
from .window_write import write_k, write_v

__all__ = ["COMPONENTS", "METHODS", "Codec", "Slot", "causal_mask", "decode_attention",
           "dense_attention", "make_codec", "method_family", "write_k", "write_v"]
