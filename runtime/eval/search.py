"""`kvrun search`: per-layer KV precision search under a memory budget (kv/profile.py; TaDA §3.3
"Searching for quantization precision" and Appendix B; KVTuner's per-layer (K, V) pairs).

Objective: mean KL(P_fp16 ‖ P_profile) of next-token distributions on a calibration text
(search_objective.py), scored through the cache each candidate config builds: a codec that
rotates its role (cb-*) is scored rotated, and a layer may pair kinds (kivi-4 K, cb-4 V).

Constraint: total KV bytes of the cache for `ctx` tokens, window and metadata included,
by `kv_bytes_at` (the arena's own accounting) <= budget × fp16 bytes of `ctx` tokens.

Search (seeded, every evaluation is a real forward):
1. sensitivity: one (layer, K|V) slot at a time at the cheapest method, all else fp16,
   gives s[slot]; each other candidate method m gets a ratio per role r, ρ_r,m =
   KLD(m on every r slot) / KLD(cheapest on every r slot), the other role fp16 (a codec
   can be good for V and bad for K: cb on Gemma). Predicted loss of a profile:
   Σ s[slot] · ρ[role(slot), method(slot)] (additive model).
2. knapsack: the profile minimising the predicted loss under the budget (multiple-choice
   knapsack, exact by dynamic programming over byte units), evaluated for real; on a model
   with rings also its minimiser at each other ring width (below).
3. trials (TaDA's random search): 1 in 4 a random profile cut down to the budget, the rest
   perturbations of the best (1–3 slots moved, repaired to fit, refilled greedily).

A model with sliding-window layers (Gemma 3) has one more slot: the width of their rings
(kv/ring.py; 4 or 8 bits by default, one width for every ring), which costs bytes like any
other slot. Its predicted loss is the KLD of the rings alone at that width (every arena layer
fp16), and the sensitivity pass keeps the rings in fp16 so that s[slot] measures the slot
alone — with the rings at 4 bits every s[slot] would carry the rings' own loss.
"""
from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from kvrun.kernels.codecs import KEY_ONLY
from ..errors import KvrunError
from ..progress import format_duration
from ..kv.layout import arena_layers
from ..kv.build import build_cache, check_kv, fp16_bytes, kv_bytes_at
from ..kv.config import KVConfig
from ..kv.key_map import fit_key_map
from .search_menu import ROLES, candidate_methods, default_bits, ring_choices
from .search_objective import Objective

# -- the search ---------------------------------------------------------------------------------

@dataclass
class SearchResult:
    layers: list[tuple[str, str]]
    kld: float
    bytes: int
    ratio: float
    limit: int                      # budget in bytes
    uniform: dict = field(default_factory=dict)      # method -> KLD of the uniform config
    role_uniform: dict = field(default_factory=dict)  # "k"|"v" -> method -> KLD, that role only
    sensitivity: list = field(default_factory=list)  # [layer][role] KLD at the lowest bits
    ring: int | None = None         # the rings' width (models with sliding-window layers)
    ring_kld: dict = field(default_factory=dict)     # ring width -> KLD, every arena layer fp16
    evaluations: int = 0
    seconds: float = 0.0


class Search:
    """Seeded search over per-layer (K, V) methods; see the module docstring."""

    def __init__(self, objective, cfg, methods: list[str], budget: float, ctx: int,
                 trials: int = 16, seed: int = 0, base: KVConfig | None = None, progress=None,
                 rings=()):
        self.obj, self.cfg, self.ctx, self.trials = objective, cfg, ctx, trials
        self.base = base or KVConfig()
        self.rng = random.Random(seed)
        self.progress = progress or (lambda s: None)
        self.L = arena_layers(cfg)          # the layers a profile lists (not the rings)
        self.rings = sorted(set(rings))     # ring widths, cheapest first; () no ring slot
        # the rings while one slot is measured: fp16, so s[slot] is the slot's alone
        self.iso_ring = 16 if self.rings else self.base.ring
        fp16 = fp16_bytes(cfg, ctx)
        self.limit = int(math.floor(budget * fp16 + 1e-6))
        self.fp16_bytes = fp16
        # methods sorted by bytes (cheapest first); per-slot costs relative to the cheapest.
        # A key-only method (kivi-3) is ranked as if its V cost what its K costs, and only
        # K slots offer it: each role has its own menu, both led by the same cheapest m0
        dense = self._bytes([("fp16", "fp16")] * self.L)
        cost = {m: 2 * self._bytes([(m, "fp16")] * self.L) - dense if m in KEY_ONLY
                else self._bytes([(m, m)] * self.L) for m in methods}
        self.methods = sorted(methods, key=lambda m: (cost[m], methods.index(m)))
        m0 = self.methods[0]
        if m0 in KEY_ONLY:
            raise KvrunError(f"{m0} stores keys only, so it cannot be the cheapest choice of every "
                             f"slot: add a narrower width to --bits")
        self.menu = {"k": self.methods, "v": [m for m in self.methods if m not in KEY_ONLY]}
        self.b0 = self._bytes([(m0, m0)] * self.L)
        self.cost = {r: [self._slot_cost(r, m) for m in self.menu[r]] for r in ROLES}
        # per slot (layer 0 K, layer 0 V, …, then the rings' width): bytes of each choice
        self.costs = [self.cost[ROLES[i % 2]] for i in range(2 * self.L)]
        if self.rings:
            self.costs.append([self._bytes([(m0, m0)] * self.L, w) - self.b0 for w in self.rings])
        if self.b0 > self.limit:
            least = f"uniform {m0}" + (f", {self.rings[0]}-bit rings" if self.rings else "")
            raise KvrunError(f"budget {budget} at {ctx} tokens is {self.limit / 2**20:.2f} MiB, but the "
                             f"smallest candidate ({least}) needs {self.b0 / 2**20:.2f} MiB "
                             f"({self.b0 / fp16:.3f}× fp16): raise --budget or --ctx, or widen --bits/--family")
        self.seen: dict[tuple, float] = {}
        self.best: tuple | None = None
        self.best_kld = math.inf

    # -- bytes --
    def _kv(self, layers, ring: int | None = None) -> KVConfig:
        """The config of per-layer methods `layers` with the rings at `ring` bits (None: the
        cheapest candidate width, or the base config's when there is no ring slot)."""
        ring = ring or (self.rings[0] if self.rings else self.base.ring)
        return self.base.replace(layers=[tuple(x) for x in layers], ring=ring)

    def _bytes(self, layers, ring: int | None = None) -> int:
        return sum(kv_bytes_at(self.cfg, self._kv(layers, ring), self.ctx).values())

    def _slot_cost(self, role: str, m: str) -> int:
        m0 = self.methods[0]
        layers = [(m0, m0)] * self.L
        layers[0] = (m, m0) if role == "k" else (m0, m)
        return self._bytes(layers) - self.b0

    def predicted_bytes(self, a: tuple) -> int:
        """a: choice index per slot, slots ordered (layer 0 K, layer 0 V, layer 1 K, …, and
        last the rings' width when the model has rings)."""
        return self.b0 + sum(self.costs[i][j] for i, j in enumerate(a))

    def layers_of(self, a: tuple) -> list[tuple[str, str]]:
        return [(self.menu["k"][a[2 * l]], self.menu["v"][a[2 * l + 1]]) for l in range(self.L)]

    def ring_of(self, a: tuple) -> int | None:
        return self.rings[a[2 * self.L]] if self.rings else self.base.ring

    def config_of(self, a: tuple) -> KVConfig:
        return self._kv(self.layers_of(a), self.ring_of(a))

    def loss(self, i: int, j: int) -> float:
        """Predicted loss of slot i at choice j (the additive model, module docstring)."""
        if i == 2 * self.L:
            return self.ring_kld[self.rings[j]]
        return float(self.s[i] * self.rho[ROLES[i % 2]][j])

    # -- evaluation --
    def evaluate(self, a: tuple, what: str) -> float:
        a = tuple(a)
        if a in self.seen:
            self.progress(f"[search] {what}: already evaluated (KLD {self.seen[a]:.5f})")
            return self.seen[a]
        kv = self.config_of(a)
        nbytes = sum(kv_bytes_at(self.cfg, kv, self.ctx).values())
        # the additive per-slot costs must agree with the arena
        assert nbytes == self.predicted_bytes(a), \
            "arena bytes are not additive over layers"
        assert nbytes <= self.limit, (nbytes, self.limit)
        kld = self.obj.kld(kv)
        self.seen[a] = kld
        if kld < self.best_kld:
            self.best, self.best_kld = a, kld
        self.progress(f"[search] {what}: KLD {kld:.5f}, {nbytes / self.fp16_bytes:.4f}× fp16 | "
                      f"best {self.best_kld:.5f} ({self.obj.evaluations} evaluations, "
                      f"{time.perf_counter() - self.t0:.0f} s)")
        return kld

    def _uniform_kld(self, m: str, role: str | None = None) -> float:
        """KLD with m in every slot (of `role` only, the other role fp16, when given)."""
        pair = (m, m) if role is None else (m, "fp16") if role == "k" else ("fp16", m)
        return self.obj.kld(self._kv([pair] * self.L, self.iso_ring))

    # -- phases --
    def sensitivity(self):
        """s[slot]: KLD with only that slot at the cheapest method; ρ per method; the
        rings' KLD at each candidate width."""
        m0 = self.methods[0]
        n = 2 * self.L
        self.s = np.zeros(n)
        t_phase = time.perf_counter()
        for i in range(n):
            layers = [("fp16", "fp16")] * self.L
            l, r = divmod(i, 2)
            layers[l] = (m0, "fp16") if r == 0 else ("fp16", m0)
            self.s[i] = self.obj.kld(self._kv(layers, self.iso_ring))
            eta = (time.perf_counter() - t_phase) / (i + 1) * (n - i - 1)
            self.progress(f"[search] sensitivity {i + 1}/{n}: layer {l} {ROLES[r].upper()} {m0}: "
                          f"KLD {self.s[i]:.5f} ({time.perf_counter() - self.t0:.0f} s, "
                          f"ETA {format_duration(eta)})")
        self.uniform, self.role_uniform = {}, {r: {} for r in ROLES}
        for m in self.methods:
            roles = [r for r in ROLES if m in self.menu[r]]
            if m in ("fp16", "bf16"):
                self.uniform[m] = 0.0
                for r in roles:
                    self.role_uniform[r][m] = 0.0
                continue
            for r in roles:
                self.role_uniform[r][m] = self._uniform_kld(m, r)
            if m in KEY_ONLY:
                self.progress(f"[search] {m} (keys only): K only KLD {self.role_uniform['k'][m]:.5f}")
                continue
            self.uniform[m] = self._uniform_kld(m)
            self.progress(f"[search] uniform {m}: KLD {self.uniform[m]:.5f} (K only "
                          f"{self.role_uniform['k'][m]:.5f}, V only {self.role_uniform['v'][m]:.5f})")
        self.ring_kld = {}
        for w in self.rings:
            self.ring_kld[w] = 0.0 if w == 16 else self.obj.kld(self._kv([("fp16", "fp16")] * self.L, w))
            self.progress(f"[search] {w}-bit rings alone: KLD {self.ring_kld[w]:.5f}")
        self._set_rho()

    def _set_rho(self) -> None:
        """ρ per role and method from the one-role uniform KLDs; the cheapest method is 1."""
        self.rho = {}
        for r in ROLES:
            u = self.role_uniform[r]
            u0 = max(u[self.methods[0]], 1e-12)
            self.rho[r] = np.array([min(1.0, u[m] / u0) for m in self.menu[r]])
            self.rho[r][0] = 1.0

    def reuse(self, sensitivity: list, uniform: dict, role_uniform: dict, ring_kld: dict) -> None:
        """Take s, ρ and the rings' KLDs from an earlier search on the same calibration
        (another budget); ring_kld is keyed by the width as a string (JSON)."""
        self.s = np.array([x for pair in sensitivity for x in pair], dtype=float)
        self.uniform = {m: uniform[m] for m in self.menu["v"]}
        self.role_uniform = {r: {m: role_uniform[r][m] for m in self.menu[r]} for r in ROLES}
        self.ring_kld = {w: 0.0 if w == 16 else float(ring_kld[str(w)]) for w in self.rings}
        self._set_rho()
        self.progress(f"[search] sensitivity and uniform KLDs reused ({len(self.s)} slots)")

    def knapsack(self, ring: int | None = None) -> tuple | None:
        """Exact minimiser of the predicted loss under the budget (DP over byte units);
        with `ring` (a ring width's index) the rings are held at that width (None if it
        cannot fit)."""
        costs, n = self.costs, len(self.costs)
        cap = self.limit - self.b0
        if ring is not None and costs[-1][ring] > cap:
            return None
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
            for j in range(len(costs[i])):
                if ring is not None and i == 2 * self.L and j != ring:
                    continue
                c, gain = units[i][j], self.loss(i, 0) - self.loss(i, j)
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
                if i in keep:
                    continue
                c = self.costs[i]
                for j2 in range(len(c)):
                    saved = c[j] - c[j2]
                    if saved <= 0:
                        continue
                    dmg = (self.loss(i, j2) - self.loss(i, j)) / saved
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
                c = self.costs[i]
                for j2 in range(len(c)):
                    extra = c[j2] - c[j]
                    gain = self.loss(i, j) - self.loss(i, j2)
                    if 0 < extra <= slack and gain > 0 and gain / extra > best:
                        best, arg = gain / extra, (i, j2)
            if arg is None:
                return a
            a[arg[0]] = arg[1]

    def random_profile(self) -> tuple:
        """TaDA's random search: methods drawn uniformly per slot, then cut to the budget
        by random downgrades."""
        a = [self.rng.randrange(len(c)) for c in self.costs]
        while not self._fits(a):
            i = self.rng.choice([i for i, j in enumerate(a) if j > 0])
            a[i] = self.rng.randrange(a[i])
        return tuple(a)

    def perturb(self, a: tuple) -> tuple:
        a = list(a)
        n = len(a)
        moved = self.rng.sample(range(n), self.rng.randint(1, min(3, n)))
        for i in moved:
            a[i] = self.rng.choice([j for j in range(len(self.costs[i])) if j != a[i]] or [a[i]])
        a = self.repair(a, keep=set(moved))
        return tuple(self.fill(a, keep=set(moved)))

    def run(self) -> SearchResult:
        self.t0 = time.perf_counter()
        if not hasattr(self, "s"):
            self.sensitivity()
        self.evaluate(self.knapsack(), "knapsack start")
        # the rings' width moves 15 layers at once, where the additive model is least sure:
        # the best profile at each width is measured too, not only the one it ranks first
        for j, w in enumerate(self.rings if len(self.rings) > 1 else ()):
            a = self.knapsack(ring=j)
            if a is not None and a not in self.seen:
                self.evaluate(a, f"knapsack start, {w}-bit rings")
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
        nbytes = self._bytes(layers, self.ring_of(self.best))
        return SearchResult(layers, self.best_kld, nbytes, nbytes / self.fp16_bytes, self.limit,
                            dict(self.uniform), {r: dict(u) for r, u in self.role_uniform.items()},
                            [[float(self.s[2 * l]), float(self.s[2 * l + 1])] for l in range(self.L)],
                            self.ring_of(self.best), dict(self.ring_kld),
                            self.obj.evaluations, time.perf_counter() - self.t0)


KEY_FIT_TOKENS = 2048        # calibration tokens a key map is fitted on (fewer if the text is short)


def fit_key_maps(model, text: str, n_tokens: int = KEY_FIT_TOKENS) -> list[dict]:
    """Per arena layer the key transform (kv/key_map.py) fitted on the keys of one fp16
    prefill of the first n_tokens tokens of `text`."""
    ids = model.tokenize(text)[:n_tokens]
    if len(ids) < 64:
        raise KvrunError(f"--key-map: the calibration text has {len(ids)} tokens; a key map "
                         f"is fitted on up to {n_tokens} (at least 64)")
    cache = build_cache(model.cfg, len(ids), "fp16")
    with torch.inference_mode():
        model.transformer(torch.tensor([ids]), cache, last_only=True)
    arena = getattr(cache, "inner", cache)          # a model with rings: its arena beside them
    return [fit_key_map(arena.rows(l)[0]) for l in range(arena.L)]


def search(model, text: str, budget: float, ctx: int = 2048, trials: int = 16, seed: int = 0,
           bits=None, family: str = "kivi", windows: int = 2, prefix: int = 512,
           n_score: int = 32, base: KVConfig | None = None, progress=None,
           reuse=None, rings=None) -> SearchResult:
    """Search per-layer K/V methods for `model` on calibration `text` (see module docstring).
    `reuse`: a Profile written by an earlier search with the same model, calibration and
    settings; its sensitivity pass is reused (a second budget costs only the trials).
    `rings`: the ring widths to choose from on a model with sliding-window layers (default:
    the base config's ring if it sets one, else DEFAULT_RINGS). A base config with key maps
    (`fit_key_maps`) scores every rotated K slot through them."""
    if not 0 < budget <= 1:
        raise KvrunError(f"--budget must be in (0, 1] (a fraction of the fp16 cache), got {budget}")
    if ctx < 1:
        raise KvrunError(f"--ctx must be >= 1, got {ctx}")
    if trials < 0:
        raise KvrunError(f"--trials must be >= 0, got {trials}")
    base = base or KVConfig()
    methods = candidate_methods(family, bits)
    rings = ring_choices(model.cfg, base, rings)
    for m in methods:                      # geometry checks (V groups etc.) before any work
        check_kv(model.cfg, base.replace(k_method=m, v_method="fp16" if m in KEY_ONLY else m))
    s = Search(None, model.cfg, methods, budget, ctx, trials, seed, base, progress, rings)
    if reuse is not None:
        _check_reuse(reuse, model, text, methods, windows, prefix, n_score, base, rings)
        s.reuse(reuse.meta["sensitivity"], reuse.meta["uniform_kld"], reuse.meta["role_kld"],
                reuse.meta.get("ring_kld", {}))
    torch.manual_seed(seed)
    s.obj = Objective(model, text, windows, prefix, n_score, chunk=base.group)
    return s.run()


def _check_reuse(p, model, text, methods, windows, prefix, n_score, base, rings) -> None:
    from ..kv.profile import kv_settings, model_record, text_sha256
    cal = p.meta.get("calibration", {})
    want = {"sha256": text_sha256(text), "windows": windows, "prefix": prefix, "scored": n_score}
    unringed = lambda kv: {k: x for k, x in kv.items() if k != "ring"}  # the searched slot
    have = {int(w) for w in p.meta.get("ring_kld") or {} if str(w).isdigit()} | {16}
    why = None
    if p.model != model_record(model.cfg):
        why = "it was searched on another model"
    elif {k: cal.get(k) for k in want} != want:
        why = "its calibration text or windows differ"
    elif unringed(p.kv) != unringed(kv_settings(base)):
        why = "its KV settings (window, groups …) differ"
    elif bool(p.meta.get("search", {}).get("key_map")) != bool(base.rotation.key_maps):
        why = "one search fitted a key map (--key-map) and the other did not"
    elif not set(rings) <= have:
        why = (f"it did not measure the rings at {', '.join(map(str, sorted(set(rings) - have)))} "
               f"bits with the arena in fp16")
    elif not isinstance(p.meta.get("sensitivity"), list) or len(p.meta["sensitivity"]) != arena_layers(model.cfg):
        why = "it has no sensitivity table"
    elif not all((m in KEY_ONLY or m in p.meta.get("uniform_kld", {})) and
                 all(m in (p.meta.get("role_kld") or {}).get(r, {})
                     for r in (("k",) if m in KEY_ONLY else ROLES)) for m in methods):
        why = f"it did not measure all of {', '.join(methods)} on K and V apart"
    if why:
        raise KvrunError(f"--reuse {p.path}: cannot reuse its sensitivity pass: {why}")


def save_result(path, result: SearchResult, model, text: str, *, budget: float, ctx: int,
                family: str, bits, trials: int, seed: int, windows: int, prefix: int,
                n_score: int, base: KVConfig) -> None:
    from ..kv.profile import kv_settings, model_record, save_profile, text_sha256
    rings = {"ring_kld": {str(w): x for w, x in result.ring_kld.items()}} if result.ring_kld else {}
    maps = base.rotation.key_maps
    if maps:                                        # kept where the chosen K is rotated
        rotated = base.replace(layers=result.layers).k_rotated(len(result.layers))
        maps = [m if r else None for m, r in zip(maps, rotated)]
    save_profile(path, result.layers, model=model_record(model.cfg),
                 kv=kv_settings(base.replace(ring=result.ring)), key_maps=maps if maps and any(maps) else None,
                 ctx=ctx, budget=budget, bytes=result.bytes, bytes_ratio=round(result.ratio, 6),
                 kld=result.kld,
                 calibration={"sha256": text_sha256(text), "windows": windows, "prefix": prefix,
                              "scored": n_score},
                 search={"family": family, "bits": default_bits(family) if bits is None else list(bits),
                         "trials": trials, "seed": seed, "key_map": bool(base.rotation.key_maps),
                         "evaluations": result.evaluations, "seconds": round(result.seconds, 1)},
                 uniform_kld=result.uniform, role_kld=result.role_uniform,
                 sensitivity=result.sensitivity, **rings)
