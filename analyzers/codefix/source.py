"""The job's own source read to place an edit (judge layer, fix planning): a file's syntax tree
parsed once per version, the calls in its loops, the statement before its training loop, the
innermost node holding a line, and the per-step edits made inside loops."""

from __future__ import annotations

import ast
import copy
import functools
import os
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from traindx.analyzers.codefix.edit import parses
from traindx.common import untrusted

R = TypeVar("R")
N = TypeVar("N", bound=ast.stmt | ast.expr)  # a node with a place in the file


# -- the job's own source, read to place an edit ---------------------------------------------------
def source_tree(path: str) -> tuple[ast.Module | None, list[str]]:
    """(the file's syntax tree, its lines), parsed once per version of the file: a live
    judgement analyses the same job script at every pass (the tree is only ever read)."""
    try:
        st = os.stat(path)
    except (OSError, ValueError, TypeError):
        return None, []
    return _parsed(path, st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=64)
def _parsed(path: str, mtime_ns: int, size: int) -> tuple[ast.Module | None, list[str]]:
    try:  # this machine's file: never for a folder recorded elsewhere (untrusted)
        text = untrusted.local_text(path)
        return ast.parse(text), text.splitlines()
    except (OSError, SyntaxError, ValueError):
        return None, []


def _per_version(fn: Callable[..., R]) -> Callable[..., R]:
    """`fn(path, *args)` computed once per version of the file (its result copied out)."""

    @functools.lru_cache(maxsize=256)
    def once(path: str, mtime_ns: int, size: int, *args: Any) -> R:
        return fn(path, *args)

    @functools.wraps(fn)
    def wrapper(path: str, *args: Any) -> R:
        try:
            st = os.stat(path)
        except (OSError, ValueError, TypeError):
            return fn(path, *args)
        return copy.deepcopy(once(path, st.st_mtime_ns, st.st_size, *args))

    return wrapper


def is_call_of(node: ast.AST, name: str) -> bool:
    """True for a call `name(...)` or `x.name(...)`, name dotted from the right: gc.collect."""
    if not isinstance(node, ast.Call):
        return False
    parts, func = [], node.func
    while isinstance(func, ast.Attribute):
        parts.insert(0, func.attr)
        func = func.value
    if isinstance(func, ast.Name):
        parts.insert(0, func.id)
    want = name.split(".")
    return parts[-len(want) :] == want


@_per_version
def calls_in_loops(path: str, name: str) -> list[tuple[int, str]]:
    """[(line, source line)] of every statement that is just a call `name(...)` inside a for or
    while loop of the file (the per-step `gc.collect()`, `torch.cuda.empty_cache()`)."""
    tree, lines = source_tree(path)
    out = []
    for loop in ast.walk(tree) if tree is not None else ():
        if not isinstance(loop, (ast.For, ast.While, ast.AsyncFor)):
            continue
        out.extend(
            (node.lineno, lines[node.lineno - 1].strip())
            for node in ast.walk(loop)
            if isinstance(node, ast.Expr) and is_call_of(node.value, name) and node.lineno == node.end_lineno
        )
    return sorted(set(out))


@_per_version
def calls_of(path: str, name: str) -> list[dict[str, Any]]:
    """[{line, last_line, source, args}] of every call `name(...)` (name dotted from the right)
    in the file: the call's own text as written and its positional arguments' texts, first line
    first (torch.set_num_threads(a.threads) -> args ["a.threads"])."""
    tree, lines = source_tree(path)
    text = "\n".join(lines)
    out = [
        {
            "line": node.lineno,
            "last_line": node.end_lineno,
            "source": ast.get_source_segment(text, node),
            "args": [ast.get_source_segment(text, a) for a in node.args],
        }
        for node in (ast.walk(tree) if tree is not None else ())
        if isinstance(node, ast.Call) and is_call_of(node, name) and node.lineno == node.end_lineno
    ]
    return sorted(out, key=lambda c: c["line"])


def _steps_inside(node: ast.AST) -> bool:
    return any(is_call_of(n, "step") or is_call_of(n, "backward") for n in ast.walk(node))


@_per_version
def before_training_loop(path: str) -> tuple[int, int, str] | None:
    """(first line, last line, source of the first line, or of the whole statement when it is a
    compound one) of the statement just before the outermost loop that steps an optimizer or calls backward (in the same block), where set-up
    ends; None when there is no such loop or it opens its block."""
    tree, lines = source_tree(path)
    if tree is None:
        return None
    best = None
    for parent in ast.walk(tree):
        for field_name in ("body", "orelse", "finalbody"):
            body = getattr(parent, field_name, None)
            if not isinstance(body, list):
                continue
            for i, node in enumerate(body):
                if isinstance(node, (ast.For, ast.While)) and _steps_inside(node) and i > 0:
                    prev = body[i - 1]
                    if best is None or prev.lineno < best[0]:
                        last = prev.end_lineno or prev.lineno
                        first_line = lines[prev.lineno - 1].strip()
                        # a compound statement (`if args.x:` and its block) is named whole: its
                        # first line alone is no code an edit could check
                        text = (
                            first_line
                            if parses(first_line)
                            and not isinstance(prev, (ast.If, ast.For, ast.While, ast.With, ast.Try))
                            else "\n".join(lines[prev.lineno - 1 : last])
                        )
                        best = (prev.lineno, last, text)
    return best


def innermost_node(tree: ast.AST, line: int, kinds: type[N] | tuple[type[N], ...]) -> N | None:
    """The innermost node of one of `kinds` whose lines hold `line`, or None."""
    best = None
    for node in ast.walk(tree):
        if (
            isinstance(node, kinds)
            and node.lineno <= line <= (node.end_lineno or node.lineno)
            and (best is None or node.lineno >= best.lineno)
        ):
            best = node
    return best


LOOP_NODES = (ast.For, ast.While, ast.AsyncFor)


def shifted(node: N, lineno: int) -> N:
    """A copy of node's position on line 1 (get_source_segment of one line of text)."""
    node = copy.copy(node)
    node.lineno = node.end_lineno = 1
    return node


def edits_in_loops(
    tree: ast.AST,
    scopes: Sequence[Sequence[ast.AST]],
    kind: type[N],
    edit: Callable[[N, Sequence[str], str], dict[str, Any] | None],
    lines: Sequence[str],
    path: str,
) -> list[dict[str, Any]]:
    """The edits `edit(node, lines, path)` makes of the `kind` nodes inside a loop (per step),
    from the first of `scopes` (node lists, narrowest first) that has any, in line order."""
    loops = [n for n in ast.walk(tree) if isinstance(n, LOOP_NODES)]

    def in_loop(node: N) -> bool:
        return any(l.lineno < node.lineno <= (l.end_lineno or l.lineno) for l in loops)

    for nodes in scopes:
        out: list[dict[str, Any]] = []
        for node in nodes:
            if isinstance(node, kind) and in_loop(node):
                change = edit(node, lines, path)
                if change and change not in out:
                    out.append(change)
        if out:
            return sorted(out, key=lambda c: c["line"])
    return []


def imports_torch(tree: ast.AST) -> bool:
    """The module binds the name `torch` (import torch, import torch as torch)."""
    return any(
        isinstance(n, ast.Import) and any(a.name == "torch" and a.asname in (None, "torch") for a in n.names)
        for n in ast.walk(tree)
    )


def shifted_col(node: N, src: str) -> N:
    """node's position in src.strip() (one line)."""
    node = copy.copy(node)
    shift = len(src.encode("utf-8")) - len(src.lstrip().encode("utf-8"))
    node.lineno = node.end_lineno = 1
    node.col_offset -= shift
    node.end_col_offset = (node.end_col_offset or 0) - shift
    return node
