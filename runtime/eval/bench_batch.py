"""`kvrun bench --batch`: batched decoding throughput (runtime/engine/batch.py), and the seeds'
throughput experiment (KIVI §4.3, GEAR §5.3: a fixed memory budget, the largest batch
each KV method fits, and the throughput there).

`tg N @ d, batch B`: B sequences, each with its own cache of the method holding d tokens,
decode N steps together (one `batch_forward` per step). A repetition's step time is the
median of its N steps (a stall of the machine does not count as decoding speed); the
aggregate tok/s = B / step time, the per-sequence ms/token = step time (what each
sequence's reader sees). As in `kvrun bench`,
the depth is reached without a prefill per cache: one fp16 prefill of random tokens (or
synthetic K/V), ingested into every cache through its own write path; each row then feeds
its own random tokens. Repetitions run interleaved (rep 1 of every method and batch, then
rep 2 …) after one warm-up pass, reported as mean ± sd.

Budget (`--kv-budget-mb M`): a sequence's cache holds d + N tokens; its bytes come from the
codec formulas (`kv_bytes_at`, window and metadata included) before anything is allocated,
so the largest batch is floor(M / bytes per sequence), which is what `kvrun serve
--kv-budget-mb M` admits for such requests. Each method is then measured at that batch.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch

from .bench import _capture_kv, _label, _synthetic_kv, run_info
from ..errors import KvrunError

MiB = 1 << 20
MAX_BUDGET_BATCH = 256              # a budget that fits more sequences is measured at this many


@dataclass
class BatchRecord:
    method: str
    batch: int                      # sequences decoded together
    n: int                          # steps per repetition
    depth: int                      # tokens in each cache before the test
    tok_s: float                    # aggregate: batch * n / time, mean over repetitions
    tok_s_sd: float
    ms_per_token: float             # per sequence: time / n, mean over repetitions
    kv_bytes_per_seq: int           # one sequence's cache (all components)
    kv_bytes: int                   # all the batch's caches
    budget_bytes: int | None = None     # set on the budget experiment's records
    reps: int = 0
    model: str = ""
    threads: int = 0
    backend: str = ""
    cpu: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


def max_batch(cfg, spec, n_tokens: int, budget_bytes: int) -> tuple[int, int]:
    """(sequences of n_tokens that fit the budget, bytes per sequence), without allocating."""
    from ..kv.build import kv_bytes_at
    per = sum(kv_bytes_at(cfg, spec, n_tokens).values())
    return min(budget_bytes // per, MAX_BUDGET_BATCH), per


def bench_batch(model, specs: list, batches: list[int], tg: int, depth: int, reps: int,
                budget_mb: float | None = None, fill: str = "model", seed: int = 0,
                progress=None) -> list[BatchRecord]:
    """tg tests of `tg` steps at `depth` for every method and batch size; with `budget_mb`,
    also each method at the largest batch that fits the budget (records with budget_bytes)."""
    from ..kv.build import make_cache
    from ..engine.batch import batch_forward
    cfg, chunk = model.cfg, model.engine.prefill_chunk
    if reps < 1:
        raise KvrunError(f"-r must be >= 1 (got {reps})")
    if tg < 1:
        raise KvrunError(f"--batch measures token generation: -n must be >= 1 (got {tg})")
    if any(b < 1 for b in batches):
        raise KvrunError(f"--batch: batch sizes must be >= 1 (got {batches})")
    if budget_mb is not None and budget_mb <= 0:
        raise KvrunError(f"--kv-budget-mb must be > 0 (got {budget_mb})")
    n_ctx = depth + tg
    tests = [(m, b, None) for m in range(len(specs)) for b in batches]     # (method, batch, budget)
    if budget_mb is not None:
        budget = int(budget_mb * MiB)
        for m, spec in enumerate(specs):
            b, per = max_batch(cfg, spec, n_ctx, budget)
            if progress:
                progress(f"[bench] {_label(spec)}: {per / MiB:.2f} MiB per sequence of {n_ctx} "
                         f"tokens, {b} fit in {budget_mb:g} MiB")
            if b < 1:
                raise KvrunError(f"--kv-budget-mb {budget_mb:g}: not one {_label(spec)} sequence of "
                                 f"{n_ctx} tokens fits ({per / MiB:.2f} MiB each)")
            tests.append((m, b, budget))
    g = torch.Generator().manual_seed(seed)
    k = v = None
    if depth:
        if progress:
            progress(f"[bench] filling depth {depth} ({fill})")
        ids = torch.randint(0, cfg.vocab_size, (depth,), generator=g).tolist()
        k, v = (_capture_kv(model, ids, chunk) if fill == "model" else
                _synthetic_kv(model, depth, ids[:min(depth, 512)], chunk, seed))
    steps = torch.randint(0, cfg.vocab_size, (tg, max(b for _, b, _ in tests)), generator=g)
    times: dict = {t: [] for t in tests}
    where = run_info(model.path.name)
    records = []
    for rep in range(reps + 1):                                  # rep 0 is the warm-up
        for t in tests:
            m, B, _ = t
            caches = [make_cache(cfg, n_ctx, specs[m]) for _ in range(B)]
            for c in caches:
                if depth:
                    c.ingest(k[:, :, :depth], v[:, :, :depth])
            step = []
            for i in range(tg):
                t0 = time.perf_counter()
                batch_forward(model.transformer, steps[i, :B].tolist(), caches)
                step.append(time.perf_counter() - t0)
            if rep:
                times[t].append(statistics.median(step))
            if rep == reps:                                      # the last pass: record
                per = sum(caches[0].nbytes().values())
                rates = [B / x for x in times[t]]
                rec = BatchRecord(_label(specs[m]), B, tg, depth, statistics.fmean(rates),
                                  statistics.stdev(rates) if reps > 1 else 0.0,
                                  1e3 * statistics.fmean(times[t]), per, per * B,
                                  t[2], reps, **where)
                records.append(rec)
                if progress:
                    progress(f"[bench] {rec.method:<14} tg{tg} @ d{depth} batch {B}: "
                             f"{rec.tok_s:8.2f} tok/s, {rec.ms_per_token:.1f} ms/token per sequence")
            del caches
    return records


def format_batch_table(records: list[BatchRecord], title: str = "") -> str:
    w = max([8] + [len(r.method) for r in records])
    rows = [title] if title else []
    plain = [r for r in records if r.budget_bytes is None]
    if plain:
        head = (f"| {'kv':<{w}} | {'test':<12} | {'batch':>5} | {'aggregate t/s':>18} | "
                f"{'ms/tok/seq':>10} | {'KV MiB/seq':>10} | {'vs batch 1':>10} |")
        rows += [head, _rule(head)]
        for r in plain:
            one = next((x for x in plain if x.method == r.method and x.batch == 1), None)
            gain = f"{r.tok_s / one.tok_s:9.2f}x" if one else f"{'':>10}"
            rows.append(f"| {r.method:<{w}} | {_test(r):<12} | {r.batch:>5} | "
                        f"{r.tok_s:8.2f} ± {r.tok_s_sd:7.2f} | {r.ms_per_token:10.1f} | "
                        f"{r.kv_bytes_per_seq / MiB:10.2f} | {gain} |")
    fit = [r for r in records if r.budget_bytes is not None]
    if fit:
        ref = next((x for x in fit if x.method == "fp16"), None)
        head = (f"| {'kv':<{w}} | {'budget MiB':>10} | {'MiB/seq':>8} | {'max batch':>9} | "
                f"{'vs fp16':>7} | {'aggregate t/s':>18} | {'vs fp16':>7} |")
        rows += (["", f"largest batch within the KV budget ({_test(fit[0])} per sequence)"]
                 if plain else []) + [head, _rule(head)]
        for r in fit:
            b_gain = f"{r.batch / ref.batch:6.2f}x" if ref else f"{'':>7}"
            t_gain = f"{r.tok_s / ref.tok_s:6.2f}x" if ref else f"{'':>7}"
            rows.append(f"| {r.method:<{w}} | {r.budget_bytes / MiB:10.0f} | "
                        f"{r.kv_bytes_per_seq / MiB:8.2f} | {r.batch:>9} | {b_gain} | "
                        f"{r.tok_s:8.2f} ± {r.tok_s_sd:7.2f} | {t_gain} |")
    return "\n".join(rows)


def _test(r: BatchRecord) -> str:
    return f"tg{r.n}" + (f" @ d{r.depth}" if r.depth else "")


def _rule(head: str) -> str:
    return "|" + "|".join("-" * len(c) for c in head.split("|")[1:-1]) + "|"
