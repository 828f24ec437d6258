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
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["replace_with", "write_bytes", "write_json", "write_text"]


def _temporary_path(path: str) -> str:
    folder, name = os.path.split(os.path.abspath(path))
    return os.path.join(folder, f".{name}.{os.getpid()}.{threading.get_ident()}.tmp")


def replace_with(path: str | os.PathLike[str], write: Callable[[str], object]) -> None:
    """Call write(temporary_path), then rename the temporary file onto `path`."""
    target = os.fspath(path)
    tmp = _temporary_path(target)
    try:
        write(tmp)
        os.replace(tmp, target)
    except BaseException:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise


def write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:
            f.write(data)

    replace_with(path, write)


def write_text(path: str | os.PathLike[str], text: str, encoding: str = "utf-8") -> None:
    # a file name read under a non-UTF-8 locale (LC_ALL=C) holds its bytes as surrogates:
    # written back as those bytes, not an error
    def write(tmp: str) -> None:
        with open(tmp, "w", encoding=encoding, errors="surrogateescape") as f:
            f.write(text)

    replace_with(path, write)


def write_json(path: str | os.PathLike[str], obj: Any, **dump_options: Any) -> None:
    """json.dump(obj) atomically; `dump_options` go to json.dump (indent, default, ...). The text
    is made before the file is opened, so an object that cannot be serialised touches nothing."""
    write_text(path, json.dumps(obj, **dump_options))
