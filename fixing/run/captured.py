"""The files of --fix's arms: what an arm wrote in its view (`captured_files`), copied into
place on request (`keep_captured`), the copy mode's private copy of the working folder and its
before/after check, and removal. Split from traindx.fixing.run.confine (which plans the views)."""

from __future__ import annotations

import json
import os
import shutil
import stat
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from traindx.common.copying import clone_or_copy
from traindx.common.errors import UserError
from traindx.profiler.manifest import CAPTURED as CAPTURED  # re-exported: confine.py reads it here

COPY_LIMIT_BYTES = 4 * 1024**3  # copy mode: a working folder larger than this is refused
MAX_FILES = 100000
LINKED_DIRS = {".git", ".hg", ".svn", ".venv", "venv", ".tox", "node_modules"}


def captured_files(arm: str) -> list[tuple[str, str]]:
    """(where the job wrote it, the captured copy) of every regular file an arm wrote."""
    captured = os.path.join(arm, CAPTURED)
    try:
        with open(os.path.join(captured, "zones.json"), encoding="utf-8") as f:
            zones = json.load(f)
    except (OSError, ValueError):
        return []
    out = []
    for name, real in sorted(zones.items()):
        made = _top_state(os.path.join(captured, name)) if name.startswith("top-") else None
        upper = (
            os.path.join(captured, name) if name.startswith("top-") else os.path.join(captured, name, "upper")
        )
        for folder, _, files in os.walk(upper):
            for file in files:
                src = os.path.join(folder, file)
                try:
                    regular = stat.S_ISREG(os.lstat(src).st_mode)  # not a whiteout (a deletion)
                except OSError:
                    continue
                dest = os.path.join(real, os.path.relpath(src, upper))
                if regular and not (name.startswith("top-") and _same(src, dest, made, upper)):
                    out.append((dest, src))
    return out


def _top_state(private: str) -> dict[str, list[int]] | None:
    try:
        with open(private + ".json", encoding="utf-8") as f:
            state: dict[str, list[int]] = json.load(f)
        return state
    except (OSError, ValueError):
        return None


def _same(copy: str, original: str, made: dict[str, list[int]] | None = None, top: str = "") -> bool:
    """A top's copy still as it was made: its size and modification time as recorded when it
    was made (a file of /tmp that another process changed meanwhile is not the arm's), else
    as the original's."""
    if made is not None:
        try:
            now = os.lstat(copy)
        except OSError:
            return False
        return made.get(os.path.relpath(copy, top)) == [now.st_size, now.st_mtime_ns]
    try:
        a, b = os.lstat(copy), os.lstat(original)
    except OSError:
        return False
    return (a.st_size, a.st_mtime_ns) == (b.st_size, b.st_mtime_ns)


def keep_captured(files: Iterable[tuple[str, str]]) -> list[str]:
    """Each captured file copied where the job wrote it; the paths written."""
    done = []
    for real, src in files:
        try:
            os.makedirs(os.path.dirname(real), exist_ok=True)
            shutil.copy2(src, real)
            done.append(real)
        except OSError:
            continue
    return done


def remove(path: str) -> None:
    """rmtree that also clears the mode-0 folders overlayfs leaves in its work folder."""

    def retry(func: Callable[..., Any], p: str, _exc: Any) -> None:
        try:
            os.chmod(os.path.dirname(p), 0o700)
            if os.path.isdir(p) and not os.path.islink(p):
                os.chmod(p, 0o700)
            func(p)
        except OSError:
            pass

    if os.path.lexists(path):
        shutil.rmtree(path, onerror=retry)


# -- copy mode ----------------------------------------------------------------------------------
def copy_tree(root: str, dest: str, exclude: Sequence[str] = ()) -> None:
    """A private copy of root (every file a clone or a copy, never a link back; version-control
    and environment folders, which a job reads, linked as folders); refused in one line when
    root is too large to copy."""
    skip = {os.path.realpath(p) for p in exclude}
    total, count = 0, 0
    for folder, dirs, files in os.walk(root):
        target = os.path.join(dest, os.path.relpath(folder, root))
        os.makedirs(target, exist_ok=True)
        for d in [d for d in dirs if d in LINKED_DIRS]:
            os.symlink(os.path.realpath(os.path.join(folder, d)), os.path.join(target, d))
        dirs[:] = [
            d for d in dirs if d not in LINKED_DIRS and os.path.realpath(os.path.join(folder, d)) not in skip
        ]
        for name in files:
            src, dst = os.path.join(folder, name), os.path.join(target, name)
            if os.path.islink(src):
                os.symlink(os.path.realpath(src), dst)  # the user's own link, to its target
                continue
            if not os.path.isfile(src):
                continue  # a socket, a pipe: nothing a copy can hold
            count += 1
            total += os.path.getsize(src)
            if total > COPY_LIMIT_BYTES or count > MAX_FILES:
                raise UserError(
                    f"--fix: this machine allows no user namespace, and {root} is too large to "
                    f"copy for each arm (over {COPY_LIMIT_BYTES // 1024**3} GB or {MAX_FILES} "
                    "files): run --fix where user namespaces are allowed, or from a smaller folder"
                )
            clone_or_copy(src, dst)


def snapshot(root: str, exclude: Sequence[str] = ()) -> dict[str, tuple[int, int]]:
    """{path: (size, mtime_ns)} of every file under root."""
    skip = {os.path.realpath(p) for p in exclude}
    out = {}
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if os.path.realpath(os.path.join(folder, d)) not in skip]
        for name in files:
            path = os.path.join(folder, name)
            try:
                st = os.lstat(path)
            except OSError:
                continue
            out[path] = (st.st_size, st.st_mtime_ns)
    return out


def changes(before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]]) -> list[str]:
    return sorted(p for p in set(before) | set(after) if before.get(p) != after.get(p))
