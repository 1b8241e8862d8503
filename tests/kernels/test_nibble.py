"""The int4-GEMM nibble layouts (kvrun.kernels.nibble): codes written token-major (K) or
channel-major (V) read back as written, for 2/4/8 bits, at offsets inside a padding block,
leaving the codes around them untouched; and the int4 op probe agrees with ATen's dispatch."""
import pytest
import torch

from kvrun.kernels import nibble

Hkv, D = 2, 96            # D not a multiple of 64: the channel-major layout pads it


def test_int4_op_layout_probe_agrees_with_the_dispatch():
    """The probe says the op reads kvrun's nibble layout exactly when ATen dispatches its
    AVX-512 kernel (the layout was written for it); elsewhere the explicit path runs."""
    cap = torch.backends.cpu.get_cpu_capability()
    assert nibble.op_reads_layout() == (cap in ("AVX512", "AMX")), cap



@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("major", ["tok", "chan"])
def test_codes_read_back_as_written(bits, major):
    g = torch.Generator().manual_seed(bits)
    S = 256
    shape = nibble.tok_shape if major == "tok" else nibble.chan_shape
    write = nibble.tok_write if major == "tok" else nibble.chan_write
    read = (lambda b, s0, s1: nibble.tok_codes(b, s0, s1, bits)) if major == "tok" else \
        (lambda b, s0, s1: nibble.chan_codes(b, s0, s1, bits, D))
    buf = torch.zeros(shape(bits, Hkv, D, S), dtype=torch.uint8)
    first = torch.randint(0, 2 ** bits, (Hkv, 32, D), generator=g, dtype=torch.uint8)
    second = torch.randint(0, 2 ** bits, (Hkv, 64, D), generator=g, dtype=torch.uint8)
    write(buf, first, 32, bits)                   # half of a 64-token block
    write(buf, second, 64, bits)                  # the next block, after it
    assert torch.equal(read(buf, 32, 64), first.float())
    assert torch.equal(read(buf, 64, 128), second.float())
    assert not read(buf, 0, 32).any() and not read(buf, 128, 192).any()


def test_layout_shapes():
    assert nibble.tok_shape(2, 3, 64, 200) == (3, 1, 2, 64, 32)     # 128-token superblocks
    assert nibble.tok_shape(8, 3, 64, 200) == (3, 2, 4, 64, 32)     # 64, and two planes
    assert nibble.chan_shape(4, 1, 96, 100) == (1, 1, 2, 128, 32)   # D padded to 128
    assert nibble.chan_shape(2, 1, 64, 100) == (1, 1, 1, 64, 32)    # 2 bits: half the rows
