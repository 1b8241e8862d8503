"""decode_attention: attention of T new queries over a compressed tail + a full-precision
window + the new tokens themselves, torch implementation (routes: kernels/table.py).

The tail is read in blocks of `block` tokens straight from the codec's packed storage
(codec.scores / codec.mix fold scales into q and p, so no dequantized K/V is built; a
block's unpack buffer is reused for every block and layer). The GQA group is folded into
the query rows, (Hkv, G_q*T, D), so every block is unpacked once for all the query heads
that share it. The window and the new tokens are one more part, in full precision, with a
causal mask over the new tokens only (every cached token precedes every new query).

On CPU the logits of a row are few (R·N floats: 3 rows x 32k tokens = 384 kB for
SmolLM2), so the torch path keeps them all and runs one exact softmax over the row, then
p·V part by part: this is the two-pass form of flash-decoding, with no log-sum-exp merge
(fewer small ops per layer: eager torch pays ~5-10 µs per op, ~40 ops per layer). The
Triton kernel (kernels/triton/) is the split-K online-softmax form of the same op.

Large T (a prefill chunk) is processed in query chunks (at most `q_chunk` queries and at
most SCORE_LIMIT logits at a time) so the score matrix stays small; every query still
sees the whole tail.

Optional soft-capping (`softcap` > 0, Gemma 2's attn_logit_softcapping): every logit s,
once scaled, becomes cap·tanh(s / cap) before the mask and the softmax (HF's order); the
tail's, the window's and the new tokens' logits meet in one buffer, so it is one line.

Optional `mass` output (token eviction, runtime/kv/evict.py): the exact softmax
probabilities, summed over the queries t >= mass_from, added into mass (H, n_tail + W + T)
— p / den of the single softmax, no second pass over the cache.
"""
from __future__ import annotations

import torch

DEFAULT_BLOCK = 4096
DEFAULT_Q_CHUNK = 128
SCORE_LIMIT = 1 << 22              # logits held at once (16 MB of fp32)


def decode_attention(q: torch.Tensor, k_tail, v_tail, n_tail: int,
                     k_win: torch.Tensor, v_win: torch.Tensor,
                     k_new: torch.Tensor, v_new: torch.Tensor,
                     block: int = DEFAULT_BLOCK, q_chunk: int = DEFAULT_Q_CHUNK,
                     mass: torch.Tensor | None = None, mass_from: int = 0,
                     softcap: float = 0.0) -> torch.Tensor:
    """Causal attention of new queries over [tail, window, new tokens].

    q: (1, H, T, D); k_tail / v_tail: (codec, storage dict) for the K and V tails, holding
    n_tail tokens (a multiple of the codecs' G; `block` must be a multiple of G too);
    k_win, v_win: (1, Hkv, W, D) full-precision window (W may be 0);
    k_new, v_new: (1, Hkv, T, D), new token t at position n_tail + W + t.
    Returns (1, H, T, D) in q's dtype; softmax scale 1/sqrt(D); fp32 accumulation.
    mass: optional float32 (H, n_tail + W + T), += attention probabilities of queries
    t >= mass_from, summed over those queries (per query head).
    softcap: > 0, logits soft-capped to softcap·tanh(s / softcap) (the module docstring).
    """
    B, H, T, D = q.shape
    Hkv = k_new.shape[1]
    assert B == 1, "decode_attention: batch 1 only"
    assert H % Hkv == 0, f"H={H} is not a multiple of Hkv={Hkv}"
    assert k_new.shape == (1, Hkv, T, D) and v_new.shape == (1, Hkv, T, D), (k_new.shape, q.shape)
    assert k_win.shape[:2] == (1, Hkv) and k_win.shape == v_win.shape, (k_win.shape, v_win.shape)
    assert n_tail == 0 or block % k_tail[0].G == 0, f"block {block} is not a multiple of G"
    N = n_tail + k_win.shape[2] + T                                      # keys of the last query
    if mass is not None:
        assert mass.shape == (H, N) and mass.dtype == torch.float32, \
            f"mass {tuple(mass.shape)} {mass.dtype} != ({H}, {N}) float32"
        mass = (mass, mass_from)
    q_chunk = max(1, min(q_chunk, SCORE_LIMIT // (H * N)))             # H·Tc·N logits per chunk
    if T <= q_chunk:
        return _attend(q, k_tail, v_tail, n_tail, k_win, v_win, k_new, v_new, 0, block, mass, softcap)
    out = torch.empty_like(q)
    for t0 in range(0, T, q_chunk):
        t1 = min(T, t0 + q_chunk)
        out[:, :, t0:t1] = _attend(q[:, :, t0:t1], k_tail, v_tail, n_tail, k_win, v_win,
                                   k_new[:, :, :t1], v_new[:, :, :t1], t0, block, mass, softcap)
    return out


def _attend(q, k_tail, v_tail, n_tail, k_win, v_win, k_new, v_new, t0, block, mass=None,
            softcap=0.0):
    """Queries are new tokens t0 .. t0+Tq-1; k_new holds new tokens 0 .. t0+Tq-1."""
    _, H, Tq, D = q.shape
    Hkv, W, Tn = k_new.shape[1], k_win.shape[2], k_new.shape[2]
    Gq = H // Hkv
    R = Gq * Tq
    N = n_tail + W + Tn
    qg = (q[0].float() * D ** -0.5).reshape(Hkv, R, D)                   # rows ordered (g, t)
    sc = torch.empty(Hkv, R, N, device=q.device)                         # every logit of the rows
    # -- compressed tail, block by block, straight from the packed codes ----------------------
    (kc, ks), (vc, vs) = k_tail, v_tail
    blocks = [(s0, min(n_tail, s0 + block)) for s0 in range(0, n_tail, block)]
    for s0, s1 in blocks:
        sc[:, :, s0:s1] = kc.scores(ks, qg, s0, s1)
    # -- window + new tokens in full precision, causal over the new ones ---------------------
    k = torch.cat([k_win[0], k_new[0]], 1).float()                       # (Hkv, W+Tn, D)
    v = torch.cat([v_win[0], v_new[0]], 1).float()
    sc[:, :, n_tail:] = torch.bmm(qg, k.transpose(1, 2))                 # (Hkv, R, W+Tn)
    if softcap:                                     # every row's logits, before the mask
        sc.div_(softcap).tanh_().mul_(softcap)
    if Tn > 1:
        qpos = torch.arange(t0, t0 + Tq, device=q.device)[:, None]       # (Tq, 1)
        hidden = torch.arange(Tn, device=q.device)[None, :] > qpos       # (Tq, Tn)
        sc[:, :, n_tail + W:].masked_fill_(hidden.repeat(Gq, 1)[None], float("-inf"))
    # -- one softmax over the whole row, then p·V part by part ---------------------------------
    p = sc.sub_(sc.amax(-1, keepdim=True)).exp_()                        # unnormalized
    den = p.sum(-1, keepdim=True)                                        # (Hkv, R, 1)
    if mass is not None:
        _add_mass(mass, p, den, t0, Tq, Gq)
    acc = torch.bmm(p[:, :, n_tail:], v)                                 # (Hkv, R, D)
    for s0, s1 in blocks:
        acc += vc.mix(vs, p[:, :, s0:s1], s0, s1)
    return acc.div_(den).view(1, H, Tq, D).to(q.dtype)                   # (1, H, Tq, D)


def _add_mass(mass, p, den, t0, Tq, Gq):
    """mass (H, N) += Σ_t p / den over queries t >= mass_from (global index t0 + row t)."""
    out, mass_from = mass
    lo = max(0, mass_from - t0)                                          # first counted row t
    if lo >= Tq:
        return
    Hkv, R, N = p.shape
    pr = (p / den).view(Hkv, Gq, Tq, N)[:, :, lo:].sum(2)                # (Hkv, Gq, N)
    out[:, :N] += pr.reshape(Hkv * Gq, N)                                # rows h = kv * Gq + g
