"""`kvrun search`: the per-layer KV precision search as a command (see runtime/eval/search.py).
Registered on the main group by runtime/cli/main.py: `main.add_command(search_cmd)`."""
from __future__ import annotations

import click

from .common import eprint, threads_option
from ..errors import KvrunError, read_text_file
from ..files import check_writable


def _bits(s: str | None, flag: str = "--bits", like: str = "2,4,8") -> list[int] | None:
    if s is None:
        return None
    try:
        items = [x.strip() for x in s.split(",")]
        if not all(items):
            raise ValueError
        return [int(x) for x in items]
    except ValueError:
        raise KvrunError(f"{flag} must be a comma list of integers like {like}, got {s!r}") from None


@click.command("search")
@click.option("-m", "--model", "model", default=None, help="Model directory (default: embedded).")
@click.option("--calib", required=True, type=click.Path(),
              help="Calibration text file (use text that is NOT your evaluation text).")
@click.option("--budget", required=True, type=float,
              help="Total KV bytes as a fraction of the fp16 cache at --ctx (window included).")
@click.option("-o", "--out", "out", required=True, type=click.Path(),
              help="Profile JSON to write (put it in $KVRUN_HOME/profiles/ for --kv-budget-mb).")
@click.option("-c", "--ctx", "ctx", default=2048, show_default=True, type=int,
              help="Context length the budget is stated at (smaller contexts pay more for the window).")
@click.option("--trials", default=16, show_default=True, type=int,
              help="Random-search trials after the sensitivity pass and the knapsack start.")
@click.option("-s", "--seed", default=0, show_default=True, type=int)
@click.option("--bits", default=None,
              help="Bit-widths to choose from (16 = fp16; default: every width of --family below 16).")
@click.option("--family", default="kivi", show_default=True,
              type=click.Choice(["kivi", "tada", "any", "cb", "all"]),
              help="Codecs per slot (kivi: kivi-2/kivi-3 (K only)/kivi-4/int8; cb: cb-2/3/4 and int8; "
                   "all: KIVI, cb and int8, K and V chosen apart; any: KIVI, TaDA and int8).")
@click.option("--rings", default=None,
              help="Widths (bits) the search may give the sliding-window rings of a model that has "
                   "them, e.g. 4,8 (the default) or 8; 16 = fp16.")
@click.option("--calib-windows", "windows", default=2, show_default=True, type=int,
              help="Calibration windows spread over the text.")
@click.option("--calib-ctx", "prefix", default=512, show_default=True, type=int,
              help="Context tokens per window (held in the cache under test).")
@click.option("--calib-tokens", "n_score", default=32, show_default=True, type=int,
              help="Scored tokens per window (fed in chunks of the KV group).")
@click.option("--reuse", default=None, type=click.Path(),
              help="A profile from an earlier search on the same calibration: reuse its sensitivity pass.")
@click.option("--kv-residual", default=None, type=int, help="Full-precision window R (default 128).")
@click.option("--kv-group", default=None, type=int, help="Token group / flush block G (default 32).")
@click.option("--kv-vgroup", default=None, type=int, help="Channels per V scale group (default 32).")
@click.option("--kv-rotate", default=None, type=click.Choice(["none", "k", "v", "kv"]),
              help="Hadamard-rotate K and/or V in every layer (recorded in the profile).")
@click.option("--key-map", is_flag=True,
              help="Fit a key transform per layer on the calibration text ((k - mean) / spread, exact "
                   "in full precision) and store keys rotated by a codebook (cb-N) through it.")
@click.option("--tada-mu", default=None, type=click.Choice(["fp16", "int8"]), help="TaDA mean storage.")
@click.option("--dtype", default="auto", show_default=True, type=click.Choice(["auto", "fp32", "fp16", "bf16"]))
@threads_option
def search_cmd(model, calib, budget, out, ctx, trials, seed, bits, family, rings, windows, prefix, n_score,
               reuse, kv_residual, kv_group, kv_vgroup, kv_rotate, key_map, tada_mu, dtype, threads):
    """Search per-layer K/V bits minimizing KL divergence vs fp16 under a KV memory budget."""
    from ..engine.api import load
    from ..kv.config import KVConfig
    from ..eval.search import fit_key_maps, save_result, search
    text = read_text_file(calib)
    check_writable(out)                         # before the search, not after it
    fields = {f: x for f, x in (("residual", kv_residual), ("group", kv_group), ("v_group", kv_vgroup),
                                ("rotate", kv_rotate), ("tada_mu", tada_mu)) if x is not None}
    base = KVConfig.from_settings(**fields)
    bl, rl = _bits(bits), _bits(rings, "--rings", "4,8")
    m = load(model, dtype=dtype, ctx=8, threads=threads, progress=eprint)
    if key_map:
        base = base.replace(layer_key_map=fit_key_maps(m, text))
    kw = dict(budget=budget, ctx=ctx, trials=trials, seed=seed, bits=bl, family=family,
              windows=windows, prefix=prefix, n_score=n_score, base=base)
    prior = None
    if reuse is not None:
        from ..kv.profile import read_profile
        prior = read_profile(reuse)
    res = search(m, text, progress=eprint, reuse=prior, rings=rl, **kw)
    save_result(out, res, m, text, **kw)
    eprint(f"[search] best KLD {res.kld:.5f} at {res.ratio:.4f}× fp16 ({res.bytes / 2**20:.2f} MiB "
            f"for {ctx} tokens), {res.evaluations} evaluations in {res.seconds:.0f} s")
    for mth, k in sorted(res.uniform.items(), key=lambda x: x[1]):
        eprint(f"[search]   uniform {mth:<8} KLD {k:.5f} (K only {res.role_uniform['k'][mth]:.5f}, "
               f"V only {res.role_uniform['v'][mth]:.5f})")
    if res.ring is not None:
        eprint(f"[search]   rings at {res.ring} bits (alone, arena fp16: " + ", ".join(
            f"{w}-bit KLD {k:.5f}" for w, k in sorted(res.ring_kld.items())) + ")")
    eprint("layer  K        V")
    for i, (k, v) in enumerate(res.layers):
        eprint(f"{i:5d}  {k:<8} {v}")
    print(out)
