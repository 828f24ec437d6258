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
SUMMARY_ROWS = 6


def _fmt_s(seconds):
    from traindx.report.charts import fmt_s

    return fmt_s(seconds)


def print_summary(run, findings, report_path=None, console=None):
    """The verdict and the top findings, from the same report data as the HTML report."""
    from traindx.report.data import build_summary

    console = console or Console(file=sys.stderr)
    data = build_summary(run, findings)
    v, st = data["verdict"], data["stats"]
    console.rule("traindx")
    if st["steps"]:
        line = (f"{st['steps']} steps recorded on {st['ranks']} rank(s) · median {_fmt_s(st['steady_median_s'])}"
                f" · p90 {_fmt_s(st['p90_step_s'])}")
        w = st["worst_step"]
        if w:
            line += f" · slowest step {w['step']} {_fmt_s(w['duration_s'])}"
            if w["cause"] != "normal":
                line += f" ({data['causes'].get(w['cause'], w['cause'])})"
        if st["compiles"]:
            line += f" · {st['compiles']} JIT compiles, {_fmt_s(st['compile_s'])}"
        console.print(line, markup=False, highlight=False)
        if st.get("ledger_line"):
            console.print(st["ledger_line"], markup=False, highlight=False)
        if st.get("startup_line"):
            console.print(st["startup_line"], markup=False, highlight=False, style="dim")
    else:
        console.print("no optimizer steps were recorded", markup=False)
    if v["kind"] == "change":
        console.print(Text("Verdict: ", style="bold") + Text(v["headline"], style="bold green"))
        if v["gain_s"]:
            gain = f"  expected saving {_fmt_s(v['gain_s'])} per step"
            if v["speedup"]:
                gain += (f" (≈ {v['speedup']:.1f}× faster: {_fmt_s(v['median_step_s'])} → "
                         f"{_fmt_s(v['after_step_s'])} per step)")
            console.print(gain, markup=False, highlight=False)
        if v["text"]:
            for line in v["text"].splitlines()[:6]:
                console.print(Text("  " + line, style="cyan"))
        console.print(Text(f"  why: {v['finding_title']}", style="dim"))
    elif v["kind"] == "problem":
        console.print(Text("Main problem: ", style="bold") + Text(v["headline"], style="bold yellow"))
    elif v["kind"] == "evidence":
        console.print(Text("Where the time went: ", style="bold") + Text(v["headline"], style="bold yellow"))
    elif v["kind"] == "nosteps":
        console.print(Text(v["headline"], style="yellow"))
    else:
        console.print(Text(v["headline"], style="green"))
    problems = [f for f in data["findings"] if f["severity"] != "info"]
    if problems:
        table = Table(show_header=True, header_style="bold")
        table.add_column("severity")
        table.add_column("finding", ratio=3)
        table.add_column("lost/step", justify="right", no_wrap=True)
        table.add_column("first prescription", ratio=2, overflow="ellipsis", max_width=48)
        for f in problems[:SUMMARY_ROWS]:
            lost = "-" if f["seconds_lost_per_step"] is None else _fmt_s(f["seconds_lost_per_step"])
            if f.get("cause"):  # a symptom, printed under its cause: its seconds are the cause's
                lost = f"({lost})"
            title = Text(f"  ↳ symptom: {f['title']}", style="dim") if f.get("cause") else Text(f["title"])
            first = f["prescriptions"][0]["summary"] if f["prescriptions"] else (
                "fix the cause above" if f.get("cause") else "")
            table.add_row(Text(f["severity"], style=SEVERITY_STYLE.get(f["severity"], "")),
                          title, lost, Text(first, no_wrap=True, overflow="ellipsis"))
        console.print(table)
        if len(problems) > SUMMARY_ROWS:
            console.print(f"… and {len(problems) - SUMMARY_ROWS} more in the report", markup=False)
    notes = [f for f in data["findings"] if f["severity"] == "info" and f["id"] != "evidence.missing"]
    for f in notes[:3]:
        console.print(Text(f"note: {f['title']}", style="dim"))
    if data["missing"]:
        console.print(Text("not collected: " + data["missing_summary"], style="dim"))
    if report_path:
        console.print(f"report: {report_path}", markup=False, highlight=False)
    console.print(f"run: {run.path}", markup=False, highlight=False)
