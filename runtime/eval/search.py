"""`kvrun search`: per-layer KV precision search under a memory budget (kv/profile.py; TaDA §3.3
"Searching for quantization precision" and Appendix B).

Objective: mean KL(P_fp16 ‖ P_profile) of next-token distributions on a calibration text,
scored through the compressed read path the way `kvrun ppl` scores: each calibration
window's context sits in the cache under test (tokens older than the residual window
compressed), and the scored tokens are fed in chunks of G so each one attends to the
compressed past as in decode order. The context is prefilled once in fp16 and its K/V
ingested into every candidate cache through the arena's write path; that is exactly what
a single-chunk prefill stores (a prefill chunk attends to itself in full precision).

Constraint: total KV bytes of the cache for `ctx` tokens, window and metadata included,
by `kv_bytes_at` (the arena's own accounting) <= budget × fp16 bytes of `ctx` tokens.

Search (seeded, every evaluation is a real forward):
1. sensitivity: one (layer, K|V) slot at a time at the lowest bit-width, all else fp16,
   gives s[slot]; each other candidate method m gets ρ_m = KLD(uniform m) / KLD(uniform
   lowest). Predicted loss of a profile: Σ s[slot] · ρ[method(slot)] (additive model).
2. knapsack: the profile minimising the predicted loss under the budget (multiple-choice
   knapsack, exact by dynamic programming over byte units), evaluated for real.
3. trials (TaDA's random search): 1 in 4 a random profile cut down to the budget, the rest
   perturbations of the best (1–3 slots moved, repaired to fit, refilled greedily).
"""
from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from ..errors import KvrunError
from ..progress import format_duration
from ..kv.layout import arena_layers
from ..kv.build import build_cache, check_kv, fp16_bytes, kv_bytes_at
from ..kv.config import KVConfig

# bits -> methods per codec family; 8-bit KIVI is the per-token int8 codec
FAMILIES = {
    "kivi": {2: ["kivi-2"], 4: ["kivi-4"], 8: ["int8"], 16: ["fp16"]},
    "tada": {2: ["tada-2"], 4: ["tada-4"], 8: ["tada-8"], 16: ["fp16"]},
    "any": {2: ["kivi-2", "tada-2"], 4: ["kivi-4", "tada-4"], 8: ["int8", "tada-8"], 16: ["fp16"]},
}
ROLES = ("k", "v")


def candidate_methods(family: str, bits: list[int]) -> list[str]:
    if family not in FAMILIES:
        raise KvrunError(f"unknown --family {family!r} ({', '.join(FAMILIES)})")
    bad = [b for b in bits if b not in FAMILIES[family]]
    if bad or not bits:
        raise KvrunError(f"--bits must be a non-empty list from {sorted(FAMILIES[family])}, got {bits}")
    return [m for b in sorted(set(bits)) for m in FAMILIES[family][b]]


# -- the objective ------------------------------------------------------------------------------

@dataclass
class _Window:
    ids: torch.Tensor           # (1, P + N) context then scored inputs
    k: torch.Tensor             # (L, Hkv, P, D) fp16 context K (rotated), from the fp16 prefill
    v: torch.Tensor
    p: torch.Tensor             # (N, V) fp16-cache next-token probabilities
    negent: torch.Tensor        # (N,) Σ p log p


class Objective:
    """Mean KLD vs the fp16 cache on calibration windows (prefix tokens + scored tokens)."""

    def __init__(self, model, text: str, n_windows: int = 2, prefix: int = 512,
                 n_score: int = 32, chunk: int = 32):
        if n_windows < 1 or prefix < 1 or n_score < 1 or chunk < 1:
            raise KvrunError("calibration windows, prefix, scored tokens and chunk must be >= 1")
        self.model, self.cfg, self.chunk = model, model.cfg, chunk
        self.prefix, self.n_score = prefix, n_score
        ids = model.tokenize(text)
        span = prefix + n_score
        if len(ids) < n_windows * span:
            raise KvrunError(f"calibration text has {len(ids)} tokens: {n_windows} windows of "
                             f"{prefix} + {n_score} tokens need {n_windows * span}")
        step = (len(ids) - span) // max(1, n_windows - 1) if n_windows > 1 else 0
        self.n_tokens = n_windows * span
        self.windows = [self._prepare(ids[i * step:i * step + span]) for i in range(n_windows)]
        self.evaluations = 0

    @torch.inference_mode()
    def _prepare(self, win: list[int]) -> _Window:
        cfg, P = self.cfg, self.prefix
        ids = torch.tensor([win])
        dense = build_cache(cfg, len(win), "fp16")
        self.model.transformer(ids[:, :P], dense, last_only=True)        # one chunk: see docstring
        k, v = dense.all_rows(torch.float16)                              # (L, Hkv, P, D)
        w = _Window(ids, k, v, None, None)
        lp = self._logprobs(dense, w)
        w.p = lp.exp()
        w.negent = (w.p * lp).sum(-1)
        return w

    def _logprobs(self, cache, w: _Window) -> torch.Tensor:
        cache.reset()
        cache.ingest(w.k, w.v)
        T = w.ids.shape[1]
        out = [self.model.transformer(w.ids[:, s:min(s + self.chunk, T)], cache)[0]
               for s in range(self.prefix, T, self.chunk)]
        return torch.log_softmax(torch.cat(out).float(), dim=-1)          # (N, V)

    @torch.inference_mode()
    def kld(self, kv: KVConfig) -> float:
        cache = build_cache(self.cfg, self.prefix + self.n_score, kv)
        tot = 0.0
        for w in self.windows:
            lq = self._logprobs(cache, w)
            tot += float((w.negent - (w.p * lq).sum(-1)).sum())
        self.evaluations += 1
        return max(0.0, tot / (len(self.windows) * self.n_score))


# -- the search ---------------------------------------------------------------------------------

@dataclass
class SearchResult:
    layers: list[tuple[str, str]]
    kld: float
    bytes: int
    ratio: float
    limit: int                      # budget in bytes
    uniform: dict = field(default_factory=dict)      # method -> KLD of the uniform config
    sensitivity: list = field(default_factory=list)  # [layer][role] KLD at the lowest bits
    evaluations: int = 0
    seconds: float = 0.0


class Search:
    """Seeded search over per-layer (K, V) methods; see the module docstring."""

    def __init__(self, objective, cfg, methods: list[str], budget: float, ctx: int,
                 trials: int = 16, seed: int = 0, base: KVConfig | None = None, progress=None):
        self.obj, self.cfg, self.ctx, self.trials = objective, cfg, ctx, trials
        self.base = base or KVConfig()
        self.rng = random.Random(seed)
        self.progress = progress or (lambda s: None)
        self.L = arena_layers(cfg)          # sliding-window layers keep their fp16 ring
        fp16 = fp16_bytes(cfg, ctx)
        self.limit = int(math.floor(budget * fp16 + 1e-6))
        self.fp16_bytes = fp16
        # methods sorted by bytes (cheapest first); per-slot costs relative to the cheapest
        cost = {m: self._bytes([(m, m)] * self.L) for m in methods}
        self.methods = sorted(methods, key=lambda m: (cost[m], methods.index(m)))
        m0 = self.methods[0]
        self.b0 = self._bytes([(m0, m0)] * self.L)
        self.cost = {r: [self._slot_cost(r, m) for m in self.methods] for r in ROLES}
        if self.b0 > self.limit:
            raise KvrunError(f"budget {budget} at {ctx} tokens is {self.limit / 2**20:.2f} MiB, but the "
                             f"smallest candidate (uniform {m0}) needs {self.b0 / 2**20:.2f} MiB "
                             f"({self.b0 / fp16:.3f}× fp16): raise --budget or --ctx, or widen --bits/--family")
        self.seen: dict[tuple, float] = {}
        self.best: tuple | None = None
        self.best_kld = math.inf

    # -- bytes --
    def _kv(self, layers) -> KVConfig:
        return self.base.replace(layers=[tuple(x) for x in layers])

    def _bytes(self, layers) -> int:
        return sum(kv_bytes_at(self.cfg, self._kv(layers), self.ctx).values())

    def _slot_cost(self, role: str, m: str) -> int:
        m0 = self.methods[0]
        layers = [(m0, m0)] * self.L
        layers[0] = (m, m0) if role == "k" else (m0, m)
        return self._bytes(layers) - self.b0

    def predicted_bytes(self, a: tuple) -> int:
        """a: method index per slot, slots ordered (layer 0 K, layer 0 V, layer 1 K, …)."""
        return self.b0 + sum(self.cost[ROLES[i % 2]][j] for i, j in enumerate(a))

    def layers_of(self, a: tuple) -> list[tuple[str, str]]:
        return [(self.methods[a[2 * l]], self.methods[a[2 * l + 1]]) for l in range(self.L)]

    # -- evaluation --
    def evaluate(self, a: tuple, what: str) -> float:
        a = tuple(a)
        if a in self.seen:
            self.progress(f"[search] {what}: already evaluated (KLD {self.seen[a]:.5f})")
            return self.seen[a]
        layers = self.layers_of(a)
        nbytes = self._bytes(layers)
        # the additive per-slot costs must agree with the arena
        assert nbytes == self.predicted_bytes(a), \
            "arena bytes are not additive over layers"
        assert nbytes <= self.limit, (nbytes, self.limit)
        kld = self.obj.kld(self._kv(layers))
        self.seen[a] = kld
        if kld < self.best_kld:
            self.best, self.best_kld = a, kld
        self.progress(f"[search] {what}: KLD {kld:.5f}, {nbytes / self.fp16_bytes:.4f}× fp16 | "
                      f"best {self.best_kld:.5f} ({self.obj.evaluations} evaluations, "
                      f"{time.perf_counter() - self.t0:.0f} s)")
        return kld

    def _uniform_kld(self, m: str) -> float:
        return self.obj.kld(self._kv([(m, m)] * self.L))

    # -- phases --
    def sensitivity(self):
        """s[slot]: KLD with only that slot at the cheapest method; ρ per method."""
        m0 = self.methods[0]
        n = 2 * self.L
        self.s = np.zeros(n)
        t_phase = time.perf_counter()
        for i in range(n):
            layers = [("fp16", "fp16")] * self.L
            l, r = divmod(i, 2)
            layers[l] = (m0, "fp16") if r == 0 else ("fp16", m0)
            self.s[i] = self.obj.kld(self._kv(layers))
            eta = (time.perf_counter() - t_phase) / (i + 1) * (n - i - 1)
            self.progress(f"[search] sensitivity {i + 1}/{n}: layer {l} {ROLES[r].upper()} {m0}: "
                          f"KLD {self.s[i]:.5f} ({time.perf_counter() - self.t0:.0f} s, "
                          f"ETA {format_duration(eta)})")
        self.uniform = {}
        for m in self.methods:
            if m in ("fp16", "bf16"):
                self.uniform[m] = 0.0
                continue
            self.uniform[m] = self._uniform_kld(m)
            self.progress(f"[search] uniform {m}: KLD {self.uniform[m]:.5f}")
        u0 = max(self.uniform[m0], 1e-12)
        self.rho = np.array([min(1.0, self.uniform[m] / u0) for m in self.methods])
        self.rho[0] = 1.0

    def reuse(self, sensitivity: list, uniform: dict) -> None:
        """Take s and ρ from an earlier search on the same calibration (another budget)."""
        self.s = np.array([x for pair in sensitivity for x in pair], dtype=float)
        self.uniform = {m: uniform[m] for m in self.methods}
        u0 = max(self.uniform[self.methods[0]], 1e-12)
        self.rho = np.array([min(1.0, self.uniform[m] / u0) for m in self.methods])
        self.rho[0] = 1.0
        self.progress(f"[search] sensitivity and uniform KLDs reused ({len(self.s)} slots)")

    def knapsack(self) -> tuple:
        """Exact minimiser of the predicted loss under the budget (DP over byte units)."""
        n, M = 2 * self.L, len(self.methods)
        costs = [[self.cost[ROLES[i % 2]][j] for j in range(M)] for i in range(n)]
        cap = self.limit - self.b0
        g = 0
        for row in costs:
            for c in row:
                g = math.gcd(g, c)
        g = max(g, 1)
        U = cap // g
        if U > 1_000_000:                          # coarser units: ceil costs stay conservative
            g = -(-cap // 1_000_000)
            U = cap // g
        units = [[-(-c // g) for c in row] for row in costs]
        dp = np.zeros(U + 1)                       # best predicted gain within u units
        choice = np.zeros((n, U + 1), dtype=np.int16)
        for i in range(n):
            new = np.full(U + 1, -np.inf)
            for j in range(M):
                c, gain = units[i][j], self.s[i] * (1.0 - self.rho[j])
                if c > U:
                    continue
                cand = np.full(U + 1, -np.inf)
                cand[c:] = dp[:U + 1 - c] + gain
                better = cand > new + 1e-15
                new = np.where(better, cand, new)
                choice[i] = np.where(better, j, choice[i])
            dp = new
        a, u = [0] * n, U
        for i in range(n - 1, -1, -1):
            j = int(choice[i, u])
            a[i] = j
            u -= units[i][j]
        return tuple(a)

    def _fits(self, a) -> bool:
        return self.predicted_bytes(a) <= self.limit

    def repair(self, a: list, keep=()) -> list:
        """Downgrade slots (least predicted damage per byte saved first) until a fits."""
        while not self._fits(a):
            best, arg = math.inf, None
            for i, j in enumerate(a):
                if j == 0 or i in keep:
                    continue
                r = ROLES[i % 2]
                for j2 in range(j):
                    saved = self.cost[r][j] - self.cost[r][j2]
                    if saved <= 0:
                        continue
                    dmg = self.s[i] * (self.rho[j2] - self.rho[j]) / saved
                    if dmg < best:
                        best, arg = dmg, (i, j2)
            if arg is None:                      # only kept slots left: release them
                keep = ()
                continue
            a[arg[0]] = arg[1]
        return a

    def fill(self, a: list, keep=()) -> list:
        """Greedy upgrades (best predicted gain per byte) while something still fits."""
        while True:
            slack = self.limit - self.predicted_bytes(a)
            best, arg = 0.0, None
            for i, j in enumerate(a):
                if i in keep:
                    continue
                r = ROLES[i % 2]
                for j2 in range(len(self.methods)):
                    extra = self.cost[r][j2] - self.cost[r][j]
                    gain = self.s[i] * (self.rho[j] - self.rho[j2])
                    if 0 < extra <= slack and gain > 0 and gain / extra > best:
                        best, arg = gain / extra, (i, j2)
            if arg is None:
                return a
            a[arg[0]] = arg[1]

    def random_profile(self) -> tuple:
        """TaDA's random search: methods drawn uniformly per slot, then cut to the budget
        by random downgrades."""
        n, M = 2 * self.L, len(self.methods)
        a = [self.rng.randrange(M) for _ in range(n)]
        while not self._fits(a):
            i = self.rng.choice([i for i, j in enumerate(a) if j > 0])
            a[i] = self.rng.randrange(a[i])
        return tuple(a)

    def perturb(self, a: tuple) -> tuple:
        a = list(a)
        n, M = len(a), len(self.methods)
        moved = self.rng.sample(range(n), self.rng.randint(1, min(3, n)))
        for i in moved:
            a[i] = self.rng.choice([j for j in range(M) if j != a[i]] or [a[i]])
        a = self.repair(a, keep=set(moved))
        return tuple(self.fill(a, keep=set(moved)))

    def run(self) -> SearchResult:
        self.t0 = time.perf_counter()
        if not hasattr(self, "s"):
            self.sensitivity()
        self.evaluate(self.knapsack(), "knapsack start")
        for t in range(self.trials):
            if t % 4 == 3:
                a, what = self.random_profile(), "random"
            else:
                a, what = self.perturb(self.best), "perturbation"
            for _ in range(8):                   # a few redraws if this one was seen already
                if a not in self.seen:
                    break
                a = self.perturb(self.best)
            self.evaluate(a, f"trial {t + 1}/{self.trials} ({what})")
        layers = self.layers_of(self.best)
        nbytes = self._bytes(layers)
        return SearchResult(layers, self.best_kld, nbytes, nbytes / self.fp16_bytes, self.limit,
                            dict(self.uniform),
                            [[float(self.s[2 * l]), float(self.s[2 * l + 1])] for l in range(self.L)],
                            self.obj.evaluations, time.perf_counter() - self.t0)


def search(model, text: str, budget: float, ctx: int = 2048, trials: int = 16, seed: int = 0,
           bits=(2, 4, 8), family: str = "kivi", windows: int = 2, prefix: int = 512,
           n_score: int = 32, base: KVConfig | None = None, progress=None,
           reuse=None) -> SearchResult:
    """Search per-layer K/V methods for `model` on calibration `text` (see module docstring).
    `reuse`: a Profile written by an earlier search with the same model, calibration and
    settings; its sensitivity pass is reused (a second budget costs only the trials)."""
    if not 0 < budget <= 1:
        raise KvrunError(f"--budget must be in (0, 1] (a fraction of the fp16 cache), got {budget}")
    if ctx < 1:
        raise KvrunError(f"--ctx must be >= 1, got {ctx}")
    if trials < 0:
        raise KvrunError(f"--trials must be >= 0, got {trials}")
    base = base or KVConfig()
    methods = candidate_methods(family, list(bits))
    for m in methods:                      # geometry checks (V groups etc.) before any work
        check_kv(model.cfg, base.replace(k_method=m, v_method=m))
    s = Search(None, model.cfg, methods, budget, ctx, trials, seed, base, progress)
    if reuse is not None:
        _check_reuse(reuse, model, text, methods, windows, prefix, n_score, base)
        s.reuse(reuse.meta["sensitivity"], reuse.meta["uniform_kld"])
    torch.manual_seed(seed)
    s.obj = Objective(model, text, windows, prefix, n_score, chunk=base.group)
    return s.run()


def _check_reuse(p, model, text, methods, windows, prefix, n_score, base) -> None:
    from ..kv.profile import kv_settings, model_record, text_sha256
    cal = p.meta.get("calibration", {})
    want = {"sha256": text_sha256(text), "windows": windows, "prefix": prefix, "scored": n_score}
    why = None
    if p.model != model_record(model.cfg):
        why = "it was searched on another model"
    elif {k: cal.get(k) for k in want} != want:
        why = "its calibration text or windows differ"
    elif p.kv != kv_settings(base):
        why = "its KV settings (window, groups …) differ"
    elif not isinstance(p.meta.get("sensitivity"), list) or len(p.meta["sensitivity"]) != arena_layers(model.cfg):
        why = "it has no sensitivity table"
    elif not all(m in p.meta.get("uniform_kld", {}) for m in methods):
        why = f"it did not measure all of {', '.join(methods)}"
    if why:
        raise KvrunError(f"--reuse {p.path}: cannot reuse its sensitivity pass: {why}")


def save_result(path, result: SearchResult, model, text: str, *, budget: float, ctx: int,
                family: str, bits, trials: int, seed: int, windows: int, prefix: int,
                n_score: int, base: KVConfig) -> None:
    from ..kv.profile import kv_settings, model_record, save_profile, text_sha256
    save_profile(path, result.layers, model=model_record(model.cfg), kv=kv_settings(base),
                 ctx=ctx, budget=budget, bytes=result.bytes, bytes_ratio=round(result.ratio, 6),
                 kld=result.kld,
                 calibration={"sha256": text_sha256(text), "windows": windows, "prefix": prefix,
                              "scored": n_score},
                 search={"family": family, "bits": list(bits), "trials": trials, "seed": seed,
                         "evaluations": result.evaluations, "seconds": round(result.seconds, 1)},
                 uniform_kld=result.uniform,
                 sensitivity=result.sensitivity)
