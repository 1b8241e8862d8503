"""What the `kvrun` commands share: the --help layout (CommonFirstCommand), the option
decorators for the model, sampling and --stop (the --kv* / --evict* flags are in kv_flags.py),
loading the model from those options, and the output helpers (stats line, result records,
partial results on Ctrl-C)."""
from __future__ import annotations

import json
import sys
from contextlib import contextmanager

import click

from .common import eprint, threads_option
from .kv_flags import kv_config, kv_options
from ..errors import KvrunError, PartialResults, as_utf8

COMMON_OPTIONS = ("-m", "-p", "-f", "-n", "-c", "--temp", "-s", "-t", "--kv")


class CommonFirstCommand(click.Command):
    """`--help` lists the options everyone reaches for (llama.cpp's -m -p -f -n -c --temp -s
    -t, and --kv) first, then the rest by long name (so --kv-*, --top-*, --crush-* sit
    together; the option helpers declare theirs in reverse), --help last. Parsing is
    untouched."""

    def format_options(self, ctx, formatter):
        rank = {o: i for i, o in enumerate(COMMON_OPTIONS)}
        common, other = [], []
        for p in self.get_params(ctx):
            # options only: click >= 8.2 gives an argument a row too (a bare "FILE" here);
            # the usage line and the docstring say what an argument is
            row = p.get_help_record(ctx) if isinstance(p, click.Option) else None
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


# -- model ------------------------------------------------------------------------------

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


def load_model(kw):
    """The model of `model_options` (consumed from `kw`), its cache built from the KV flags."""
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
    # no prefix cache across calls: generate prefills one prompt, chat's turns extend the cache
    m = load(kw["model"], dtype=kw["dtype"], ctx=kw["ctx"], kv=kv, prefill_chunk=kw["chunk"],
             threads=kw["threads"], progress=eprint, cache_ram_mb=0)
    warn_ctx(m.cfg, kw["ctx"], "-c")
    return m


def warn_ctx(cfg, n: int, what: str, consequence: str | None = None) -> None:
    """One `warning:` line when `n` tokens exceed the model's trained context (RoPE
    positions it never saw: quality degrades, as llama.cpp warns for n_ctx > n_ctx_train)."""
    if n > cfg.max_position:
        eprint(f"warning: {what} {n} exceeds the model's trained context ({cfg.max_position} "
               f"tokens): {consequence or f'text past {cfg.max_position} tokens may degrade'}")


# -- how many tokens --------------------------------------------------------------------

def n_predict_option(default: int, what: str):
    """-n/--n-predict as llama.cpp has it: -1 generates until EOS (or the context is full;
    with --ctx-policy shift, until EOS)."""
    return click.option("-n", "--n-predict", "n", default=default, show_default=True, type=int,
                        help=f"{what}; -1: until EOS or a full context (as llama.cpp).")


def check_n(n: int) -> None:
    """-n is -1 or >= 0 (checked before the model loads)."""
    if n < -1:
        raise KvrunError(f"-n must be >= 0, or -1 for until EOS (got {n})")


def max_tokens(n: int, m) -> int:
    """The token limit -n means for model `m`: n itself, or for -1 what the context allows
    (the engine stops there, finish reason "context"), unbounded when the context shifts."""
    if n != -1:
        return n
    return sys.maxsize if m.engine.can_shift else m.ctx


# -- sampling and stops -----------------------------------------------------------------

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


def stop_option(f):
    return click.option("--stop", "stop", multiple=True, metavar="STR",
                        help="Stop when the text contains STR (repeatable); STR is not printed. "
                             r"Escapes \n \t \\ are processed.")(f)


def stop_strings(stop) -> list[str]:
    """--stop values, escapes processed and validated (before the model loads)."""
    from ..engine.stops import check_stops, unescape
    return check_stops([unescape(as_utf8(s, "--stop", eprint)) for s in stop])


# -- output -----------------------------------------------------------------------------

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
