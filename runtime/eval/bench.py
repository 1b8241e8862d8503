"""`kvrun bench`: prompt-processing and token-generation speed at a depth, with KV bytes and
peak memory, for several cache methods side by side (llama-bench conventions).

Model mode: `pp N` = tok/s of an N-token prefill into a fresh cache of the method;
`tg N @ d` = tok/s and ms/token of N single-token decode steps with d tokens already in
the cache. Reaching depth d does not cost a prefill per method: the prompt is prefilled
once into an fp16 cache (or, with `--fill synthetic`, K/V are drawn per layer and channel
from the mean and spread measured on a short real prefill), and every method's cache is
filled from those K/V through its own write path (`ingest`), so all methods hold the
same tokens. Tests run interleaved (rep 1 of every method, then rep 2 …) with one warm-up
pass excluded, and report mean ± sd.

Layer mode (`--layer llama-3.1-70b` or `--layer H,HKV,D`): one attention layer of a named
geometry with random data, decoded autoregressively from 0 to `--ctx` tokens through the
real cache and read path, as in TaDA's Table 3: mean time per token and at checkpoints.
"""
from __future__ import annotations

import platform
import resource
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..errors import KvrunError
from ..files import atomic_output, check_writable
from ..kv.build import build_cache, fp16_bytes
from ..kv.layout import layer_windows

GEOMETRIES = {                      # (query heads, KV heads, head dim)
    "llama-2-7b": (32, 32, 128),
    "llama-3-8b": (32, 8, 128),
    "mistral-7b": (32, 8, 128),
    "llama-3.1-70b": (64, 8, 128),
    "smollm2-135m": (9, 3, 64),
}


@dataclass
class BenchRecord:
    method: str
    test: str                       # "pp" | "tg" | "layer"
    n: int                          # tokens processed per repetition
    depth: int                      # tokens in the cache before the test
    tok_s: float                    # mean over repetitions
    tok_s_sd: float
    ms_per_token: float             # mean over repetitions
    ms_per_token_median: float      # median single-step latency (tg / layer)
    kv_bytes: int                   # allocated KV bytes (all components)
    kv_bytes_by_component: dict
    kv_ratio: float                 # vs an fp16 cache of the same capacity
    peak_rss_bytes: int             # process peak RSS after this test
    reps: int
    fill: str = "model"             # how the depth was reached: model | synthetic | decode
    checkpoints_ms: dict = field(default_factory=dict)   # layer mode: ms/token near 1k, 8k, 32k
    cuda_max_allocated: int | None = None
    ms_per_token_sd: float = 0.0    # sd of ms/token over repetitions (the plot's error bars)
    # where it ran (llama-bench's model_filename, n_threads, backends, cpu_info)
    model: str = ""
    threads: int = 0
    backend: str = ""               # attention backend: native | triton | torch
    cpu: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


def parse_count(s: str) -> int:
    """'512' → 512, '4k' → 4096, '32K' → 32768."""
    t = s.strip().lower()
    try:
        return int(t[:-1]) * 1024 if t.endswith("k") else int(t)
    except ValueError:
        raise KvrunError(f"bad token count {s!r} (use e.g. 512, 4k, 32k)") from None


def parse_list(s: str, what: str) -> list[int]:
    items = [x for x in s.split(",") if x.strip()]
    if not items:
        raise KvrunError(f"{what}: empty list")
    out = [parse_count(x) for x in items]
    if any(x < 0 for x in out):
        raise KvrunError(f"{what}: values must be >= 0")
    return out


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def cpu_name() -> str:
    """The CPU's marketing name (/proc/cpuinfo "model name"), else what platform knows."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and value.strip():
                    return value.strip()
    except OSError:                       # not Linux
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def run_info(model: str) -> dict:
    """The BenchRecord fields that say where a run happened."""
    from kvrun.kernels.dispatch import select
    from kvrun.threads import governor
    # the cap (-t): the count in use at this instant is the governor's, lower on a busy machine
    return dict(model=model, threads=governor.cap, backend=select(), cpu=cpu_name())


def _stats(times: list[float], n: int) -> tuple[float, float, float, float]:
    """(mean tok/s, sd tok/s, mean ms/token, sd ms/token) of repetitions that each
    processed n tokens."""
    rates = [n / t for t in times]
    ms = [1e3 * t / n for t in times]
    two = len(times) > 1
    return (statistics.fmean(rates), statistics.stdev(rates) if two else 0.0,
            statistics.fmean(ms), statistics.stdev(ms) if two else 0.0)


# -- model mode ----------------------------------------------------------------------------------

def _capture_kv(model, ids: list[int], chunk: int):
    """Prefill `ids` into an fp16 cache; returns its K, V: (L, Hkv, n, D) fp16 each (a
    sliding layer's positions before its window zero: KVCache.all_rows)."""
    cache = build_cache(model.cfg, len(ids), "fp16")
    t = torch.tensor([ids])
    for s in range(0, len(ids), chunk):
        model.transformer(t[:, s:s + chunk], cache, last_only=True)
    return cache.all_rows(torch.float16)


def _synthetic_kv(model, depth: int, probe_ids: list[int], chunk: int, seed: int):
    """K/V for `depth` tokens drawn per (layer, head, channel) from a real prefill's statistics
    (over the probe's last tokens every layer holds: a sliding layer holds its window)."""
    k, v = _capture_kv(model, probe_ids, chunk)                      # (L, Hkv, p, D)
    held = min([w for w in layer_windows(model.cfg) if w] + [k.shape[2]])
    g = torch.Generator().manual_seed(seed)

    def draw(x):
        xf = x[:, :, -held:].float()
        mean, std = xf.mean(2, keepdim=True), xf.std(2, keepdim=True)  # (L, Hkv, 1, D)
        L, H, _, D = x.shape
        out = torch.empty(L, H, depth, D, dtype=torch.float16)
        for s in range(0, depth, 4096):                               # bounded fp32 scratch
            e = min(depth, s + 4096)
            out[:, :, s:e] = (mean + std * torch.randn(L, H, e - s, D, generator=g)).half()
        return out
    return draw(k), draw(v)


def _ingest(cache, k, v, n: int) -> None:
    """Fill an empty cache with the first n tokens of k, v: (L, Hkv, S, D)."""
    cache.reset()
    if n:
        cache.ingest(k[:, :, :n], v[:, :, :n])


def bench_model(model, methods: list, pp: list[int], tg: int, depths: list[int], reps: int,
                fill: str = "model", seed: int = 0, progress=None) -> list[BenchRecord]:
    """pp tests for each length in `pp`, then tg tests of `tg` tokens at each depth
    (`tg` = 0: none, as llama-bench's -n 0), every method side by side."""
    from ..kv.build import make_cache
    cfg, chunk = model.cfg, model.engine.prefill_chunk
    if reps < 1:
        raise KvrunError(f"-r must be >= 1 (got {reps})")
    if fill not in ("model", "synthetic"):
        raise KvrunError(f"--fill must be model or synthetic (got {fill!r})")
    if tg < 0:
        raise KvrunError(f"-n must be >= 0 (got {tg})")
    if not any(pp) and not tg:
        raise KvrunError("nothing to measure: -p and -n are both 0")
    g = torch.Generator().manual_seed(seed)
    vocab = cfg.vocab_size
    max_pp = max(pp) if pp else 0
    need = max([max_pp] + [d + tg for d in depths if tg])
    specs = methods
    methods = list(range(len(specs)))                 # KVConfigs are not hashable: use indices
    caches = {m: make_cache(cfg, max(need, 1), specs[m]) for m in methods}
    labels = {m: _label(specs[m]) for m in methods}
    ref_bytes = fp16_bytes(cfg, max(need, 1))           # Gemma: its rings included
    records: list[BenchRecord] = []
    where = run_info(model.path.name)

    def record(m, test, n, depth, times, step_ms, fill_kind):
        mean, sd, ms, ms_sd = _stats(times, n)
        parts = caches[m].nbytes()
        rec = BenchRecord(labels[m], test, n, depth, mean, sd, ms,
                          statistics.median(step_ms) if step_ms else ms,
                          sum(parts.values()), parts, sum(parts.values()) / ref_bytes,
                          peak_rss_bytes(), len(times), fill_kind, ms_per_token_sd=ms_sd, **where)
        records.append(rec)
        if progress:
            progress(f"[bench] {rec.method:<14} {test} {n} @ {depth}: {mean:8.2f} ± {sd:.2f} tok/s")

    # -- pp: prefill N random tokens into an empty cache --
    for n in pp:
        ids = torch.randint(0, vocab, (1, n), generator=g)
        times = {m: [] for m in methods}
        for rep in range(reps + 1):                                  # rep 0 is the warm-up
            for m in methods:
                cache = caches[m]
                cache.reset()
                t0 = time.perf_counter()
                for s in range(0, n, chunk):
                    model.transformer(ids[:, s:s + chunk], cache, last_only=True)
                if rep:
                    times[m].append(time.perf_counter() - t0)
        for m in methods:
            record(m, "pp", n, 0, times[m], [], "none")

    # -- tg: decode `tg` tokens with `depth` tokens already cached (-n 0: no tg tests) --
    for depth in depths if tg else []:
        if depth:
            if progress:
                progress(f"[bench] filling depth {depth} ({fill})")
            ids = torch.randint(0, vocab, (depth,), generator=g).tolist()
            if fill == "model":
                k, v = _capture_kv(model, ids, chunk)
            else:
                probe = ids[:min(depth, 512)]
                k, v = _synthetic_kv(model, depth, probe, chunk, seed)
        else:
            k = v = None
        steps = torch.randint(0, vocab, (tg,), generator=g).tolist()
        times = {m: [] for m in methods}
        step_ms = {m: [] for m in methods}
        for rep in range(reps + 1):
            for m in methods:
                cache = caches[m]
                _ingest(cache, k, v, depth)
                t_all = time.perf_counter()
                for tok in steps:
                    t0 = time.perf_counter()
                    model.transformer(torch.tensor([[tok]]), cache, last_only=True)
                    if rep:
                        step_ms[m].append(1e3 * (time.perf_counter() - t0))
                if rep:
                    times[m].append(time.perf_counter() - t_all)
        for m in methods:
            record(m, "tg", tg, depth, times[m], step_ms[m], fill if depth else "none")
        del k, v
    return records


def _label(m) -> str:
    return m if isinstance(m, str) else m.label()


# -- layer mode ----------------------------------------------------------------------------------

def parse_geometry(spec: str) -> tuple[str, tuple[int, int, int]]:
    if spec in GEOMETRIES:
        return spec, GEOMETRIES[spec]
    parts = spec.split(",")
    try:
        H, Hkv, D = (int(x) for x in parts)
    except ValueError:
        raise KvrunError(f"--layer {spec!r}: a name ({', '.join(GEOMETRIES)}) or H,HKV,D") from None
    if min(H, Hkv, D) < 1 or H % Hkv or D % 2:
        raise KvrunError(f"--layer {spec!r}: need H a multiple of HKV and an even D")
    return f"{H},{Hkv},{D}", (H, Hkv, D)


def bench_layer(geometry: str, methods: list, ctx: int, checkpoints=(1024, 8192, 32768),
                seed: int = 0, progress=None, dtype=torch.float32) -> list[BenchRecord]:
    """Decode one attention layer from 0 to ctx tokens per method (random q/k/v), through
    the step the model takes (`attend_new`: the fused window write where the cache's
    layer has one, else attend; random K counts as rotated there, so no RoPE is timed)."""
    from ..kv.build import make_cache
    from ..model.config import ModelConfig
    from ..kv.cache import NewKV
    from kvrun.kernels.rope import Rope
    name, (H, Hkv, D) = parse_geometry(geometry)
    if ctx < 1:
        raise KvrunError(f"--ctx must be >= 1 (got {ctx})")
    cfg = ModelConfig(architecture="llama", vocab_size=1, hidden_size=H * D, intermediate_size=1,
                      num_layers=1, num_heads=H, num_kv_heads=Hkv, head_dim=D, max_position=ctx)
    rope = Rope(D, cfg.rope_theta, cfg.rope_scaling, ctx)
    g = torch.Generator().manual_seed(seed)
    records = []
    window = 64                                   # steps averaged around each checkpoint
    for m in methods:
        cache = make_cache(cfg, ctx, m)
        step = []
        t_all = time.perf_counter()
        for i in range(ctx):
            q = torch.randn(1, H, 1, D, generator=g, dtype=dtype)
            k = torch.randn(1, Hkv, 1, D, generator=g, dtype=dtype)
            v = torch.randn(1, Hkv, 1, D, generator=g, dtype=dtype)
            t0 = time.perf_counter()
            cos, sin = rope.tables(cache.positions(1), dtype)
            cache.attend_new(0, q, NewKV(k, cos, sin, v=v, rotated=lambda k=k, v=v: (k, v)))
            cache.commit(1)
            step.append(time.perf_counter() - t0)
            if progress and (i + 1) % 4096 == 0:
                progress(f"[bench] {_label(m)} layer {name}: {i + 1}/{ctx} tokens")
        wall = time.perf_counter() - t_all
        cps = {str(c): 1e3 * statistics.fmean(step[max(0, c - window):c]) for c in checkpoints if c <= ctx}
        parts = cache.nbytes()
        total = sum(parts.values())
        mean_ms = 1e3 * statistics.fmean(step)
        records.append(BenchRecord(_label(m), "layer", ctx, 0, 1e3 / mean_ms, 0.0, mean_ms,
                                   1e3 * statistics.median(step), total, parts,
                                   total / fp16_bytes(cfg, ctx), peak_rss_bytes(), 1,
                                   "decode", cps, **run_info(f"layer {name}")))
        if progress:
            at = "".join(f", {v:.3f} ms at {k}" for k, v in cps.items())
            progress(f"[bench] {_label(m)} layer {name}: {mean_ms:.3f} ms/token mean{at} ({wall:.1f} s)")
        del cache
    return records


# -- output --------------------------------------------------------------------------------------

def format_table(records: list[BenchRecord], title: str = "") -> str:
    """A markdown table; layer-mode checkpoints (ms/token near 1k, 8k, 32k) are columns of
    their own, empty where a record's decode did not reach them."""
    w = max([16] + [len(r.method) for r in records])        # profile:NAME labels are long
    cps = sorted({k for r in records for k in r.checkpoints_ms}, key=int)
    head = (f"| {'kv':<{w}} | {'test':<14} | {'t/s':>18} | {'ms/tok':>8} | {'KV MiB':>9} | "
            f"{'ratio':>6} | {'peak RSS MiB':>12} |" + "".join(f" {'ms @' + k:>9} |" for k in cps))
    rows = [title] if title else []
    rows += [head, "|" + "|".join("-" * (len(c)) for c in head.split("|")[1:-1]) + "|"]
    for r in records:
        test = f"{r.test}{r.n}" + (f" @ d{r.depth}" if r.depth else "")
        if r.test == "layer":
            test = f"layer 0→{r.n}"
        rate = f"{r.tok_s:.2f} ± {r.tok_s_sd:.2f}"
        at = "".join(f" {r.checkpoints_ms[k]:9.3f} |" if k in r.checkpoints_ms else f" {'':>9} |"
                     for k in cps)
        rows.append(f"| {r.method:<{w}} | {test:<14} | {rate:>18} | {r.ms_per_token:8.2f} | "
                    f"{r.kv_bytes / 2**20:9.2f} | {r.kv_ratio:6.3f} | {r.peak_rss_bytes / 2**20:12.0f} |"
                    + at)
    return "\n".join(rows)


CSV_FIELDS = ["method", "test", "n", "depth", "tok_s", "tok_s_sd", "ms_per_token",
              "ms_per_token_sd", "ms_per_token_median", "kv_bytes", "kv_ratio", "peak_rss_bytes",
              "reps", "fill", "model", "threads", "backend", "cpu"]


def to_csv(records: list[BenchRecord]) -> str:
    import csv
    import io
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")         # quotes a CPU name with a comma in it
    w.writerow(CSV_FIELDS)
    for r in records:
        d = r.to_dict()
        w.writerow([f"{d[f]:.6g}" if isinstance(d[f], float) else d[f] for f in CSV_FIELDS])
    return buf.getvalue().rstrip("\n")


def plot_title(records: list[BenchRecord]) -> str:
    """Model, CPU, threads and backend of the run (the first record's: one run, one place)."""
    r = records[0]
    fill = {r.fill for r in records} - {"none"}
    return (f"{r.model} | {r.cpu} | {r.threads} thread{'s' if r.threads != 1 else ''} | {r.backend}"
            + (" | synthetic K/V" if fill == {"synthetic"} else ""))


# the formats matplotlib's savefig writes, by extension (it refuses any other, after the run)
PLOT_FORMATS = ("eps", "jpeg", "jpg", "pdf", "pgf", "png", "ps", "raw", "rgba", "svg", "svgz",
                "tif", "tiff", "webp")


def check_plot_path(path: str) -> None:
    """Before the run: `path` can take the plot (an image extension savefig writes, a
    writable place); KvrunError saying which otherwise."""
    ext = Path(path).suffix.lower().lstrip(".")
    if ext not in PLOT_FORMATS:
        raise KvrunError(f"-o {path}: the plot's format comes from its extension, one of "
                         f"{', '.join('.' + e for e in PLOT_FORMATS)} (e.g. bench.png)")
    check_writable(path)


def plot(records: list[BenchRecord], path: str) -> None:
    """ms per generated token for each method: against depth (lines, ± sd over repetitions),
    or one bar per method when there is a single depth. The y axis starts at 0 so bar
    heights and gaps compare as ratios."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise KvrunError("-o needs matplotlib: pip install 'kvrun[plot]'") from None
    tg = [r for r in records if r.test in ("tg", "layer")]
    if not tg:
        raise KvrunError("-o plots tg results: give -n >= 1 and at least one depth (-d)")
    methods = list(dict.fromkeys(r.method for r in tg))
    depths = sorted({r.depth for r in tg})
    fig, ax = plt.subplots(figsize=(8, 4.5))
    if len(depths) == 1:
        xs = range(len(methods))
        rs = [next(r for r in tg if r.method == m) for m in methods]
        bars = ax.bar(xs, [r.ms_per_token for r in rs], yerr=[r.ms_per_token_sd for r in rs],
                      capsize=4, color=[f"C{i}" for i in xs])
        # values inside the bars: above them they would collide with the error bars
        ax.bar_label(bars, fmt="%.1f", label_type="center", color="white", fontsize=9)
        ax.set_xticks(list(xs), methods, rotation=30 if len(methods) > 5 else 0, ha="center")
        what = (f"decode 0 → {tg[0].n} tokens" if tg[0].test == "layer"
                else f"tg{tg[0].n} at depth {depths[0]}")
        ax.set_xlabel(f"KV cache ({what})")
    else:
        for m in methods:
            rs = sorted((r for r in tg if r.method == m), key=lambda r: r.depth)
            ax.errorbar([r.depth for r in rs], [r.ms_per_token for r in rs],
                        yerr=[r.ms_per_token_sd for r in rs], marker="o", capsize=3, label=m)
        ax.set_xlabel(f"depth (tokens in cache), tg{tg[0].n}")
        ax.set_xlim(left=0)
        ax.legend()
    ax.set_ylim(bottom=0)
    ax.set_ylabel("ms / generated token (mean ± sd)")
    ax.set_title(plot_title(tg), fontsize=10)
    ax.grid(alpha=0.3, axis="y" if len(depths) == 1 else "both")
    fig.tight_layout()
    try:
        with atomic_output(path, suffix=Path(path).suffix) as tmp:
            fig.savefig(tmp, dpi=120)
    finally:
        plt.close(fig)
