"""The planner's optimizer edit of a job's file (ast): the `torch.optim.<Class>(...)` call that
makes the optimizer a launch-bound step spends its time in, made multi-tensor: `fused=True`
where the class has a fused kernel, else `foreach=True` (traindx.fixing.plan.source)."""

from __future__ import annotations

import ast
import inspect
from typing import Any

from traindx.analyzers.codefix.edit import code_change, set_keywords
from traindx.analyzers.codefix.source import source_tree

OPTIM_MODULES = ("torch.optim", "optim")


def multi_tensor_keyword(class_name: str) -> str | None:
    """ "fused" or "foreach": the keyword of torch.optim's `class_name` that steps every
    parameter in a few kernels (fused first: one kernel per group), read from the installed
    torch's signature; None where the class takes neither or torch is not importable."""
    try:  # torch is optional where a run is analysed (an extra)
        import torch.optim
    except ImportError:
        return None
    cls = getattr(torch.optim, class_name, None)
    if not isinstance(cls, type):
        return None
    try:
        params = inspect.signature(cls).parameters
    except (TypeError, ValueError):
        return None
    for keyword in ("fused", "foreach"):
        if keyword in params:
            return keyword
    return None


def _imported_from_optim(tree: ast.AST, name: str) -> bool:
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.ImportFrom)
            and node.module == "torch.optim"
            and any((a.asname or a.name) == name and a.name == name for a in node.names)
        ):
            return True
    return False


def _defines(tree: ast.AST, name: str) -> bool:
    return any(isinstance(n, ast.ClassDef) and n.name == name for n in ast.walk(tree))


def optimizer_calls(path: str, class_name: str) -> list[ast.Call]:
    """The calls that make torch.optim's `class_name` in the file: `torch.optim.X(...)`,
    `optim.X(...)`, or `X(...)` imported from torch.optim; never a class of the file's own."""
    tree, _ = source_tree(path)
    if tree is None or _defines(tree, class_name):
        return []
    bare = _imported_from_optim(tree, class_name)
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if (
            isinstance(func, ast.Attribute)
            and func.attr == class_name
            and ast.unparse(func.value) in OPTIM_MODULES
            or bare
            and isinstance(func, ast.Name)
            and func.id == class_name
        ):
            out.append(node)
    return sorted(out, key=lambda n: n.lineno)


def multi_tensor_edits(path: str, class_name: str) -> list[dict[str, Any]]:
    """Code changes that set the multi-tensor keyword on every call making the optimizer (the
    other keyword set to None where the call gives it: torch refuses fused and foreach both
    True), [] where the class has no such keyword or a call says so already."""
    keyword = multi_tensor_keyword(class_name)
    if keyword is None:
        return []
    other = "foreach" if keyword == "fused" else "fused"
    _, lines = source_tree(path)
    source = "\n".join(lines)
    out = []
    for node in optimizer_calls(path, class_name):
        given = {k.arg: ast.unparse(k.value) for k in node.keywords if k.arg}
        if given.get(keyword) == "True" or any(k.arg is None for k in node.keywords):
            continue  # already multi-tensor, or **kwargs that may say otherwise
        settings = {keyword: "True"}
        if other in given and given[other] != "None":
            settings[other] = "None"
        text = ast.get_source_segment(source, node)
        after = set_keywords(text, settings) if text else None
        if text is None or after is None:
            continue
        last = node.end_lineno or node.lineno
        change = code_change(path, node.lineno, text, after, last_line=last if last > node.lineno else None)
        if change:
            out.append(dict(change, op="replace"))
    return out
