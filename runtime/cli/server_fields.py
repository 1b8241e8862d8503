"""The request body of `kvrun serve` (runtime/cli/server.py) checked field by field: every value a
client sends is parsed here, before anything runs, and anything wrong is an `ApiError` with
OpenAI's error shape and a 4xx status naming the parameter.

What a body may hold: strict JSON (no NaN / Infinity, at most MAX_DEPTH levels, valid
Unicode: a lone surrogate such as "\\ud800" is refused), the fields kvrun implements with their
types, and the OpenAI fields kvrun does not implement only at their neutral values
(`frequency_penalty: 0`, `best_of: 1` ...). Any other field is refused by name, as
OpenAI's API does, rather than silently ignored. The `kv` extension may name a KV method or
a shipped profile; profile files are the operator's (`kvrun serve --kv`), never a client's.
"""
from __future__ import annotations

import json

from ..errors import KvrunError
from ..engine.generate import check_ids
from ..engine.grammar import Grammar, Grammars
from ..engine.sampling import MAX_TOP_LOGPROBS, SamplingParams

MAX_DEPTH = 32                  # nesting of a body: OpenAI's own requests need 5
MAX_STOPS, MAX_STOP_CHARS = 16, 256     # stop strings are matched at every token
MAX_MESSAGE = 400               # characters of an error message (they quote the request)

try:
    from starlette.responses import JSONResponse
except ImportError:                                 # the optional extra
    JSONResponse = None


class ApiError(Exception):
    """An HTTP error reply in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        message = message if len(message) <= MAX_MESSAGE else message[:MAX_MESSAGE - 3] + "..."
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self) -> "JSONResponse":
        return JSONResponse(self.body(), self.status)


# -- the body as a whole ----------------------------------------------------------------------
def _no_constant(name: str):
    raise ApiError(400, f"malformed JSON body: {name} is not a JSON value")


def parse_body(raw: bytes) -> dict:
    """The request's JSON object, or ApiError 400 saying what is wrong with it."""
    try:
        body = json.loads(raw, parse_constant=_no_constant)
    except RecursionError:
        raise ApiError(400, f"malformed JSON body: nested deeper than {MAX_DEPTH} levels") from None
    except (ValueError, UnicodeDecodeError) as e:   # JSONDecodeError, over-long integers
        raise ApiError(400, f"malformed JSON body: {str(e)[:200]}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    _check_values(body)
    return body


def _check_values(body: dict) -> None:
    """Depth and Unicode of every value, iteratively (a recursive walk is what overflows)."""
    stack = [(body, 1)]
    while stack:
        x, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise ApiError(400, f"malformed JSON body: nested deeper than {MAX_DEPTH} levels")
        items = x.items() if isinstance(x, dict) else enumerate(x)
        for k, v in items:
            for s in (k, v):
                if isinstance(s, str):
                    try:
                        s.encode("utf-8")
                    except UnicodeEncodeError:
                        raise ApiError(400, "the body holds a string that is not valid Unicode "
                                            "(a lone surrogate such as \\ud800)") from None
            if isinstance(v, (dict, list)):
                stack.append((v, depth + 1))


# fields kvrun implements (both endpoints; chat adds messages and max_completion_tokens)
COMMON = {"model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream",
          "stream_options", "top_k", "min_p", "repeat_penalty", "repeat_last_n", "kv",
          "logprobs", "n", "response_format"}
IGNORED = {"user", "store", "metadata", "service_tier", "prompt_cache_key",
           "safety_identifier", "parallel_tool_calls"}      # no effect on the output
# OpenAI fields kvrun does not implement: accepted only at these neutral values
NEUTRAL = {"frequency_penalty": (0,), "presence_penalty": (0,),
           "top_logprobs": (0,), "logit_bias": ({},), "tools": ([],),
           "tool_choice": ("none",), "functions": ([],), "function_call": ("none",),
           "modalities": (["text"],),
           "echo": (False,), "best_of": (1,), "suffix": ("",), "reasoning_effort": (),
           "audio": (), "prediction": (), "web_search_options": ()}


def check_fields(body: dict, chat: bool) -> None:
    """Refuse fields kvrun does not implement (ApiError 400 naming the first)."""
    own = COMMON | ({"messages", "max_completion_tokens", "top_logprobs"} if chat else
                    {"prompt", "echo"})
    for k, v in body.items():
        if k in own or k in IGNORED:
            continue
        if k in NEUTRAL:
            if v is None or any(_same(v, n) for n in NEUTRAL[k]):
                continue
            raise ApiError(400, f"'{k}' is not supported by kvrun (got {_show(v)})", param=k,
                           code="unsupported_parameter")
        raise ApiError(400, f"unknown parameter '{k:.60}'", param=k[:60], code="unknown_parameter")
    for k in ("user", "service_tier", "prompt_cache_key", "safety_identifier"):
        field(body, k, str)


def _same(v, n) -> bool:
    """v is the neutral value n (0 and 0.0 alike; false is not 0)."""
    if isinstance(n, bool) or isinstance(v, bool):
        return v is n
    if isinstance(n, (int, float)):
        return isinstance(v, (int, float)) and v == n
    return v == n


def _show(x) -> str:
    s = json.dumps(x)
    return s if len(s) <= 80 else s[:77] + "..."


# -- one field --------------------------------------------------------------------------------
def field(body: dict, name: str, kinds, default=None):
    """body[name] checked against `kinds` (bool is not a number here); None is `default`."""
    x = body.get(name)
    if x is None:
        return default
    kinds = kinds if isinstance(kinds, tuple) else (kinds,)
    if (isinstance(x, bool) and bool not in kinds) or not isinstance(x, kinds):
        raise ApiError(400, f"'{name}' must be {_kind_names(kinds)}, got {_show(x)}", param=name)
    return x


def _kind_names(kinds: tuple) -> str:
    names = {int: "an integer", float: "a number", str: "a string", bool: "a boolean",
             list: "a list", dict: "an object"}
    return " or ".join(dict.fromkeys(names[k] for k in kinds))


# SamplingParams' names (and the CLI flags in its messages) as the request's field names
_SAMPLING = (("temp", "--temp", "temperature"), ("top_p", "--top-p", "top_p"),
             ("top_k", "--top-k", "top_k"), ("min_p", "--min-p", "min_p"),
             ("repeat_penalty", "--repeat-penalty", "repeat_penalty"),
             ("repeat_last_n", "--repeat-last-n", "repeat_last_n"), ("seed", "--seed", "seed"))


def sampling_from(body: dict) -> SamplingParams:
    """OpenAI's sampling fields (and llama.cpp's extensions) as SamplingParams, with OpenAI's
    defaults (temperature 1, top_p 1, no top-k / min-p); SamplingParams checks the values."""
    got = {"temp": float(field(body, "temperature", (int, float), 1.0)),
           "top_p": float(field(body, "top_p", (int, float), 1.0)),
           "top_k": field(body, "top_k", int, 0),
           "min_p": float(field(body, "min_p", (int, float), 0.0)),
           "repeat_penalty": float(field(body, "repeat_penalty", (int, float), 1.0)),
           "repeat_last_n": field(body, "repeat_last_n", int, 64),
           "seed": field(body, "seed", int)}
    try:
        return SamplingParams(**got)
    except KvrunError as e:
        msg, param = str(e), None
        for _, flag, name in _SAMPLING:
            if msg.startswith(flag + " "):
                msg, param = f"'{name}'" + msg[len(flag):], name
        raise ApiError(400, msg, param=param) from None


def max_tokens_from(body: dict, chat: bool) -> int | None:
    """`max_tokens` (chat: or its newer name `max_completion_tokens`; both given, they must
    be equal: neither silently wins); None: until the context is full."""
    got = {}
    for k in ("max_tokens", "max_completion_tokens") if chat else ("max_tokens",):
        n = field(body, k, int)
        if n is not None and n < 0:
            raise ApiError(400, f"'{k}' must be >= 0 (got {n})", param=k)
        if n is not None:
            got[k] = n
    if len(set(got.values())) > 1:
        raise ApiError(400, f"'max_tokens' ({got['max_tokens']}) and 'max_completion_tokens' "
                            f"({got['max_completion_tokens']}) differ: send one of them",
                       param="max_completion_tokens")
    return next(iter(got.values()), None)


def stop_from(body: dict) -> list[str] | None:
    stop = body.get("stop")
    if stop is None:
        return None
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise ApiError(400, "'stop' must be a non-empty string or a list of them", param="stop")
    if len(stops) > MAX_STOPS or any(len(s) > MAX_STOP_CHARS for s in stops):
        raise ApiError(400, f"'stop' takes at most {MAX_STOPS} strings of at most "
                            f"{MAX_STOP_CHARS} characters", param="stop")
    return stops or None


MAX_N = 16                      # choices per request, whatever --parallel is


def n_from(body: dict, parallel: int, seed: int | None) -> int:
    """`n`: choices per request, 1..min(MAX_N, parallel) (choice i is its own sequence, so
    n never waits for itself); with a seed, seed + n - 1 must still be a seed."""
    n = field(body, "n", int, 1)
    most = min(MAX_N, parallel)
    if not 1 <= n <= most:
        raise ApiError(400, f"'n' must be in [1, {most}] on this server (--parallel "
                            f"{parallel}; got {n})", param="n")
    if seed is not None and seed + n - 1 >= 1 << 64:
        raise ApiError(400, "'seed' + 'n' - 1 must be < 2^64 (choice i samples with seed + i)",
                       param="seed")
    return n


MAX_LEGACY_LOGPROBS = 5         # the completions endpoint's bound (OpenAI's)


def logprobs_from(body: dict, chat: bool) -> int | None:
    """How many alternatives each token's log-probability comes with; None: no logprobs.
    Chat: `logprobs` (a boolean) and `top_logprobs` (0..20, only with logprobs true);
    completions: `logprobs` (0..5; false or null: none)."""
    if chat:
        on = field(body, "logprobs", bool, False)
        k = field(body, "top_logprobs", int)
        if k is not None and not 0 <= k <= MAX_TOP_LOGPROBS:
            raise ApiError(400, f"'top_logprobs' must be in [0, {MAX_TOP_LOGPROBS}] (got {k})",
                           param="top_logprobs")
        if k and not on:
            raise ApiError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        return (k or 0) if on else None
    if body.get("logprobs") is False:
        return None
    k = field(body, "logprobs", int)
    if k is not None and not 0 <= k <= MAX_LEGACY_LOGPROBS:
        raise ApiError(400, f"'logprobs' must be in [0, {MAX_LEGACY_LOGPROBS}] (got {k})",
                       param="logprobs")
    return k


def stream_from(body: dict) -> tuple[bool, bool]:
    """(stream, include_usage): with include_usage the stream ends with a chunk holding no
    choices and the usage of them all (before `data: [DONE]`)."""
    stream = field(body, "stream", bool, False)
    opts = field(body, "stream_options", dict, {})
    for k in opts:
        if k != "include_usage":
            raise ApiError(400, f"unknown parameter 'stream_options.{k:.60}'", param="stream_options")
    usage = bool(field(opts, "include_usage", bool, False))
    if body.get("stream_options") is not None and not stream:  # as OpenAI: silently ignored else
        raise ApiError(400, "'stream_options' is only allowed with 'stream': true",
                       param="stream_options")
    return stream, usage


_SCHEMA_KEYS = {"name", "description", "schema", "strict"}


def response_format_from(body: dict) -> dict | None:
    """The JSON Schema a reply must follow, or None for free text. `response_format`:
    {"type": "text"}; {"type": "json_object"} (any JSON object: the schema {"type":
    "object"}); {"type": "json_schema", "json_schema": {"name", "description", "schema",
    "strict"}} (without "schema": any JSON value). Whether the schema itself is valid is
    the grammar compiler's to say (runtime/engine/grammar.py)."""
    rf = field(body, "response_format", dict)
    if rf is None:
        return None
    kind = rf.get("type")
    extra = sorted(set(rf) - ({"type", "json_schema"} if kind == "json_schema" else {"type"}))
    if kind not in ("text", "json_object", "json_schema"):
        raise ApiError(400, f"'response_format.type' must be 'text', 'json_object' or "
                            f"'json_schema' (got {_show(kind)})", param="response_format")
    if extra:
        raise ApiError(400, f"unknown parameter 'response_format.{extra[0]:.60}'",
                       param="response_format")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    spec = rf.get("json_schema")
    if not isinstance(spec, dict):
        raise ApiError(400, "'response_format.json_schema' must be an object holding the "
                            "'schema'", param="response_format")
    for k in spec:
        if k not in _SCHEMA_KEYS:
            raise ApiError(400, f"unknown parameter 'response_format.json_schema.{k:.60}'",
                           param="response_format")
    for k, kinds in (("name", str), ("description", str), ("strict", bool), ("schema", dict)):
        if spec.get(k) is not None and not isinstance(spec[k], kinds):
            raise ApiError(400, f"'response_format.json_schema.{k}' must be "
                                f"{_kind_names((kinds,))}, got {_show(spec[k])}",
                           param="response_format")
    schema = spec.get("schema")
    return {} if schema is None else schema


def grammar_from(body: dict, grammars: Grammars) -> Grammar | None:
    """`response_format` compiled into the constraint the reply is sampled under (None: free
    text); a schema the compiler refuses, or no compiler installed, is a 400 naming it."""
    schema = response_format_from(body)
    if schema is None:
        return None
    try:
        return grammars.json_schema(schema)
    except KvrunError as e:
        raise ApiError(400, f"'response_format': {e}", param="response_format") from None


# -- prompts ----------------------------------------------------------------------------------
ROLE_NAMES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


def messages_from(body: dict) -> list[dict]:
    """The chat messages as {"role", "content"} with text content (OpenAI's "developer" role
    is the system role)."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise ApiError(400, "'messages' must be a non-empty list", param="messages")
    return [_message(m, i) for i, m in enumerate(msgs)]


def _message(m, i: int) -> dict:
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise ApiError(400, f"{where} must be an object", param="messages")
    for k in m:
        if k not in ("role", "content", "name", "refusal"):
            raise ApiError(400, f"{where}.{k:.60} is not supported by kvrun", param="messages")
    role = m.get("role")
    if role not in ROLE_NAMES:
        raise ApiError(400, f"{where}.role must be one of {', '.join(ROLE_NAMES)} "
                            f"(got {_show(role)})", param="messages")
    content = m.get("content")
    if content is None:             # kvrun has no tool calls, the one reason OpenAI allows it
        raise ApiError(400, f"{where}.content is missing or null: every message needs its text "
                            f"(a string or a list of text parts)", param="messages")
    if isinstance(content, list):                   # content parts: text only
        texts = []
        for j, p in enumerate(content):
            if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                kind = p.get("type") if isinstance(p, dict) else None
                raise ApiError(400, f"{where}.content[{j}] must be a text part "
                                    f"{{'type': 'text', 'text': ...}}"
                               + (f" (kvrun reads text only, got type {_show(kind)})"
                                  if isinstance(kind, str) and kind != "text" else ""),
                               param="messages")
            texts.append(p["text"])
        content = "".join(texts)
    if not isinstance(content, str):
        raise ApiError(400, f"{where}.content must be a string or a list of text parts",
                       param="messages")
    if not isinstance(m.get("name", ""), str):
        raise ApiError(400, f"{where}.name must be a string", param="messages")
    return {"role": ROLE_NAMES[role], "content": content}


def prompt_from(body: dict, vocab_size: int) -> str | list[int]:
    """A completion's prompt: text, or token ids in [0, vocab_size); one prompt per request."""
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]                                        # a batch of one
    if isinstance(p, str) and p:
        return p
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        try:
            check_ids(p, vocab_size)                    # the library's check of caller ids
        except KvrunError as e:
            raise ApiError(400, str(e), param="prompt") from None
        return p
    raise ApiError(400, "'prompt' must be a non-empty string or a list of token ids "
                        "(one prompt per request)", param="prompt")


# -- the kv extension -------------------------------------------------------------------------
def request_kv(spec: str, shipped: dict) -> str:
    """A request's `kv` field as a --kv spec that opens no file but a shipped profile:
    `profile:NAME` must name one of `shipped` ({name: path}) and becomes its path; methods
    ("kivi-4", "int8@64+rot", "auto") pass as they are. The error does not depend on what
    exists on the server's disk."""
    if not spec.strip():
        raise ApiError(400, "'kv' is empty: name a KV method (\"fp16\", \"kivi-4\", \"auto\" ...) "
                            "or leave the field out for the server's --kv", param="kv")
    base = spec.partition("+")[0].partition("@")[0].strip()
    if not base.startswith("profile:"):
        return spec
    name = base[len("profile:"):].strip()
    name = name[:-len(".json")] if name.endswith(".json") else name
    if name not in shipped:
        raise ApiError(400, f"'kv': a request may name a KV method or a shipped profile "
                            f"({', '.join('profile:' + n for n in sorted(shipped)) or 'none'}); "
                            f"profile files are set by the server's operator (--kv)", param="kv")
    return f"profile:{shipped[name]}" + spec.strip()[len(base):]

