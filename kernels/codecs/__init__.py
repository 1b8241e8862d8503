"""Codec registry: method names → codec objects (adding a codec: docs/architecture.md).

Method names: fp16, bf16, fp32 (uncompressed), int8, kivi-2, kivi-4, kivi-3 (keys only), tada-2, tada-4, tada-8, GEAR on a KIVI
backbone: gear-l / gear (4-bit backbone), gear-l-2 / gear-2 (2-bit), gear-l-4 / gear-4, and the
codebooks after rotation cb-2, cb-3, cb-4.
"""
from __future__ import annotations

import torch

from .base import COMPONENTS, Codec, FpCodec, Int8Codec, Slot
from .codebook import CodebookCodec
from .gear import GearCodec
from .kivi import KiviCodec
from .tada import TadaCodec

METHODS = ("fp16", "bf16", "fp32", "int8", "kivi-2", "kivi-3", "kivi-4", "tada-2", "tada-4", "tada-8",
           "gear-l", "gear-l-2", "gear-l-4", "gear", "gear-2", "gear-4", "cb-2", "cb-3", "cb-4")


def method_family(method: str) -> tuple[str, int]:
    """("kivi", 2) for "kivi-2"; gear defaults to a 4-bit backbone. ValueError if unknown."""
    if method not in METHODS:
        raise ValueError(method)
    if method in ("fp16", "bf16", "fp32"):
        return method, 32 if method == "fp32" else 16
    if method == "int8":
        return "int8", 8
    if method in ("gear-l", "gear"):
        return method, 4
    fam, bits = method.rsplit("-", 1)
    return fam, int(bits)


def make_codec(method: str, role: str, G: int, v_group: int = 32, rank: int = 4,
               sparsity: float = 2.0, tada_mu: str = "fp16") -> Codec:
    fam, bits = method_family(method)
    if fam == "fp16":
        return FpCodec(role, G, torch.float16)
    if fam == "bf16":
        return FpCodec(role, G, torch.bfloat16)
    if fam == "fp32":
        return FpCodec(role, G, torch.float32)
    if fam == "int8":
        return Int8Codec(role, G)
    if fam == "kivi":
        return KiviCodec(role, G, bits, v_group)
    if fam == "tada":
        return TadaCodec(role, G, bits, tada_mu)
    if fam == "cb":
        return CodebookCodec(role, G, bits)
    return GearCodec(role, G, bits, v_group, rank, sparsity if fam == "gear" else None)


KEY_ONLY = ("kivi-3",)    # per-channel codecs with no value layout: a layer's K only


__all__ = ["COMPONENTS", "KEY_ONLY", "METHODS", "Codec", "Slot", "make_codec", "method_family"]
