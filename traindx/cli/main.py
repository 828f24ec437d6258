"""`diagnose`: one module per subcommand (traindx.cli.commands.*), each with prepare_parser/run.

`diagnose [options] -- <command>` runs a job; `diagnose <subcommand> ...` does the rest.
"""

from __future__ import annotations

import argparse
import importlib
import os
import resource
import signal
import sys
import warnings
from types import ModuleType
from typing import TextIO

from traindx.cli import argtypes
from traindx.common import stdfds
from traindx.common.errors import UserError
from traindx.common.termsafe import safe_std_streams

SUBCOMMANDS = {
    "attach": "attach",
    "analyze": "analyze",
    "report": "report",
    "compare": "compare",
    "card": "card",
    "merge": "merge",
    "watch": "watch",
}
DEFAULT = "run"
INTERNAL_ERROR_EXIT = 1


def _parser_for(name: str) -> tuple[ModuleType, argtypes.ArgumentParser]:
    module = importlib.import_module(f"traindx.cli.commands.{name}")
    prog = "diagnose" if name == DEFAULT else f"diagnose {name}"
    epilog = None
    if name == DEFAULT:  # `diagnose --help` names what else there is
        epilog = (
            "subcommands (diagnose SUBCOMMAND --help):\n"
            + argtypes.subcommand_list(
                {cmd: f"traindx.cli.commands.{mod}" for cmd, mod in SUBCOMMANDS.items()}
            )
            + "\n\nsee also: kernel-cache --help (precompile and manage FA4 kernel caches)"
        )
    parser = argtypes.ArgumentParser(
        prog=prog,
        description=module.__doc__,
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    module.prepare_parser(parser)
    return module, parser


def _show_warning(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: TextIO | None = None,
    line: str | None = None,
) -> None:
    """What traindx skipped or could not do: one line each, on stderr."""
    print(f"diagnose: warning: {argtypes.one_line(message)}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # diagnose is the program: its own file names in UTF-8 (see below)
        _in_utf8_mode()
    with safe_std_streams():  # no control sequence of the job reaches the terminal (termsafe)
        code = _main(argv)
    if argv is None:  # diagnose is the program (not a call in another's process)
        stdfds.quiet_if_reader_left()
        _end_as_the_job(code)
    return code


def _in_utf8_mode() -> None:
    """Under a C/POSIX locale with UTF-8 mode turned off (PYTHONUTF8=0), this process could
    neither encode the UTF-8 file names a run holds (py-spy's frames, the shim's events) nor
    decode a non-ASCII working folder: the job's files would be unreadable and its findings lost.
    diagnose starts itself again in UTF-8 mode, as Python does by itself under a C locale unless
    told otherwise; the job keeps its own environment (PYTHONUTF8=0 included), bytes unchanged."""
    if sys.flags.utf8_mode or sys.getfilesystemencoding().lower().replace("-", "") == "utf8":
        return
    orig = getattr(sys, "orig_argv", None)
    if not orig or not sys.executable:
        return
    try:
        os.execv(sys.executable, [sys.executable, "-X", "utf8", *orig[1:]])
    except OSError:  # left as it is: the paths' findings may be missing, nothing else
        pass


def _end_as_the_job(code: int) -> None:
    """A job killed by a signal ends diagnose by the same signal, once the report is out: the
    caller sees what it would see bare (a shell loop stops at a Ctrl-C'd job, a scheduler reads
    a signal death, not exit 128+N). Without a core of diagnose's own (the job's is the job's)."""
    recording = sys.modules.get("traindx.cli.recording")
    sig = getattr(recording, "JOB_SIGNAL", None)
    if not sig or code != 128 + sig[0]:
        return
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):
            pass
    for step in (
        lambda: resource.setrlimit(resource.RLIMIT_CORE, (0, resource.getrlimit(resource.RLIMIT_CORE)[1])),
        lambda: signal.signal(sig[0], signal.SIG_DFL),  # (SIGKILL has no handler to reset)
        lambda: signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig[0]]),
        lambda: os.kill(os.getpid(), sig[0]),
    ):
        try:
            step()
        except (OSError, ValueError):
            pass
    # still here: a signal whose default is not to end a process; exit 128+N stays


def _main(argv: list[str] | None) -> int:
    stdfds.hold_closed()  # before anything is opened: a closed stdout is never our file's number
    argv = list(sys.argv[1:] if argv is None else argv)
    name = SUBCOMMANDS.get(argv[0], DEFAULT) if argv else DEFAULT
    if name != DEFAULT:
        argv = argv[1:]
    module, parser = _parser_for(name)
    args = parser.parse_args(argv)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("default")
            warnings.showwarning = _show_warning  # restored by catch_warnings
            code: int = module.run(args, parser)
            return code
    except UserError as exc:
        print(f"diagnose: error: {argtypes.one_line(exc)}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("diagnose: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # a bug of traindx: one line (TRAINDX_DEBUG=1 shows the traceback)
        if os.environ.get("TRAINDX_DEBUG"):
            raise
        print(
            f"diagnose: internal error: {type(exc).__name__}: {argtypes.one_line(exc)} "
            "(a bug of traindx; TRAINDX_DEBUG=1 shows where)",
            file=sys.stderr,
        )
        return INTERNAL_ERROR_EXIT


if __name__ == "__main__":
    sys.exit(main())
