"""kvrun.cli.kv_flags: the one table of --kv* / --evict* flags drives the commands' options and
lands on KVConfig."""
from kvrun.cli.main import main


def test_kv_flags_table_drives_the_options_and_parse_kv():
    """Each KV_FLAGS row is one click option on the commands that take the KV flags, under the
    keyword its row maps, and lands on a KVConfig field or a parse_kv argument."""
    import inspect

    from kvrun.cli.kv_flags import EVICT_FLAGS, KV_FLAGS, PARSE_ARGS, kv_config
    from kvrun.kv.config import SETTINGS, parse_kv
    fields = set(SETTINGS)
    assert set(PARSE_ARGS) <= set(inspect.signature(parse_kv).parameters)
    for r in KV_FLAGS:
        assert r.dest is None or r.dest in fields | set(PARSE_ARGS), r
    for name, rows in (("generate", KV_FLAGS), ("chat", KV_FLAGS), ("ppl", EVICT_FLAGS),
                       ("needle", EVICT_FLAGS), ("bench", EVICT_FLAGS)):
        params = {p.opts[0]: p.name for p in main.commands[name].params}
        for r in rows:
            assert params[r.flag] == r.param, (name, r.flag)
    kw = {r.param: None for r in KV_FLAGS} | {"kv": "kivi-4", "kv_rotate": "k", "evict": "h2o",
                                              "kv_budget": 512, "keep": 2, "other": 1}
    cfg = kv_config(kw)
    assert kw == {"other": 1}                   # the KV flags consumed, nothing else
    assert (cfg.k_method, cfg.rotation.which, cfg.eviction.policy, cfg.eviction.budget, cfg.context.n_keep) == ("kivi-4", "k", "h2o", 512, 2)
