"""The --kv* and --evict* flags, declared once in KV_FLAGS: each row gives a flag's name, where
its value goes (a KVConfig setting name, kv/config.py SETTINGS, or one of parse_kv's own
arguments), its click type, default and help. Both the click options (`kv_options`, `eviction_options`)
and the mapping of their values onto parse_kv (`kv_config`, `eviction_fields`) are generated
from it, so adding a flag is adding a row."""
from __future__ import annotations

from importlib import import_module
from typing import Callable, NamedTuple

import click

from ..errors import KvrunError

# destinations that are parse_kv's own arguments (the method spec, its K and V overrides, a
# profile), not KVConfig fields; an empty value there is an unset shell variable: an error
PARSE_ARGS = ("spec", "k", "v", "profile")


def _kv(module: str, name: str):
    """`name` from kvrun.kv.<module>, imported when asked: kvrun.kv loads torch, and the
    flags are declared when the CLI starts (`kvrun --help` must not wait for torch)."""
    return getattr(import_module(f"kvrun.kv.{module}"), name)


class LazyChoice(click.Choice):
    """A click.Choice over kvrun.kv.<module>.<name>, read when a command parses or shows
    its --help (_kv)."""

    def __init__(self, module: str, name: str):
        self._where, self.case_sensitive = (module, name), True

    @property
    def choices(self):
        return tuple(_kv(*self._where))


class LazyHelpOption(click.Option):
    """An option whose help text is a function, called when --help shows it (it names what
    kvrun.kv holds: _kv)."""

    def __init__(self, *a, help_fn: Callable[[], str], **kw):
        super().__init__(*a, **kw)
        self._help_fn = help_fn

    def get_help_record(self, ctx):
        self.help = self._help_fn()
        return super().get_help_record(ctx)


class Flag(NamedTuple):
    """One row of KV_FLAGS. `default` is click's, shown in --help when set; None leaves the
    flag unset, so parse_kv's or KVConfig's own default applies (the help text says which)."""
    flag: str               # the option's name, e.g. "--kv-group"
    dest: str | None        # a SETTINGS name or a PARSE_ARGS entry; None: the command reads it
    type: object            # click type: str, int, float, click.Choice(...), click.Path()
    default: object
    help: str | Callable[[], str]   # a function: computed when --help shows it
    evict: bool = False     # token eviction: also on the evaluations (ppl, needle, bench)

    @property
    def param(self) -> str:
        """The keyword click passes the value under: --kv-rotate-seed → kv_rotate_seed."""
        return self.flag.lstrip("-").replace("-", "_")


def shipped_profile_names() -> str:
    return ", ".join(p.stem for p in _kv("profile", "shipped_profiles")()) or "none installed"


def kv_help() -> str:
    return ("KV cache method for K and V: fp16, bf16, fp32, int8, kivi-2, kivi-4, tada-2/4/8, "
           "gear-l, gear, cb-2/3/4; or K/V like kivi-4/kivi-2 (kivi-3: keys only, e.g. kivi-3/cb-3); suffixes @N (groups of N), +rot "
           "(Hadamard rotation) and +ring4/8/16 (sliding-window ring width); auto (the "
           "per-layer profile shipped for the model in use; a model without one gets the "
           "generic default, rotated kivi-4, labelled 'auto (generic ...)': `kvrun search` "
           "tunes a profile for it); "
            f"profile:NAME (a shipped profile: {shipped_profile_names()}) or profile:FILE.")

KV_FLAGS = (
    #    flag               dest              type                        default
    Flag("--kv",            "spec",           str,                        "fp16", kv_help),
    Flag("--kv-k",          "k",              str,                        None,
         "Method for K only."),
    Flag("--kv-v",          "v",              str,                        None,
         "Method for V only."),
    Flag("--kv-residual",   "residual",       int,                        None,
         "Full-precision window R (default 128)."),
    Flag("--kv-group",      "group",          int,                        None,
         "Token group / flush block G (default 32)."),
    Flag("--kv-vgroup",     "v_group",        int,                        None,
         "Channels per V scale group g for per-token V (default 32)."),
    Flag("--kv-rank",       "rank",           int,                        None,
         "GEAR low-rank rank r (default 4)."),
    Flag("--kv-ring",       "ring",           int,                        None,
         "Bits of the sliding-window rings (Gemma 3; default: 4 when a method is below 8 bits)."),
    Flag("--kv-profile",    "profile",        click.Path(),               None,
         "Per-layer profile: a JSON file (kvrun search -o) or a shipped name."),
    Flag("--ctx-policy",    "ctx_policy",     LazyChoice("config", "CTX_POLICIES"), None,
         "When the context is full: error (default) or llama.cpp-style shift."),
    Flag("--keep",          "n_keep",         int,                        None,
         "Tokens kept at the start on a shift."),
    Flag("--kv-rotate",     "rotate",         LazyChoice("config", "ROTATE"), None,
         "Hadamard-rotate K and/or V along the head dim before quantizing."),
    Flag("--kv-rotate-seed", "rotate_seed",   int,                        None,
         "Random ±1 signs on the rotation (seeded)."),
    # token eviction (runtime/kv/evict.py), combinable with any --kv method; --evict is no
    # click.Choice: KVConfig checks it, with a one-line error
    Flag("--evict",         "evict",          str,                        None,
         lambda: f"Token-eviction policy: {', '.join(_kv('evict', 'POLICIES')[1:])} "
                 "(needs --kv-budget).", evict=True),
    Flag("--kv-budget",     "budget",         int,                        None,
         "Tokens kept per layer with --evict, window included (mean for pyramidkv).", evict=True),
    Flag("--sinks",         "sinks",          int,                        None,
         "streaming: first tokens kept (default 4).", evict=True),
    Flag("--snap-window",   "snap_window",    int,                        None,
         "snapkv/pyramidkv/kvcrush: observation queries (default 32).", evict=True),
    Flag("--crush-fraction", "crush_fraction", float,                     None,
         "kvcrush: budget share of representatives (default 0.25).", evict=True),
    Flag("--crush-anchor",  "crush_anchor",   LazyChoice("evict", "ANCHORS"), None,
         "kvcrush: Hamming anchor (default random).", evict=True),
    Flag("--evict-slack",   "evict_slack",    int,                        None,
         "Tail tokens freed beyond need at each compaction (default 0): fewer compactions "
         "(not with KIVI/GEAR keys, which re-pack one block per compaction).", evict=True),
    Flag("--evict-scores",  "evict_scores",   LazyChoice("config", "PROMPT_SCORES"), None,
         "snapkv/pyramidkv/kvcrush: a prompt's chunks attend and are scored over its exact "
         "K/V, held while it is prefilled (default), or over the compressed codes (no copy).",
         evict=True),
    # not a KVConfig field: load_model picks the whole configuration that fits
    Flag("--kv-budget-mb",  None,             float,                      None,
         "Pick the best shipped/searched KV configuration that fits this many MiB at -c "
         "tokens (overrides --kv)."),
)
EVICT_FLAGS = tuple(r for r in KV_FLAGS if r.evict)


def _declare(f, rows):
    """`f` with a click option per row. click lists an option declared later first, so the
    rows go on in table order, as the hand-written decorators did."""
    for r in rows:
        extra = {} if r.default is None else {"show_default": True}
        if callable(r.help):
            extra.update(cls=LazyHelpOption, help_fn=r.help)
        else:
            extra["help"] = r.help
        f = click.option(r.flag, type=r.type, default=r.default, **extra)(f)
    return f


def kv_options(f):
    """--kv and its refinements, eviction included: every row of KV_FLAGS. `kv_config` turns
    their values into one KVConfig."""
    return _declare(f, KV_FLAGS)


def eviction_options(f):
    """The token-eviction rows of KV_FLAGS alone (the evaluations take their own --kv list)."""
    return _declare(f, EVICT_FLAGS)


def eviction_fields(kw) -> dict:
    """KVConfig fields from the eviction flags in `kw` (consumed; unset ones omitted)."""
    got = {r.dest: kw.pop(r.param, None) for r in EVICT_FLAGS}
    return {f: x for f, x in got.items() if x is not None}


def kv_config(kw) -> "KVConfig":
    """A KVConfig from the KV_FLAGS values in `kw` (consumed; unset ones omitted, so
    parse_kv's and KVConfig's defaults apply)."""
    got = [(r, kw.pop(r.param, None)) for r in KV_FLAGS]
    for r, x in got:
        if r.dest in PARSE_ARGS and x is not None and not str(x).strip():
            raise KvrunError(f"{r.flag} is empty")    # an unset shell variable, not "default"
    return _kv("config", "parse_kv")(**{r.dest: x for r, x in got if r.dest is not None and x is not None})
