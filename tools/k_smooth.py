"""What a per-model key transform fitted once would buy the codecs: `kvrun ppl` with every
key entering the arena replaced by (k - mu) / sigma and every query by q * sigma, per
arena layer, KV head and channel, before the codec sees them.

Exact in full precision: q' . k' = q . k - q . mu, and a shift the same for every key a
query sees is one constant per query row, which softmax removes. So the fp16 row of every
mode gives the same ppl (to fp16 rounding), and what changes is what the codec quantizes:
keys without the direction every token shares (mu, docs/codebook.md "Why K loses"), and
with sigma, channels of equal spread. mu and sigma come from an fp16 prefill of --calib
(the keys after RoPE, positions from --skip on); sigma is each channel's standard deviation,
scaled to unit RMS over the channels.

    python tools/k_smooth.py wiki.test.raw --calib pg_essays.txt -m gemma-3-270m -c 2048 \
        --windows 1 --kv kivi-4,cb-4,cb-3 --mode none,mean,scale

Modes: none (the codecs as they are), mean (k - mu), scale ((k - mu) / sigma, q * sigma).

`--attention L[,L...]` instead: for those arena layers, one fp16 prefill of -c tokens of
FILE, and the attention of its last 256 queries with the keys through the cb codec of
--bits (every key, window included), in fp32: the KL divergence from the exact attention,
the sink's share of it (position 0) and the mean |logit error| at the sink and elsewhere,
for none, mean, and mean with the sink's key kept exact.

The runtime has the transform itself now (a profile's "k_map", fitted by `kvrun search
--key-map`: runtime/kv/key_map.py, one sigma per channel over the KV heads); this tool is
the measurement that led to it, and its --attention report.

The transform is applied at KVArena.attend, the per-layer route every prompt chunk takes
(the one-call native decode step, which would bypass it, is switched off here); a sliding
window ring layer (Gemma) is left as it is.
"""
from __future__ import annotations

import argparse
import sys

import torch

import kvrun
from kvrun.errors import KvrunError
from kvrun.eval.ppl import format_table, perplexity
from kvrun.kv.arena import KVArena
from kvrun.kernels.codecs import make_codec
from kvrun.kernels.hadamard import rotation_matrix
from kvrun.kv.build import make_cache
from kvrun.kv.layout import arena_layers

MODES = ("none", "mean", "scale")


def prefill(model, text: str, n: int, what: str) -> None:
    """One fp16 prefill of the first n tokens of text, through KVArena.attend"""
    ids = model.tokenize(text)[:n]
    if len(ids) < n:
        raise KvrunError(f"{what} has {len(ids)} tokens: need {n}")
    with torch.inference_mode():
        model.transformer(torch.tensor([ids]), make_cache(model.cfg, n, "fp16"), last_only=True)


class KeyTransform:
    """Installed over KVArena.attend: records key sums (calibration) or transforms q and k."""

    def __init__(self):
        self.sums: list | None = None          # per arena layer [sum k, sum k^2, n]
        self.skip = 0
        self.mu: list | None = None            # per arena layer (Hkv, D)
        self.sigma: list | None = None
        self.seen: dict | None = None          # layer -> (q, k) of a capture
        self._attend = KVArena.attend

    def __call__(self, arena, layer: int, q, k, v):
        if self.seen is not None:
            self.seen[layer] = (q[0].float(), k[0].float())
        if self.sums is not None:
            kk = k[0, :, max(0, self.skip - arena.seq_len):].float()      # (Hkv, T', D)
            s = self.sums[layer]
            s[0] += kk.sum(1)
            s[1] += (kk * kk).sum(1)
            s[2] += kk.shape[1]
        if self.mu is not None:
            k = k.float() - self.mu[layer][None, :, None]
            if self.sigma is not None:
                k = k / self.sigma[layer][None, :, None]
                g = q.shape[1] // k.shape[1]
                q = (q.float() * self.sigma[layer].repeat_interleave(g, 0)[None, :, None]).to(q.dtype)
            k = k.to(v.dtype)
        return self._attend(arena, layer, q, k, v)

    def capture(self, model, text: str, n: int) -> dict:
        """layer -> (q (H, n, D), k (Hkv, n, D)) of one fp16 prefill of n tokens of text"""
        self.seen = {}
        prefill(model, text, n, "the text")
        seen, self.seen = self.seen, None
        return seen

    def calibrate(self, model, text: str, n: int) -> None:
        """mu and sigma from the keys of one fp16 prefill of n tokens of text"""
        H, D = model.cfg.num_kv_heads, model.cfg.head_dim
        self.sums = [[torch.zeros(H, D, dtype=torch.float64), torch.zeros(H, D, dtype=torch.float64), 0]
                     for _ in range(arena_layers(model.cfg))]
        prefill(model, text, n, "--calib")
        self.mu, self.sigma = [], []
        for s1, s2, cnt in self.sums:
            mu = s1 / cnt
            sd = (s2 / cnt - mu * mu).clamp_min(0).sqrt()
            sd = sd / sd.pow(2).mean(-1, keepdim=True).sqrt().clamp_min(1e-30)
            self.mu.append(mu.float())
            self.sigma.append(sd.float().clamp_min(1e-6))
        self.sums = None


def attention_error(q, k, mu, bits: int, n_q: int = 256) -> list[str]:
    """The last n_q queries' attention over k (every key through cb-`bits`, after the shift
    by mu or not) against the exact one: one line per variant."""
    H, Hkv, n, D = q.shape[0], k.shape[0], k.shape[1], k.shape[2]
    g, R = H // Hkv, rotation_matrix(D)
    qs = q[:, -n_q:] / D ** 0.5
    causal = torch.ones(n_q, n, dtype=torch.bool).tril(n - n_q)

    def logp(keys):
        s = qs @ keys.repeat_interleave(g, 0).transpose(1, 2)
        return torch.log_softmax(s.masked_fill(~causal, float("-inf")), -1)
    exact = logp(k)
    lines = [f"sink share of the attention {float(exact[..., 0].exp().mean()):.2f}"]
    c = make_codec(f"cb-{bits}", "k", 32)
    for name, shift, sink in (("none", 0, False), ("mean", mu, False), ("mean, exact sink", mu, True)):
        x = ((k - shift) @ R).contiguous()
        kh = c.pack(c.alloc(Hkv, D, n), x, 0) @ R.T + shift
        if sink:
            kh[:, 0] = k[:, 0]
        lp = logp(kh)
        err = ((kh - k).repeat_interleave(g, 0) @ qs.transpose(1, 2)).abs()       # (H, n, n_q)
        kl = float((exact.exp() * (exact - lp).nan_to_num()).sum(-1).mean())
        lines.append(f"{name}: KL {kl:.5f}, |logit error| sink {float(err[:, 0].mean()):.3f} "
                     f"others {float(err[:, 1:].mean()):.3f}")
    return lines


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("file", help="the text scored (kvrun ppl's FILE)")
    ap.add_argument("--calib", required=True, help="the text mu and sigma are fitted on")
    ap.add_argument("--calib-tokens", type=int, default=2048)
    ap.add_argument("--skip", type=int, default=4, help="first positions left out of the fit")
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("-c", "--ctx", type=int, default=2048)
    ap.add_argument("--windows", type=int, default=1)
    ap.add_argument("--kv", default="kivi-4,cb-4,cb-3")
    ap.add_argument("--mode", default="none,mean,scale")
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--attention", default=None, help="arena layers: the attention-error report")
    ap.add_argument("--bits", type=int, default=4, choices=(2, 3, 4), help="of --attention's cb codec")
    a = ap.parse_args(argv)
    try:
        modes = a.mode.split(",")
        if any(md not in MODES for md in modes):
            raise KvrunError(f"--mode takes {', '.join(MODES)} (got {a.mode!r})")
        try:
            layers = None if a.attention is None else [int(x) for x in a.attention.split(",")]
        except ValueError:
            raise KvrunError(f"--attention takes arena layer numbers (got {a.attention!r})") from None
        with open(a.file, encoding="utf-8", errors="replace") as f:
            text = f.read()
        with open(a.calib, encoding="utf-8", errors="replace") as f:
            calib = f.read()
        m = kvrun.load(a.model, ctx=max(a.ctx, a.calib_tokens), threads=a.threads)
        m.transformer.native_step = lambda ids, cache: None       # every step through attend
        tr = KeyTransform()
        tr.skip = a.skip
        KVArena.attend = lambda arena, layer, q, k, v: tr(arena, layer, q, k, v)
        try:
            seen = tr.capture(m, text, a.ctx) if layers is not None else None   # untransformed
            tr.calibrate(m, calib, a.calib_tokens)
            mu, sigma = tr.mu, tr.sigma
            if seen is not None:
                for layer in layers:
                    if layer not in seen:
                        raise KvrunError(f"--attention: no arena layer {layer} (0..{len(seen) - 1})")
                    q, k = seen[layer]
                    print(f"layer {layer}: " + " | ".join(attention_error(q, k, mu[layer][:, None], a.bits)),
                          flush=True)
                return
            for md in modes:
                tr.mu = None if md == "none" else mu
                tr.sigma = sigma if md == "scale" else None
                recs = perplexity(m, text, a.ctx, a.kv.split(","), n_windows=a.windows)
                print(f"mode {md}:")
                print(format_table(recs), flush=True)
        finally:
            KVArena.attend = tr._attend                         # the class as it was
    except (KvrunError, OSError) as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
