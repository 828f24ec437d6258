"""No secret left in what `--fix` copied: once the loop ends, every text file under the fix
folder that is not one of our run folders (the scratch copies of the job's tree: its config
files, a `.env`, a script holding a key) is rewritten with its secrets hidden (traindx.common.
redact: the job's environment and command line, names and shapes). The arms have run by then;
the copies are only kept for the user to look at, and fix.patch was made before.

A file is rewritten beside and renamed into place, so a copy that is a link to the user's own
file is replaced, never written through; a symbolic link is never followed."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator, Mapping

from traindx.common import redact
from traindx.common.atomic import write_text

MAX_BYTES = 8 << 20  # larger files are data (a checkpoint, a dataset), not configuration
RUN_MARKERS = ("manifest.json", ".traindx.lock")  # a run folder: its recorder redacted it


def _copied_files(root: str) -> Iterator[str]:
    for folder, dirs, files in os.walk(root):
        if folder != root and any(m in files for m in RUN_MARKERS):
            dirs[:] = []
            continue
        if folder == root:
            continue  # fix.json, the patches: written redacted
        for name in files:
            yield os.path.join(folder, name)


def _text_of(path: str) -> str | None:
    try:
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_BYTES:
            return None
        with open(path, "rb") as f:
            data = f.read(MAX_BYTES + 1)
        if b"\0" in data:
            return None
        return data.decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def scrub_copies(root: str, command: list[str], env: Mapping[str, str]) -> list[str]:
    """Hide the secrets of every text file copied under the fix folder `root`; returns one line
    per file that could not be rewritten (the caller warns)."""
    redactor = redact.Redactor.for_job(env, command)
    problems = []
    for path in _copied_files(root):
        text = _text_of(path)
        if not text:
            continue
        clean = redactor.line(text)
        if clean == text:
            continue
        try:
            write_text(path, clean)
        except OSError as exc:
            problems.append(f"{path}: {exc.strerror or exc}")
    return problems
