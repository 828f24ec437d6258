"""The job's own source files, as the record names them (a frame's file and line, a script of the
command): the one reader of them for the judge. Each file is read once per version (its mtime and
size): a live judgement reads the same script at every pass. A file that cannot be read here (gone,
another machine's path, not text, not a regular file, or any file of this machine while a folder
recorded elsewhere is loaded: common/untrusted.py) reads as None or empty, never as an error."""

from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING

from traindx.common import untrusted
from traindx.profiler.code_paths import is_library_path

if TYPE_CHECKING:  # annotations only
    from traindx.derive.runview import RunView

# events whose `caller` is the job's frame that made the call ({file, line, function}): a setter
# it called (switch), a DataLoader it built, a compile it triggered, a cache it emptied
CALLER_EVENTS = ("switch", "dataloader", "compile", "empty_cache")


def _version(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except (OSError, ValueError, TypeError):
        return None
    return st.st_mtime_ns, st.st_size


@functools.lru_cache(maxsize=128)
def _read(path: str, mtime_ns: int, size: int) -> str | None:
    try:  # a regular file of at most 64 MiB: a frame naming /dev/zero or a FIFO is never read
        return untrusted.local_text(path)
    except (OSError, ValueError):
        return None


def source_text(path: str | None, cwd: str | None = None) -> str | None:
    """The text of the job's file at `path` (relative ones also tried under the job's `cwd`), or
    None when it is not readable here."""
    if not path:
        return None
    for candidate in (path, os.path.join(cwd, path)) if cwd else (path,):
        try:  # asked before the cache: a folder recorded elsewhere may have been loaded since
            untrusted.refuse_local(candidate)
        except OSError:
            return None
        version = _version(candidate)
        if version is not None and os.path.isfile(candidate):
            text = _read(candidate, *version)
            if text is not None:
                return text
    return None


def source_lines(path: str | None, cwd: str | None = None) -> list[str]:
    """The file's lines (no line ends), [] when it is not readable here."""
    text = source_text(path, cwd)
    return text.splitlines() if text is not None else []


def source_line(path: str | None, line: int | None, cwd: str | None = None) -> str | None:
    """Line `line` (1-based) of the job's file, unstripped and without its line end, or None."""
    if line is None or line < 1:
        return None
    lines = source_lines(path, cwd)
    return lines[line - 1] if line <= len(lines) else None


def _paths_of(run: RunView) -> list[object]:
    """The file names the record holds, as recorded (not checked: a record is untrusted input)."""
    paths: list[object] = []
    for type_ in CALLER_EVENTS:
        ev = run.of_type(type_)
        if len(ev) and "caller" in ev:
            paths += [c.get("file") for c in ev["caller"] if isinstance(c, dict)]
    frames = run.of_type("host_frame")  # the shim's samples of the training thread
    if len(frames) and "file" in frames:
        paths += list(frames["file"].dropna().unique())
    for threads in (getattr(run, "pyspy", None) or {}).values():  # py-spy's stacks
        for samples in threads.values():
            paths += list({f.file for stack in samples.stacks for f in stack})
    return paths


def named_files(run: RunView) -> list[str]:
    """The job's own files that its record shows ran, first named first: the callers the shim
    recorded, the frames of its samples of the training thread and of py-spy's stacks (absolute;
    relative ones under the job's cwd). Installed code is left out; no folder is listed, so a
    script beside the job that it never ran is not among them."""

    def build() -> list[str]:
        cwd = run.manifest.get("cwd") or ""
        out: dict[str, None] = {}
        for path in _paths_of(run):
            if not isinstance(path, str) or not path or is_library_path(path):
                continue
            out.setdefault(os.path.normpath(os.path.join(cwd, path)), None)
        return list(out)

    return run.cached("sources.named_files", build)
