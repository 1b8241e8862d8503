"""The library API: `kvrun.load()` → `Model` with generate / stream / chat / logits.

    import kvrun
    m = kvrun.load()                         # the embedded SmolLM2-135M-Instruct
    print(m.chat([{"role": "user", "content": "Name a prime."}], max_tokens=32, temp=0))
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch

from kvrun.kernels import native
from ..model.chat_template import template_for
from ..model.config import ModelConfig
from ..errors import KvrunError
from .generate import DEFAULT_PREFILL_CHUNK, Engine, StreamEvent, check_ids
from .grammar import Grammar, Grammars
from ..kv import build_cache
from ..kv.build import make_cache
from ..kv.config import KVConfig, parse_kv
from ..model.loader import check_model_dir, load_config, load_tokenizer, load_transformer, parse_dtype
from .model_prefix import ModelPrefix
from .prefix_budget import model_default_mb
from .sampling import sampling_params
from .session import load_session, save_session
from .stops import with_stops
from ..threads import MAX_THREADS, configure as configure_threads, tick as tick_threads

DEFAULT_CTX = 4096
BATCH_KV_MB = 1024          # generate_batch's default bound on the KV caches held at once


@contextmanager
def _naming(i: int):
    """A KvrunError raised for prompt `i` of a batch says which prompt it was."""
    try:
        yield
    except KvrunError as e:
        raise KvrunError(f"prompt {i}: {e}") from None


def check_count(what: str, n) -> None:
    """An integer >= 1 (a float, a string or NaN raised TypeError deep inside torch)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise KvrunError(f"{what} must be an integer >= 1 (got {n!r})")


class Model:
    """A loaded model with one KV cache (one conversation at a time), and a prefix cache
    across calls (`prefix_cache`; runtime/engine/model_prefix.py) that a new prompt resumes
    from when it shares a long prefix with an earlier one.

    Thread-safe by serialization: a generation holds the model from its first token to its
    last (an open `stream()` iterator included), and a call from another thread waits for
    it; a second generation started in the same thread while one is still open raises
    KvrunError. For several sequences at once, use `generate_batch` (or `kvrun serve`)."""

    def __init__(self, path: Path, cfg: ModelConfig, transformer, tokenizer, cache,
                 prefill_chunk: int = DEFAULT_PREFILL_CHUNK):
        self.path, self.cfg, self.transformer, self.tokenizer = path, cfg, transformer, tokenizer
        self.engine = Engine(transformer, tokenizer, cache, prefill_chunk)
        self.template = template_for(cfg.chat_template, cfg.default_system)
        self.stop_ids = set(cfg.eos_token_ids)
        self.kv: "str | KVConfig" = "fp16"     # the cache's method (load() sets it)
        # JSON-schema constraints (`json_schema=`): the library's tokenizer is built at first use
        self.grammars = Grammars(tokenizer, cfg.vocab_size, self.stop_ids)
        self.dtype = "auto"                    # the --dtype it was loaded with (load() sets it)

    # -- tokens --
    def tokenize(self, text: str, bos: bool | None = None) -> list[int]:
        if not isinstance(text, str):
            raise KvrunError(f"text to tokenize must be a str, got {type(text).__name__}")
        return self.tokenizer.encode(text, bos)

    def detokenize(self, ids: list[int]) -> str:
        ids = list(ids)
        check_ids(ids, self.cfg.vocab_size)
        return self.tokenizer.decode(ids)

    def check_text_fits(self, n_chars: int) -> None:
        """KvrunError for prompt text of `n_chars` characters that cannot fit the context,
        before it is tokenized."""
        if n_chars > self.tokenizer.max_text_chars(self.ctx):
            raise KvrunError(f"prompt too long: {n_chars} characters cannot fit in the context "
                             f"({self.ctx} tokens; raise ctx / -c)")

    def _prompt_ids(self, prompt) -> list[int]:
        """A raw prompt's ids: text is tokenized (after the length check it can take
        untokenized), a list or tuple of ids is taken as is."""
        if isinstance(prompt, str):
            self.check_text_fits(len(prompt))
            return self.tokenize(prompt)
        if isinstance(prompt, (list, tuple)):
            return list(prompt)
        raise KvrunError(f"a prompt is text or a list of token ids, got {type(prompt).__name__}")

    @property
    def cache(self):
        return self.engine.cache

    @property
    def prefix_cache(self):
        """The PrefixCache across calls (`load(cache_ram_mb=)`), or None when off."""
        return None if self.engine.prefix is None else self.engine.prefix.cache

    @property
    def ctx(self) -> int:
        return self.engine.max_ctx

    def _grammar(self, json_schema) -> "Grammar | None":
        return None if json_schema is None else self.grammars.json_schema(json_schema)

    # -- generation --
    def stream(self, prompt: str | list[int], max_tokens: int = 128, *, stop=None,
               json_schema: "dict | str | None" = None, **sampling) -> Iterator[StreamEvent]:
        """Stream a continuation of a raw prompt (text or token ids). `stop`: a string or a
        list of strings that end the generation (finish_reason "stop"); the stop string
        itself is not part of the text (runtime/engine/stops.py). `json_schema`: the text
        is JSON valid under this JSON Schema ({"type": "object"}: any object) when the
        generation stops by itself (runtime/engine/grammar.py; needs llguidance)."""
        ids = self._prompt_ids(prompt)
        return with_stops(self.engine.stream(ids, max_tokens, sampling_params(sampling),
                                             self.stop_ids, grammar=self._grammar(json_schema)),
                          stop)

    def generate(self, prompt: str | list[int], max_tokens: int = 128, *, stop=None,
                 json_schema: "dict | str | None" = None, **sampling) -> str:
        return "".join(ev.text for ev in self.stream(prompt, max_tokens, stop=stop,
                                                     json_schema=json_schema, **sampling))

    def chat_stream(self, messages: list[dict], max_tokens: int = 256, *, stop=None,
                    json_schema: "dict | str | None" = None, **sampling) -> Iterator[StreamEvent]:
        """Reply to a conversation; earlier turns still in the cache are not recomputed.
        Message contents are tokenized as plain text (special-token text in them stays
        text); only the template's markers are control tokens. `stop` and `json_schema` as
        in `stream`."""
        if isinstance(messages, list):
            self.check_text_fits(sum(len(m["content"]) for m in messages if isinstance(m, dict)
                                  and isinstance(m.get("content"), str)))
        ids = self.tokenizer.encode_parts(self.template.render_parts(messages))
        return with_stops(self.engine.stream(ids, max_tokens, sampling_params(sampling),
                                             self.stop_ids, grammar=self._grammar(json_schema)),
                          stop)

    def chat(self, messages: list[dict], max_tokens: int = 256, *, stop=None,
             json_schema: "dict | str | None" = None, **sampling) -> str:
        return "".join(ev.text for ev in self.chat_stream(messages, max_tokens, stop=stop,
                                                          json_schema=json_schema, **sampling))

    def generate_batch(self, prompts: list, max_tokens: int = 128, *, stop=None,
                       parallel: int | None = None, kv: "str | KVConfig | None" = None,
                       kv_budget_mb: float | None = None,
                       json_schema: "dict | str | None" = None, **sampling) -> list[str]:
        """Continuations of many raw prompts (texts or token-id lists), decoded together:
        one forward per step over all running sequences, each on its own KV cache of
        prompt + max_tokens tokens (at most the model's context) with method `kv` (default:
        the model's). `parallel` (default: all) and `kv_budget_mb` (default: BATCH_KV_MB,
        or the largest prompt's cache when that is more) bound how many run at once; the
        rest wait, so memory does not grow with the number of prompts. Greedy outputs
        equal `generate`'s, prompt by prompt. A prompt that `generate` would refuse, or
        whose generation fails, raises KvrunError naming it ("prompt 3: ..."); no output
        is ever a silent "".
        `stop`, `json_schema` and the sampling options apply to every prompt (each sequence
        has its own state in the schema's grammar; a seed gives each prompt the
        stream `generate` with that seed gives it); runtime/engine/scheduler.py takes them per
        request."""
        from .scheduler import MiB, Scheduler
        if not isinstance(prompts, (list, tuple)):
            raise KvrunError(f"generate_batch takes a list of prompts, got {type(prompts).__name__}")
        ids = []
        for i, p in enumerate(prompts):
            with _naming(i):
                ids.append(self._prompt_ids(p))
                check_ids(ids[-1], self.cfg.vocab_size)
        if kv_budget_mb is None:                # the largest cache, when over the default bound
            probe = Scheduler(self, parallel=1, max_queue=0, kv=kv)
            need = 0
            for i, x in enumerate(ids):
                with _naming(i):
                    need = max(need, probe.plan(len(x), max_tokens, probe.kv)[2])
            kv_budget_mb = max(BATCH_KV_MB, need / MiB)
        sched = Scheduler(self, parallel=parallel or max(1, len(ids)), kv_budget_mb=kv_budget_mb,
                          max_queue=len(ids), kv=kv)
        params = sampling_params(sampling)
        grammar = self._grammar(json_schema)
        reqs = []
        for i, x in enumerate(ids):
            with _naming(i):
                reqs.append(sched.submit(x, max_tokens, params, stop, grammar=grammar))
        with self.engine.exclusive():           # the batch shares the model's decode scratch
            sched.run()
        failed = [(i, r) for i, r in enumerate(reqs) if r.finish_reason == "error"]
        if failed:
            i, r = failed[0]
            more = f" (and {len(failed) - 1} more)" if len(failed) > 1 else ""
            raise KvrunError(f"prompt {i}: {r.error}{more}")
        return [r.text for r in reqs]

    # -- scoring --
    def logits(self, ids: list[int]) -> torch.Tensor:
        """(T, V) float32 next-token logits of a full forward over `ids` (fresh fp32 cache;
        the conversation cache is left untouched)."""
        if not ids:
            raise KvrunError("logits() needs at least one token")
        ids = list(ids)
        if len(ids) > self.ctx:                 # (T, V) floats and a cache of T tokens
            raise KvrunError(f"logits() takes at most the context's {self.ctx} ids (got "
                             f"{len(ids)}; raise ctx / -c)")
        check_ids(ids, self.cfg.vocab_size)
        with self.engine.exclusive():
            return self._logits(ids)

    def _logits(self, ids: list[int]) -> torch.Tensor:
        cache = build_cache(self.cfg, len(ids), "fp32")
        chunk = self.engine.prefill_chunk
        out = [self.transformer(torch.tensor([ids[s:s + chunk]]), cache)[0]
               for s in range(0, len(ids), chunk)]
        return torch.cat(out)

    def reset(self) -> None:
        with self.engine.exclusive():
            self.engine.reset()

    def kv_bytes(self) -> dict[str, int]:
        return self.engine.cache.nbytes()

    # -- sessions on disk (runtime/engine/session.py) --
    def save(self, path, extra: dict | None = None) -> int:
        """Write the conversation cache to the session file `path` (atomically: whole or
        not at all); returns its bytes. `extra`: JSON-able data kept beside it."""
        with self.engine.exclusive():
            return save_session(self, path, extra)

    def load_session(self, path) -> dict:
        """Continue from the session file `path`: its cache and token ids replace the
        conversation cache, so the next prompt that extends them prefills only its new
        tokens. KvrunError for a file of another model, dtype or KV config, or one that is
        truncated, corrupt or not a session (the cache is then left as it was). Returns the
        `extra` it was saved with."""
        return load_session(self, path)


def load(path: str | Path | None = None, dtype: str = "auto", ctx: int = DEFAULT_CTX,
         kv: "str | KVConfig" = "fp16", prefill_chunk: int = DEFAULT_PREFILL_CHUNK, threads: int | None = None,
         progress=None, session: str | Path | None = None,
         cache_ram_mb: float | None = None) -> Model:
    """Load a kvrun model directory, or a model `kvrun pull --list` names (pulled and
    converted on first use; None → the embedded default model).

    dtype: auto | fp32 | fp16 | bf16 (auto = fp32 prefill + fp16 decode weights on CPU).
    ctx: KV cache size in tokens, allocated once. kv: "fp16" | "fp32" | a --kv spec
    ("tada-4", "kivi-4/kivi-2" ...) or a KVConfig. threads: the most CPU threads the
    compute uses, process-wide (None leaves the cap as it is; by default the CPUs this
    process may run on); fewer while other processes keep cores busy (runtime/threads.py).
    session: a session file (`Model.save`) to continue from (`Model.load_session`).
    cache_ram_mb: MiB of host RAM for the prefix cache across calls (model_prefix.py: a
    prompt resumes from the longest chunk-boundary state an earlier prefill passed through,
    output unchanged); None: 1/32 of the machine's memory, at most 1024 MiB
    (prefix_budget.py); 0: off. `Model.prefix_cache.stats()` counts its hits.
    """
    from .pull import resolve_model
    check_count("context size", ctx)
    check_count("prefill chunk", prefill_chunk)
    if threads is not None:
        check_count("threads", threads)
        if threads > MAX_THREADS:
            raise KvrunError(f"threads must be at most {MAX_THREADS} (got {threads})")
    if path is not None and not isinstance(path, (str, os.PathLike)):
        raise KvrunError(f"a model is a directory path or a pullable name, got {type(path).__name__}")
    if not isinstance(kv, (str, KVConfig)):
        raise KvrunError(f"kv is a --kv spec string or a KVConfig, got {type(kv).__name__}")
    if cache_ram_mb is None:
        cache_ram_mb = model_default_mb()
    if isinstance(cache_ram_mb, bool) or not isinstance(cache_ram_mb, (int, float)) \
            or not 0 <= cache_ram_mb < float("inf"):
        raise KvrunError(f"cache_ram_mb must be a finite number >= 0 (got {cache_ram_mb!r})")
    path = check_model_dir(resolve_model(path, progress=progress))
    cfg = load_config(path)
    if threads is not None:
        configure_threads(threads)
    compute, gemv = parse_dtype(dtype)
    native.load()                   # built once per machine here, not inside a timed prefill
    # the weights' repacks are torch ops too: with spinning waits, 2 threads beside a busy
    # process took 7-12 s to load the default model where 1 thread takes 1 s
    tick_threads()
    transformer = load_transformer(path, cfg, compute, gemv)
    tokenizer = load_tokenizer(path, cfg)
    cache = make_cache(cfg, ctx, kv)
    model = Model(path, cfg, transformer, tokenizer, cache, prefill_chunk)
    model.kv, model.dtype = kv, dtype
    if cache_ram_mb:
        model.engine.prefix = ModelPrefix(kv if isinstance(kv, KVConfig) else parse_kv(kv),
                                          cache_ram_mb)
    if session is not None:
        model.load_session(session)
    return model
