"""How every `kvrun` command ends: the click group that turns each way a command can fail
into one `error: …` line on stderr and an exit status (1 for errors, usage errors included;
130 Ctrl-C; 128 + signal for SIGTERM/SIGHUP, after the cleanups `raise_on_signals` lets run;
141 silently when the reader of stdout left). `--debug` re-raises instead."""
from __future__ import annotations

import errno
import os
import signal
import sys

import click

from ..errors import KvrunError, Terminated, raise_on_signals


def eprint(*a, **kw):
    print(*a, file=sys.stderr, flush=True, **kw)


THREADS_HELP = ("Most CPU threads used (default: every CPU this process may run on); fewer "
                "while other processes keep cores busy (KVRUN_THREADS_ADAPT=0: exactly N).")


class ThreadCount(click.IntRange):
    """An integer in 1..MAX_THREADS (runtime/threads.py, read when a value is parsed: that
    module loads torch, and the option is declared when the CLI starts)."""

    def __init__(self):
        super().__init__(1)

    def _load(self) -> None:
        from ..threads import MAX_THREADS
        self.max = MAX_THREADS

    def convert(self, value, param, ctx):
        self._load()
        return super().convert(value, param, ctx)

    def _describe_range(self) -> str:          # a command's --help (loads torch there)
        self._load()
        return super()._describe_range()


def threads_option(f):
    """-t/--threads, the same for every command that computes."""
    return click.option("-t", "--threads", default=None, type=ThreadCount(),
                        help=THREADS_HELP)(f)


def user_errors() -> tuple[type, ...]:
    """The exceptions reported as one `error:` line: KvrunError, and the kernels'
    BackendError (a bad KVRUN_BACKEND) once kvrun.kernels is loaded — looked up, not
    imported, so the CLI starts without torch (it can only be raised after that import)."""
    dispatch = sys.modules.get("kvrun.kernels.dispatch")
    return (KvrunError,) if dispatch is None else (KvrunError, dispatch.BackendError)


def one_line(text: str) -> str:
    return " ".join(text.split())


def _silence_stdout() -> None:
    """Point fd 1 at /dev/null, so the interpreter's final flush of what is still buffered
    for a full disk or a closed pipe does not print a second error."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):   # no real fd (captured output)
        pass


class KvrunGroup(click.Group):
    """Turns every way a command can fail into one stderr line and an exit status.

    `own_signals`: commands that handle SIGTERM/SIGHUP themselves (serve); every other
    command runs under `raise_on_signals`, so a kill removes its temp files as Ctrl-C does."""

    own_signals: set[click.Command] = set()

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, False, **extra)
        try:
            try:
                rv = super().main(args, prog_name, complete_var, False, **extra)
            except click.exceptions.NoArgsIsHelpError as e:     # bare `kvrun`: the help page
                click.echo(e.ctx.get_help())
                rv = 0
            sys.stdout.flush()
        except click.ClickException as e:       # usage: unknown option, bad value, missing -p
            eprint(f"error: {one_line(e.format_message())} (see '{self._help_for(e, args)}')")
            sys.exit(1)
        except click.exceptions.Abort:          # Ctrl-C or end of input while click parses
            eprint("\ninterrupted")
            sys.exit(130)
        except OSError as e:                    # --help or --version into a full disk
            exit_on_os_error(e)
        sys.exit(rv if isinstance(rv, int) else 0)      # an int: click's Exit (--help, --version)

    def _help_for(self, e: click.ClickException, args) -> str:
        """The --help to read after a usage error: the command's when it is known."""
        ctx = getattr(e, "ctx", None)
        if ctx is not None:
            return f"{ctx.command_path} --help"
        words = [a for a in (sys.argv[1:] if args is None else args) if not a.startswith("-")]
        name = words[0] if words and words[0] in self.commands else None
        return f"kvrun {name} --help" if name else "kvrun --help"

    def resolve_command(self, ctx, args):
        name, cmd, rest = super().resolve_command(ctx, args)
        if cmd is not None and cmd not in self.own_signals:
            ctx.with_resource(raise_on_signals())   # until this context closes
        return name, cmd, rest

    def invoke(self, ctx):
        try:
            rv = super().invoke(ctx)
            sys.stdout.flush()                  # a full disk fails here, not at interpreter exit
            return rv
        except user_errors() as e:
            if ctx.params.get("debug"):
                raise
            eprint(f"error: {one_line(str(e))}")
            sys.exit(1)
        except Terminated as e:
            eprint(f"\nterminated ({signal.Signals(e.signum).name})")
            raise
        except KeyboardInterrupt:
            eprint("\ninterrupted")
            sys.exit(130)
        except OSError as e:                    # the environment: stdout, disk, permissions
            if ctx.params.get("debug"):
                raise
            exit_on_os_error(e)
        except (click.ClickException, click.exceptions.Exit, click.exceptions.Abort):
            raise                               # usage errors, --help: `main` reports them
        except Exception as e:                  # a bug, but still one line for the user
            if ctx.params.get("debug"):
                raise
            eprint(f"error: internal error ({type(e).__name__}: {one_line(str(e))[:300]}); "
                   f"`kvrun --debug ...` shows the traceback")
            sys.exit(1)


def exit_on_os_error(e: OSError):
    """One line and status 1; a closed pipe (`| head`: the reader left) quietly, 141."""
    if e.errno == errno.EPIPE:
        _silence_stdout()
        sys.exit(141)
    eprint(f"error: {_os_error(e)}")
    sys.exit(1)


def _os_error(e: OSError) -> str:
    if e.filename and e.strerror:
        return f"{e.filename}: {e.strerror}"
    if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO):
        _silence_stdout()               # most likely stdout itself (`> /dev/full`, a full disk)
        return f"cannot write output: {e.strerror}"
    return one_line(e.strerror or str(e) or repr(e))
