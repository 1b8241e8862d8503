"""decode_attention on the native CPU kernel (decode_attention.c): same arguments and
result as kernels.decode_attention (the torch implementation), one C call per query chunk.

`covers_layer` says from a layer's codecs and shape alone whether the kernel reads it (head
dim <= 256, tails of whole 32-token tiles, GEAR rank <= 8, a codebook role's head dim a
multiple of 32): kernels/backend.py resolves a layer's route from it when the cache is built.
`describe` maps a codec and its storage to the C descriptor (pointers + element strides);
the call wrappers return None for a request outside that coverage, which a routed call
never makes (kernels/dispatch.py raises `KernelRouteError` if one does).
"""
from __future__ import annotations

import ctypes
import weakref

import torch

from ..decode_attention import DEFAULT_BLOCK, DEFAULT_Q_CHUNK, SCORE_LIMIT
from ..hadamard import k_bias, k_matrix, q_matrix
from ..table import covers
from . import load
from .structs import Args, CodecDesc  # noqa: F401  (the C structs, mirrored in one place)

FP16, BF16, FP32, INT8, KIVI, TADA, CB = range(7)    # codec_desc.h's kinds
_FP = {torch.float16: FP16, torch.bfloat16: BF16, torch.float32: FP32}
MAX_D, MAX_RANK, TILE = 256, 8, 32

_p = ctypes.c_void_p
_i64 = ctypes.c_int64




ATTN_PATHS = ("fp32", "int")       # how the C kernel multiplies KIVI keys (decode_attention)


def _qint(attn: str) -> int:
    assert attn in ATTN_PATHS, f"attn {attn!r} not in {ATTN_PATHS}"
    return int(attn == "int")


def _strides(dst, t: torch.Tensor, n: int):
    for i in range(n):
        dst[i] = t.stride(i)


def covers_layer(k_codec, v_codec, D: int, G: int) -> bool:
    """Whether the kernel reads an arena layer of these K / V codecs, head dim D and tail
    blocks of G tokens (a tail growing by whole blocks stays whole 32-token tiles when G is a
    multiple of 32), once the library built: what `describe` accepts of every storage such
    a layer allocates."""
    return (load() is not None and D <= MAX_D and G % TILE == 0
            and all(_covers_codec(c, D) for c in (k_codec, v_codec)))


def _covers_codec(codec, D: int) -> bool:
    if not covers("decode_attention", "native", codec):
        return False
    if codec.kind == "cb":
        return D % 32 == 0
    if codec.kind == "gear":
        return _reads_gear(codec)
    return True


def _reads_gear(codec) -> bool:
    """GEAR's low-rank terms as the kernel holds them: rank <= MAX_RANK, blocks <= 256 tokens."""
    return codec.rank <= MAX_RANK and codec.G <= 256


def fused_rows(H: int, N: int) -> int:
    """The most new tokens `attend_append` takes in one call over N keys (its query block:
    the scores of every query row fit the kernel's buffer)."""
    return min(DEFAULT_Q_CHUNK, SCORE_LIMIT // (H * N))


def describe(codec, st: dict) -> CodecDesc | None:
    """The C descriptor of a codec's storage, or None when the kernel does not read it (a
    kind or width outside the kernel table's row, kernels/table.py, or a shape it declines)."""
    if not covers("decode_attention", "native", codec):
        return None
    kind = codec.kind
    c = CodecDesc()
    c.role = 0 if codec.role == "k" else 1
    c.G = codec.G
    if kind == "fp":
        x = st["x"]
        if x.stride(2) != 1 or x.dtype not in _FP:
            return None
        c.kind, c.x = _FP[x.dtype], x.data_ptr()
        _strides(c.xs, x, 2)
        return c
    codes = st["codes"]
    c.codes = codes.data_ptr()
    _strides(c.cs, codes, min(4, codes.dim()))
    c.scale = st["scale"].data_ptr()
    if kind == "cb":                            # codebook_attention.c's tile reads
        D = codes.shape[2] if codec.role == "k" else codes.shape[2] * 32
        if D % 32:
            return None
        c.kind, c.bits = CB, codec.bits
        _strides(c.ss, st["scale"], 2)
        for i, x in enumerate(codec.levels(D)[0].tolist()):
            c.lv[i] = x
        return c
    if kind == "int8":
        c.kind, c.bits = INT8, 8
        _strides(c.ss, st["scale"], 2)
        return c
    c.zero = st["zero"].data_ptr()
    _strides(c.ss, st["scale"], st["scale"].dim())
    c.bits = codec.bits
    if kind == "tada":
        c.kind = TADA
        mu = st["mu"]
        c.mu, c.mus = mu.data_ptr(), mu.stride(0)
        if codec.mu == "int8":
            c.mu_int8, c.mu_scale = 1, st["mu_scale"].data_ptr()
        return c
    c.kind, c.g = KIVI, codec.g                 # kivi, and gear: KIVI codes + its own terms
    if "hi" in st:                              # 3-bit keys: the third bits' planes
        c.hi = st["hi"].data_ptr()
        _strides(c.hs, st["hi"], 2)
    if kind == "gear":
        if not _reads_gear(codec):
            return None
        c.rank = codec.rank
        a, b = st["lr_a"], st["lr_b"]
        if a.stride(2) != 1 or a.stride(1) != codec.rank or b.stride(3) != 1 or b.stride(2) != codec.rank:
            return None
        c.lr_a, c.lr_b = st["lr_a"].data_ptr(), st["lr_b"].data_ptr()
        _strides(c.as_, st["lr_a"], 2)
        _strides(c.bs, st["lr_b"], 3)
        if codec.sparsity:
            oi = st["out_idx"]
            c.k2, c.oidx, c.oval = oi.shape[-1], oi.data_ptr(), st["out_val"].data_ptr()
            _strides(c.os, oi, oi.dim() - 1)
    return c


_EMPTY = CodecDesc()      # descriptor of an empty tail
_DESC: dict = {}          # (id(codec), id(first storage tensor)) -> (weakref, descriptor)


def _cached(codec, st: dict):
    """describe(codec, st) once per storage: the descriptor lives as long as the storage
    tensor (a weak reference checks it is the same live tensor, so a reused id or address
    never returns stale pointers)."""
    t = next(iter(st.values()))
    key = (id(codec), id(t))
    hit = _DESC.get(key)
    if hit is not None and hit[0]() is t:
        return hit[1]
    d = describe(codec, st)
    _DESC[key] = (weakref.ref(t, lambda _, k=key: _DESC.pop(k, None)), d)
    return d


def _descriptors(q, k_tail, v_tail, n_tail: int):
    """(K, V) descriptors when the kernel covers the request, else None: batch 1 on CPU, head
    dim <= 256, a tail of whole 32-token tiles, codecs it reads."""
    D = q.shape[3]
    if q.shape[0] != 1 or q.device.type != "cpu" or load() is None or D > MAX_D or n_tail % TILE:
        return None
    if not n_tail:
        return _EMPTY, _EMPTY
    kd, vd = _cached(*k_tail), _cached(*v_tail)
    return None if kd is None or vd is None else (kd, vd)



def decode_attention(q, k_tail, v_tail, n_tail, k_win, v_win, k_new, v_new,
                     block: int = DEFAULT_BLOCK, q_chunk: int = DEFAULT_Q_CHUNK,
                     mass: torch.Tensor | None = None, mass_from: int = 0, attn: str = "int",
                     softcap: float = 0.0):
    """kernels.decode_attention (see there) on the native kernel; None when it does not
    cover the request (the caller then runs the torch implementation). attn: "int", KIVI
    keys' q.K in int32 over int16-quantized folded queries (decode_attention.c
    kivi_tiles_int) and KIVI V's p.V with its scales folded into the weights (vmix_kivi),
    or "fp32", the reference; the other codecs run the same on both. kernels/dispatch.py
    `attn_path` reads it from KVRUN_ATTN. softcap: the logits' soft-cap (0: off), applied
    by the kernel's softmax phase to the fp32 logits of either path."""
    _, H, T, D = q.shape
    desc = _descriptors(q, k_tail, v_tail, n_tail)
    if desc is None:
        return None
    kd, vd = desc
    N = n_tail + k_win.shape[2] + T
    if mass is not None:
        assert mass.shape == (H, N) and mass.dtype == torch.float32 and mass.is_contiguous(), \
            f"mass {tuple(mass.shape)} {mass.dtype} != ({H}, {N}) float32"
    q_chunk = max(1, min(q_chunk, SCORE_LIMIT // (H * N)))
    out = q if T <= q_chunk else torch.empty_like(q)
    for t0 in range(0, T, q_chunk):
        t1 = min(T, t0 + q_chunk)
        o = _attend(q[:, :, t0:t1], kd, vd, n_tail, k_win, v_win, k_new[:, :, :t1],
                    v_new[:, :, :t1], t0, mass, mass_from, attn=attn, softcap=softcap)
        if T <= q_chunk:
            return o
        out[:, :, t0:t1] = o
    return out



def _rows(x: torch.Tensor) -> torch.Tensor:
    """(1, Hkv, n, D) with unit channel stride."""
    return x if x.stride(3) == 1 else x.contiguous()


def _scratch(name: str, n: int) -> int:
    """Address of a reused float32 scratch buffer of at least n elements."""
    b = _BUF.get(name)
    if b is None or b.numel() < n:
        b = _BUF[name] = torch.empty(max(n, b.numel() * 3 // 2 if b is not None else 0))
    return b.data_ptr()


_BUF: dict = {}
_SPLITS: list = []


def _splits_max(lib) -> int:
    """The most token splits the C kernel cuts a tail into (a constant of the build: the split
    count follows the length, not the thread count), read once."""
    if not _SPLITS:
        _SPLITS.append(lib.kvrun_attention_splits_max())
    return _SPLITS[0]


def attend_append(q, k_tail, v_tail, n_tail, k_win, v_win, k_new, v_new, k_dst, v_dst,
                  rot_k=None, rot_v=None, mass=None, mass_from=0, attn: str = "int",
                  softcap: float = 0.0):
    """decode_attention with the arena's window append fused in (one C call per layer):
    the new tokens k_new, v_new (1, Hkv, T, D), any float dtype, are rotated by rot_k /
    rot_v ((D, D) float32, x @ R; q is rotated by rot_k too), rounded to the window dtype
    and written to k_dst / v_dst (Hkv, T, D) window slots, then attended from there; the
    output is un-rotated by rot_v. Same result as rotating, rounding and appending first
    and calling decode_attention on the rotated q. None when not covered (the caller then
    runs those steps itself). attn, softcap: as decode_attention's."""
    _, H, T, D = q.shape
    N = n_tail + k_win.shape[2] + T
    desc = _descriptors(q, k_tail, v_tail, n_tail)
    if desc is None or T > fused_rows(H, N) or k_dst.stride(2) != 1 or v_dst.stride(2) != 1:
        return None
    kd, vd = desc
    _check_rotations(rot_k, rot_v)
    return _attend(q, kd, vd, n_tail, k_win, v_win, k_new, v_new, 0, mass, mass_from,
                   fuse=(k_dst, v_dst, rot_k, rot_v), attn=attn, softcap=softcap)


class FusedStep:
    """`attend_append` for one token of one arena layer, its C arguments built once: per
    step only the lengths and the pointers that move (q, the new rows, the window slot they
    go to, the tail descriptors) are set before the call. The general path rebuilds ~50
    fields through ~40 torch calls per layer and step, ~60 µs on a 2-core VM: at depth 0
    more than the attention itself. It holds pointers only (no tensor: a view would keep
    its arena's windows alive); `fused_step` keeps one per live window tensor and layer.
    attn, softcap: as decode_attention's, fixed when the step is built."""

    def __init__(self, H: int, k_win: torch.Tensor, v_win: torch.Tensor, rot_k, rot_v,
                 attn: str = "int", softcap: float = 0.0):
        Hkv, cap, D = k_win.shape
        self.lib, self.H, self.cap, self.D, self.attn = load(), H, cap, D, attn
        self.softcap = softcap
        a = self.a = step_args(H, k_win, v_win, rot_k, rot_v, attn, softcap)
        self.row = k_win.element_size() * a.kws[1]            # bytes from one slot to the next
        self.vrow = v_win.element_size() * a.vws[1]
        self.splits = _splits_max(self.lib)
        self.desc = (None, None)

    def __call__(self, q: torch.Tensor, k_tail, v_tail, n_tail: int, w: int, k: torch.Tensor,
                 v: torch.Tensor, mass: torch.Tensor | None = None,
                 mass_from: int = 0) -> torch.Tensor | None:
        """q (1, H, 1, D), k, v (1, Hkv, 1, D) with unit channel stride; w tokens in the
        window. Writes the new rows into window slot w and returns (1, H, 1, D) float32, or
        None when the kernel does not cover the step (the caller takes the general path).
        mass, mass_from: as decode_attention's (`bind_mass`)."""
        if q.stride(3) != 1 or k.stride(3) != 1 or v.stride(3) != 1 or w >= self.cap:
            return None
        desc = _descriptors(q, k_tail, v_tail, n_tail)
        if desc is None:
            return None
        a, D, H = self.a, self.D, self.H
        N = n_tail + w + 1
        out = torch.empty(1, H, 1, D)
        if desc[0] is not self.desc[0] or desc[1] is not self.desc[1]:   # another tail storage
            self.desc = desc
            a.kc, a.vc = ctypes.pointer(desc[0]), ctypes.pointer(desc[1])
        a.n_tail, a.W, a.nthreads = n_tail, w, torch.get_num_threads()
        a.qdtype, a.ndtype = _FP[q.dtype], _FP[k.dtype]
        a.qin, a.qs[0], a.qs[1] = q.data_ptr(), q.stride(1), q.stride(2)
        a.kn, a.vn = k.data_ptr(), v.data_ptr()
        a.kns[0], a.kns[1], a.vns[0], a.vns[1] = k.stride(1), k.stride(2), v.stride(1), v.stride(2)
        a.kdst, a.vdst = a.kw + w * self.row, a.vw + w * self.vrow
        a.q, a.out = _scratch("q", H * D), out.data_ptr()
        a.sc, a.part = _scratch("sc", H * N), _scratch("part", H * self.splits * D)
        bind_mass(a, mass, mass_from)
        rc = self.lib.kvrun_decode_attention(ctypes.byref(a))
        assert rc == 0, f"native decode_attention refused its arguments ({rc})"
        return out if q.dtype == torch.float32 else out.to(q.dtype)


def bind_mass(a: Args, mass: torch.Tensor | None, lo: int = 0) -> None:
    """The attention-mass output of prebuilt or fresh arguments `a`: the kernel adds the query
    heads' probabilities of every key from `lo` on into mass (H, N) float32 (an evicting
    arena's scores); None: no mass."""
    if mass is None:
        a.mass, a.mass_stride, a.mass_lo = None, 0, 0
        return
    assert mass.dtype == torch.float32 and mass.is_contiguous(), "mass: contiguous float32"
    a.mass, a.mass_stride, a.mass_lo = mass.data_ptr(), mass.stride(0), lo


def _check_rotations(rot_k, rot_v) -> None:
    for r in (k_matrix(rot_k), q_matrix(rot_k), k_bias(rot_k), rot_v):
        assert r is None or (r.dtype == torch.float32 and r.is_contiguous()), "rotation: (D, D) float32"


def _set_rotations(a: Args, rot_k, rot_v) -> None:
    """The rotation fields: rot_k a (D, D) rotation or a hadamard.KeyMap (q's own matrix and
    a bias per KV head; its tensors must outlive the arguments), rot_v (D, D) or None."""
    ptr = (lambda t: t.data_ptr() if t is not None else None)
    a.rk, a.rq, a.kb = ptr(k_matrix(rot_k)), ptr(q_matrix(rot_k)), ptr(k_bias(rot_k))
    a.rv = ptr(rot_v)


def step_args(H: int, k_win: torch.Tensor, v_win: torch.Tensor, rot_k, rot_v,
              attn: str = "int", softcap: float = 0.0) -> Args:
    """The fields of a one-token arena step that stay from step to step: k_win, v_win (Hkv,
    cap, D) one layer's window, H query heads, rot_k / rot_v (D, D) float32 or None, attn
    and softcap as decode_attention's. The one argument builder: FusedStep, the one-call
    decode step (decode_step.py) and every general call (`_attend`) start from it; a step
    sets the lengths, q, the new rows and the window slot they go to, the scratch and the
    tail descriptors."""
    Hkv, _, D = k_win.shape
    a = Args()
    a.qint, a.softcap = _qint(attn), softcap
    a.Hkv, a.D, a.Gq, a.R, a.Tq, a.t0, a.Tn = Hkv, D, H // Hkv, H // Hkv, 1, 0, 1
    a.wdtype = _FP[k_win.dtype]
    a.kw, a.vw = k_win.data_ptr(), v_win.data_ptr()
    a.kws[0], a.kws[1], a.vws[0], a.vws[1] = k_win.stride(0), k_win.stride(1), v_win.stride(0), v_win.stride(1)
    a.kds[0], a.kds[1], a.vds[0], a.vds[1] = a.kws[0], a.kws[1], a.vws[0], a.vws[1]
    _set_rotations(a, rot_k, rot_v)
    return a


_STEPS: dict = {}         # (id(window K tensor), layer) -> (weakref to it, FusedStep)


def fused_step(win_k: torch.Tensor, win_v: torch.Tensor, layer: int, H: int, rot_k=None,
               rot_v=None, attn: str = "int", softcap: float = 0.0) -> FusedStep:
    """The FusedStep of window layer `layer` of win_k / win_v (L, Hkv, cap, D), built once
    and kept while win_k lives (a weak reference, as `_cached`); rot_k / rot_v: the
    layer's (D, D) float32 rotations, which live as long as the windows; attn, softcap: as
    decode_attention's (asked for another, the step is rebuilt)."""
    key = (id(win_k), layer)
    hit = _STEPS.get(key)
    if (hit is not None and hit[0]() is win_k and hit[1].H == H and hit[1].attn == attn
            and hit[1].softcap == softcap):
        return hit[1]
    _check_rotations(rot_k, rot_v)
    st = FusedStep(H, win_k[layer], win_v[layer], rot_k, rot_v, attn, softcap)
    _STEPS[key] = (weakref.ref(win_k, lambda _, k=key: _STEPS.pop(k, None)), st)
    return st


def _attend(q, kd, vd, n_tail, k_win, v_win, k_new, v_new, t0, mass, mass_from, fuse=None,
            attn: str = "int", softcap: float = 0.0):
    """One kvrun_decode_attention call for queries q (1, H, Tq, D) at chunk offset t0 over
    [tail (descriptors kd, vd), window k_win / v_win (1, Hkv, W, D), new rows (1, Hkv, Tn,
    D)]; fuse = (k_dst, v_dst, rot_k, rot_v): the window append (attend_append). The
    arguments start from `step_args`, the one builder FusedStep and the one-call step use,
    and the fields a general call sets on top."""
    _, H, Tq, D = q.shape
    Hkv, W, Tn = k_new.shape[1], k_win.shape[2], k_new.shape[2]
    R = H // Hkv * Tq
    N = n_tail + W + Tn
    lib = load()
    q, kw, vw, kn, vn = _rows(q), _rows(k_win), _rows(v_win), _rows(k_new), _rows(v_new)
    assert kw.dtype == vw.dtype and kn.dtype == vn.dtype, (kw.dtype, kn.dtype)
    out = torch.empty(1, H, Tq, D)
    k_dst, v_dst, rot_k, rot_v = fuse if fuse is not None else (None, None, None, None)
    a = step_args(H, kw[0], vw[0], rot_k, rot_v, attn, softcap)
    a.R, a.Tq, a.t0, a.Tn, a.n_tail, a.W = R, Tq, t0, Tn, n_tail, W
    a.ndtype, a.qdtype, a.nthreads = _FP[kn.dtype], _FP[q.dtype], torch.get_num_threads()
    a.qin, a.qs[0], a.qs[1] = q.data_ptr(), q.stride(1), q.stride(2)
    a.kn, a.vn = kn.data_ptr(), vn.data_ptr()
    a.kns[0], a.kns[1], a.vns[0], a.vns[1] = kn.stride(1), kn.stride(2), vn.stride(1), vn.stride(2)
    a.q, a.out = _scratch("q", H * Tq * D), out.data_ptr()
    a.sc, a.part = _scratch("sc", Hkv * R * N), _scratch("part", Hkv * _splits_max(lib) * R * D)
    bind_mass(a, mass, mass_from)
    a.kc, a.vc = ctypes.pointer(kd), ctypes.pointer(vd)
    if fuse is not None:
        a.kdst, a.vdst = k_dst.data_ptr(), v_dst.data_ptr()
        a.kds[0], a.kds[1], a.vds[0], a.vds[1] = k_dst.stride(0), k_dst.stride(1), v_dst.stride(0), v_dst.stride(1)
    rc = lib.kvrun_decode_attention(ctypes.byref(a))
    assert rc == 0, f"native decode_attention refused its arguments ({rc})"
    return out if q.dtype == torch.float32 else out.to(q.dtype)
