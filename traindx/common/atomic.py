"""One atomic writer: a file is either its old self or its whole new self, never half, and no
temporary file is left behind whatever fails.

The content goes to a temporary file beside the target (same folder, so the rename stays on one
file system), which is renamed onto the target; on any failure the temporary file is removed
and the error is re-raised for the caller to report. The temporary name carries the process
and thread, so two writers of one path never write into each other's temporary file.

No write goes through a link: a run folder may be received from someone else or sit on shared
storage, and a planted `log.txt -> ~/.bashrc` would otherwise be written through. The target
may not be a symbolic link, and with `root` (the folder the caller writes into, e.g. the run
folder) no component below it may be one and the path may not leave it (`../`); the temporary
file is created exclusively, never through a link (O_EXCL | O_NOFOLLOW). A refusal is
LinkRefused: an OSError for callers that report failed writes, a UserError (one line) for those
that do not.

No secret is written either: every string of a JSON document and the text of write_text pass
through redact.redact_text (a token's shape, `NAME=value` named like a secret), so a token on the
job's hot source line, quoted by a finding, never lands in findings.json. `redact=False` is for
text that must stay byte-exact and holds nothing the job printed or wrote unredacted (a patch to
apply; the HTML report, whose shown strings are redacted where they are made).
(The in-job shim cannot import traindx and keeps its own writer: profiler/shim/_traindx_shim.)
"""

from __future__ import annotations

import errno
import json
import os
import threading
from collections.abc import Callable, Iterable
from typing import Any

from traindx.common import redact as redaction
from traindx.common.errors import UserError

__all__ = [
    "LinkRefused",
    "refuse_links",
    "replace_with",
    "write_bytes",
    "write_json",
    "write_lines",
    "write_text",
]

Root = str | os.PathLike[str] | None


class LinkRefused(OSError, UserError):
    """A write refused because its path holds a symbolic link or leaves its root."""

    def __str__(self) -> str:
        return str(self.strerror)


def refuse_links(path: str | os.PathLike[str], root: Root = None) -> str:
    """The absolute target of a write into `root` (default: the target's own folder), or
    LinkRefused when it leaves root or the target or a folder between root and it is a link."""
    target = os.path.abspath(path)
    base = os.path.abspath(root) if root is not None else os.path.dirname(target)
    rel = os.path.relpath(target, base)
    if rel == os.pardir or rel.startswith(os.pardir + os.sep) or os.path.isabs(rel):
        raise LinkRefused(errno.EACCES, f"{os.fspath(path)} is outside {base}: not written")
    step = base
    for part in rel.split(os.sep):
        step = os.path.join(step, part)
        if os.path.islink(step):
            raise LinkRefused(errno.ELOOP, f"{step} is a symbolic link: not written through")
    return target


def _temporary_path(path: str) -> str:
    folder, name = os.path.split(os.path.abspath(path))
    return os.path.join(folder, f".{name}.{os.getpid()}.{threading.get_ident()}.tmp")


def _create_exclusively(tmp: str) -> None:
    """An empty temporary file of our own: a stale one (a killed writer's) or a planted link in
    its place is removed first, never written through."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(tmp, flags, 0o666)
    except FileExistsError:
        os.remove(tmp)
        fd = os.open(tmp, flags, 0o666)
    os.close(fd)


def replace_with(path: str | os.PathLike[str], write: Callable[[str], object], root: Root = None) -> None:
    """Call write(temporary_path), then rename the temporary file onto `path` (see refuse_links
    for `root`)."""
    target = refuse_links(path, root)
    tmp = _temporary_path(target)
    _create_exclusively(tmp)
    try:
        write(tmp)
        os.replace(tmp, target)
    except BaseException:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise


def write_bytes(path: str | os.PathLike[str], data: bytes, root: Root = None) -> None:
    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:
            f.write(data)

    replace_with(path, write, root)


def write_text(
    path: str | os.PathLike[str], text: str, encoding: str = "utf-8", root: Root = None, redact: bool = True
) -> None:
    if redact:
        text = redaction.redact_text(text)

    # a file name read under a non-UTF-8 locale (LC_ALL=C) holds its bytes as surrogates:
    # written back as those bytes, not an error
    def write(tmp: str) -> None:
        with open(tmp, "w", encoding=encoding, errors="surrogateescape") as f:
            f.write(text)

    replace_with(path, write, root)


def write_lines(path: str | os.PathLike[str], lines: Iterable[str], root: Root = None) -> None:
    """write_text of lines that need not all be in memory at once (each redacted)."""

    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8", errors="surrogateescape") as f:
            for line in lines:
                f.write(redaction.redact_text(line))

    replace_with(path, write, root)


def write_json(path: str | os.PathLike[str], obj: Any, root: Root = None, **dump_options: Any) -> None:
    """json.dump(obj) atomically, every string value redacted; `dump_options` go to json.dump
    (indent, default, ...). The text is made before the file is opened, so an object that
    cannot be serialised touches nothing."""
    write_text(path, json.dumps(redacted(obj), **dump_options), root=root, redact=False)


def redacted(obj: Any) -> Any:
    """A JSON-able value with every string value passed through redact_text (keys are ours)."""
    if isinstance(obj, str):
        return redaction.redact_text(obj)
    if isinstance(obj, dict):
        return {k: redacted(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [redacted(v) for v in obj]
    return obj
