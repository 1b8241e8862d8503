"""decode_attention: attention of T new queries over a compressed tail + a full-precision
window + the new tokens themselves (DESIGN §7, op 3), torch implementation.

Flash-decoding structure (Dao et al. 2023 "Flash-Decoding"; lightllm's stage1/stage2):
the tail is read in blocks of `block` tokens straight from the codec's packed storage
(codec.scores / codec.mix fold scales into q and p, so no dequantized K/V is built); each
block yields (m, l, acc) = (row max, Σ exp, Σ exp·V) and the parts are merged by
log-sum-exp. The GQA group is folded into the query rows, (Hkv, G_q*T, D), so every block
is unpacked once for all the query heads that share it. The window and the new tokens are
one more part, in full precision, with a causal mask over the new tokens only (every
cached token precedes every new query).

Large T (a prefill chunk) is processed in query chunks of `q_chunk` so the score matrix
stays small; every query still sees the whole tail.

Optional `mass` output (token eviction, runtime/kv/evict.py): the exact softmax
probabilities, summed over the queries t >= mass_from, added into mass (H, n_tail + W + T).
Each part's unnormalised p is kept and rescaled by exp(m - M) / den once the merge knows
the final max M and denominator den, so no second pass over the cache is needed. The
default path (mass=None) is unchanged.
"""
from __future__ import annotations

import torch

DEFAULT_BLOCK = 4096
DEFAULT_Q_CHUNK = 128


def _softmax_part(sc: torch.Tensor):
    """sc: (Hkv, R, n) logits, consumed in place → (m (Hkv,R,1), l (Hkv,R,1), p (Hkv,R,n))."""
    m = sc.amax(-1, keepdim=True)
    p = sc.sub_(m).exp_()
    return m, p.sum(-1, keepdim=True), p


def decode_attention(q: torch.Tensor, k_tail, v_tail, n_tail: int,
                     k_win: torch.Tensor, v_win: torch.Tensor,
                     k_new: torch.Tensor, v_new: torch.Tensor,
                     block: int = DEFAULT_BLOCK, q_chunk: int = DEFAULT_Q_CHUNK,
                     mass: torch.Tensor | None = None, mass_from: int = 0) -> torch.Tensor:
    """Causal attention of new queries over [tail, window, new tokens].

    q: (1, H, T, D); k_tail / v_tail: (codec, storage dict) for the K and V tails, holding
    n_tail tokens (a multiple of the codecs' G; `block` must be a multiple of G too);
    k_win, v_win: (1, Hkv, W, D) full-precision window (W may be 0);
    k_new, v_new: (1, Hkv, T, D), new token t at position n_tail + W + t.
    Returns (1, H, T, D) in q's dtype; softmax scale 1/sqrt(D); fp32 accumulation.
    mass: optional float32 (H, n_tail + W + T), += attention probabilities of queries
    t >= mass_from, summed over those queries (per query head).
    """
    B, H, T, D = q.shape
    Hkv = k_new.shape[1]
    assert B == 1, "decode_attention: batch 1 only"
    assert H % Hkv == 0, f"H={H} is not a multiple of Hkv={Hkv}"
    assert k_new.shape == (1, Hkv, T, D) and v_new.shape == (1, Hkv, T, D), (k_new.shape, q.shape)
    assert k_win.shape[:2] == (1, Hkv) and k_win.shape == v_win.shape, (k_win.shape, v_win.shape)
    assert n_tail == 0 or block % k_tail[0].G == 0, f"block {block} is not a multiple of G"
    if mass is not None:
        assert mass.shape == (H, n_tail + k_win.shape[2] + T) and mass.dtype == torch.float32, \
            f"mass {tuple(mass.shape)} {mass.dtype} != ({H}, {n_tail + k_win.shape[2] + T}) float32"
        mass = (mass, mass_from)
    if T <= q_chunk:
        return _attend(q, k_tail, v_tail, n_tail, k_win, v_win, k_new, v_new, 0, block, mass)
    out = torch.empty_like(q)
    for t0 in range(0, T, q_chunk):
        t1 = min(T, t0 + q_chunk)
        out[:, :, t0:t1] = _attend(q[:, :, t0:t1], k_tail, v_tail, n_tail, k_win, v_win,
                                   k_new[:, :, :t1], v_new[:, :, :t1], t0, block, mass)
    return out


def _attend(q, k_tail, v_tail, n_tail, k_win, v_win, k_new, v_new, t0, block, mass=None):
    """Queries are new tokens t0 .. t0+Tq-1; k_new holds new tokens 0 .. t0+Tq-1."""
    _, H, Tq, D = q.shape
    Hkv, W, Tn = k_new.shape[1], k_win.shape[2], k_new.shape[2]
    Gq = H // Hkv
    R = Gq * Tq
    qg = (q[0].float() * D ** -0.5).reshape(Hkv, R, D)                   # rows ordered (g, t)
    parts, probs = [], []                   # probs: (offset, m, p) per part, only for `mass`
    # -- compressed tail, block by block ---------------------------------------------------
    (kc, ks), (vc, vs) = k_tail, v_tail
    for s0 in range(0, n_tail, block):
        s1 = min(n_tail, s0 + block)
        m, l, p = _softmax_part(kc.scores(ks, qg, s0, s1))               # (Hkv, R, n)
        if mass is not None:
            probs.append((s0, m, p.clone()))
        parts.append((m, l, vc.mix(vs, p, s0, s1)))                       # acc (Hkv, R, D)
    # -- window + new tokens in full precision, causal over the new ones ---------------------
    k = torch.cat([k_win[0], k_new[0]], 1).float()                       # (Hkv, W+Tn, D)
    v = torch.cat([v_win[0], v_new[0]], 1).float()
    sc = torch.bmm(qg, k.transpose(1, 2))                                # (Hkv, R, W+Tn)
    if Tn > 1:
        qpos = torch.arange(t0, t0 + Tq, device=q.device)[:, None]       # (Tq, 1)
        hidden = torch.arange(Tn, device=q.device)[None, :] > qpos       # (Tq, Tn)
        sc[:, :, W:].masked_fill_(hidden.repeat(Gq, 1)[None], float("-inf"))
    m, l, p = _softmax_part(sc)
    if mass is not None:
        probs.append((n_tail, m, p))                # bmm below does not modify p
    parts.append((m, l, torch.bmm(p, v)))
    # -- log-sum-exp merge -------------------------------------------------------------------
    if mass is not None:
        _add_mass(mass, probs, parts, t0, Tq, Gq)
    if len(parts) == 1:
        o = parts[0][2].div_(parts[0][1])
    else:
        M = torch.stack([pm for pm, _, _ in parts]).amax(0)             # (Hkv, R, 1)
        num = torch.zeros(Hkv, R, D, device=q.device)
        den = torch.zeros(Hkv, R, 1, device=q.device)
        for pm, pl, acc in parts:
            w = torch.exp(pm - M)
            num.addcmul_(acc, w)
            den.addcmul_(pl, w)
        o = num.div_(den)
    return o.view(1, H, Tq, D).to(q.dtype)                               # (1, H, Tq, D)


def _add_mass(mass, probs, parts, t0, Tq, Gq):
    """mass (H, n) += Σ_t p / den over queries t >= mass_from (global index t0 + row t)."""
    out, mass_from = mass
    M = torch.stack([pm for pm, _, _ in parts]).amax(0)                 # (Hkv, R, 1)
    den = sum(pl * torch.exp(pm - M) for pm, pl, _ in parts)            # (Hkv, R, 1)
    lo = max(0, mass_from - t0)                                          # first counted row t
    if lo >= Tq:
        return
    for off, pm, p in probs:
        w = torch.exp(pm - M) / den                                      # (Hkv, R, 1)
        Hkv, R, n = p.shape
        pr = (p * w).view(Hkv, Gq, Tq, n)[:, :, lo:].sum(2)              # (Hkv, Gq, n)
        out[:, off:off + n] += pr.reshape(Hkv * Gq, n)                   # rows h = kv * Gq + g
