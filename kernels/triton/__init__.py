"""kvrun.kernels.triton — the Triton implementations of kvrun.kernels' ops (CUDA; on CPU
only under TRITON_INTERPRET=1, which must be set before this package is imported).
Importing this package imports triton; kernels/dispatch.py imports it lazily."""
from .decode_attention import decode_attention, supports
from .kivi_pack import kivi_pack
from .kivi_pack import supports as kivi_pack_supports
from .ring_attention import covers as ring_covers
from .ring_attention import ring_step
from .window_write import write_k, write_v

__all__ = ["decode_attention", "kivi_pack", "kivi_pack_supports", "ring_covers", "ring_step", "supports",
           "write_k", "write_v"]
