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
import stat
import tempfile
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


def _written_through(target: str) -> bool:
    """A path the user named that is not a regular file (a link such as /dev/stdout, a device
    such as /dev/null, a FIFO) is written through, as a shell's `>` would: renamed onto, it
    would be replaced (as root, /dev/null itself). A block device is never an output."""
    try:
        st = os.lstat(target)
    except OSError:
        return False
    if stat.S_ISREG(st.st_mode) and st.st_nlink > 1:
        return True  # another name shares its content: a rename would leave that one behind
    if stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode):
        return False
    try:
        if stat.S_ISBLK(os.stat(target).st_mode):
            raise IsADirectoryError(f"{target} is a block device, not an output file")
    except FileNotFoundError:  # a link to nothing yet: created through it, as `>` does
        pass
    return True


def _write_through(target: str, write: Callable[[str], object]) -> None:
    """write() into a private temporary file, then its bytes into target (opened as `>` does):
    a failure while making the content leaves the target as it was."""
    fd, tmp = tempfile.mkstemp(prefix=".traindx-out-")
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb") as src, open(target, "wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
    finally:
        try:
            os.remove(tmp)
        except OSError:
            pass


def _keep_mode_and_owner(target: str, tmp: str) -> None:
    """The new file takes the old one's mode (a private 0600 report stays private) and owner."""
    try:
        st = os.stat(target)
    except OSError:
        return
    os.chmod(tmp, stat.S_IMODE(st.st_mode))
    try:
        os.chown(tmp, st.st_uid, st.st_gid)
    except OSError:
        pass  # not ours to give away: the file is the writer's, as any new one would be


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


def replace_with(
    path: str | os.PathLike[str], write: Callable[[str], object], root: Root = None, user_path: bool = False
) -> None:
    """Call write(temporary_path), then rename the temporary file onto `path` (see refuse_links
    for `root`). user_path: a path the user named (-o, --json): a link, device or FIFO there is
    written through instead, as a shell's `>` would (never a link planted in a run folder: those
    are refused, not followed)."""
    if user_path and _written_through(os.fspath(path)):
        _write_through(os.fspath(path), write)
        return
    target = refuse_links(path, root)
    tmp = _temporary_path(target)
    _create_exclusively(tmp)
    try:
        write(tmp)
        if user_path:
            _keep_mode_and_owner(target, tmp)
        os.replace(tmp, target)
    except BaseException:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise


def write_bytes(
    path: str | os.PathLike[str], data: bytes, root: Root = None, user_path: bool = False
) -> None:
    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:
            f.write(data)

    replace_with(path, write, root, user_path)


def write_text(
    path: str | os.PathLike[str],
    text: str,
    encoding: str = "utf-8",
    root: Root = None,
    redact: bool = True,
    user_path: bool = False,
) -> None:
    if redact:
        text = redaction.redact_text(text)

    # a file name read under a non-UTF-8 locale (LC_ALL=C) holds its bytes as surrogates:
    # written back as those bytes, not an error
    def write(tmp: str) -> None:
        with open(tmp, "w", encoding=encoding, errors="surrogateescape") as f:
            f.write(text)

    replace_with(path, write, root, user_path)


def write_lines(path: str | os.PathLike[str], lines: Iterable[str], root: Root = None) -> None:
    """write_text of lines that need not all be in memory at once (each redacted)."""

    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8", errors="surrogateescape") as f:
            for line in lines:
                f.write(redaction.redact_text(line))

    replace_with(path, write, root)


def write_json(
    path: str | os.PathLike[str], obj: Any, root: Root = None, user_path: bool = False, **dump_options: Any
) -> None:
    """json.dump(obj) atomically, every string value redacted; `dump_options` go to json.dump
    (indent, default, ...). The text is made before the file is opened, so an object that
    cannot be serialised touches nothing."""
    write_text(path, json.dumps(redacted(obj), **dump_options), root=root, redact=False, user_path=user_path)


def redacted(obj: Any) -> Any:
    """A JSON-able value with every string value passed through redact_text (keys are ours)."""
    if isinstance(obj, str):
        return redaction.redact_text(obj)
    if isinstance(obj, dict):
        return {k: redacted(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [redacted(v) for v in obj]
    return obj
