"""Compiles seen in py-spy stacks alone: which compiler, which kernel, on which thread, how long.

For jobs traindx could not instrument (attach mode, or a py-spy file a user already has). A
sample is compiling when its stack goes through a JIT compiler's own code (the signatures
below). Consecutive compiling samples of one thread form one compile; a new one starts when the
call site changes or when the compiler's code goes back to an earlier line of the same function
(its pipeline restarted: a new compile). py-spy's speedscope keeps sample order but no
timestamps, so compiles are counted per call site, not placed on a clock.
"""

from __future__ import annotations

import collections
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from traindx.analyzers.core import evidence as ev
from traindx.profiler import speedscope

if TYPE_CHECKING:  # annotations only
    from traindx.profiler.speedscope import Frame, Recording, ThreadSamples

# (kind, a frame's file path, its function name or None for any): the outermost match on a
# stack decides the kind. Only the compilers' own compile paths: torch/_dynamo's eval_frame
# wrappers and a compiled graph's call run on every step and are not compiles.
SIGNATURES = (
    ("dynamo", re.compile(r"[/\\]torch[/\\]_dynamo[/\\](convert_frame|symbolic_convert)\.py$"), None),
    ("inductor", re.compile(r"[/\\]torch[/\\]_inductor[/\\]compile_fx\.py$"), None),
    (
        "triton_autotune",
        re.compile(r"[/\\]triton[/\\]runtime[/\\]autotuner\.py$"),
        re.compile(r"bench|prune"),
    ),
    (
        "cute_dsl",
        re.compile(r"[/\\]cutlass[/\\]base_dsl[/\\](compiler|dsl)\.py$"),
        re.compile(r"compile|generate_mlir|_func"),
    ),
    ("triton", re.compile(r"[/\\]triton[/\\]compiler[/\\]compiler\.py$"), re.compile(r"compile")),
)
COMPILER_PATH = re.compile(
    r"[/\\](cutlass[/\\]base_dsl|triton[/\\](compiler|runtime)|torch[/\\]_inductor|"
    r"torch[/\\]_dynamo|cutlass[/\\]cute)[/\\]"
)
FA4_PATH = re.compile(r"[/\\]flash_attn[/\\]cute[/\\]")
# FA4 helper modules: not the kernel being built
FA4_HELPERS = {
    "__init__.py",
    "interface.py",
    "utils.py",
    "tile_scheduler.py",
    "mask.py",
    "softmax.py",
    "pipeline.py",
    "cute_dsl_utils.py",
    "seqlen_info.py",
    "block_info.py",
    "named_barrier.py",
    "fast_math.py",
    "cache_utils.py",
    "testing.py",
    "copy_utils.py",
}
# py-spy --threads root frames: 'thread (0x7f…)', 'thread (718): MainThread'


@dataclass
class Compile:
    """One compile seen in the samples of one thread."""

    thread: str
    kind: str
    site: tuple[Any, ...]  # the frames that asked for the compile (innermost last)
    first_sample: int
    samples: int = 0
    seconds: float = 0.0
    kernel_files: collections.Counter[str] = field(default_factory=collections.Counter)

    @property
    def site_frame(self) -> Any:
        return _site_frame(self.site)

    @property
    def site_label(self) -> Any:
        frame = self.site_frame
        return f"{frame.name} ({_short(frame.file)}:{frame.line})" if frame else "?"

    @property
    def kernel_file(self) -> Any:
        return self.kernel_files.most_common(1)[0][0] if self.kernel_files else None

    @property
    def function(self) -> Any:
        frame = self.site_frame
        return frame.name if frame else None


def _short(path: str) -> Any:
    """A path from its package on: '.../site-packages/flash_attn/cute/x.py' -> 'flash_attn/cute/x.py'."""
    m = re.search(r"[/\\](site|dist)-packages[/\\](.+)$", path or "")
    if m:
        return m.group(2)
    m = re.search(r"[/\\]((flash_attn|cutlass|triton|torch)[/\\].+)$", path or "")
    return m.group(1) if m else path


def strip_thread_root(stack: Sequence[Frame]) -> tuple[Sequence[Frame], str | None]:
    """(stack without py-spy's thread root frames, thread name found there or None)."""
    name = None
    while stack and not stack[0].file:
        root = speedscope.root_frame(stack[0].name)
        if root is None or root[0] is None:  # a "process N:" frame is not a thread's root
            break
        name = name or root[1]
        stack = stack[1:]
    return stack, name


def classify(stack: Sequence[Frame]) -> tuple[str, int] | None:
    """(kind, index of the outermost compiler frame) of a compiling sample, else None."""
    for i, frame in enumerate(stack):
        for kind, path, function in SIGNATURES:
            if frame.file and path.search(frame.file) and (function is None or function.search(frame.name)):
                return kind, i
    return None


SITE_DEPTH = 4  # frames above the compiler that tell one call site from another


def _site(stack: Sequence[Frame], entry: Any) -> Any:
    """The frames that called into the compiler (innermost last), up to SITE_DEPTH: two calls
    of one helper from different lines of its caller are different kernels."""
    callers = [f for f in stack[:entry] if not COMPILER_PATH.search(f.file or "")]
    return tuple(callers[-SITE_DEPTH:])


def _site_frame(site: Any) -> Any:
    """The frame to name a site by: FA4's interface function (_flash_attn_fwd/_flash_attn_bwd)
    when it is on the stack, else the direct caller of the compiler."""
    for frame in site:
        if frame.name.startswith("_flash_attn_") and FA4_PATH.search(frame.file or ""):
            return frame
    return site[-1] if site else None


PIPELINE_DEPTH = 5  # the compiler's stage functions below its entry (deeper code loops)


def _restarted(previous: Any, stack: Sequence[Frame], entry: Any) -> Any:
    """True when `stack` is a new compile after `previous` at the same site: at the first frame
    where they differ, within the compiler's pipeline functions near its entry (deeper code
    loops), the same function is at an earlier line."""
    for a, b in zip(previous[entry : entry + PIPELINE_DEPTH], stack[entry : entry + PIPELINE_DEPTH]):
        if a == b:
            continue
        return (
            a.name == b.name
            and a.file == b.file
            and b.line < a.line
            and COMPILER_PATH.search(a.file or "") is not None
        )
    return False


MAX_GAP = 2  # non-compiling samples tolerated inside one compile
PARTIAL_STACK = 3  # py-spy sometimes unwinds only the innermost frames of a sample


def compiles_of_thread(thread: str, samples: ThreadSamples) -> list[Compile]:
    """The compiles in one thread's samples, in sample order."""
    found, current, previous, gap = [], None, None, 0
    for index, (stack, weight) in enumerate(zip(samples.stacks, samples.weights)):
        stack, _ = strip_thread_root(stack)
        if len(stack) <= PARTIAL_STACK:  # py-spy lost (most of) this stack: no evidence either way
            continue
        if ev.is_import_sample(stack):
            # start-up imports are not compiles; a lazy import inside a compile does not end it
            if current is not None and classify(stack):
                current.samples += 1
                current.seconds += weight
            continue
        hit = classify(stack)
        if hit is None:
            gap += 1
            if gap > MAX_GAP:
                current = previous = None
            continue
        gap = 0
        kind, entry = hit
        site = _site(stack, entry)
        same = (
            current is not None
            and current.kind == kind
            and current.site == site
            and not _restarted(previous, stack, entry)
        )
        if not same or current is None:
            current = Compile(thread=thread, kind=kind, site=site, first_sample=index)
            found.append(current)
        current.samples += 1
        current.seconds += weight
        for frame in stack[entry:]:
            base = os.path.basename(frame.file or "")
            if FA4_PATH.search(frame.file or "") and base not in FA4_HELPERS:
                current.kernel_files[_short(frame.file)] += 1
        previous = stack
    return found


def thread_names(recording: Recording) -> dict[str, str]:
    """{speedscope label: readable thread name} from py-spy's labels and root frames."""
    names = {}
    for label, samples in recording.items():
        tid, name = ev.thread_key(label)
        for stack in samples.stacks[:2000]:
            _, root_name = strip_thread_root(stack)
            if root_name:
                name = name or root_name
                break
        names[label] = name or f"thread {tid}"
    return names


def main_thread_label(recording: Recording) -> str | None:
    """The main thread: named MainThread, else the one whose stacks start at a module's top level
    (`<module>`), else the one with the most samples."""
    names = thread_names(recording)
    for label, name in names.items():
        if name == "MainThread":
            return label
    for label, samples in recording.items():
        for stack in samples.stacks[:2000]:
            stack, _ = strip_thread_root(stack)
            if stack and stack[0].name == "<module>":
                return label
    if not recording:
        return None
    return max(recording, key=lambda label: sum(recording[label].weights))


@dataclass
class SiteSummary:
    """All compiles of one call site on one thread."""

    thread: str
    is_main_thread: bool
    kind: str
    site_label: str
    function: str
    kernel_file: str | None
    compiles: list[Compile]
    total_seconds: float
    thread_seconds: float  # all samples of that thread (outside imports)
    recording_seconds: float  # all samples of the recording (outside imports)

    @property
    def count(self) -> Any:
        return len(self.compiles)

    @property
    def recompiles(self) -> Any:
        return self.compiles[1:]


def summarize(recording: Recording) -> list[SiteSummary]:
    """[SiteSummary] of every compiling call site in a recording ({label: ThreadSamples})."""
    names = thread_names(recording)
    main = main_thread_label(recording)
    recording_s = sum(ev.training_weight(s) for s in recording.values())
    out = []
    for label, samples in recording.items():
        by_site = collections.OrderedDict()
        for c in compiles_of_thread(names[label], samples):
            by_site.setdefault((c.kind, c.site), []).append(c)
        thread_s = ev.training_weight(samples)
        for (kind, _), group in by_site.items():
            files = collections.Counter()
            for c in group:
                files.update(c.kernel_files)
            out.append(
                SiteSummary(
                    thread=names[label],
                    is_main_thread=label == main,
                    kind=kind,
                    site_label=group[0].site_label,
                    function=group[0].function,
                    kernel_file=files.most_common(1)[0][0] if files else None,
                    compiles=group,
                    total_seconds=sum(c.seconds for c in group),
                    thread_seconds=thread_s,
                    recording_seconds=recording_s,
                )
            )
    return out


def gil_share_compiling(recording_gil: Recording | None, thread_name: str) -> tuple[float, float] | None:
    """Seconds the thread held the GIL while compiling, and all seconds of the --gil recording
    (start-up imports excluded)."""
    if not recording_gil:
        return None
    names = thread_names(recording_gil)
    compiling = total = 0.0
    for label, samples in recording_gil.items():
        for stack, weight in zip(samples.stacks, samples.weights):
            if ev.is_import_sample(stack):
                continue
            total += weight
            if names[label] == thread_name and classify(strip_thread_root(stack)[0]):
                compiling += weight
    return compiling, total
