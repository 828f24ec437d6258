"""Reading py-spy recordings: speedscope JSON, and py-spy's raw (collapsed) format."""
import json
import re
from dataclasses import dataclass, field

from traindx.errors import UserError

# py-spy --threads puts "thread (0x7F…)" or "process 123:"python x.py"" frames at the root
_THREAD_FRAME = re.compile(r"^thread \((0x[0-9a-fA-F]+|\d+)\)$|^process \d+:")


@dataclass(frozen=True)
class Frame:
    name: str
    file: str
    line: int

    def label(self):
        return f"{self.name} ({self.file}:{self.line})" if self.file else self.name


@dataclass
class ThreadSamples:
    thread: str
    stacks: list = field(default_factory=list)  # each a tuple of Frame, root first
    weights: list = field(default_factory=list)


def load(path):
    """{thread name: ThreadSamples} from a speedscope or raw py-spy file."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise UserError(f"cannot read py-spy file {path}: {exc.strerror}") from None
    if text.lstrip().startswith("{"):
        return _from_speedscope(path, text)
    return _from_collapsed(path, text)


def _from_speedscope(path, text):
    try:
        doc = json.loads(text)
        frames = [Frame(f.get("name", "?"), f.get("file") or "", int(f.get("line") or 0))
                  for f in doc["shared"]["frames"]]
        threads = {}
        for profile in doc["profiles"]:
            name = profile.get("name", "thread")
            ts = threads.setdefault(name, ThreadSamples(name))
            weights = profile.get("weights") or [1] * len(profile["samples"])
            for sample, weight in zip(profile["samples"], weights):
                stack = tuple(frames[i] for i in sample)
                ts.stacks.append(_strip_thread_root(stack))
                ts.weights.append(weight)
        return threads
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise UserError(f"{path} is not a valid speedscope file ({type(exc).__name__}: {exc})") from None


def _strip_thread_root(stack):
    while stack and not stack[0].file and _THREAD_FRAME.match(stack[0].name):
        stack = stack[1:]
    return stack


_COLLAPSED_FRAME = re.compile(r"^(?P<name>.*?) \((?P<file>[^():]+)(?::(?P<line>\d+))?\)$")


def _from_collapsed(path, text):
    threads = {}
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        stack_text, _, count = line.rpartition(" ")
        if not stack_text or not count.isdigit():
            raise UserError(f"{path}:{n}: not a py-spy raw (collapsed) line")
        parts = stack_text.split(";")
        thread = "MainThread"
        if parts and (parts[0].startswith("thread (") or parts[0].startswith("process ")):
            thread = parts[0]
            parts = parts[1:]
        frames = []
        for part in parts:
            m = _COLLAPSED_FRAME.match(part)
            frames.append(Frame(m["name"], m["file"], int(m["line"] or 0)) if m else Frame(part, "", 0))
        ts = threads.setdefault(thread, ThreadSamples(thread))
        ts.stacks.append(tuple(frames))
        ts.weights.append(int(count))
    if not threads:
        raise UserError(f"{path} holds no py-spy samples")
    return threads
