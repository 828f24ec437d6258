"""rich's Console for everything diagnose prints.

A reader that went away (`diagnose ... 2>&1 | head`) silences it. rich's default ends the program
(SystemExit(1), after swapping stdout for /dev/null): diagnose's own lines would then change the
job's exit code and drop the job's later output, which the job's caller may still be reading on
the other stream.

Every string printed, and every segment's text, goes through for_terminal (traindx.common.
termsafe: control sequences stripped, secrets redacted) before rich adds its own styles: function
names, commands and source lines from the job reach no terminal as control sequences or with a
token in them, whatever the caller of print() forgot. It writes to the raw stream under a SafeStream,
so rich's own colours are kept."""

from collections.abc import Iterable
from typing import IO, Any

from rich.console import Console as RichConsole
from rich.errors import MarkupError
from rich.segment import Segment
from rich.text import Text

from traindx.common.termsafe import for_terminal, raw_stream


class Console(RichConsole):
    def on_broken_pipe(self) -> None:
        self.quiet = True  # nothing more from this console; the job's bytes go on unchanged

    @property
    def file(self) -> IO[str]:
        stream: IO[str] = raw_stream(RichConsole.file.fget(self))  # type: ignore[attr-defined]
        return stream

    @file.setter
    def file(self, new_file: IO[str]) -> None:
        RichConsole.file.fset(self, new_file)  # type: ignore[attr-defined]

    def render_str(self, text: str, **options: Any) -> Text:
        # before markup and highlighting split a sequence over segments of different styles
        shown = for_terminal(text)
        try:
            return super().render_str(shown, **options)
        except MarkupError:  # a redaction took a closing tag with the value: shown as plain text
            return super().render_str(shown, **dict(options, markup=False))

    def _render_buffer(self, buffer: Iterable[Segment]) -> str:
        # rich's own control segments (cursor moves of a live display) are kept; text is not
        safe = (
            Segment(for_terminal(text), style, control) if not control else Segment(text, style, control)
            for text, style, control in buffer
        )
        rendered: str = super()._render_buffer(safe)
        return rendered
