"""The `kvrun chat` read-eval-print loop: input lines, /commands, streaming replies.

On a terminal, lines are read through Python's `readline` (line editing, Up/Down history,
Tab completes /commands). The history persists across sessions in $KVRUN_HOME/chat_history
(like ~/.python_history); KVRUN_CHAT_HISTORY names another file, or "" keeps it in memory
only. A line starting with / is a command, never a message: an unknown one is an error
line (`//text` sends "/text"). A line ending in \\ continues on the next (llama.cpp's
multi-line input). Replies go to stdout, everything else to stderr. Bytes that are not
UTF-8 in a line become U+FFFD with a warning (`as_utf8`), as `kvrun generate` does: a bad
line never ends the session.
"""
from __future__ import annotations

import io
import sys
from pathlib import Path

from .. import knobs
from ..engine.chat_session import ChatSession
from ..engine.generate import PromptTooLong
from ..errors import KvrunError, as_utf8
from ..files import kvrun_home
from ..kv.report import fmt_bytes, kv_summary

COMMANDS = {                          # name -> (aliases, help)
    "/help": ((), "this list"),
    "/kv": ((), "KV cache: method, tokens held, bytes by component, ratio to fp16"),
    "/reset": (("/clear",), "forget the conversation (the system prompt stays)"),
    "/exit": (("/quit",), "leave (Ctrl-D too)"),
}
ALIASES = {a: name for name, (aliases, _) in COMMANDS.items() for a in (name, *aliases)}
HISTORY_LINES = 1000
LINE_LIMIT = 64 << 20                 # characters in one input line: far beyond any context


def help_text() -> str:
    rows = [(", ".join((name, *aliases)), what) for name, (aliases, what) in COMMANDS.items()]
    rows += [("//text", "send a message that starts with /"),
             ("line ending in \\", "continue the message on the next line")]
    width = max(len(r[0]) for r in rows)
    return "\n".join(["commands:"] + [f"  {a:<{width}}  {b}" for a, b in rows]
                     + ["Ctrl-C stops a reply; Up/Down recall earlier lines"])


def parse_command(line: str) -> tuple[str | None, str | None]:
    """(command, None) for a known /command (aliases resolved), (None, message) for a
    message to the model; a KvrunError for an unknown /command or one given an argument."""
    text = line.strip()
    if text.startswith("//"):
        return None, line.lstrip()[1:]
    if not text.startswith("/"):
        return None, line
    word, _, rest = text.partition(" ")
    name = ALIASES.get(word)
    if name is None:
        raise KvrunError(f"unknown command {word!r} (/help lists them; start with // to send "
                         f"a message beginning with /)")
    if rest.strip():
        raise KvrunError(f"{word} takes no argument")
    return name, None


def history_path() -> Path | None:
    env = knobs.chat_history()
    if env is not None:
        return Path(env).expanduser() if env.strip() else None
    return kvrun_home() / "chat_history"


class LineReader:
    """Input lines, through readline on a terminal (history saved by `close`)."""

    def __init__(self, interactive: bool):
        self.interactive = interactive
        self.readline, self.path = None, None
        # keep undecodable bytes (as surrogates, for as_utf8) instead of raising mid-session;
        # possible until the first read (else a bad line is an error line, see run_chat)
        try:
            sys.stdin.reconfigure(errors="surrogateescape")
        except (AttributeError, io.UnsupportedOperation):
            pass
        if interactive:
            try:
                import readline             # line editing just by being imported
            except ImportError:             # Python built without it (some Windows builds)
                return
            self.readline, self.path = readline, history_path()
            readline.set_history_length(HISTORY_LINES)
            if self.path is not None and self.path.is_file():
                try:
                    readline.read_history_file(str(self.path))
                except OSError:
                    pass                    # an unreadable history only costs the history
            readline.set_completer(self._complete)
            readline.set_completer_delims(" \t\n")
            bind = "bind ^I rl_complete" if "libedit" in (readline.__doc__ or "") else "tab: complete"
            readline.parse_and_bind(bind)

    @staticmethod
    def _complete(text: str, state: int) -> str | None:
        hits = [c for c in ALIASES if text.startswith("/") and c.startswith(text)]
        return hits[state] if state < len(hits) else None

    def _one(self, prompt: str) -> str:
        if self.interactive:
            return input(prompt)
        line = sys.stdin.readline(LINE_LIMIT + 1)
        if not line:
            raise EOFError
        if len(line) > LINE_LIMIT:          # `< /dev/zero`: no newline ever comes
            raise KvrunError(f"an input line is over {LINE_LIMIT >> 20} MiB characters")
        return line.rstrip("\n")

    def read(self) -> str:
        """One message or command; raises EOFError at the end of input (Ctrl-D)."""
        line = self._one("> ")
        while line.endswith("\\"):
            line = line[:-1] + "\n" + self._one("... ")
        return line

    def close(self) -> None:
        if self.readline is not None and self.path is not None:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self.readline.write_history_file(str(self.path))
            except OSError:
                pass


def banner(m) -> str:
    s = kv_summary(m)
    return (f"kvrun chat: {m.path.name} | KV {s.label}, {fmt_bytes(s.total)} "
            f"({s.ratio:.3f}x fp16) | context {s.max_ctx} tokens\n"
            f"/help lists commands; Ctrl-C stops a reply, Ctrl-D exits")


def run_chat(m, system: str | None, n: int, sampling: dict, stop: list[str], eprint,
             session_file: str | None = None) -> None:
    """The loop: until /exit or end of input. `session_file`: the conversation is restored
    from it when it exists and saved to it after every turn and /reset."""
    session = ChatSession(m, system)
    if session_file is not None:            # locked for this chat; restored when it exists
        session.attach(session_file)
        if system is not None and system != session.system:
            eprint("[--system ignored: the restored conversation keeps its own system prompt]")
    reader = LineReader(sys.stdin.isatty())
    eprint(banner(m))
    if session_file is not None and session.ids:
        eprint(f"[session {session_file}: {len(session.ids)} tokens restored]")

    def save():
        if session_file is not None:
            try:
                session.save(session_file)
            except KvrunError as e:
                eprint(f"error: session not saved: {e}")
    try:
        while True:
            try:
                line = reader.read()
            except EOFError:
                eprint("")
                return
            except KeyboardInterrupt:       # Ctrl-C at the prompt: a fresh prompt
                eprint("")
                continue
            except UnicodeDecodeError:      # stdin could not be set to keep bad bytes
                eprint("error: this line is not valid UTF-8 text; not sent")
                continue
            line = as_utf8(line, "this line", eprint)
            if not line.strip():
                continue
            try:
                cmd, message = parse_command(line)
            except KvrunError as e:
                eprint(f"error: {e}")
                continue
            if cmd == "/exit":
                return
            if cmd == "/help":
                eprint(help_text())
            elif cmd == "/reset":
                session.reset()
                save()
                eprint("[conversation reset]")
            elif cmd == "/kv":
                eprint(session.kv_report())
            else:
                reply(session, message, n, sampling, stop, eprint)
                save()
    finally:
        reader.close()
        session.close()                     # the session file's lock


SHIFT_HINT = ", or restart with --ctx-policy shift to drop the oldest tokens as it fills"


def full_hint(session: ChatSession, e: PromptTooLong) -> str:
    """What a chat user can do when a message does not fit: /reset when earlier turns take
    the room, --ctx-policy shift when the cache does not shift (-c is in the message)."""
    if e.new > e.ctx:                       # the message alone: only a larger -c helps
        return ""
    return ("; /reset starts a new conversation"
            + (SHIFT_HINT if not session.m.engine.can_shift else ""))


def reply(session: ChatSession, message: str, n: int, sampling: dict, stop: list[str],
          eprint) -> None:
    """Stream one reply to stdout, then its statistics to stderr."""
    last, wrote = None, False
    try:
        for ev in session.reply(message, n, stop=stop, **sampling):
            sys.stdout.write(ev.text)
            sys.stdout.flush()
            last, wrote = ev, wrote or bool(ev.text)
    except KeyboardInterrupt:
        session.interrupted()
        eprint("\n[interrupted]")
        return
    except PromptTooLong as e:              # the conversation (or the message) is too long
        eprint(("\n" if wrote else "") + f"error: {e}{full_hint(session, e)}")
        return
    except KvrunError as e:
        eprint(("\n" if wrote else "") + f"error: {e}")
        return
    sys.stdout.write("\n")
    sys.stdout.flush()
    if last is not None:
        if last.finish_reason == "context":
            eprint(f"[context full: /reset to start over{SHIFT_HINT if not session.m.engine.can_shift else ''}]")
        t = last.timings
        eprint(f"[{t.prompt_tokens} new prompt tok, {t.prompt_tok_s:.0f} tok/s | "
               f"{t.gen_tokens} tok, {t.gen_tok_s:.1f} tok/s | cache {session.cached} tok]")
