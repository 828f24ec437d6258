"""The job's own source files, as the record names them (a frame's file and line, a script of the
command): the one reader of them for the judge. Each file is read once per version (its mtime and
size): a live judgement reads the same script at every pass. A file that cannot be read here (gone,
another machine's path, not text, not a regular file, or any file of this machine while a folder
recorded elsewhere is loaded: common/untrusted.py) reads as None or empty, never as an error."""

from __future__ import annotations

import functools
import os

from traindx.common import untrusted


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
