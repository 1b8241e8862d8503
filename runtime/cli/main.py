"""The `kvrun` command line (click). Generated text goes to stdout; progress and
statistics to stderr, so stdout pipes cleanly. Every error, usage errors included, is one
`error: …` line and exit status 1; Ctrl-C exits 130, SIGTERM/SIGHUP 128 + the signal (after
removing anything half-written), a closed pipe on stdout 141 silently; `--debug` shows
tracebacks."""
from __future__ import annotations

import json
import sys
from contextlib import contextmanager

import click

from .common import KvrunGroup, eprint, threads_option
from ..errors import KvrunError, PartialResults, as_utf8, read_text_file


@click.group(cls=KvrunGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--debug", is_flag=True, help="Show tracebacks on errors.")
@click.version_option("0.1.0", prog_name="kvrun")
def main(debug):
    """kvrun — LLM decoding with a compressed KV-cache arena."""


MAX_TRIALS = 1_000_000      # the needles are drawn up front: 10^21 of them exhausted memory
SEED = click.IntRange(0, (1 << 64) - 1)         # what torch and SamplingParams accept
COMMON_OPTIONS = ("-m", "-p", "-n", "-c", "--temp", "-s", "-t", "--kv")


class CommonFirstCommand(click.Command):
    """`--help` lists the options everyone reaches for (llama.cpp's -m -p -n -c --temp -s
    -t, and --kv) first, then the rest by long name (so --kv-*, --top-*, --crush-* sit
    together; the option helpers declare theirs in reverse), --help last. Parsing is
    untouched."""

    def format_options(self, ctx, formatter):
        rank = {o: i for i, o in enumerate(COMMON_OPTIONS)}
        common, other = [], []
        for p in self.get_params(ctx):
            row = p.get_help_record(ctx)
            if row is None:
                continue
            i = min((rank[o] for o in p.opts if o in rank), default=None)
            if i is not None:
                common.append((i, row))
            else:                                # --help last, the rest by long name
                last = "--help" in p.opts
                other.append(((last, max(p.opts, key=len).lstrip("-")), row))
        common.sort(key=lambda x: x[0])
        other.sort(key=lambda x: x[0])
        for title, rows in (("Common options", common), ("Other options", other)):
            if rows:
                with formatter.section(title):
                    formatter.write_dl([row for _, row in rows])


# -- shared options ---------------------------------------------------------------------

def model_options(f):
    f = click.option("-m", "--model", "model", default=None,
                     help="kvrun model directory, or a name from `kvrun pull --list` "
                          "(default: the embedded SmolLM2-135M-Instruct).")(f)
    f = click.option("-c", "--ctx-size", "ctx", default=4096, show_default=True, type=int,
                     help="KV cache size in tokens (allocated once).")(f)
    f = click.option("--dtype", default="auto", show_default=True,
                     type=click.Choice(["auto", "fp32", "fp16", "bf16"]),
                     help="Compute dtype; auto = fp32 prefill + fp16 decode weights.")(f)
    f = kv_options(f)
    f = click.option("-b", "--batch-size", "chunk", default=512, show_default=True, type=int,
                     help="Prefill chunk size in tokens.")(f)
    f = threads_option(f)
    return f


def eval_model_options(f):
    """-m, --dtype, -b and -t for the evaluations (ppl, needle, bench): the model is loaded
    once and each KV method gets its own cache, so no -c or --kv here."""
    f = threads_option(f)
    f = click.option("-b", "--batch-size", "prefill_chunk", default=512, show_default=True,
                     type=int, help="Prefill chunk size in tokens.")(f)
    f = click.option("--dtype", default="auto", show_default=True,
                     type=click.Choice(["auto", "fp32", "fp16", "bf16"]),
                     help="Compute dtype; auto = fp32 prefill + fp16 decode weights.")(f)
    return click.option("-m", "--model", "model", default=None,
                        help="Model directory or pullable name (default: embedded).")(f)


def shipped_profile_names() -> str:
    from ..kv.profile import shipped_profiles
    return ", ".join(p.stem for p in shipped_profiles()) or "none installed"


def kv_options(f):
    """--kv and its refinements; they build one KVConfig (see runtime/kv/config.py)."""
    f = click.option("--kv", default="fp16", show_default=True,
                     help="KV cache method for K and V: fp16, bf16, fp32, int8, kivi-2, kivi-4, "
                          "tada-2/4/8, gear-l, gear; or K/V like kivi-4/kivi-2; suffixes "
                          "@N (groups of N) and +rot (Hadamard rotation); auto (the per-layer "
                          "profile shipped for the model in use); profile:NAME (a shipped "
                          f"profile: {shipped_profile_names()}) or profile:FILE.")(f)
    f = click.option("--kv-k", default=None, help="Method for K only.")(f)
    f = click.option("--kv-v", default=None, help="Method for V only.")(f)
    f = click.option("--kv-residual", default=None, type=int, help="Full-precision window R (default 128).")(f)
    f = click.option("--kv-group", default=None, type=int, help="Token group / flush block G (default 32).")(f)
    f = click.option("--kv-vgroup", default=None, type=int,
                     help="Channels per V scale group g for per-token V (default 32).")(f)
    f = click.option("--kv-rank", default=None, type=int, help="GEAR low-rank rank r (default 4).")(f)
    f = click.option("--kv-profile", default=None, type=click.Path(),
                     help="Per-layer profile: a JSON file (kvrun search -o) or a shipped name.")(f)
    f = click.option("--ctx-policy", default=None, type=click.Choice(["error", "shift"]),
                     help="When the context is full: error (default) or llama.cpp-style shift.")(f)
    f = click.option("--keep", default=None, type=int, help="Tokens kept at the start on a shift.")(f)
    f = click.option("--kv-rotate", default=None, type=click.Choice(["none", "k", "v", "kv"]),
                     help="Hadamard-rotate K and/or V along the head dim before quantizing.")(f)
    f = click.option("--kv-rotate-seed", default=None, type=int,
                     help="Random ±1 signs on the rotation (seeded).")(f)
    f = eviction_options(f)
    f = click.option("--kv-budget-mb", default=None, type=float,
                     help="Pick the best shipped/searched KV configuration that fits this many MiB "
                          "at -c tokens (overrides --kv).")(f)
    return f


def eviction_options(f):
    """Token eviction (runtime/kv/evict.py); combinable with any --kv method."""
    from ..kv.evict import ANCHORS, POLICIES
    f = click.option("--evict", default=None,       # checked by KVConfig: a one-line error
                     help=f"Token-eviction policy: {', '.join(POLICIES[1:])} (needs --kv-budget).")(f)
    f = click.option("--kv-budget", default=None, type=int,
                     help="Tokens kept per layer with --evict, window included (mean for pyramidkv).")(f)
    f = click.option("--sinks", default=None, type=int, help="streaming: first tokens kept (default 4).")(f)
    f = click.option("--snap-window", default=None, type=int,
                     help="snapkv/pyramidkv/kvcrush: observation queries (default 32).")(f)
    f = click.option("--crush-fraction", default=None, type=float,
                     help="kvcrush: budget share of representatives (default 0.25).")(f)
    f = click.option("--crush-anchor", default=None, type=click.Choice(ANCHORS),
                     help="kvcrush: Hamming anchor (default random).")(f)
    f = click.option("--evict-slack", default=None, type=int,
                     help="Tail tokens freed beyond need at each compaction (default 0): fewer "
                          "compactions (not with KIVI/GEAR keys, which re-pack one block "
                          "per compaction).")(f)
    return f


EVICT_FLAGS = (("evict", "evict"), ("kv_budget", "budget"), ("sinks", "sinks"),
               ("snap_window", "snap_window"), ("crush_fraction", "crush_fraction"),
               ("crush_anchor", "crush_anchor"), ("evict_slack", "evict_slack"))


def eviction_fields(kw) -> dict:
    """KVConfig fields from the eviction flags in `kw` (consumed; unset ones omitted)."""
    got = {f: kw.pop(o, None) for o, f in EVICT_FLAGS}
    return {f: x for f, x in got.items() if x is not None}


def kv_config(kw, spec: str | None = None):
    """A KVConfig from the --kv flags in `kw` (consumed)."""
    from ..kv.config import parse_kv
    spec = kw.pop("kv") if spec is None else spec
    opts = {f: kw.pop(o) for o, f in (("kv_residual", "residual"), ("kv_group", "group"),
                                       ("kv_vgroup", "v_group"),
                                       ("kv_rank", "rank"), ("ctx_policy", "ctx_policy"),
                                       ("keep", "n_keep"), ("kv_rotate", "rotate"),
                                       ("kv_rotate_seed", "rotate_seed"))}
    k, v, profile = kw.pop("kv_k"), kw.pop("kv_v"), kw.pop("kv_profile")
    for flag, x in (("--kv", spec), ("--kv-k", k), ("--kv-v", v), ("--kv-profile", profile)):
        if x is not None and not str(x).strip():    # an unset shell variable, not "default"
            raise KvrunError(f"{flag} is empty")
    kw.pop("kv_budget_mb", None)
    opts = {f: x for f, x in opts.items() if x is not None} | eviction_fields(kw)
    return parse_kv(spec, k=k, v=v, profile=profile, **opts)


def sampling_options(f):
    f = click.option("-s", "--seed", default=None, type=int, help="RNG seed (same seed → same text).")(f)
    f = click.option("--temp", default=0.8, show_default=True, type=float, help="Temperature; 0 = greedy.")(f)
    f = click.option("--top-k", default=40, show_default=True, type=int)(f)
    f = click.option("--top-p", default=0.95, show_default=True, type=float)(f)
    f = click.option("--min-p", default=0.05, show_default=True, type=float)(f)
    f = click.option("--repeat-penalty", default=1.0, show_default=True, type=float)(f)
    f = click.option("--repeat-last-n", default=64, show_default=True, type=int)(f)
    return f


def sampling_kwargs(kw) -> dict:
    from ..engine.sampling import SamplingParams
    d = {k: kw.pop(k) for k in ("seed", "temp", "top_k", "top_p", "min_p",
                                "repeat_penalty", "repeat_last_n")}
    SamplingParams(**d)                         # validate flags before loading the model
    return d


def load_model(kw):
    from ..engine.api import load
    if kw["ctx"] < 1:
        raise KvrunError(f"-c/--ctx-size must be >= 1 (got {kw['ctx']})")
    budget = kw.get("kv_budget_mb")
    kv = kv_config(kw)
    if budget is not None:
        from ..model.loader import check_model_dir, load_config
        from ..engine.pull import resolve_model
        from ..kv.budget import fit_budget
        path = check_model_dir(resolve_model(kw["model"], progress=eprint))
        kv, why = fit_budget(load_config(path), kw["ctx"], budget,
                             **({} if isinstance(kv, str) else
                                {"residual": kv.residual, "group": kv.group}))
        eprint(f"[kv] {why}")
        kw["model"] = path
    m = load(kw["model"], dtype=kw["dtype"], ctx=kw["ctx"], kv=kv,
             prefill_chunk=kw["chunk"], threads=kw["threads"], progress=eprint)
    warn_ctx(m.cfg, kw["ctx"], "-c")
    return m


def warn_ctx(cfg, n: int, what: str, consequence: str | None = None) -> None:
    """One `warning:` line when `n` tokens exceed the model's trained context (RoPE
    positions it never saw: quality degrades, as llama.cpp warns for n_ctx > n_ctx_train)."""
    if n > cfg.max_position:
        eprint(f"warning: {what} {n} exceeds the model's trained context ({cfg.max_position} "
               f"tokens): {consequence or f'text past {cfg.max_position} tokens may degrade'}")


@contextmanager
def partial_on_interrupt(as_json: bool, render):
    """Ctrl-C during a long evaluation: print the records finished so far (PartialResults),
    say how much they cover, and exit 130 as any interrupt does."""
    try:
        yield
    except PartialResults as e:
        eprint(f"\ninterrupted: results over the first {e.done} of {e.total} {e.unit}")
        print_records(e.records, as_json, render)
        sys.exit(130)


def peak_rss_mb() -> float:
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def print_records(records, as_json: bool, render) -> None:
    """Result records on stdout: a JSON list of their dicts, or `render(records)` (a table)."""
    print(json.dumps([r.to_dict() for r in records], indent=2) if as_json else render(records))


def print_stats(t, m) -> None:
    """The stats line after `generate`: speeds, the KV method with its allocated bytes and
    their ratio to fp16 (the numbers of chat's /kv), and peak memory."""
    from ..kv.report import kv_summary
    rate = f"{t.gen_tok_s:.1f} tok/s" if t.decode_tokens else "no decode step"
    e = m.engine
    shifts = (f" | context shifted {e.n_shifts}x, {e.n_dropped} tokens dropped"
              if e.n_shifts else "")
    eprint(f"\n[prompt: {t.prompt_tokens} tok, {t.prompt_tok_s:.1f} tok/s | "
           f"generated: {t.gen_tokens} tok, {rate} | "
           f"{kv_summary(m).short()}{shifts} | peak RSS {peak_rss_mb():.0f} MB]")


def stop_option(f):
    return click.option("--stop", "stop", multiple=True, metavar="STR",
                        help="Stop when the text contains STR (repeatable); STR is not printed. "
                             r"Escapes \n \t \\ are processed.")(f)


def stop_strings(stop) -> list[str]:
    """--stop values, escapes processed and validated (before the model loads)."""
    from ..engine.stops import check_stops, unescape
    return check_stops([unescape(as_utf8(s, "--stop", eprint)) for s in stop])


STDIN_LIMIT = 64 << 20      # far beyond any context; `< /dev/zero` must not fill memory


def read_stdin() -> str:
    """All of stdin as text (at most STDIN_LIMIT bytes); bytes that are not UTF-8 become
    U+FFFD (see `as_utf8`)."""
    buf = getattr(sys.stdin, "buffer", None)
    data = buf.read(STDIN_LIMIT + 1) if buf is not None else sys.stdin.read(STDIN_LIMIT + 1)
    if len(data) > STDIN_LIMIT:
        raise KvrunError(f"the prompt on stdin is over {STDIN_LIMIT >> 20} MiB")
    return data.decode("utf-8", "surrogateescape") if isinstance(data, bytes) else data


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
    from ..kv.build import physical_memory
    if n > MAX_BENCH_TOKENS:
        raise KvrunError(f"{flag} {n} tokens is beyond what this benchmark allocates (1M)")
    mem = physical_memory()
    if mem is not None and n * bytes_per_token > mem:
        raise KvrunError(f"{flag} {n}: its K/V need {n * bytes_per_token / 2**30:.1f} GiB, more "
                         f"than this machine's {mem / 2**30:.1f} GiB")


def count_list(s: str, flag: str) -> list[int]:
    """A comma list of token counts (512, 4k, 32k) for bench's -p, -d, --batch."""
    from ..eval.bench import parse_list
    return parse_list(",".join(comma_list(s, flag)), flag)


# -- commands ---------------------------------------------------------------------------

@main.command(cls=CommonFirstCommand)
@click.option("-p", "--prompt", required=True, help="Prompt text, or - to read stdin.")
@click.option("-n", "--n-predict", "n", default=128, show_default=True, type=int,
              help="Tokens to generate.")
@click.option("--chat", "as_chat", is_flag=True, help="Wrap the prompt in the chat template.")
@model_options
@sampling_options
@stop_option
def generate(prompt, n, as_chat, stop, **kw):
    """Generate a continuation of PROMPT (streamed to stdout)."""
    if n < 0:
        raise KvrunError(f"-n must be >= 0 (got {n})")
    sampling = sampling_kwargs(kw)
    stop = stop_strings(stop)
    prompt = as_utf8(read_stdin() if prompt == "-" else prompt, "the prompt", eprint)
    m = load_model(kw)
    events = (m.chat_stream([{"role": "user", "content": prompt}], n, stop=stop, **sampling)
              if as_chat else m.stream(prompt, n, stop=stop, **sampling))
    last = None
    for ev in events:
        sys.stdout.write(ev.text)
        sys.stdout.flush()
        last = ev
    sys.stdout.write("\n")
    if last.finish_reason == "context":
        eprint("[stopped: context full]")
    print_stats(last.timings, m)


@main.command(cls=CommonFirstCommand)
@click.option("--system", default=None, help="System prompt.")
@click.option("-n", "--n-predict", "n", default=512, show_default=True, type=int,
              help="Max tokens per reply.")
@model_options
@sampling_options
@stop_option
def chat(system, n, stop, **kw):
    """Interactive chat (line editing and history on a terminal).

    Commands: /help, /kv (KV method, tokens held, bytes, ratio to fp16), /reset (/clear),
    /exit (/quit); //text sends a message starting with /; a line ending in \\ continues.
    Ctrl-C stops a reply, Ctrl-D exits. History: $KVRUN_HOME/chat_history
    (KVRUN_CHAT_HISTORY= keeps it in memory only)."""
    from .chat import run_chat
    if n < 0:                                   # else every message would fail on its own
        raise KvrunError(f"-n must be >= 0 (got {n})")
    sampling = sampling_kwargs(kw)
    stop = stop_strings(stop)
    if system is not None:
        system = as_utf8(system, "--system", eprint)
    m = load_model(kw)
    run_chat(m, system, n, sampling, stop, eprint)


@main.command()
@click.argument("model", required=False)
@click.option("--json", "as_json", is_flag=True,
              help="Machine-readable output: typed values (numbers, booleans, null).")
def info(model, as_json):
    """Show a model directory's architecture, sizes, dtype, source and template."""
    from ..model.info import model_facts, model_info
    from ..engine.pull import resolve_model
    path = resolve_model(model, progress=eprint)
    if as_json:                                 # typed values: numbers, booleans, null
        print(json.dumps(model_facts(path), indent=2))
    else:
        for k, v in model_info(path).items():
            print(f"{k:<22} {v}")


@main.command()
@click.argument("src")
@click.option("-o", "--out", "out", required=True, help="Output model directory.")
@click.option("--weights", default=None, type=click.Choice(["int8", "int4", "bf16", "fp16", "fp32"]),
              help="Weight format: int8 (per channel) / int4 (group-wise) weight-only "
                   "quantization with the embedding in int8, or a float dtype (= --dtype).")
@click.option("--group", default=32, show_default=True, type=click.Choice(["32", "64", "128"]),
              help="int4: input columns per scale/min group (32 repacks Q4_0/Q4_1 GGUF blocks exactly).")
@click.option("--dtype", default="bf16", show_default=True, type=click.Choice(["bf16", "fp16", "fp32"]),
              help="Float tensors' dtype (with --weights int8/int4: norms and biases).")
@click.option("--force", is_flag=True, help="Replace an existing output directory.")
@click.option("-v", "--verbose", is_flag=True, help="Print each quantized tensor's error.")
def convert(src, out, weights, group, dtype, force, verbose):
    """Convert an HF checkpoint folder or a GGUF file into a kvrun model directory.

    --force replaces OUT only if it is a kvrun model directory (what convert or pull wrote);
    any other directory, the current one or a parent of it is refused before any work."""
    from kvrun.convert import convert_any
    from ..progress import CountProgress
    # -v prints a line per tensor: a progress line would interleave with them
    progress = None if verbose else CountProgress("[convert]", "tensors")
    fmt = "float"
    if weights in ("int8", "int4"):
        fmt = weights
        src_kind = click.get_current_context().get_parameter_source("dtype")
        if src_kind == click.core.ParameterSource.DEFAULT:
            dtype = "fp32"          # norms/biases are tiny: keep them exact
    elif weights is not None:
        dtype = weights
    cfg = convert_any(src, out, dtype=dtype, progress=progress, overwrite=force,
                      weights=fmt, group=int(group), log=eprint if verbose else None)
    what = dtype if fmt == "float" else fmt + (f" group {cfg.weight_group}" if fmt == "int4" else "")
    eprint(f"wrote {out} ({cfg.architecture}, {cfg.num_layers} layers, {what})")


@main.command(cls=CommonFirstCommand)
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
def ppl(file, kv_list, windows, chunk, as_json, model, ctx, dtype, prefill_chunk, threads, **ev):
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


@main.command(cls=CommonFirstCommand)
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
def needle(file, kv_list, ctx, depths, trials, baseline, as_json, model, dtype, prefill_chunk,
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
    table = lambda rs: format_table(rs, ds, list(specs))    # noqa: E731 (the whole grid)
    with partial_on_interrupt(as_json, table):
        records = run_needle(m, text, ctx, ds, specs, trials, seed=seed, progress=eprint)
    print_records(records, as_json, table)


@main.command(cls=CommonFirstCommand)
@click.option("--kv", "kv_list", default="fp16,int8,kivi-2,kivi-4,tada-4,gear-l", show_default=True,
              help="Comma list of KV methods, measured side by side.")
@click.option("-p", "--n-prompt", "pp", default="512", show_default=True,
              help="Prompt lengths for pp tests (comma list; 0 = none).")
@click.option("-n", "--n-gen", "tg", default=128, show_default=True, type=int,
              help="Generated tokens per tg test.")
@click.option("-d", "--depth", "depths", default=None,
              help="Comma list of depths for tg tests (e.g. 512,4k,32k).")
@click.option("--ctx", "ctx", default=None,
              help="Depth for tg (model mode) or decode length (layer mode, default 32k).")
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
def bench(model, kv_list, pp, tg, depths, ctx, reps, fill, layer, as_json, as_csv, plot_path,
          dtype, prefill_chunk, threads, seed, batch, budget_mb, **ev):
    """Measure pp/tg speed, KV bytes and peak memory for several KV methods side by side."""
    from ..eval import bench as B
    from ..kv.config import parse_kv
    methods = comma_list(kv_list, "--kv")
    evict = eviction_fields(ev)                 # applies to every method
    specs = [parse_kv(m, **evict) for m in methods]
    if tg < 0:
        raise KvrunError(f"-n must be >= 0 (got {tg})")
    if reps < 1:
        raise KvrunError(f"-r must be >= 1 (got {reps})")
    if plot_path is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise KvrunError("-o needs matplotlib: pip install 'kvrun[plot]'") from None
        from ..files import check_writable
        check_writable(plot_path)               # before the run, not after minutes of it
    if threads is not None:
        from ..threads import configure
        configure(threads)
    if budget_mb is not None:
        from ..engine.scheduler import check_budget_mb
        check_budget_mb(budget_mb)
    if budget_mb is not None and batch is None:
        raise KvrunError("--kv-budget-mb goes with --batch (e.g. --batch 1,4 --kv-budget-mb 256)")
    if batch is not None:
        return bench_batch_cmd(model, specs, batch, budget_mb, tg, depths, ctx, reps, fill, layer,
                               as_json, as_csv, plot_path, dtype, prefill_chunk, seed)
    if layer is not None:
        n = one_count(ctx, "--ctx") if ctx else 32768
        name, (h, hkv, d) = B.parse_geometry(layer)
        if h * d > MAX_BENCH_TOKENS:                     # a model dim no model has
            raise KvrunError(f"--layer {layer}: H x D = {h * d} is beyond what this benchmark "
                             f"allocates ({MAX_BENCH_TOKENS})")
        check_bench_size(n, 2 * hkv * d * 4, "--ctx")    # fp32 K and V of n tokens
        records = B.bench_layer(layer, specs, n, seed=seed, progress=eprint)
        title = f"attention layer {name}, decode 0 → {n} tokens, random q/k/v"
    else:
        from ..engine.api import load
        d = count_list(depths, "-d") if depths is not None else ([one_count(ctx, "--ctx")] if ctx else [0])
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


def bench_batch_cmd(model, specs, batch, budget_mb, tg, depths, ctx, reps, fill, layer, as_json,
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
    d = count_list(depths, "-d") if depths is not None else ([one_count(ctx, "--ctx")] if ctx else [0])
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


@main.command()
@click.argument("name", required=False)
@click.option("--weights", default=None, type=click.Choice(["int4", "int8", "fp32"]),
              help="Weight format to convert to (default: the model's; SmolLM2: int4, its Q4_1 "
                   "blocks repacked; Gemma 3: int8; fp32: exact dequantized weights).")
@click.option("--list", "as_list", is_flag=True, help="List the models that can be pulled.")
def pull(name, weights, as_list):
    """Fetch and convert a model (default: SmolLM2-135M-Instruct); print its directory.

    NAME is one of `kvrun pull --list`; `-m NAME` pulls on first use as well. The directory
    printed on stdout is what `-m` takes, e.g.
    `kvrun generate -m "$(kvrun pull --weights fp32)" -p ...`."""
    from ..engine import pull as P
    if as_list:
        for entry in P.REGISTRY.values():
            have = [w for w in entry.model_names if (P.model_dir(entry.name, None, w) / "config.json").is_file()]
            mark = " (default)" if entry.name == P.DEFAULT_MODEL else ""
            print(f"{entry.name:<14} {entry.description}{mark}")
            print(f"{'':<14} weights {', '.join(entry.model_names)} (default {entry.default_weights}); "
                  f"converted: {', '.join(have) or 'none'}")
        return
    if name is None or name == P.DEFAULT_MODEL:
        path = P.ensure_default_model(progress=eprint, weights=weights or P.DEFAULT_WEIGHTS)
    else:
        path = P.ensure_model(name, progress=eprint, weights=weights)
    print(path)


from .search import search_cmd  # noqa: E402  (a command module of its own)

main.add_command(search_cmd)

from .serve import serve_cmd  # noqa: E402

main.add_command(serve_cmd)
KvrunGroup.own_signals.add(serve_cmd)       # its server shuts down on its own terms

if __name__ == "__main__":
    main()
