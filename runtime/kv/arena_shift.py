"""llama.cpp's context shift on the arena (KVArena.shift plans it, this moves one layer):
keep tokens [0, a), drop [a, a + nd), and re-append the rest through the arena's normal
write path with their keys re-rotated by -nd (RoPE at angle -nd·θ; a Hadamard-rotated K is
un-rotated first and rotated back, a key transform undone and redone with it), so the cache is as if the kept tokens sat at positions
0 .. n-1. Compressed tokens are dequantized and re-packed: a one-off double quantization."""
from __future__ import annotations

from kvrun.kernels.hadamard import rotate_k, unrotate_k
from kvrun.kernels.rope import apply_rope


def shift_layer(arena, l: int, a: int, nd: int, cos, sin) -> None:
    """Layer l of `arena` after the shift (a, nd); cos, sin (1, D) of the angle -nd·θ."""
    nt, w = arena.n_tail[l], arena.n_win[l]
    G, wd = arena.G, arena.wdtype
    rk = arena.rot_k[l]

    def rot(x):                                                         # (Hkv, n, D)
        if rk is None:
            return apply_rope(x[None], cos, sin)[0]
        return rotate_k(apply_rope(unrotate_k(x, rk)[None], cos, sin)[0], rk)
    win_k = arena.win_k[l, :, :w].clone()                               # sources survive the rewrite
    win_v = arena.win_v[l, :, :w].clone()
    arena.n_tail[l], arena.n_win[l] = min(a, nt), 0                     # untouched prefix
    if a > nt:                                                          # sinks still in the window
        arena.append(l, win_k[:, :a - nt], win_v[:, :a - nt])
    start = a + nd
    kc, vc = arena.k_codecs[l], arena.v_codecs[l]
    # reads run ahead of writes: chunk [c0, c1) is dequantized before appending it writes
    # tail tokens below c1 - nd, so no unread block is ever overwritten
    for c0 in range(start // G * G, nt, arena.kv.block):
        c1 = min(nt, c0 + arena.kv.block)
        off = max(0, start - c0)
        kx = kc.dequant(arena.k_store[l], c0, c1)[:, off:]
        vx = vc.dequant(arena.v_store[l], c0, c1)[:, off:]
        arena.append(l, rot(kx).to(wd), vx.to(wd))
    i0 = max(start, nt) - nt
    if i0 < w:
        arena.append(l, rot(win_k[:, i0:].float()).to(wd), win_v[:, i0:])
