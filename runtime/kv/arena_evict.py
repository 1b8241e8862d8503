"""Token eviction inside the KV arena (DESIGN §5): bounded memory for any sequence length.

With `--evict POLICY --kv-budget N` the arena's tail holds S_l = N - (R + G) tokens per
layer (whole blocks of G; per-layer for pyramidkv), allocated once, so the window's R + G
slots plus the tail never exceed the budget and `nbytes()` does not depend on -c. The
window is never evicted; tokens are chosen only among the tail and the block leaving the
window.

Design — per-KV-head token sets, compaction of dirty blocks in place:
- Every KV head keeps its own tokens (SnapKV selects per head): codec storage is already
  (Hkv, S, ...), so slot j of head 0 and slot j of head 1 may hold different tokens. The
  read path does not care: attention is order-free over keys, and K is stored rotated at
  the token's original position, so a kept token keeps its RoPE phase. `pos_tail`
  (Hkv, S) records each slot's absolute position; the next token's position is the
  absolute sequence length (`arena.seq_len`), not the number of cached tokens.
  (TaDA's per-token mean is shared across heads per slot: a slot whose heads all keep the
  same token re-packs with that token's stored mean, which makes the re-pack exact; a slot
  holding different tokens per head gets the mean of those tokens, a re-quantization.)
- When a flush would overflow the tail, the policy keeps K = S of the n_tail + f
  candidates per head (K = S - slack with `evict_slack`, so compactions are rarer), in
  slots [0, K). A tail block whose G tokens every head keeps is *clean* and is not touched
  (its codes stay bit-exact). The other blocks are *dirty*: their kept tokens and the kept
  incoming tokens are re-packed into the dirty blocks' slots (evicted slots are reused in
  place; the tail behaves as a ring at block granularity — streaming evicts the oldest
  block and refills exactly that block). Re-packing is through the codec's normal pack,
  i.e. a double quantization of the kept tokens of dirty blocks: lossless for fp16/bf16,
  near-idempotent for per-token codecs (int8, TaDA, KIVI's V), and a re-quantization with
  new group statistics for codecs whose groups span tokens (KIVI/GEAR K). The alternative —
  masking evicted tokens inside still-packed blocks — never frees memory unless whole
  blocks die, which violates the bound; evicting whole blocks would not keep the tokens
  the policies select.
- Scores: decode_attention's `mass` output (exact probabilities, per query head) is
  accumulated per slot (`acc_tail` (H, S), `acc_win` (H, R+G)) and moves with its token.
  H2O-style policies accumulate every query. SnapKV-style ones use an observation window:
  a prefill chunk resets the scores and adds only its last W queries (exactly SnapKV when
  the prompt fits one chunk — raise -b for long prompts); during decoding the scores
  restart after every compaction, so the window is the queries since the last one.
"""
from __future__ import annotations

import torch

from .evict import pyramid_budgets, resets_scores, select


def tail_sizes(kv, n_layers: int, max_ctx: int) -> list[int]:
    """Tail capacity per layer: the usual capacity for max_ctx tokens, capped by the budget."""
    from .arena import tail_capacity
    cap = tail_capacity(max_ctx, kv.residual, kv.group)
    if kv.evict == "none":
        return [cap] * n_layers
    S = kv.evict_tail()
    sizes = pyramid_budgets(S * n_layers, n_layers, kv.group) if kv.evict == "pyramidkv" \
        else [S] * n_layers
    return [min(cap, s) for s in sizes]


def _runs(slots: torch.Tensor, G: int) -> list[tuple[int, int]]:
    """Sorted slot indices made of whole G-blocks → contiguous [s0, s1) runs."""
    out: list[list[int]] = []
    for b in (slots[::G] // G).tolist():
        if out and out[-1][1] == b * G:
            out[-1][1] += G
        else:
            out.append([b * G, b * G + G])
    return [(a, b) for a, b in out]


class ArenaEviction:
    """Per-layer eviction state of one KVArena (positions and scores of every slot)."""

    def __init__(self, arena, n_heads: int):
        a, kv = arena, arena.kv
        self.a, self.kv, self.policy, self.H = arena, kv, kv.evict, n_heads
        assert n_heads % a.Hkv == 0, (n_heads, a.Hkv)
        self.needs_mass = kv.evict != "streaming"
        self.resets = resets_scores(kv.evict)
        dev = self.dev = a.win_k.device
        self.pos_tail = [torch.zeros(a.Hkv, S, dtype=torch.long, device=dev) for S in a.S_l]  # (Hkv, S)
        self.acc_tail = [torch.zeros(n_heads, S, device=dev) for S in a.S_l]                  # (H, S)
        self.acc_win = torch.zeros(a.L, n_heads, a.R + a.G, device=dev)                       # (L, H, R+G)
        self.n_drop = [0] * a.L               # tokens evicted per layer
        self.pending = [None] * a.L           # (H, T) mass of the tokens being appended
        self.n_compactions = 0
        self.n_repacked = 0                   # kept tail tokens re-packed (per head, summed)

    def n_recent(self, l: int) -> int:
        """H2O's even split: half the budget goes to recent tokens; the window counts."""
        return min(self.a.S_l[l] // 2, max(0, self.kv.budget // 2 - self.a.R))

    # -- hooks called by KVArena -------------------------------------------------------------
    def mass_buffer(self, l: int, T: int):
        """(buffer, mass_from) for decode_attention, or (None, 0) when scores are unused."""
        if not self.needs_mass:
            return None, 0
        n = self.a.n_tail[l] + self.a.n_win[l] + T
        return (torch.zeros(self.H, n, device=self.dev),
                max(0, T - self.kv.snap_window) if self.resets else 0)

    def after_attend(self, l: int, mass, T: int) -> None:
        if mass is None:
            return
        nt, w = self.a.n_tail[l], self.a.n_win[l]
        if self.resets and T > 1:              # a prefill chunk: a fresh observation window
            self.acc_tail[l].zero_()
            self.acc_win[l].zero_()
        self.acc_tail[l][:, :nt] += mass[:, :nt]
        self.acc_win[l][:, :w] += mass[:, nt:nt + w]
        self.pending[l] = mass[:, nt + w:]

    def append(self, l: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """KVArena._append with eviction: k, v (Hkv, T, D) in the window dtype."""
        a = self.a
        w, T, nt = a.n_win[l], k.shape[1], a.n_tail[l]
        acc_new = self.pending[l] if self.pending[l] is not None else torch.zeros(self.H, T, device=self.dev)
        self.pending[l] = None
        total = w + T
        if total < a.R + a.G:
            a.win_k[l, :, w:total] = k
            a.win_v[l, :, w:total] = v
            self.acc_win[l][:, w:total] = acc_new
            a.n_win[l] = total
            return
        f = (total - a.R) // a.G * a.G                                   # tokens to flush
        seq_k = torch.cat([a.win_k[l, :, :w], k], 1)                     # (Hkv, w+T, D)
        seq_v = torch.cat([a.win_v[l, :, :w], v], 1)
        seq_a = torch.cat([self.acc_win[l][:, :w], acc_new], 1)         # (H, w+T)
        p0 = nt + self.n_drop[l]                                         # position of seq[0]
        seq_pos = torch.arange(p0, p0 + total, device=self.dev)
        if nt + f <= a.S_l[l]:
            self._pack(l, seq_k[:, :f], seq_v[:, :f], nt)
            self.pos_tail[l][:, nt:nt + f] = seq_pos[:f]
            self.acc_tail[l][:, nt:nt + f] = seq_a[:, :f]
            a.n_tail[l] = nt + f
        else:
            self._compact(l, seq_k[:, :f], seq_v[:, :f], seq_a[:, :f], seq_pos[:f])
            if self.resets:                      # the next selection observes fresh queries
                seq_a.zero_()
        a.win_k[l, :, :total - f] = seq_k[:, f:]
        a.win_v[l, :, :total - f] = seq_v[:, f:]
        self.acc_win[l][:, :total - f] = seq_a[:, f:]
        a.n_win[l] = total - f

    def truncate(self, n: int) -> int:
        """Keep the first n tokens when only window tokens go (every layer's tail lies below
        n); otherwise evicted history cannot be restored: empty the cache (returns 0)."""
        a = self.a
        self.pending = [None] * a.L            # an interrupted forward may leave one behind
        starts = [nt + d for nt, d in zip(a.n_tail, self.n_drop)]        # window start per layer
        if all(s <= n for s in starts):
            for l, s in enumerate(starts):
                a.n_win[l] = n - s
            a.seq_len = n
            return n
        a.reset()
        return 0

    def reset(self) -> None:
        self.n_drop = [0] * self.a.L
        self.pending = [None] * self.a.L
        for t in self.acc_tail:
            t.zero_()
        self.acc_win.zero_()

    def kept_positions(self, l: int) -> torch.Tensor:
        """(Hkv, n_kept) sorted absolute positions of the tokens layer l holds, per KV head."""
        a = self.a
        nt, w = a.n_tail[l], a.n_win[l]
        win = torch.arange(nt + self.n_drop[l], nt + self.n_drop[l] + w, device=self.dev)
        return torch.cat([self.pos_tail[l][:, :nt], win.expand(a.Hkv, w)], 1).sort(-1).values

    # -- internals -----------------------------------------------------------------------------
    def _pack(self, l: int, k: torch.Tensor, v: torch.Tensor, s0: int, means=None) -> None:
        """Pack k, v (Hkv, n, D) into tail slots [s0, s0+n), n a multiple of G. means: for
        codecs with per-token means (TaDA), (K means, V means), each (n, D) or None."""
        a = self.a
        kc, vc = a.k_codecs[l], a.v_codecs[l]
        mk, mv = means if means is not None else (None, None)
        for c0 in range(0, k.shape[1], a.kv.block):
            c1 = min(k.shape[1], c0 + a.kv.block)
            for c, st, x, m in ((kc, a.k_store[l], k, mk), (vc, a.v_store[l], v, mv)):
                if m is None:
                    c.store(st, x[:, c0:c1].float(), s0 + c0)
                else:
                    c.pack(st, x[:, c0:c1].float(), s0 + c0, mu=m[c0:c1])

    def _compact(self, l, xk, xv, xa, xpos) -> None:
        """The tail is full: keep K = S - slack of the n_tail + f candidates per head (the
        tail, then the f flushing tokens xk, xv (Hkv, f, D) with scores xa (H, f), positions
        xpos (f,)). The kept tokens end up in slots [0, K)."""
        a = self.a
        S, nt, f, G, Hkv = a.S_l[l], a.n_tail[l], xk.shape[1], a.G, a.Hkv
        K = S - min(self.kv.evict_slack // G * G, S - G)
        n = nt + f
        pos = torch.cat([self.pos_tail[l][:, :nt], xpos[None].expand(Hkv, f)], 1)   # (Hkv, n)
        score = torch.cat([self.acc_tail[l][:, :nt], xa], 1)                        # (H, n)
        keep = select(self.policy, score, pos, K, sinks=self.kv.sinks, n_recent=self.n_recent(l),
                      crush_fraction=self.kv.crush_fraction, crush_anchor=self.kv.crush_anchor)
        kept = torch.zeros(Hkv, n, dtype=torch.bool).scatter_(1, keep, True)        # (Hkv, n)
        # -- clean blocks (in [0, K), every head keeps all G tokens) stay as packed -----------
        slot_kept = torch.zeros(Hkv, S, dtype=torch.bool)
        slot_kept[:, :nt] = kept[:, :nt]
        clean = slot_kept.view(Hkv, S // G, G).all(-1).all(0).repeat_interleave(G)  # (S,)
        clean[K:] = False
        dirty = torch.nonzero(~clean[:K])[:, 0]          # target slots (nd,)
        nd = dirty.numel()
        in_clean = torch.zeros(n, dtype=torch.bool)
        in_clean[:nt] = clean[:nt]
        fill = kept & ~in_clean[None]                                                # (Hkv, n)
        src = torch.nonzero(fill)[:, 1].view(Hkv, nd)    # per head, candidate order
        # -- sources: dequantize the other tail blocks before any of them is overwritten -----
        dirty_tail = torch.nonzero(~clean[:nt])[:, 0]
        runs = _runs(dirty_tail, G)
        kc, vc = a.k_codecs[l], a.v_codecs[l]
        kd = torch.cat([kc.dequant(a.k_store[l], r0, r1) for r0, r1 in runs] + [xk.float()], 1)
        vd = torch.cat([vc.dequant(a.v_store[l], r0, r1) for r0, r1 in runs] + [xv.float()], 1)
        row = torch.full((n,), -1, dtype=torch.long)     # candidate → row of kd / vd
        row[dirty_tail] = torch.arange(dirty_tail.numel())
        row[nt:] = dirty_tail.numel() + torch.arange(f)
        rows = row[src]                                                              # (Hkv, nd)
        assert bool((rows >= 0).all())
        self.n_repacked += int((rows < dirty_tail.numel()).sum())      # double-quantized
        idx = rows[..., None].expand(-1, -1, a.D)
        newk, newv = kd.gather(1, idx), vd.gather(1, idx)                            # (Hkv, nd, D)
        # per-token means (TaDA): a slot whose heads all hold the same old token keeps that
        # token's stored mean, so its re-pack is exact instead of a re-quantization
        same = (rows == rows[:1]).all(0)                                            # (nd,)
        means = []
        for c, st in ((kc, a.k_store[l]), (vc, a.v_store[l])):
            if not hasattr(c, "means"):
                means.append(None)
                continue
            old = torch.cat([c.means(st, r0, r1) for r0, r1 in runs]
                            + [torch.full((f, a.D), float("nan"))], 0)             # (rows, D)
            m = old[rows[0]]
            m[~same] = float("nan")
            means.append(m)
        new_pos = pos.gather(1, src)
        new_acc = score.gather(1, src.repeat_interleave(self.H // Hkv, 0))           # (H, nd)
        # -- re-pack into the dirty slots --------------------------------------------------------
        o = 0
        for r0, r1 in _runs(dirty, G):
            sl = slice(o, o + r1 - r0)
            self._pack(l, newk[:, sl], newv[:, sl], r0,
                       [m[sl] if m is not None else None for m in means])
            o += r1 - r0
        self.pos_tail[l][:, dirty] = new_pos
        self.acc_tail[l][:, dirty] = new_acc
        if self.resets:
            self.acc_tail[l].zero_()
        a.n_tail[l] = K
        self.n_drop[l] += n - K
        self.n_compactions += 1
