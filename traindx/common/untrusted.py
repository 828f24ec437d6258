"""Reading a run folder as untrusted input: every reader of a run folder's files goes through here.

A run folder may be received from someone else or damaged, so what it holds is data to check, not
to trust: a file is read only when it is a regular file reached without a symbolic link (O_NOFOLLOW:
a link to /dev/zero or to the reader's own files is never followed), opened without blocking (a FIFO
or a device never hangs a reader), of a size a recorder writes (a sparse file of terabytes is
refused, not read until memory runs out); a gzipped segment inflates to at most INFLATE_RATIO times
its size (a decompression bomb is refused early, its memory never taken); JSON is parsed with a
bound on nesting (a line nested 200,000 deep is a corrupt line, not a RecursionError). A refusal is
a `Refused`, an OSError: the readers' own handling of an unreadable file (skip it, say so in one
line) applies as it does to a missing one. `folder_links` finds the links a folder holds (its
readers refuse the folder: a linked sub-folder would lead every read elsewhere).
"""

from __future__ import annotations

import errno
import gzip
import io
import json
import os
import re
import socket
import stat
import sys
import warnings
import zlib
from typing import Any

MiB = 1 << 20
# the largest evidence file read: a recorder's file is at most its rank's disk budget (2 GiB by
# default, shared by every file of that rank); twice that is no file traindx wrote
MAX_FILE_BYTES = 4096 * MiB
# a gzipped segment of real evidence inflates ~4-30x (events, logs, py-spy dumps); deflate's own
# limit is ~1000x, which only a crafted (or all-blank) file reaches
INFLATE_RATIO = 100
INFLATE_FLOOR = 16 * MiB  # a small segment may inflate this far whatever its ratio
MAX_DEPTH = 64  # JSON nesting: the deepest event the shim writes is ~5 levels
_CHUNK = 1 * MiB


class Refused(OSError):
    """A file of a run folder that is not read (a link, not a regular file, too large, a
    decompression bomb, nested too deep): an OSError whose strerror says why in a few words."""

    def __init__(self, code: int, why: str, path: str = "") -> None:
        super().__init__(code, why, path)


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISDIR, "a folder"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def open_file(path: str) -> io.BufferedReader:
    """The file at path opened for reading, binary: only a regular file reached without a link
    in its last component (Refused otherwise), never blocking on a FIFO or a device."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # O_NOFOLLOW met a link
            raise Refused(errno.ELOOP, "a symbolic link, not followed", path) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Refused(errno.EINVAL, f"{_kind(st.st_mode)}, not a file", path)
        if st.st_size > MAX_FILE_BYTES:
            raise Refused(errno.EFBIG, f"{st.st_size >> 20} MiB, larger than any evidence file", path)
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _read_capped(f: Any, cap: int, path: str, what: str) -> bytes:
    parts, total = [], 0
    while True:
        chunk = f.read(min(_CHUNK, cap + 1 - total))
        if not chunk:
            return b"".join(parts)
        total += len(chunk)
        if total > cap:
            raise Refused(errno.EFBIG, f"{what} past {cap >> 20} MiB", path)
        parts.append(chunk)


def read_bytes(path: str, limit: int = MAX_FILE_BYTES) -> bytes:
    """The bytes of a plain file of the run folder (open_file's checks; at most `limit`)."""
    with open_file(path) as f:
        return _read_capped(f, limit, path, "grows")


class _Capped(io.RawIOBase):
    """A gzip stream's inflated bytes, refused (Refused) past `cap`: a decompression bomb stops
    at its cap, its memory never taken; a corrupt stream is an OSError, as gzip raises it."""

    def __init__(self, raw: io.BufferedReader, path: str) -> None:
        size = os.fstat(raw.fileno()).st_size
        self._raw, self._path, self._size = raw, path, size
        self._gz = gzip.GzipFile(fileobj=raw, mode="rb")
        self._cap = min(MAX_FILE_BYTES, max(INFLATE_FLOOR, INFLATE_RATIO * size))
        self._total = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        try:
            n = self._gz.readinto(buffer)
        except (EOFError, zlib.error) as exc:
            raise OSError(errno.EIO, f"not a whole gzip file ({exc})", self._path) from None
        self._total += n
        if self._total > self._cap:
            raise Refused(
                errno.EFBIG,
                f"{self._size >> 10} KiB inflating past {self._cap >> 20} MiB (a decompression bomb?)",
                self._path,
            )
        return n

    def close(self) -> None:
        if not self.closed:
            self._gz.close()
            self._raw.close()
        super().close()


def open_gzip(path: str) -> io.BufferedReader:
    """A gzipped file of the run folder opened for reading, inflated: open_file's checks, and
    at most INFLATE_RATIO times its size (INFLATE_FLOOR at least; Refused past it)."""
    raw = open_file(path)
    try:
        return io.BufferedReader(_Capped(raw, path), _CHUNK)
    except BaseException:
        raw.close()
        raise


def read_gzip(path: str) -> bytes:
    """The inflated bytes of a gzipped file of the run folder (open_gzip's cap)."""
    with open_gzip(path) as f:
        return _read_capped(f, MAX_FILE_BYTES, path, "inflates")


def read_text(path: str, limit: int = MAX_FILE_BYTES) -> str:
    """read_bytes as UTF-8 text (invalid bytes shown as U+FFFD; line ends kept as they are)."""
    return read_bytes(path, limit).decode("utf-8", errors="replace")


_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')  # a JSON string, escapes included


def too_deep(text: str | bytes, depth: int = MAX_DEPTH) -> bool:
    """Whether a JSON text nests more than `depth` levels: a count of brackets first (a flat
    line: one pass in C), then the running depth over the text without its strings (numpy)."""
    data = text.encode("utf-8", errors="replace") if isinstance(text, str) else text
    if data.count(b"[") + data.count(b"{") <= depth:
        return False
    import numpy as np  # lazily: only a text with many brackets gets here

    buf = np.frombuffer(_STRING.sub(b"", data), dtype=np.uint8)
    steps = (buf == ord("[")).astype(np.int32) + (buf == ord("{"))
    steps -= (buf == ord("]")).astype(np.int32) + (buf == ord("}"))
    return bool(len(steps)) and int(np.cumsum(steps).max()) > depth


def loads(text: str | bytes, bounded: bool = True) -> Any:
    """json.loads with nesting bounded (MAX_DEPTH; bounded=False: only as deep as Python's own
    recursion limit, for a large document whose reader takes only known fields): deeper is a
    ValueError, as corrupt JSON is."""
    if bounded and too_deep(text):
        raise ValueError(f"JSON nested deeper than {MAX_DEPTH} levels")
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("JSON nested deeper than Python's recursion limit") from None


def load_json(path: str, limit: int = MAX_FILE_BYTES, bounded: bool = True) -> Any:
    """A JSON file of the run folder (open_file's checks, nesting bounded as loads()); a
    ValueError when it is not JSON, an OSError (Refused among them) when it is not read."""
    return loads(read_bytes(path, limit), bounded)


def folder_links(root: str, skip: tuple[str, ...] = ()) -> list[str]:
    """The symbolic links inside root (paths relative to it), links to folders not descended
    into; `skip`: top-level names not walked (--fix's private copies of the job's folders)."""
    found = []
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(folder, name)
            if os.path.islink(path):
                found.append(os.path.relpath(path, root))
        if folder == root:
            dirs[:] = [d for d in dirs if d not in skip]
    return sorted(found)


# -- a folder recorded elsewhere: this machine's files, and the folder's own code -------------
# A run's frames name source files of the machine that recorded it. A folder recorded elsewhere
# (its manifest names another host, or none) makes this process read none of this machine's
# files for it (the same path here may be anything: a key, another user's file), and its
# recorded --log-regex is not run (a pattern can backtrack for ever). The user who copied their
# own run along with its code says so with TRUST_ENV=1 (their word: not repeated).
TRUST_ENV = "TRAINDX_TRUST_RUN"
MAX_SOURCE_BYTES = 64 * MiB
_received: list[str] = []  # run folders recorded on another machine that this process loaded


def recorded_here(manifest: dict[str, Any]) -> bool:
    host = manifest.get("host")
    return isinstance(host, dict) and host.get("hostname") == socket.gethostname()


def trusted(manifest: dict[str, Any]) -> bool:
    """The run was recorded on this machine, or the user says it is theirs (TRUST_ENV=1)."""
    return recorded_here(manifest) or os.environ.get(TRUST_ENV) == "1"


def note_folder(path: str, manifest: dict[str, Any]) -> None:
    """Note a run folder this process analyses: one recorded on another machine (or on an
    unknown one) turns this machine's source files off for the process (open_local)."""
    if not recorded_here(manifest):
        host = manifest.get("host")
        name = host.get("hostname") if isinstance(host, dict) else None
        _received.append(
            f"{path} was recorded on {name!r}" if isinstance(name, str) else f"{path} names no host"
        )


def refuse_local(path: str) -> None:
    """Refuse (Refused) reading a file of this machine while a folder recorded elsewhere is loaded."""
    if _received and os.environ.get(TRUST_ENV) != "1":
        if not _told:  # said once, where it matters: the first source line not read
            _told.append(True)
            warnings.warn(
                f"{_received[0]}: no file of this machine is read for its source lines "
                f"({TRUST_ENV}=1 reads them, for a copy of your own run and code)",
                stacklevel=4,
            )
        raise Refused(errno.EPERM, "the run was recorded on another machine: not read here", path)


_told: list[bool] = []


def fs_path(path: str) -> str | bytes:
    """`path` as this process's file system calls take it. A run names its files in UTF-8 text
    (the shim's writer); under a C/POSIX locale without UTF-8 mode this process cannot encode
    such a name, so it is given as its UTF-8 bytes (what the folder's name is on disk)."""
    try:
        path.encode(sys.getfilesystemencoding(), "surrogateescape")
        return path
    except UnicodeEncodeError:
        return path.encode("utf-8", "surrogateescape")


def open_local(path: str) -> io.BufferedReader:
    """A source file of this machine named by a run's frames, opened for reading: only while no
    folder recorded elsewhere was loaded (note_folder; Refused otherwise), only a regular file
    (a frame naming /dev/zero or a FIFO is never read) of at most MAX_SOURCE_BYTES. Links are
    followed: a source tree's own links (an editable install) are the user's."""
    refuse_local(path)
    fd = os.open(fs_path(path), os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_SOURCE_BYTES:
            raise Refused(errno.EINVAL, "not a source file", path)
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def local_text(path: str) -> str:
    """The text of a source file of this machine (open_local's checks; invalid UTF-8 replaced)."""
    with open_local(path) as f:
        return f.read().decode("utf-8", errors="replace")
