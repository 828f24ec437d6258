"""The planner's edit for a checkpoint written inline: the job's `torch.save(...)` statements
call a helper (inserted after the module's imports) that serializes the state into memory at the
call and writes the file on a thread (traindx.fixing.plan.derived.async_checkpoint_options)."""

from __future__ import annotations

import ast
from collections.abc import Sequence
from typing import Any

from traindx.analyzers.codefix.edit import code_change
from traindx.analyzers.codefix.source import innermost_node, source_tree

BACKGROUND_SAVE = """

import io as _io
import os as _os
import threading as _threading


def _save_in_background(obj, path):
    \"\"\"torch.save of obj as it is now, into memory; the file written on a thread (added by
    traindx --fix: the disk write leaves the training step, and it holds no lock the steps
    need; one write per file at a time; non-daemon, so a run that ends waits for its last
    checkpoint).\"\"\"
    if not isinstance(path, (str, _os.PathLike)):
        return torch.save(obj, path)
    buffer = _io.BytesIO()
    torch.save(obj, buffer)
    pending = _BACKGROUND_SAVES.pop(_os.fspath(path), None)
    if pending is not None:
        pending.join()
    thread = _threading.Thread(target=_write_file, args=(path, buffer))
    thread.start()
    _BACKGROUND_SAVES[_os.fspath(path)] = thread


def _write_file(path, buffer):
    with open(path, "wb") as f:
        f.write(buffer.getbuffer())


_BACKGROUND_SAVES = {}
"""


def _is_torch_save(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Expr)
        and isinstance(node.value, ast.Call)
        and isinstance(node.value.func, ast.Attribute)
        and node.value.func.attr == "save"
        and isinstance(node.value.func.value, ast.Name)
        and node.value.func.value.id == "torch"
    )


def background_save_edits(path: str, lines: Sequence[int]) -> list[dict[str, Any]]:
    """The edits that make the `torch.save(obj, path)` statements at the given lines write on a
    thread: the helper inserted after the module's last top-level import (it needs the module's
    own `import torch`), then each statement calling it. [] when none of the lines is such a
    statement, or the module does not import torch at its top."""
    tree, text = source_tree(path)
    if tree is None:
        return []
    imports = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    if not any(
        isinstance(n, ast.Import) and any(a.name == "torch" and not a.asname for a in n.names)
        for n in imports
    ):
        return []
    calls = []
    for line in lines:
        stmt = innermost_node(tree, line, ast.stmt)
        if stmt is not None and _is_torch_save(stmt) and stmt not in calls:
            calls.append(stmt)
    if not calls:
        return []
    anchor = imports[-1]
    end = anchor.end_lineno or anchor.lineno
    insert = code_change(
        path,
        anchor.lineno,
        "\n".join(text[anchor.lineno - 1 : end]),
        BACKGROUND_SAVE,
        last_line=end if end > anchor.lineno else None,
        op="insert_after",
    )
    if insert is None:
        return []
    out = [insert]
    for stmt in sorted(calls, key=lambda n: n.lineno):
        last = stmt.end_lineno or stmt.lineno
        before = "\n".join(text[stmt.lineno - 1 : last])
        after = before.replace("torch.save(", "_save_in_background(", 1)
        change = code_change(path, stmt.lineno, before, after, last_line=last if last > stmt.lineno else None)
        if change is None:
            return []
        out.append(dict(change, op="replace"))
    return out
