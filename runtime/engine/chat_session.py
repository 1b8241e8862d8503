"""A multi-turn conversation that keeps its KV cache between turns.

The session keeps the exact token ids of the conversation so far (prompts as fed, replies
as sampled) and only ever appends to them: turn N+1 is `ids + close(reply) + new user
message + generation prompt`, so the engine finds all earlier turns in the cache and
prefills only the new tokens. Re-rendering and re-tokenizing the whole conversation would
not round-trip exactly (a reply's tokens need not be the canonical tokenization of its
text) and would force a recompute from the first mismatch. The one exception is a reply
cut by a stop string: the conversation keeps the text before it, so the next turn re-feeds
the few tokens around the cut.

A turn continues the cache as it stands (`append`): it is prefilled over the compressed
past, the way the conversation was built, so the same turns after a reset give the same
replies. When a context shift drops ids from the middle of the conversation, the
session's ids follow the cache's.

A conversation kept in a session file (`attach`) holds that file's lock until `close()` or
the process ends, so a second chat on the same file is refused at its start instead of
silently overwriting the first one's turns.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

from ..errors import KvrunError
from ..files import FileLock, check_writable, sweep_stale_temps
from .generate import StreamEvent, check_ids
from .sampling import SamplingParams
from .session import read_session, save_session, session_limit
from .stops import StopStrings


class ChatSession:
    def __init__(self, model, system: str | None = None):
        self.m = model
        self.system = system
        self._held: tuple[Path, FileLock] | None = None      # attach's file and its lock
        self.reset()

    def reset(self) -> None:
        self.ids: list[int] = []        # the conversation so far, as token ids
        self.m.engine.reset()

    @property
    def cached(self) -> int:
        return len(self.m.engine.cached)

    def _turn_ids(self, text: str) -> list[int]:
        """The ids of the next turn; the text is a message's: special-token text stays text."""
        self.m.check_text_fits(len(text) + len(self.system or ""))     # before tokenizing it
        user = {"role": "user", "content": text}
        if not self.ids:
            msgs = ([{"role": "system", "content": self.system}] if self.system else []) + [user]
            return self.m.tokenizer.encode_parts(self.m.template.render_parts(msgs))
        return self.ids + self.m.tokenizer.encode_parts(self.m.template.continue_parts([user]))

    def reply(self, text: str, max_tokens: int, stop=None, **sampling) -> Iterator[StreamEvent]:
        """Stream the reply to `text`. `stop`: stop strings (runtime/engine/stops.py); when one
        ends the reply, the conversation keeps the reply as printed, without it."""
        ids = self._turn_ids(text)
        params = SamplingParams(**sampling)
        stops = StopStrings(stop)
        reply: list[int] = []
        dropped = self.m.engine.n_dropped
        # append: the turn continues the cache as it stands (runtime/engine/generate.py)
        for ev in stops.apply(self.m.engine.stream(ids, max_tokens, params, self.m.stop_ids,
                                                   append=True)):
            if ev.token_id is not None and ev.token_id not in self.m.stop_ids:
                reply.append(ev.token_id)
            if ev.finish_reason is not None:
                full = ids + (reply if stops.matched is None else self._kept(reply, stops.text))
                self.ids = self._as_held(full, self.m.engine.n_dropped - dropped)
            yield ev

    def _as_held(self, full: list[int], dropped: int) -> list[int]:
        """The conversation as the model holds it: a context shift during the turn dropped
        `dropped` ids after the kept start, so the next turn continues from the cache's ids
        plus the ids not fed yet (the reply's last token)."""
        if not dropped:
            return full
        cached = self.m.engine.cached
        return list(cached) + full[len(cached) + dropped:]

    def _kept(self, reply: list[int], text: str) -> list[int]:
        """Token ids for the reply cut before a stop string, whose printed text is `text`:
        the longest run of sampled tokens whose text lies within it, then the rest of
        `text` tokenized. The next turn then sees what the user saw (as llama.cpp's and
        mlx-lm's servers do with the trimmed reply); its prefix reuse drops the cached
        tokens past the cut."""
        def decoded(n: int) -> str:
            return self.m.tokenizer.decode(reply[:n], skip_special=True)
        n = len(reply)
        while n and not text.startswith(decoded(n)):   # the cut is near the end: few steps
            n -= 1
        rest = text[len(decoded(n)):]
        return reply[:n] + (self.m.tokenize(rest, bos=False) if rest else [])

    def attach(self, path) -> None:
        """Keep this conversation in the session file `path`: lock it for this session
        (KvrunError when another kvrun holds it), remove the temporary files a killed
        writer left beside it, and continue the conversation it holds when it exists."""
        check_writable(path)                # a FIFO or device: refused, and no lock file
        lock = FileLock(path, "session")
        try:
            p = Path(path)
            sweep_stale_temps(p.parent if str(p.parent) else Path("."), p.name)
            if p.exists() or p.is_symlink():
                self.load(path)
        except BaseException:
            lock.release()
            raise
        self.close()
        self._held = (Path(path).absolute(), lock)

    def close(self) -> None:
        """Release the session file's lock (`attach`)."""
        if self._held is not None:
            self._held[1].release()
            self._held = None

    def save(self, path) -> int:
        """Write the conversation to a session file (runtime/engine/session.py): the cache,
        and beside it the conversation's ids and system prompt; returns its bytes.
        KvrunError when another kvrun holds the file's lock."""
        held = self._held is not None and self._held[0] == Path(path).absolute()
        with self.m.engine.exclusive():
            return save_session(self.m, path, {"chat": {"ids": self.ids, "system": self.system}},
                                lock=not held)

    def load(self, path) -> None:
        """Continue the conversation saved at `path` (the model and KV config must be the
        ones it was saved with); KvrunError for any other file, the session unchanged."""
        chat = read_session(path, session_limit(self.m))[0]["extra"].get("chat")
        if not isinstance(chat, dict) or not isinstance(chat.get("ids"), list) \
                or not isinstance(chat.get("system"), (str, type(None))):
            raise KvrunError(f"{path}: a session without a chat conversation (saved by Model.save)")
        check_ids(chat["ids"], self.m.cfg.vocab_size)
        self.m.load_session(path)
        self.ids, self.system = list(chat["ids"]), chat["system"]

    def interrupted(self) -> None:
        """Ctrl-C mid-reply: keep what the model has already seen of the reply."""
        self.ids = list(self.m.engine.cached)

    def kv_report(self) -> str:
        from ..kv.report import format_kv
        return format_kv(self.m)
