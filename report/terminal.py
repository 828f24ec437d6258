"""Terminal output: the live status line while a job runs and the ranked summary after it."""
import glob
import json
import os
import sys
import threading
import time

from rich.console import Console
from rich.live import Live
from rich.table import Table
from rich.text import Text


class EventTail:
    """Follows events/*.jsonl as the shim writes them: step count, last step time, compiles."""

    def __init__(self, run_dir):
        self.run_dir = run_dir
        self.offsets = {}
        self.step = 0
        self.last_step_s = None
        self.compiles = 0

    def poll(self):
        for path in glob.glob(os.path.join(self.run_dir, "events", "*.jsonl")):
            try:
                with open(path, encoding="utf-8") as f:
                    f.seek(self.offsets.get(path, 0))
                    chunk = f.read()
            except OSError:
                continue
            complete = chunk[: chunk.rfind("\n") + 1]
            self.offsets[path] = self.offsets.get(path, 0) + len(complete.encode())
            for line in complete.splitlines():
                try:
                    e = json.loads(line)
                except ValueError:
                    continue
                if e.get("type") == "step_end":
                    self.step = max(self.step, e["step"] + 1)
                    self.last_step_s = e.get("duration_s")
                elif e.get("type") == "compile":
                    self.compiles += 1


class LiveStatus:
    def __init__(self, run_dir, enabled=True):
        self.enabled = enabled
        self.tail = EventTail(run_dir)
        self.start = time.time()
        self.console = Console(file=sys.stderr)
        self._live = None
        self._stop = threading.Event()

    def _render(self):
        self.tail.poll()
        last = "-" if self.tail.last_step_s is None else f"{self.tail.last_step_s:.3f} s"
        return Text(f"traindx ▸ {time.time() - self.start:6.0f} s elapsed │ step "
                    f"{self.tail.step} │ last step {last} │ compiles {self.tail.compiles}",
                    style="bold cyan")

    def __enter__(self):
        if self.enabled:
            self._live = Live(self._render(), console=self.console, refresh_per_second=2,
                              transient=True, get_renderable=self._render)
            self._live.__enter__()
        return self

    def __exit__(self, *exc):
        if self._live is not None:
            self._live.__exit__(*exc)

    def print_line(self, stream, text):
        if self._live is not None:
            self._live.console.print(text, markup=False, highlight=False, emoji=False)
        else:
            out = sys.stdout if stream == "o" else sys.stderr
            out.write(text + "\n")
            out.flush()


SEVERITY_STYLE = {"critical": "bold red", "high": "red", "medium": "yellow", "low": "cyan",
                  "info": "dim"}


def print_summary(run, findings, report_path=None, console=None):
    console = console or Console(file=sys.stderr)
    steps = run.steps
    console.rule("traindx")
    if len(steps):
        med = steps["duration_s"].median()
        console.print(f"{len(steps)} steps recorded on {len(run.ranks)} rank(s); "
                      f"median step {med:.3f} s", markup=False)
    else:
        console.print("no optimizer steps were recorded", markup=False)
    shown = [f for f in findings if f.severity != "info"] or findings[:3]
    if not shown:
        console.print("No problems found.", style="green")
    else:
        top = shown[0]
        if top.prescriptions:
            p = top.prescriptions[0]
            gain = (f" (expected gain ≈ {p.expected_gain_s_per_step:.2f} s/step)"
                    if p.expected_gain_s_per_step else "")
            console.print(Text("Verdict: " + p.summary + gain, style="bold"))
        table = Table(show_header=True, header_style="bold")
        table.add_column("severity")
        table.add_column("finding")
        table.add_column("lost/step", justify="right")
        table.add_column("first prescription")
        for f in shown[:8]:
            lost = "-" if f.seconds_lost_per_step is None else f"{f.seconds_lost_per_step:.3f} s"
            table.add_row(Text(f.severity, style=SEVERITY_STYLE.get(f.severity, "")),
                          Text(f.title), lost,
                          Text(f.prescriptions[0].summary if f.prescriptions else ""))
        console.print(table)
    if report_path:
        console.print(f"report: {report_path}", markup=False)
    console.print(f"run: {run.path}", markup=False)
