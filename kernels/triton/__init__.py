"""kvrun.kernels.triton — the Triton implementations of kvrun.kernels' ops (CUDA; on CPU
only under TRITON_INTERPRET=1, which must be set before this package is imported).
Importing this package imports triton; kernels/dispatch.py imports it lazily."""
from .decode_attention import decode_attention, supports
from .fused_compress import rope_compress_k, vproj_compress
from .kivi_pack import kivi_pack
from .kivi_pack import supports as kivi_pack_supports
from .ring_attention import ring_step

__all__ = ["decode_attention", "kivi_pack", "kivi_pack_supports", "ring_step", "rope_compress_k",
           "supports", "vproj_compress"]
