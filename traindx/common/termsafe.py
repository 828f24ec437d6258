"""Nothing from the job or a received run folder reaches the user's terminal as a control
sequence. Function names, commands, source lines and log text are the job's: a name holding
`ESC ] 52 ; c ; ...` writes the user's clipboard, `ESC ] 0 ;` retitles the window, `ESC [ 2 J`
clears the screen (rich's markup escaping leaves all three alone).

`for_terminal` is what every such string becomes: terminal_safe, then redacted (traindx.common.
redact: a token on the hot source line is hidden on the terminal as in every file we write).
`terminal_safe` removes ESC sequences (CSI, OSC, DCS/SOS/PM/APC strings, two-character
escapes), their one-byte C1 forms, and every other C0/C1 control but newline and tab. It is
applied at the two places diagnose's own text is written: `SafeStream` wraps sys.stdout and
sys.stderr for every print() of the commands (traindx.cli.main, kernel-cache's main), and
traindx.common.console.Console strips each segment's text before rich adds its own styles
(writing to the raw stream, so those styles survive). The job's own output is relayed as bytes
to the file descriptors (profiler.launcher.write_output) and never passes here.
"""

from __future__ import annotations

import contextlib
import re
import sys
from collections.abc import Iterator
from typing import Any, TextIO

from traindx.common.redact import redact_text

__all__ = ["SafeStream", "for_terminal", "raw_stream", "safe_std_streams", "terminal_safe"]

_ANY = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
_SEQUENCE = re.compile(
    r"\x1b\][^\x07\x1b\x9c\n]*(?:\x07|\x1b\\|\x9c)?"  # OSC ... BEL or ST
    r"|\x1b[PX^_][^\x1b\x9c\n]*(?:\x1b\\|\x9c)?"  # DCS, SOS, PM, APC ... ST
    r"|\x1b\[[0-?]*[ -/]*[@-~]?"  # CSI
    r"|\x1b[ -/]*[0-~]?"  # the other escapes (charset, keypad, ...)
    r"|\x9b[0-?]*[ -/]*[@-~]?"  # CSI as one C1 byte
    r"|[\x90\x98\x9d\x9e\x9f][^\x07\x1b\x9c\n]*(?:\x07|\x9c)?"  # DCS, SOS, OSC, PM, APC as C1
    r"|[\x00-\x08\x0b-\x1f\x7f-\x9f]"  # any other control but \t and \n (\r rewrites a line)
)


def terminal_safe(text: str) -> str:
    """`text` without control sequences or control characters (newline and tab kept)."""
    return _SEQUENCE.sub("", text) if _ANY.search(text) else text


def for_terminal(text: str) -> str:
    """`text` as diagnose may show it: no control sequence, no secret."""
    return redact_text(terminal_safe(text))


class SafeStream:
    """A text stream whose writes go through for_terminal; everything else is the stream's.
    A reader that went away (`diagnose analyze --json RUN | head -1`) silences it, as it does
    traindx.common.console: the command goes on to its end (its files written, the job's exit
    code its own) and stdfds.quiet_if_reader_left keeps the interpreter's exit flush quiet."""

    def __init__(self, raw: TextIO) -> None:
        self.raw = raw
        self.reader_left = False

    def write(self, text: str) -> int:
        if not self.reader_left:
            try:
                self.raw.write(for_terminal(text))
            except BrokenPipeError:
                self.reader_left = True
        return len(text)

    def flush(self) -> None:
        if not self.reader_left:
            try:
                self.raw.flush()
            except BrokenPipeError:
                self.reader_left = True

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.raw, name)


def raw_stream(stream: Any) -> Any:
    """The stream under a SafeStream (rich writes its own styles there), else the stream."""
    return stream.raw if isinstance(stream, SafeStream) else stream


@contextlib.contextmanager
def safe_std_streams() -> Iterator[None]:
    """sys.stdout and sys.stderr wrapped in SafeStream while a command runs (once: nested
    commands keep the outer wrapping), restored after."""
    saved = sys.stdout, sys.stderr
    if sys.stdout is not None and not isinstance(sys.stdout, SafeStream):
        sys.stdout = SafeStream(sys.stdout)
    if sys.stderr is not None and not isinstance(sys.stderr, SafeStream):
        sys.stderr = SafeStream(sys.stderr)
    try:
        yield
    finally:
        sys.stdout, sys.stderr = saved
