"""rich's Console for everything diagnose prints: a reader that went away (`diagnose ... 2>&1 |
head`) silences it. rich's default ends the program (SystemExit(1), after swapping stdout for
/dev/null): diagnose's own lines would then change the job's exit code and drop the job's later
output, which the job's caller may still be reading on the other stream."""

from rich.console import Console as RichConsole


class Console(RichConsole):
    def on_broken_pipe(self) -> None:
        self.quiet = True  # nothing more from this console; the job's bytes go on unchanged
