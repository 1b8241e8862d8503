"""The evaluation commands: `kvrun ppl` (perplexity and KL divergence vs the fp16 cache),
`kvrun needle` (needle-in-a-haystack retrieval) and `kvrun bench` (speed and memory), each
over a comma list of KV methods. Registered on the main group by runtime/cli/main.py:
`main.add_command(ppl_cmd)` and so on."""
from __future__ import annotations

import importlib.util

import click

from .common import eprint
from .kv_flags import eviction_fields, eviction_options
from .options import (CommonFirstCommand, eval_model_options, partial_on_interrupt, print_records,
                      warn_ctx)
from ..errors import KvrunError, read_text_file

MAX_TRIALS = 1_000_000      # the needles are drawn up front: 10^21 of them exhausted memory
SEED = click.IntRange(0, (1 << 64) - 1)         # what torch and SamplingParams accept


def comma_list(s: str, flag: str) -> list[str]:
    """The stripped items of a comma list; an empty list or an empty item (`4k,,8k`, a
    trailing comma: usually a shell variable that expanded to nothing) is an error."""
    items = [x.strip() for x in s.split(",")]
    if not any(items):
        raise KvrunError(f"{flag}: empty list")
    if not all(items):
        raise KvrunError(f"{flag}: empty item in {s!r}")
    return items



MAX_BENCH_TOKENS = 1 << 20      # what `kvrun bench` allocates at most, in either mode
MAX_BATCH = 4096


def one_count(s: str, flag: str) -> int:
    """One token count (512, 4k) for a flag that takes a single value."""
    out = count_list(s, flag)
    if len(out) != 1:
        raise KvrunError(f"{flag} takes one value (got {s!r})")
    return out[0]


def check_bench_size(n: int, bytes_per_token: int, flag: str) -> None:
    """n tokens of `bytes_per_token` must fit the benchmark's limit and this machine."""
    from ..machine import memory_bytes
    if n > MAX_BENCH_TOKENS:
        raise KvrunError(f"{flag} {n} tokens is beyond what this benchmark allocates (1M)")
    mem = memory_bytes()
    if mem is not None and n * bytes_per_token > mem:
        raise KvrunError(f"{flag} {n}: its K/V need {n * bytes_per_token / 2**30:.1f} GiB, more "
                         f"than this machine's {mem / 2**30:.1f} GiB")


def count_list(s: str, flag: str) -> list[int]:
    """A comma list of token counts (512, 4k, 32k) for bench's -p, -d, --batch."""
    from ..eval.bench import parse_list
    return parse_list(",".join(comma_list(s, flag)), flag)


# -- commands ---------------------------------------------------------------------------

@click.command("ppl", cls=CommonFirstCommand)
@click.argument("file", type=click.Path())
@click.option("--kv", "kv_list", default="fp16", show_default=True,
              help="Comma list of KV methods; the fp16 baseline is always evaluated too.")
@click.option("--windows", default=None, type=int, help="Number of windows (default: all).")
@click.option("--chunk", default=32, show_default=True, type=int,
              help="Scored half fed in chunks of this many tokens (1 = strict decode order).")
@click.option("--json", "as_json", is_flag=True, help="Print records as JSON on stdout.")
@click.option("-c", "--ctx-size", "ctx", default=2048, show_default=True, type=int,
              help="Window size in tokens (first half context, second half scored).")
@eval_model_options
@eviction_options
def ppl_cmd(file, kv_list, windows, chunk, as_json, model, ctx, dtype, prefill_chunk, threads,
            **ev):
    """Perplexity and KL divergence vs the fp16 cache on a text FILE (llama-perplexity style)."""
    from ..engine.api import load
    from ..eval.ppl import format_table, perplexity
    text = read_text_file(file)
    methods = comma_list(kv_list, "--kv")
    evict = eviction_fields(ev)
    if evict:
        from ..kv.config import parse_kv
        parse_kv("fp16", **evict)               # bad eviction flags fail before loading
    m = load(model, dtype=dtype, ctx=8, prefill_chunk=prefill_chunk, threads=threads, progress=eprint)
    warn_ctx(m.cfg, ctx, "-c")
    with partial_on_interrupt(as_json, format_table):
        records = perplexity(m, text, ctx, methods, windows, chunk, progress=eprint, evict=evict)
    print_records(records, as_json, format_table)


@click.command("needle", cls=CommonFirstCommand)
@click.argument("file", type=click.Path())
@click.option("--kv", "kv_list", default="fp16", show_default=True,
              help="Comma list of KV methods (each combined with --evict when given).")
@click.option("-c", "--ctx-size", "ctx", default=2048, show_default=True, type=int,
              help="Prompt length in tokens (filler + needle + question).")
@click.option("--depths", default="0,0.25,0.5,0.75,1", show_default=True,
              help="Needle depths as fractions of the filler.")
@click.option("--trials", default=3, show_default=True, type=click.IntRange(1, MAX_TRIALS),
              help="Needles per depth.")
@click.option("--baseline/--no-baseline", default=True, show_default=True,
              help="Also run the full fp16 cache without eviction.")
@click.option("--json", "as_json", is_flag=True, help="Records as JSON on stdout.")
@eval_model_options
@click.option("-s", "--seed", default=0, show_default=True, type=SEED)
@eviction_options
def needle_cmd(file, kv_list, ctx, depths, trials, baseline, as_json, model, dtype, prefill_chunk,
           threads, seed, **ev):
    """Needle-in-a-haystack retrieval accuracy by depth, with FILE as the filler text."""
    from ..engine.api import load
    from ..kv.config import parse_kv
    from ..eval.needle import format_table, run_needle
    text = read_text_file(file)
    try:
        ds = [float(x) for x in comma_list(depths, "--depths")]
    except ValueError:
        raise KvrunError(f"--depths: expected comma-separated fractions, got {depths!r}") from None
    if any(not 0 <= d <= 1 for d in ds):
        raise KvrunError(f"--depths: fractions in [0, 1], got {depths!r}")
    evict = eviction_fields(ev)
    specs = {"fp16": "fp16"} if baseline else {}
    for m in comma_list(kv_list, "--kv"):
        spec = parse_kv(m, **evict)
        specs[spec.label()] = spec
    m = load(model, dtype=dtype, ctx=8, prefill_chunk=prefill_chunk, threads=threads, progress=eprint)
    warn_ctx(m.cfg, ctx, "-c")
    ref = parse_kv("fp16", **evict).label()     # each needle against fp16 under the same policy
    table = lambda rs: format_table(rs, ds, list(specs), ref)    # noqa: E731 (the whole grid)
    with partial_on_interrupt(as_json, table):
        records = run_needle(m, text, ctx, ds, specs, trials, seed=seed, progress=eprint)
    print_records(records, as_json, table)


@click.command("bench", cls=CommonFirstCommand)
@click.option("--kv", "kv_list", default="fp16,int8,kivi-2,kivi-4,tada-4,gear-l", show_default=True,
              help="Comma list of KV methods, measured side by side.")
@click.option("-p", "--n-prompt", "pp", default="512", show_default=True,
              help="Prompt lengths for pp tests (comma list; 0 = none).")
@click.option("-n", "--n-gen", "tg", default=128, show_default=True, type=int,
              help="Generated tokens per tg test.")
@click.option("-d", "--depth", "depths", default=None,
              help="Comma list of depths for tg tests, as llama-bench's -d (e.g. 512,4k,32k; "
                   "default 0); with --layer, the one decode length (default 32k).")
@click.option("--ctx", "ctx", default=None, hidden=True,       # -d's old name, one value
              help="The same as -d with one value.")
@click.option("-r", "--repetitions", "reps", default=3, show_default=True, type=int)
@click.option("--fill", default="model", show_default=True, type=click.Choice(["model", "synthetic"]),
              help="Reach the depth by a real prefill, or K/V drawn from measured statistics.")
@click.option("--layer", default=None, help="Attention-layer mode: a geometry name or H,HKV,D.")
@click.option("--json", "as_json", is_flag=True, help="Records as JSON on stdout.")
@click.option("--csv", "as_csv", is_flag=True, help="Records as CSV on stdout.")
@click.option("-o", "--plot", "plot_path", default=None, help="Save a ms/token-vs-depth plot (matplotlib).")
@eval_model_options
@click.option("-s", "--seed", default=0, show_default=True, type=SEED)
@click.option("--batch", "batch", default=None,
              help="Comma list of batch sizes (e.g. 1,4,16): B sequences, each on its own cache, "
                   "decoded together; aggregate tok/s and ms/token per sequence (model mode, one depth).")
@click.option("--kv-budget-mb", "budget_mb", default=None, type=float,
              help="With --batch: also each method at the largest batch whose caches fit this "
                   "many MiB (the seeds' throughput experiment).")
@eviction_options
def bench_cmd(model, kv_list, pp, tg, depths, ctx, reps, fill, layer, as_json, as_csv, plot_path,
          dtype, prefill_chunk, threads, seed, batch, budget_mb, **ev):
    """Measure pp/tg speed, KV bytes and peak memory for several KV methods side by side."""
    from ..eval import bench as B
    from ..kv.config import parse_kv
    depths = depth_flag(depths, ctx)
    methods = comma_list(kv_list, "--kv")
    evict = eviction_fields(ev)                 # applies to every method
    specs = [parse_kv(m, **evict) for m in methods]
    if tg < 0:
        raise KvrunError(f"-n must be >= 0 (got {tg})")
    if reps < 1:
        raise KvrunError(f"-r must be >= 1 (got {reps})")
    if plot_path is not None:
        if importlib.util.find_spec("matplotlib") is None:      # installed? (not imported yet)
            raise KvrunError("-o needs matplotlib: pip install 'kvrun[plot]'")
        B.check_plot_path(plot_path)            # before the run, not after minutes of it
    if threads is not None:
        from ..threads import configure
        configure(threads)
    if budget_mb is not None:
        from ..engine.scheduler import check_budget_mb
        check_budget_mb(budget_mb)
    if budget_mb is not None and batch is None:
        raise KvrunError("--kv-budget-mb goes with --batch (e.g. --batch 1,4 --kv-budget-mb 256)")
    if batch is not None:
        return _bench_batch(model, specs, batch, budget_mb, tg, depths, reps, fill, layer,
                               as_json, as_csv, plot_path, dtype, prefill_chunk, seed)
    if layer is not None:
        n = one_count(depths, "-d") if depths else 32768
        name, (h, hkv, d) = B.parse_geometry(layer)
        if h * d > MAX_BENCH_TOKENS:                     # a model dim no model has
            raise KvrunError(f"--layer {layer}: H x D = {h * d} is beyond what this benchmark "
                             f"allocates ({MAX_BENCH_TOKENS})")
        check_bench_size(n, 2 * hkv * d * 4, "-d")       # fp32 K and V of n tokens
        records = B.bench_layer(layer, specs, n, seed=seed, progress=eprint)
        title = f"attention layer {name}, decode 0 → {n} tokens, random q/k/v"
    else:
        from ..engine.api import load
        d = count_list(depths, "-d") if depths is not None else [0]
        pps = [x for x in count_list(pp, "-p") if x > 0]
        if not pps and not tg:
            raise KvrunError("nothing to measure: -p and -n are both 0")
        if not tg and plot_path:
            raise KvrunError("-o plots tg results: -n 0 runs none")
        if not tg and any(d):                   # llama-bench: -n 0 means no tg tests
            eprint("note: -n 0 runs no tg tests; -d only applies to them and is ignored")
        need = max([d_ + tg for d_ in d if tg] + pps)
        if need > MAX_BENCH_TOKENS:
            raise KvrunError(f"depth {need} tokens is beyond what this benchmark allocates (1M)")
        m = load(model, dtype=dtype, ctx=8, prefill_chunk=prefill_chunk, progress=eprint)
        warn_ctx(m.cfg, need, "a bench context of", "latency and memory figures are still valid")
        records = B.bench_model(m, specs, pps, tg, d, reps, fill=fill, seed=seed, progress=eprint)
        where = B.run_info(m.path.name)
        title = (f"{model_title(m)} | {where['cpu']} | dtype {dtype} | "
                 f"threads {where['threads']} | attention {where['backend']} | fill {fill}"
                 + (" (SYNTHETIC K/V: latency and memory only)" if fill == "synthetic" else ""))
    print_records(records, as_json, lambda rs: B.to_csv(rs) if as_csv else B.format_table(rs, title))
    if plot_path:
        B.plot(records, plot_path)
        eprint(f"wrote {plot_path}")


def model_title(m) -> str:
    """A bench table's model: its source file and how its weights are stored, so an int4
    and an fp32 conversion of the same GGUF are told apart."""
    from ..model.info import weight_format
    return f"{m.cfg.source.get('path', m.path.name)} | weights {weight_format(m.cfg)}"


def depth_flag(depths: str | None, ctx: str | None) -> str | None:
    """bench's -d, given as -d or as --ctx (its old name, one value; not both)."""
    if ctx is None:
        return depths
    if depths is not None:
        raise KvrunError("-d and --ctx are one setting (--ctx is -d's old name): give -d only")
    return str(one_count(ctx, "--ctx"))


def _bench_batch(model, specs, batch, budget_mb, tg, depths, reps, fill, layer, as_json,
                    as_csv, plot_path, dtype, prefill_chunk, seed):
    """`kvrun bench --batch` (runtime/eval/bench_batch.py)."""
    from ..eval import bench as B
    from ..engine.api import load
    from ..eval.bench_batch import bench_batch, format_batch_table
    if layer is not None or as_csv or plot_path:
        raise KvrunError("--batch runs in model mode with a table or --json (not --layer, --csv, -o)")
    batches = count_list(batch, "--batch")
    if max(batches) > MAX_BATCH:
        raise KvrunError(f"--batch: at most {MAX_BATCH} sequences (got {max(batches)})")
    d = count_list(depths, "-d") if depths is not None else [0]
    if len(d) != 1:
        raise KvrunError(f"--batch measures at one depth (got -d {depths})")
    m = load(model, dtype=dtype, ctx=8, prefill_chunk=prefill_chunk, progress=eprint)
    warn_ctx(m.cfg, d[0] + tg, "a bench context of", "latency and memory figures are still valid")
    records = bench_batch(m, specs, batches, tg, d[0], reps, budget_mb, fill=fill, seed=seed,
                          progress=eprint)
    where = B.run_info(m.path.name)
    title = (f"{model_title(m)} | {where['cpu']} | dtype {dtype} | "
             f"threads {where['threads']} | attention {where['backend']} | fill {fill} | batched decode")
    print_records(records, as_json, lambda rs: format_batch_table(rs, title))

