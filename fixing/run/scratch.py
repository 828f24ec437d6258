"""The scratch copy a `--fix` candidate runs from, the user's files untouched: the job's source
tree is copied into the fix folder and the planned edits (traindx.fixing.plan.source) written
there. Python files and small files are copied; large files (data, checkpoints) are cloned
(copy-on-write) or copied, never linked back to the user's file, unless the arm runs in a private
view of the file system (`link_big`: traindx.fixing.run.confine's namespace, where a link resolves
to that view and a write through it is the arm's own). Version-control, virtual-environment, cache
and run folders are left out."""

from __future__ import annotations

import ast
import os
import shutil
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from traindx.analyzers.core.evidence import SKIP_DIRS
from traindx.common.copying import clone_or_copy
from traindx.fixing.plan.source import PatchError, check_bindings, patched_text, unified_diff

COPY_LIMIT_BYTES = 2 * 1024 * 1024
# the large files of a scratch copy, cloned or copied: past this many bytes they are linked
# (link_big) or the copy is refused
BIG_COPY_BUDGET_BYTES = 2 * 1024**3
MAX_FILES = 20000


def copy_tree(root: str, dest: str, exclude: Iterable[str | None] = (), link_big: bool = False) -> int:
    """Copy the job's tree: every file cloned (copy-on-write) or copied, never linked back to
    the user's file; past BIG_COPY_BUDGET_BYTES of large files, those are linked when the arm
    runs in a private view (link_big: a write through the link is the view's), else the copy
    is refused. Returns the number of files."""
    exclude = {os.path.realpath(p) for p in exclude if p}
    count, big = 0, 0
    for folder, dirs, files in os.walk(root):
        dirs[:] = [
            d
            for d in dirs
            if d not in SKIP_DIRS
            and not d.endswith(".egg-info")
            and os.path.realpath(os.path.join(folder, d)) not in exclude
        ]
        rel = os.path.relpath(folder, root)
        target = os.path.join(dest, rel) if rel != "." else dest
        os.makedirs(target, exist_ok=True)
        for name in files:
            src = os.path.join(folder, name)
            dst = os.path.join(target, name)
            count += 1
            if count > MAX_FILES:
                raise PatchError(f"{root} holds over {MAX_FILES} files: too big to copy")
            try:
                size = os.path.getsize(src)
                if os.path.islink(src):
                    os.symlink(os.path.realpath(src), dst)  # the user's own link, to its target
                    continue
                if size > COPY_LIMIT_BYTES:
                    big += size
                if big > BIG_COPY_BUDGET_BYTES and size > COPY_LIMIT_BYTES:
                    if not link_big:
                        raise PatchError(
                            f"{root} holds over {BIG_COPY_BUDGET_BYTES // 1024**3} GB of large "
                            "files: too big to copy, and a link would let the candidate write "
                            "into them (no private view here)"
                        )
                    os.symlink(os.path.realpath(src), dst)
                else:
                    clone_or_copy(src, dst)
            except OSError:
                continue
    return count


def make_scratch(
    root: str,
    dest: str,
    edits: Sequence[Mapping[str, Any]],
    exclude: Iterable[str | None] = (),
    link_big: bool = False,
) -> str:
    """The scratch copy with the edits made; returns the diff (fix.patch's text)."""
    diff = unified_diff(root, edits)
    if os.path.exists(dest):
        shutil.rmtree(dest)
    copy_tree(root, dest, exclude, link_big=link_big)
    by_file = {}
    for e in edits:
        by_file.setdefault(os.path.realpath(e["file"]), []).append(e)
    for path, file_edits in by_file.items():
        copy = os.path.join(dest, os.path.relpath(path, root))
        check_bindings(path, file_edits)  # a patch never unbinds a name the program assigns
        text = patched_text(path, file_edits)
        if path.endswith(".py"):
            try:
                ast.parse(text)
            except SyntaxError as exc:
                raise PatchError(
                    f"the edited {os.path.basename(path)} does not parse: {exc.msg} at line {exc.lineno}"
                ) from None
        if os.path.islink(copy):
            os.unlink(copy)
        with open(copy, "w", encoding="utf-8") as f:
            f.write(text)
    return diff
