"""Token eviction inside the KV arena (policies: evict.py): bounded memory for any sequence length.

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
- When a flush would overflow the tail, the policy keeps K = S of the n_tail + f
  candidates per head (K = S - slack with `evict_slack`, so compactions are rarer), in
  slots [0, K). A tail block whose G tokens a head keeps is *clean* for that head and is
  not touched (its codes stay bit-exact); with TaDA, whose mean is shared by the heads of
  a slot, a block is clean only when every head keeps it. The kept tokens of the other
  (*dirty*) blocks and the kept incoming tokens are re-packed into the dirty slots
  (evicted slots are reused in place: the tail is a ring at block granularity). Masking
  evicted tokens inside still-packed blocks was rejected: it frees no memory until a whole
  block dies, which breaks the bound.
- A re-pack is exact or nearly so for the per-token codecs: lossless for fp16/bf16,
  idempotent for int8 and KIVI's values (a token's own min/max come back), and exact for
  TaDA when the slot's mean is the token's stored one. So TaDA slots are aligned: tokens
  every head keeps take the same slot in every head, and a slot takes the stored mean of
  the token most of its heads hold (only a minority head re-quantizes).
- Keys quantized per channel over G-token blocks (KIVI, GEAR) are different: a re-pack
  re-quantizes every token of the block with new group statistics, and a token that
  survives many compactions compounds that error. Three rules bound it:
  (1) a compaction re-packs at most one tail block per head per G flushing tokens
  (`dirty_blocks`): the blocks with most of the policy's victims join the flushing tokens
  in a pool whose best tokens refill them; the policy's other victims wait for their
  block's turn (the tail stays full, so slack does not apply). A decode flush (G tokens)
  re-packs one block; a prefill chunk of f tokens up to f / G, so a selection made from
  the question's chunk can take in as many of its tokens as fp16 would (with one block
  per chunk, a 512-token chunk could keep only G of its tokens: the needle left with
  the rest). Keys of 4 bits or more (FINE_KEY_BITS) re-quantize cheaply, so a prefill
  chunk re-packs every dirty block of theirs and keeps exactly the policy's choice: with
  f / G blocks the victims left in the other blocks kept out tokens fp16 takes in, and
  kivi-4 + snapkv lost 6 of the 19 needles fp16 + snapkv found, now 2. With every dirty
  block re-packed at every compaction, kivi-4's ppl under eviction moved 20.99 → 21.01
  and kivi-2's 28.6 → 54.2, so 2- and 3-bit keys keep f / G (docs/eviction.md) — unless
  the layer holds the prompt's exact rows (below): a re-pack from them quantizes once, so
  every width then re-packs every dirty block while the prompt is prefilled;
  (2) dirty slots are refilled in position order, so a block holds neighbouring tokens
  (RoPE turns each channel pair by an angle growing with the position, so a block of
  far-apart tokens spreads every channel's range);
  (3) streaming's sinks round up to a whole block, which is then never re-packed.
  Measured, kivi-2 at -c 2048 with 512 tokens (`kvrun ppl … -c 2048 --windows 1 --kv
  kivi-2 --evict POLICY --kv-budget 512`): h2o / snapkv ppl 40.5 / 59.9 when every dirty
  block was re-packed, 25.8 / 27.7 with one per compaction (2 blocks: 37.9 / 38.6, whole-
  block eviction with no re-pack at all: 37.1 / 88.8, coarser selection); streaming
  42.9 → 29.6 with the sink block. Letting a prefill chunk re-pack up to f / G blocks costs
  perplexity on continuous text and buys retrieval (docs/eviction.md).
- Scores: decode_attention's `mass` output (exact probabilities, per query head) is
  accumulated per slot in `acc` (H, n_tail + n_win), laid out as the mass is (tail slots,
  then the window), so a flush into free slots moves nothing and a decode token's mass is
  added in place by the kernel; a compaction moves each score with its token. H2O-style
  policies accumulate every query. SnapKV-style ones use an observation window: a prefill
  chunk resets the scores and adds only its last W queries (exactly SnapKV when
  the prompt fits one chunk — raise -b for long prompts); during decoding the scores
  restart after every compaction, so the window is the queries since the last one.
- The prompt over exact rows. A prompt longer than a chunk is compressed as it arrives, so
  each later chunk, the question's included, read the tail through the codec twice over:
  its scores (4-bit keys alone moved SnapKV's choice off fp16's) and its attention, whose
  error changed the hidden states and so the queries that choose in every layer above
  (with the scores exact, the choice still moved, and that decided a needle; the slot
  overlaps: docs/eviction.md). So while
  a prompt is prefilled, an observation-window policy over a tail that is not lossless
  keeps the tail's rows as they were packed, in the window dtype (`keys` / `values`, (Hkv,
  S_l, D) per layer, each where its codec is lossy: the budget's tokens, SmolLM2 at a
  budget of 1024 with kivi-4, 19.9 MB beside its 10.1 MB arena; fp16's arena of that
  budget takes 23.6), attends each chunk over them (`attend_exact`: what the attention
  gives over a lossless tail, so the prompt's hidden states are fp16 + the policy's), scores
  its last W queries there, and re-packs dirty blocks from them (a re-pack is then one
  quantization, so every width re-packs every dirty block of a prompt). The copy lives from
  an empty tail until `end_prompt` (the engine's prefill and ppl's context say when the
  prompt is in) or the first one-token step: decoding, a later prompt (a chat's next turn)
  and every decode-time compaction read the codes. H2O-style policies score every decode
  query over the codes anyway and hold no copy; `--evict-scores codes` holds none either.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kvrun.kernels.dense_attention import causal_mask, dense_attention
from .layout import tail_capacity
from .evict import group_scores, pyramid_budgets, resets_scores, select


def tail_sizes(kv, n_layers: int, max_ctx: int) -> list[int]:
    """Tail capacity per layer: the usual capacity for max_ctx tokens, capped by the budget."""
    cap = tail_capacity(max_ctx, kv.residual, kv.group)
    if not kv.eviction.on:
        return [cap] * n_layers
    S = kv.evict_tail()
    sizes = pyramid_budgets(S * n_layers, n_layers, kv.group) if kv.eviction.policy == "pyramidkv" \
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
    """Per-layer eviction state of one KVArena: positions and scores of every slot. A
    policy object the arena calls (mass_buffer / observe around each step's attention,
    flush when blocks leave the window, truncate, reset); it changes the arena's storage
    only through the arena's methods (pack_tail; tail_rows / tail_means to read) and
    returns the counts for the arena to set."""

    def __init__(self, arena, n_heads: int):
        a, kv = arena, arena.kv
        self.a, self.kv, self.policy, self.H = arena, kv, kv.eviction.policy, n_heads
        assert n_heads % a.Hkv == 0, (n_heads, a.Hkv)
        self.needs_mass = kv.eviction.policy != "streaming"
        self.resets = resets_scores(kv.eviction.policy)
        dev = self.dev = a.win_k.device
        self.pos_tail = [torch.zeros(a.Hkv, S, dtype=torch.long, device=dev) for S in a.S_l]  # (Hkv, S)
        # (H, n_tail + n_win): each slot's score, tail then window, the layout of the mass
        # decode_attention reports, so a flush moves no score and a decode step adds in place
        self.acc = [torch.zeros(n_heads, 0, device=dev) for _ in range(a.L)]
        self.zero_col = torch.zeros(n_heads, 1, device=dev)
        self.n_drop = [0] * a.L               # tokens evicted per layer
        self.n_compactions = 0
        self.n_repacked = 0                   # kept tail tokens re-packed (per head, summed)
        self.token_groups = [token_groups(c, a.Hkv, a.D, S) for c, S in zip(a.k_codecs, a.S_l)]
        # per-channel keys of 4 bits or more: a prefill chunk re-packs every dirty block (rule 1)
        self.fine_keys = [tg and getattr(c, "bits", 0) >= FINE_KEY_BITS
                          for tg, c in zip(self.token_groups, a.k_codecs)]
        # a sink block of per-channel keys is kept whole, so it is never re-quantized
        sinks = kv.eviction.sinks
        self.sinks = [-(-sinks // a.G) * a.G if tg and sinks else sinks for tg in self.token_groups]
        self.per_head = [per_head_storage(kc, a.Hkv, a.D, S) and per_head_storage(vc, a.Hkv, a.D, S)
                         for kc, vc, S in zip(a.k_codecs, a.v_codecs, a.S_l)]
        # the prompt's exact rows (module docstring, "The prompt over exact rows"): observation-
        # window policies over a tail that is not lossless keep, while the prompt is being
        # prefilled, the tail's K and V as they were packed in the window dtype, (Hkv, S, D)
        # per layer, each where its codec is lossy (a lossless side is read from storage)
        exact = self.resets and kv.eviction.prompt_scores == "exact"
        self.exact_keys, self.exact_values = (
            [exact and not lossless_codec(c, a.wdtype) for c in cs] for cs in (a.k_codecs, a.v_codecs))
        self.keys: list[torch.Tensor | None] = [None] * a.L
        self.values: list[torch.Tensor | None] = [None] * a.L
        self.prefilling = [True] * a.L

    def n_recent(self, l: int) -> int:
        """H2O's even split: half the budget goes to recent tokens; the window counts."""
        return min(self.a.S_l[l] // 2, max(0, self.kv.eviction.budget // 2 - self.a.R))

    # -- what KVArena calls --------------------------------------------------------------------
    def mass_buffer(self, l: int, T: int):
        """(buffer, mass_from) for this step's attention (decode_attention's `mass`), or
        (None, 0) when the policy uses no scores. One decode token: the layer's scores
        plus a zero column, which the kernel adds the query's probabilities into (acc + p,
        as adding p separately would round); a chunk: zeros (observe adds the scores)."""
        if not self.needs_mass or self.exact(l, T):
            return None, 0
        acc = self.acc[l]
        mass_from = max(0, T - self.kv.eviction.snap_window) if self.resets else 0
        if T == 1:
            return torch.cat([acc, self.zero_col], 1), mass_from
        return acc.new_zeros(self.H, acc.shape[1] + T), mass_from

    def observe(self, l: int, mass, T: int) -> None:
        """T tokens are being appended to layer l after attending with `mass` (the buffer
        mass_buffer gave, or attend_exact's; None: no scores, e.g. ingested without
        attention). A single token ends the prefill."""
        if T == 1:
            self._release(l)
        acc = self.acc[l]
        if mass is None:
            self.acc[l] = F.pad(acc, (0, T))
            return
        if T > 1 and not self.resets:            # resets: a chunk opens a fresh observation window
            mass[:, :acc.shape[1]] += acc
        self.acc[l] = mass

    def flush(self, l: int, k: torch.Tensor, v: torch.Tensor) -> int:
        """The f oldest window tokens k, v (Hkv, f, D) leave layer l's window: packed into
        the free tail slots, or, when the tail lacks room, a compaction. Returns how many
        tail tokens the layer then holds (the arena sets its counts)."""
        a = self.a
        nt, f = a.n_tail[l], k.shape[1]
        assert self.acc[l].shape[1] >= nt + f, "observe() must run before the tokens are appended"
        p0 = nt + self.n_drop[l]                         # the window's first position
        pos = torch.arange(p0, p0 + f, device=self.dev)
        if nt == 0 and self.prefilling[l] and not self._holding(l):
            if self.exact_keys[l]:
                self.keys[l] = k.new_empty(a.Hkv, a.S_l[l], a.D)
            if self.exact_values[l]:
                self.values[l] = v.new_empty(a.Hkv, a.S_l[l], a.D)
        if nt + f <= a.S_l[l]:
            a.pack_tail(l, k, v, nt)
            self.pos_tail[l][:, nt:nt + f] = pos
            for copy, x in ((self.keys[l], k), (self.values[l], v)):
                if copy is not None:
                    copy[:, nt:nt + f] = x
            return nt + f
        return self._compact(l, k, v, pos)

    def truncate(self, n: int) -> list[int] | None:
        """Keeping the first n tokens is possible when only window tokens go (every layer's
        tail lies below n): the window length per layer, else None (evicted history cannot
        be restored: the arena empties itself)."""
        a = self.a
        starts = [nt + d for nt, d in zip(a.n_tail, self.n_drop)]        # window start per layer
        if any(s > n for s in starts):
            return None
        wins = [n - s for s in starts]
        self.acc = [x[:, :nt + w].clone() for x, nt, w in zip(self.acc, a.n_tail, wins)]
        return wins

    def reset(self) -> None:
        self.n_drop = [0] * self.a.L
        self.acc = [x.new_zeros(self.H, 0) for x in self.acc]
        for l in range(self.a.L):
            self._release(l)
        self.prefilling = [True] * self.a.L

    def end_prompt(self) -> None:
        """The prompt is in: later chunks attend and are scored over the tail as stored."""
        for l in range(self.a.L):
            self._release(l)

    def _release(self, l: int) -> None:
        self.keys[l] = self.values[l] = None
        self.prefilling[l] = False

    def _holding(self, l: int) -> bool:
        """Whether layer l holds the prompt's exact rows (of at least one side)."""
        return self.keys[l] is not None or self.values[l] is not None

    def transient_nbytes(self) -> int:
        """Bytes of the exact rows held while the prompt is prefilled (freed by end_prompt
        or the first single-token step)."""
        return sum(x.numel() * x.element_size() for x in self.keys + self.values if x is not None)

    def kept_positions(self, l: int) -> torch.Tensor:
        """(Hkv, n_kept) sorted absolute positions of the tokens layer l holds, per KV head."""
        a = self.a
        nt, w = a.n_tail[l], a.n_win[l]
        win = torch.arange(nt + self.n_drop[l], nt + self.n_drop[l] + w, device=self.dev)
        return torch.cat([self.pos_tail[l][:, :nt], win.expand(a.Hkv, w)], 1).sort(-1).values

    # -- internals -----------------------------------------------------------------------------
    def _compact(self, l, xk, xv, xpos) -> int:
        """The tail is full: keep K = S - slack of the n_tail + f candidates per head (the
        tail, then the f flushing tokens xk, xv (Hkv, f, D) at positions xpos (f,)), in
        slots [0, K); returns K.

        A block is clean for head h when h keeps all its G tokens; with per-head storage
        (every codec but TaDA, whose mean is shared by the heads of a slot) each head keeps
        its own clean blocks as packed, otherwise a block is clean only when every head
        keeps it. The other kept tokens fill the dirty slots in `_priority` order. Keys
        quantized per channel over G-token blocks first go through `dirty_blocks`."""
        a = self.a
        S, nt, f, G, Hkv, D = a.S_l[l], a.n_tail[l], xk.shape[1], a.G, a.Hkv, a.D
        groups, keys, values = self.token_groups[l], self.keys[l], self.values[l]
        K = S if groups else S - min(self.kv.eviction.slack // G * G, S - G)
        n = nt + f
        pos = torch.cat([self.pos_tail[l][:, :nt], xpos[None].expand(Hkv, f)], 1)   # (Hkv, n)
        score = self.acc[l][:, :n]                                                  # (H, n)
        keep = self.choose(l, score, pos, K)
        kept = torch.zeros(Hkv, n, dtype=torch.bool).scatter_(1, keep, True)        # (Hkv, n)
        per_head = self.per_head[l]
        if groups:            # KIVI / GEAR keys: re-packing re-quantizes a whole block
            n_blocks = nt // G if self._holding(l) or f > G and self.fine_keys[l] else -(-f // G)
            kept = dirty_blocks(kept, self._value(score, pos), nt, G, per_head, n_blocks)
        # -- clean blocks (in [0, K), all G tokens kept) stay as packed --------------------------
        clean = torch.zeros(Hkv, S // G, dtype=torch.bool)
        clean[:, :nt // G] = kept[:, :nt].view(Hkv, nt // G, G).all(-1)
        clean[:, K // G:] = False
        if not per_head:
            clean[:] = clean.all(0)
        clean_slot = clean.repeat_interleave(G, 1)                                   # (Hkv, S)
        fill = kept.clone()
        fill[:, :nt] &= ~clean_slot[:, :nt]                                          # (Hkv, n)
        src = fill_order(fill, self._priority(l, score, pos), aligned=not per_head)   # [(nd_h,)]
        dirty = [torch.nonzero(~clean_slot[h, :K])[:, 0] for h in range(Hkv)]     # [(nd_h,)]
        assert [d.numel() for d in dirty] == [s.numel() for s in src]
        # -- sources: dequantize the tail blocks they lie in before any is overwritten -------
        blocks = torch.zeros(S // G, dtype=torch.bool)
        for s in src:
            blocks[s[s < nt] // G] = True
        old_slots = torch.nonzero(blocks.repeat_interleave(G))[:, 0]
        runs = _runs(old_slots, G)
        kd, vd = a.tail_rows(l, runs, keys=keys is None, values=values is None)
        if keys is not None:                     # re-pack the rows as they were, not decoded
            kd = keys[:, old_slots].float()
        if values is not None:
            vd = values[:, old_slots].float()
        kd, vd = torch.cat([kd, xk.float()], 1), torch.cat([vd, xv.float()], 1)
        n_old = old_slots.numel()
        row = torch.full((n,), -1, dtype=torch.long)     # candidate → row of kd / vd
        row[old_slots] = torch.arange(n_old)
        row[nt:] = n_old + torch.arange(f)
        rows = [row[s] for s in src]
        assert all(bool((r >= 0).all()) for r in rows)
        self.n_repacked += sum(int((r < n_old).sum()) for r in rows)   # quantized once more
        # -- re-pack into the dirty slots --------------------------------------------------------
        if per_head:
            for h in range(Hkv):
                self._pack_runs(l, dirty[h], kd[h:h + 1, rows[h]], vd[h:h + 1, rows[h]], head=h)
        else:
            r = torch.stack(rows)                                                    # (Hkv, nd)
            idx = r[..., None].expand(-1, -1, D)
            self._pack_runs(l, dirty[0], kd.gather(1, idx), vd.gather(1, idx),
                            means=self._slot_means(l, runs, r, f))
        # -- positions, exact rows and scores follow their tokens ------------------------------
        for h in range(Hkv):
            self.pos_tail[l][h, dirty[h]] = pos[h, src[h]]
            for copy, x in ((keys, kd), (values, vd)):
                if copy is not None:
                    copy[h, dirty[h]] = x[h, rows[h]].to(copy.dtype)
        win = self.acc[l][:, n:]                             # the tokens staying in the window
        if self.resets:                         # the next selection observes fresh queries
            self.acc[l] = score.new_zeros(self.H, K + win.shape[1])
        else:
            g = self.H // Hkv
            tail = score.new_zeros(self.H, K)
            tail[:, :min(nt, K)] = score[:, :min(nt, K)]                            # clean slots
            for h in range(Hkv):
                tail[h * g:(h + 1) * g][:, dirty[h]] = score[h * g:(h + 1) * g][:, src[h]]
            self.acc[l] = torch.cat([tail, win], 1)
        self.n_drop[l] += n - K
        self.n_compactions += 1
        return K

    def exact(self, l: int, T: int) -> bool:
        """Whether a prefill chunk of layer l attends over the exact rows (the arena then
        calls attend_exact): while they are held and some of the tail is compressed. Before
        the first flush every row is in the window, exact, and the attention kernel's mass
        is the lossless one."""
        return T > 1 and self._holding(l) and self.a.n_tail[l] > 0

    def attend_exact(self, l: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """A prefill chunk's attention over [tail, window, new tokens] from the exact rows:
        q (1, H, T, D), k, v (1, Hkv, T, D) in the tail's rotation and the window dtype. Returns
        (1, H, T, D) float32, what the attention gives over a lossless tail, and records
        the scores (the last snap_window queries' probabilities summed per query head, as
        decode_attention's `mass`) as observe does."""
        a = self.a
        nt, w = a.n_tail[l], a.n_win[l]
        _, H, T, D = q.shape
        stored = a.tail_rows(l, [(0, nt)] if nt else [], keys=self.keys[l] is None,
                             values=self.values[l] is None)
        rows = [held[:, :nt] if held is not None else x        # x: a lossless side, decoded
                for held, x in zip((self.keys[l], self.values[l]), stored)]
        keys, values = (torch.cat([t.float(), win[l][:, :w].float(), new[0].float()], 1)[None]
                        for t, win, new in zip(rows, (a.win_k, a.win_v), (k, v)))
        o = dense_attention(q.float(), keys, values, nt + w, softcap=a.softcap)
        m0 = max(0, T - self.kv.eviction.snap_window)
        g, Tw = H // a.Hkv, T - m0
        qg = q[0, :, m0:].float().reshape(a.Hkv, g * Tw, D) * D ** -0.5   # rows (g, t)
        sc = torch.bmm(qg, keys[0].transpose(1, 2))                       # (Hkv, g Tw, N)
        if a.softcap:                                   # the probabilities the attention used
            sc = sc.div_(a.softcap).tanh_().mul_(a.softcap)
        seen = causal_mask(Tw, nt + w + T, nt + w + m0, q.device)          # (Tw, N)
        sc.masked_fill_(~seen.repeat(g, 1)[None], float("-inf"))
        self.observe(l, sc.softmax(-1).view(a.Hkv, g, Tw, -1).sum(2).reshape(H, -1), T)
        return o

    def choose(self, l: int, score: torch.Tensor, pos: torch.Tensor, K: int) -> torch.Tensor:
        """The policy's choice at a compaction of layer l: (Hkv, K) sorted candidate indices
        from the scores (H, n) and positions (Hkv, n). A diagnostic can replace it on an
        instance (tools/evict_replay.py forces another cache's selection)."""
        return select(self.policy, score, pos, K, sinks=self.sinks[l], n_recent=self.n_recent(l),
                      crush_fraction=self.kv.eviction.crush_fraction,
                      crush_anchor=self.kv.eviction.crush_anchor)

    def _value(self, score, pos):
        """(Hkv, n): dirty_blocks' order within the policy's kept / evicted tokens: the
        newest first (streaming), else the most attended."""
        if self.policy == "streaming":
            return pos.double()
        return group_scores(score, self.a.Hkv).double()

    def _priority(self, l: int, score: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """(Hkv, n): the order in which kept tokens fill the dirty slots (higher first).
        Keys quantized per channel over G-token blocks (KIVI, GEAR) go in position order: a
        block of neighbouring tokens has tight per-channel ranges (RoPE turns each channel
        pair by an angle that grows with the position, so tokens far apart spread them).
        Otherwise by expected lifetime: streaming evicts by age, so the sinks, then the
        newest; the scored policies keep high scores."""
        if self.token_groups[l]:
            return -pos.double()
        v = self._value(score, pos)
        return v.masked_fill(pos < self.sinks[l], float("inf")) if self.policy == "streaming" else v

    def _slot_means(self, l, runs, rows, f):
        """Per-token means for a shared-slot re-pack (TaDA), one list entry per K and V codec
        (None: the codec has none): slot j takes the stored mean of the token most heads
        hold there if that token was packed before (exact for those heads), else NaN (the
        pack computes the mean of the slot's rows)."""
        same = (rows[None] == rows[:, None]).sum(0)                       # (Hkv, nd) votes
        major = rows.gather(0, same.argmax(0)[None])[0]                   # (nd,) first max
        nan = torch.full((f, self.a.D), float("nan"))
        return [None if m is None else torch.cat([m, nan], 0)[major]      # (rows, D) → (nd, D)
                for m in self.a.tail_means(l, runs)]

    def _pack_runs(self, l, slots, k, v, head=None, means=(None, None)) -> None:
        """Pack k, v (h, nd, D) into the tail slots `slots` (nd,), sorted whole blocks; head:
        write only that KV head's storage (per-head codecs), else all heads."""
        o = 0
        for r0, r1 in _runs(slots, self.a.G):
            sl = slice(o, o + r1 - r0)
            self.a.pack_tail(l, k[:, sl], v[:, sl], r0, head=head,
                             means=[m[sl] if m is not None else None for m in means])
            o += r1 - r0


def dirty_blocks(kept: torch.Tensor, value: torch.Tensor, nt: int, G: int, per_head: bool,
                 n_blocks: int = 1) -> torch.Tensor:
    """Restrict a compaction to at most n_blocks dirty tail blocks per head (for keys
    quantized per channel over G-token blocks). kept (Hkv, n): the policy's choice over nt
    tail tokens + the flushing ones; value (Hkv, n): ranks tokens within the policy's kept /
    evicted sets. Returns the kept mask actually applied: the n_blocks tail blocks holding
    the most tokens the policy evicts (ties: the least value; blocks with no victim are
    never taken) and the flushing tokens form a pool; the pool's best tokens (policy-kept
    first, then by value) fill those blocks' slots and the free ones, every other tail
    token stays. The policy's other victims wait for their block's turn. per_head False:
    the same blocks for every head."""
    Hkv, n = kept.shape
    nb = nt // G
    out = torch.zeros_like(kept)
    out[:, :nt] = True
    if nb:
        evicted = (~kept[:, :nt]).view(Hkv, nb, G).sum(-1)                   # (Hkv, nb)
        worth = value[:, :nt].reshape(Hkv, nb, G).sum(-1)
        if not per_head:
            evicted = evicted.sum(0, keepdim=True).expand(Hkv, nb)
            worth = worth.sum(0, keepdim=True).expand(Hkv, nb)
        order = _lex_order((evicted, True), (worth, False))[:, :n_blocks]   # (Hkv, <= n_blocks)
        for h in range(Hkv):
            for b in order[h].tolist():
                if evicted[h, b] > 0:
                    out[h, b * G:b * G + G] = False
    n_keep = int(kept[0].sum())
    for h in range(Hkv):
        pool = torch.nonzero(~out[h])[:, 0]
        rank = _lex_order((kept[h, pool], True), (value[h, pool], True))
        out[h, pool[rank[:n_keep - int(out[h].sum())]]] = True
    return out


def _lex_order(*keys) -> torch.Tensor:
    """Indices sorting the last axis by keys (tensor, descending) in priority order; ties
    keep index order."""
    order = torch.arange(keys[0][0].shape[-1]).expand_as(keys[0][0])
    for x, desc in reversed(keys):
        order = order.gather(-1, x.gather(-1, order).sort(dim=-1, descending=desc, stable=True).indices)
    return order


def _lex_first(*keys) -> torch.Tensor:
    return _lex_order(*keys)[..., 0]


def lossless_codec(codec, wdtype: torch.dtype) -> bool:
    """The codec stores rows as the window holds them (fp16 / bf16 / fp32 in the window's
    dtype): a flush loses nothing."""
    return codec.kind == "fp" and codec.dtype == wdtype


FINE_KEY_BITS = 4      # keys this fine re-quantize cheaply: a prefill chunk frees every dirty block


def token_groups(codec, Hkv: int, D: int, S: int) -> bool:
    """The codec quantizes over groups of tokens (KIVI / GEAR keys: per channel over a block
    of G), so re-packing a block re-quantizes every token in it. The arena's geometry:
    `slots` records the head dim on the (shared) codec."""
    return any(s.component == "scales_zeros" and s.unit > 1 for s in codec.slots(Hkv, D, S))


def per_head_storage(codec, Hkv: int, D: int, S: int) -> bool:
    """Every storage tensor of the codec has the KV heads on axis 0 (a head's tokens can be
    re-packed without touching the other heads); TaDA's per-slot mean does not."""
    return all(s.axis != 0 and s.shape[0] == Hkv for s in codec.slots(Hkv, D, S))


def fill_order(fill: torch.Tensor, prio: torch.Tensor, aligned: bool) -> list[torch.Tensor]:
    """Per head, the candidates with `fill` set by decreasing priority (ties: lower index
    first). aligned (heads share slots, all heads fill the same count): the tokens every
    head fills come first, in the same order for every head, so they share slots."""
    Hkv, n = fill.shape
    key = prio.masked_fill(~fill, float("-inf"))
    common = fill.all(0, keepdim=True).expand(Hkv, n) & aligned
    key = torch.where(common, prio.sum(0, keepdim=True).expand(Hkv, n), key)
    order = _lex_order((common, True), (key, True))
    return [order[h, :int(fill[h].sum())] for h in range(Hkv)]
