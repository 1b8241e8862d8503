"""The `kvrun` command line (click). Generated text goes to stdout; progress and
statistics to stderr, so stdout pipes cleanly. Every error, usage errors included, is one
`error: …` line and exit status 1; Ctrl-C exits 130, SIGTERM/SIGHUP 128 + the signal (after
removing anything half-written), a closed pipe on stdout 141 silently; `--debug` shows
tracebacks.

This file holds the group and the small commands (generate, chat, info, convert, pull); the
evaluations (ppl, needle, bench) are in evaluate.py, search in search.py, serve in serve.py,
all registered at the bottom. Shared options and helpers: options.py; the --kv* / --evict*
flags: kv_flags.py."""
from __future__ import annotations

import json
import sys

import click

from .common import KvrunGroup, eprint
from .options import (CommonFirstCommand, check_n, load_model, max_tokens, model_options,
                      n_predict_option, print_stats, sampling_kwargs, sampling_options,
                      stop_option, stop_strings)
from ..errors import KvrunError, as_utf8, read_text_file
from ..files import check_writable


@click.group(cls=KvrunGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--debug", is_flag=True, help="Show tracebacks on errors.")
@click.version_option("0.1.0", prog_name="kvrun")
def main(debug):
    """kvrun — LLM decoding with a compressed KV-cache arena."""


STDIN_LIMIT = 64 << 20      # far beyond any context; `< /dev/zero` must not fill memory


def read_stdin() -> str:
    """All of stdin as text (at most STDIN_LIMIT bytes); bytes that are not UTF-8 become
    U+FFFD (see `as_utf8`)."""
    buf = getattr(sys.stdin, "buffer", None)
    data = buf.read(STDIN_LIMIT + 1) if buf is not None else sys.stdin.read(STDIN_LIMIT + 1)
    if len(data) > STDIN_LIMIT:
        raise KvrunError(f"the prompt on stdin is over {STDIN_LIMIT >> 20} MiB")
    return data.decode("utf-8", "surrogateescape") if isinstance(data, bytes) else data


def read_prompt(prompt: str | None, file: str | None) -> str:
    """The prompt of -p TEXT or -f FILE (llama.cpp's flags; `-` for either reads stdin):
    exactly one of them."""
    if (prompt is None) == (file is None):
        raise click.UsageError("give the prompt with -p TEXT or -f FILE (one of them; - reads "
                               "stdin)", click.get_current_context(silent=True))
    if prompt == "-" or file == "-":
        return read_stdin()
    if prompt is not None:
        return prompt
    from pathlib import Path
    if Path(file).is_file() and Path(file).stat().st_size > STDIN_LIMIT:
        raise KvrunError(f"{file}: the prompt file is over {STDIN_LIMIT >> 20} MiB")
    return read_text_file(file)


# -- commands ---------------------------------------------------------------------------

@main.command(cls=CommonFirstCommand)
@click.option("-p", "--prompt", default=None, help="Prompt text, or - to read stdin.")
@click.option("-f", "--file", "prompt_file", default=None, metavar="FILE",
              help="Read the prompt from FILE (UTF-8 text; - reads stdin).")
@n_predict_option(128, "Tokens to generate")
@click.option("--chat", "as_chat", is_flag=True, help="Wrap the prompt in the chat template.")
@model_options
@sampling_options
@stop_option
def generate(prompt, prompt_file, n, as_chat, stop, **kw):
    """Generate a continuation of the prompt (-p TEXT or -f FILE), streamed to stdout."""
    check_n(n)
    sampling = sampling_kwargs(kw)
    stop = stop_strings(stop)
    prompt = as_utf8(read_prompt(prompt, prompt_file), "the prompt", eprint)
    m = load_model(kw)
    n = max_tokens(n, m)
    events = (m.chat_stream([{"role": "user", "content": prompt}], n, stop=stop, **sampling)
              if as_chat else m.stream(prompt, n, stop=stop, **sampling))
    last = None
    for ev in events:
        sys.stdout.write(ev.text)
        sys.stdout.flush()
        last = ev
    # stdout is the generated text exactly (`> out.txt`), at EOS, a --stop string or -n alike;
    # the stats line on stderr starts on a line of its own
    if last.finish_reason == "context":
        eprint("\n[stopped: context full]", end="")       # print_stats ends the line
    print_stats(last.timings, m)


@main.command(cls=CommonFirstCommand)
@click.option("--system", default=None, help="System prompt.")
@n_predict_option(512, "Max tokens per reply")
@click.option("--session", "session_file", default=None, metavar="FILE",
              help="Continue the conversation saved in FILE (if it exists) and save it there "
                   "after every turn (docs/serve.md, sessions).")
@model_options
@sampling_options
@stop_option
def chat(system, n, stop, session_file, **kw):
    """Interactive chat (line editing and history on a terminal).

    Commands: /help, /kv (KV method, tokens held, bytes, ratio to fp16), /reset (/clear),
    /exit (/quit); //text sends a message starting with /; a line ending in \\ continues.
    Ctrl-C stops a reply, Ctrl-D exits. History: $KVRUN_HOME/chat_history
    (KVRUN_CHAT_HISTORY= keeps it in memory only). --session FILE: the conversation's KV
    cache survives a restart (same model and --kv)."""
    from .chat import run_chat
    check_n(n)                                  # else every message would fail on its own
    sampling = sampling_kwargs(kw)
    stop = stop_strings(stop)
    if system is not None:
        system = as_utf8(system, "--system", eprint)
    if session_file is not None:
        check_writable(session_file)            # before the model loads, not after a turn
    m = load_model(kw)
    run_chat(m, system, max_tokens(n, m), sampling, stop, eprint, session_file)


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
                   "quantization with the embedding in int8, or a float dtype (= --dtype). "
                   "Default: a GGUF's own bits (int4 for Q4_0/Q4_1/Q4_K, int8 for Q5/Q6/Q8, "
                   "float for F16/F32 linears), float for an HF folder.")
@click.option("--group", default=32, show_default=True, type=click.Choice(["32", "64", "128"]),
              help="int4: input columns per scale/min group (32 repacks Q4_0/Q4_1/Q4_K GGUF blocks).")
@click.option("--dtype", default="bf16", type=click.Choice(["bf16", "fp16", "fp32"]),
              help="Float tensors' dtype (with int8/int4 weights: norms and biases). Default: "
                   "bf16, or fp32 beside int8/int4 weights.")
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
    fmt = None                  # the source's own: a GGUF's bits, float for an HF folder
    if click.get_current_context().get_parameter_source("dtype") == click.core.ParameterSource.DEFAULT:
        dtype = None            # the format's: fp32 norms beside int8/int4, else bf16
    if weights in ("int8", "int4"):
        fmt = weights
    elif weights is not None:
        fmt, dtype = "float", weights
    from kvrun.convert.writer import DestinationNotEmpty
    try:
        cfg = convert_any(src, out, dtype=dtype, progress=progress, overwrite=force,
                          weights=fmt, group=int(group), log=eprint if verbose else None)
    except DestinationNotEmpty as e:            # the library's words are overwrite=True
        raise DestinationNotEmpty(e.dest, "--force replaces it") from None
    what = cfg.torch_dtype if cfg.weights == "float" else \
        cfg.weights + (f" group {cfg.weight_group}" if cfg.weights == "int4" else "")
    eprint(f"wrote {out} ({cfg.architecture}, {cfg.num_layers} layers, {what})")


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


from .evaluate import bench_cmd, needle_cmd, ppl_cmd  # noqa: E402  (commands of their own modules)
from .search import search_cmd  # noqa: E402
from .serve import serve_cmd  # noqa: E402

main.add_command(ppl_cmd)
main.add_command(needle_cmd)
main.add_command(bench_cmd)
main.add_command(search_cmd)
main.add_command(serve_cmd)
KvrunGroup.own_signals.add(serve_cmd)       # its server shuts down on its own terms

if __name__ == "__main__":
    main()
