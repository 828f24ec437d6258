"""One atomic writer: a file is either its old self or its whole new self, never half, and no
temporary file is left behind whatever fails.

The content goes to a temporary file beside the target (same folder, so the rename stays on one
file system), which is renamed onto the target; on any failure the temporary file is removed
and the error is re-raised for the caller to report. The temporary name carries the process
and thread, so two writers of one path never write into each other's temporary file.
(The in-job shim cannot import traindx and keeps its own writer: profiler/shim/_traindx_shim.)
"""

from __future__ import annotations

import json
import os
import stat
import tempfile
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["replace_with", "write_bytes", "write_json", "write_text"]


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


def replace_with(
    path: str | os.PathLike[str], write: Callable[[str], object], user_path: bool = False
) -> None:
    """Call write(temporary_path), then rename the temporary file onto `path`. user_path: a
    path the user named (-o, --json): a link, device or FIFO there is written through instead
    (never a link planted in a run folder: those are refused, not followed)."""
    target = os.fspath(path)
    if user_path and _written_through(target):
        _write_through(target, write)
        return
    tmp = _temporary_path(target)
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


def write_bytes(path: str | os.PathLike[str], data: bytes, user_path: bool = False) -> None:
    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:
            f.write(data)

    replace_with(path, write, user_path)


def write_text(
    path: str | os.PathLike[str], text: str, encoding: str = "utf-8", user_path: bool = False
) -> None:
    # a file name read under a non-UTF-8 locale (LC_ALL=C) holds its bytes as surrogates:
    # written back as those bytes, not an error
    def write(tmp: str) -> None:
        with open(tmp, "w", encoding=encoding, errors="surrogateescape") as f:
            f.write(text)

    replace_with(path, write, user_path)


def write_json(path: str | os.PathLike[str], obj: Any, user_path: bool = False, **dump_options: Any) -> None:
    """json.dump(obj) atomically; `dump_options` go to json.dump (indent, default, ...). The text
    is made before the file is opened, so an object that cannot be serialised touches nothing."""
    write_text(path, json.dumps(obj, **dump_options), user_path=user_path)
