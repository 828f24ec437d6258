"""Reading py-spy recordings: speedscope JSON, and py-spy's raw (collapsed) format."""

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from traindx.common import untrusted
from traindx.common.errors import UserError

# -- py-spy's thread labels, parsed here and nowhere else -----------------------------------------
# a speedscope profile's name: 'Thread 8485 "MainThread"' (py-spy 0.4 may leave the name empty)
_THREAD_LABEL = re.compile(r'^Thread (?P<tid>\d+|0x[0-9a-fA-F]+)(?: "(?P<name>.*)")?$')
# root frames py-spy --threads puts on a stack: "thread (0x7F…)", "thread (718): MainThread",
# "process 123:"python x.py""
_ROOT_FRAME = re.compile(r"^thread \((?P<tid>0x[0-9a-fA-F]+|\d+)\)(?::\s*(?P<name>.*))?$|^process \d+:")


def parse_thread_label(label: object) -> tuple[str, str] | None:
    """(thread id, thread name) of a py-spy thread label like 'Thread 8485 "MainThread"' (the
    name "" when py-spy left it empty), or None for a label of another shape."""
    m = _THREAD_LABEL.match(str(label or ""))
    return (m["tid"], m["name"] or "") if m else None


def root_frame(name: str | None) -> tuple[str | None, str | None] | None:
    """A py-spy root frame's (thread id or None, thread name or None), or None when `name` is
    a frame of the program. Only frames without a file can be root frames."""
    m = _ROOT_FRAME.match(name or "")
    if not m:
        return None
    return m["tid"], (m["name"] or None)


@dataclass(frozen=True)
class Frame:
    name: str
    file: str
    line: int

    def label(self) -> str:
        return f"{self.name} ({self.file}:{self.line})" if self.file else self.name


@dataclass
class ThreadSamples:
    thread: str
    stacks: list[Sequence[Frame]] = field(default_factory=list)  # each a tuple of Frame, root first
    weights: list[float] = field(default_factory=list)


# a py-spy recording: {thread label: ThreadSamples}
Recording = dict[str, ThreadSamples]


def load(path: str) -> Recording:
    """{thread name: ThreadSamples} from a speedscope or raw py-spy file, read as a run folder's
    file is (traindx.common.untrusted: a link, a FIFO, a device or a file of any size is not)."""
    try:
        raw = untrusted.read_bytes(path)
    except OSError as exc:
        raise UserError(f"cannot read py-spy file {path}: {exc.strerror}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    if text is None or "\x00" in text:  # py-spy writes UTF-8 text only
        raise UserError(f"{path} is not a py-spy recording (binary data)")
    if text.lstrip().startswith("{"):
        return _from_speedscope(path, text)
    return _from_collapsed(path, text)


def _from_speedscope(path: str, text: str) -> Recording:
    try:
        doc = untrusted.loads(text, bounded=False)  # large: only its known fields are read
        frames = [
            Frame(str(f.get("name", "?")), str(f.get("file") or ""), int(f.get("line") or 0))
            for f in doc["shared"]["frames"]
        ]
        threads: Recording = {}
        for profile in doc["profiles"]:
            name = str(profile.get("name", "thread"))
            ts = threads.setdefault(name, ThreadSamples(name))
            weights = profile.get("weights") or [1] * len(profile["samples"])
            for sample, weight in zip(profile["samples"], weights):
                stack = tuple(frames[_index(i)] for i in sample)
                ts.stacks.append(_strip_thread_root(stack))
                ts.weights.append(_weight(weight))
        return threads
    except (ValueError, KeyError, IndexError, TypeError, AttributeError, RecursionError) as exc:
        raise UserError(f"{path} is not a valid speedscope file ({type(exc).__name__}: {exc})") from None


def _index(i: object) -> int:
    """A frame index of a sample: a whole number >= 0 (frames[-1] would be another frame)."""
    if not isinstance(i, int) or isinstance(i, bool) or i < 0:
        raise ValueError(f"frame index {i!r}")
    return i


def _weight(w: object) -> float:
    """A sample's weight: a finite number >= 0 (NaN, a string or -1 would skew every share)."""
    if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w < 0:
        raise ValueError(f"sample weight {w!r}")
    return w


def _strip_thread_root(stack: tuple[Frame, ...]) -> tuple[Frame, ...]:
    """Drop the bare root frames; a named one ('thread (718): MainThread') stays: it is the
    thread's name when the label has none (analyzers/evidence.merge_threads)."""
    while stack and not stack[0].file:
        root = root_frame(stack[0].name)
        if root is None or root[1] is not None:
            break
        stack = stack[1:]
    return stack


_COLLAPSED_FRAME = re.compile(r"^(?P<name>.*?) \((?P<file>[^():]+)(?::(?P<line>\d+))?\)$")


def _from_collapsed(path: str, text: str) -> Recording:
    threads: Recording = {}
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
