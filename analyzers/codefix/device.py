"""Edits that keep the training thread off the device's queue (judge layer, fix planning):
per-step values kept on the device instead of read to the host (`device_accumulations`), checks
that read a tensor only to raise made device-side asserts (`device_checks`), host-to-device
copies made asynchronous from pinned memory (`async_copy_edits`)."""

from __future__ import annotations

import ast
import copy
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeGuard

from traindx.analyzers.codefix.edit import code_change, set_keywords
from traindx.analyzers.codefix.source import (
    LOOP_NODES,
    N,
    edits_in_loops,
    imports_torch,
    innermost_node,
    shifted,
    shifted_col,
    source_tree,
)

HOST_READ_METHODS = ("item", "cpu", "tolist")


def _read_inner(node: ast.AST) -> ast.expr | None:
    """The tensor expression a host read reads (`loss` of `loss.item()`, `loss.detach().cpu()`,
    `float(loss)`, `loss.cpu().item()`), or None when `node` is no host read."""
    inner = None
    if (
        isinstance(node, ast.Call)
        and not node.args
        and not node.keywords
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in HOST_READ_METHODS
    ):
        inner = node.func.value
    elif (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in ("float", "int")
        and len(node.args) == 1
        and not node.keywords
        and isinstance(node.args[0], (ast.Name, ast.Attribute, ast.Call, ast.Subscript))
    ):
        inner = node.args[0]
    if inner is None:
        return None
    deeper = _read_inner(inner)
    return deeper if deeper is not None else inner


def _outer_reads(node: ast.AST) -> list[ast.expr]:
    """The outermost host-read calls inside an expression."""
    out: list[ast.expr] = []

    def visit(n: ast.AST) -> None:
        if isinstance(n, ast.expr) and _read_inner(n) is not None:
            out.append(n)
            return
        for child in ast.iter_child_nodes(n):
            visit(child)

    visit(node)
    return out


# calls that make a tensor from nothing: reading one is a host value made on purpose
_MAKERS = {
    "randint",
    "rand",
    "randn",
    "randperm",
    "tensor",
    "arange",
    "empty",
    "zeros",
    "ones",
    "full",
    "multinomial",
    "as_tensor",
    "from_numpy",
}


def _read_edit(stmt: ast.stmt, lines: Sequence[str], path: str) -> dict[str, Any] | None:
    """The device-side form of one statement that reads a tensor to the host only to keep it:
    `total += loss.item()` -> `total += loss.detach()`, `losses.append(loss.item())` ->
    `losses.append(loss.detach())`, `meter.update(loss.item(), n)` ->
    `meter.update(loss.detach(), n)`. None for any other statement (a print keeps its read: that
    is where the value is shown)."""
    if stmt.lineno != stmt.end_lineno:
        return None
    if isinstance(stmt, ast.AugAssign):
        value = stmt.value
    elif (
        isinstance(stmt, ast.Expr)
        and isinstance(stmt.value, ast.Call)
        and isinstance(stmt.value.func, ast.Attribute)
        and stmt.value.args
        and (
            stmt.value.func.attr == "append" and len(stmt.value.args) == 1 or stmt.value.func.attr == "update"
        )
    ):  # a list, an AverageMeter
        value = stmt.value.args[0]
    else:
        return None
    reads = _outer_reads(value)
    if len(reads) != 1 or (not isinstance(stmt, ast.AugAssign) and reads[0] is not value):
        return None
    read = reads[0]
    inner_node = _read_inner(read)
    if (
        isinstance(inner_node, ast.Call)
        and isinstance(inner_node.func, (ast.Attribute, ast.Name))
        and getattr(inner_node.func, "attr", getattr(inner_node.func, "id", "")) in _MAKERS
    ):
        return None  # `torch.randint(...).item()` makes a host value on purpose: not a result
    if not isinstance(inner_node, (ast.Name, ast.Attribute, ast.Subscript, ast.Call)):
        return None
    text = lines[stmt.lineno - 1]
    segment = ast.get_source_segment(text, shifted(read, stmt.lineno))
    inner = ast.get_source_segment(text, shifted(inner_node, stmt.lineno))
    if not segment or not inner or text.count(segment) != 1:
        return None
    after = text.replace(segment, f"{inner}.detach()").strip()
    change = code_change(path, stmt.lineno, text.strip(), after)
    return dict(change, op="replace") if change else None


def device_accumulations(path: str, line: int, widen: bool = True) -> list[dict[str, Any]]:
    """Edits that keep a per-step value on the device instead of reading it to the host each step (a
    host read waits for every queued kernel): `total += x.item()` becomes `total += x.detach()`,
    `losses.append(x.item())` becomes `losses.append(x.detach())`. The statement at `line`, else
    those in loops of its innermost loop, function or file (a profiler names a function by its first
    line); widen=False: the statement at `line` only. [] when there is none."""
    tree, lines = source_tree(path)
    if tree is None:
        return []
    stmt = innermost_node(tree, line, ast.stmt)
    scopes: list[list[ast.AST]] = []
    if stmt is not None and not isinstance(
        stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef) + LOOP_NODES
    ):
        scopes.append([stmt])
    for kinds in (LOOP_NODES, (ast.FunctionDef, ast.AsyncFunctionDef)) if widen else ():
        node = innermost_node(tree, line, kinds)
        if node is not None:
            scopes.append(list(ast.walk(node)))
    if widen:
        scopes.append(list(ast.walk(tree)))  # a module-level loop: the script is the scope
    return edits_in_loops(tree, scopes, ast.stmt, _read_edit, lines, path)


def _check_edit(stmt: ast.stmt, lines: Sequence[str], path: str) -> dict[str, Any] | None:
    """The device-side form of a guard that reads a tensor to the host only to raise:
    `if not <cond>.item(): raise E("msg")` -> `torch._assert_async(<cond>, "msg")` (and
    `if <cond>.item(): raise ...` -> `torch._assert_async(torch.logical_not(<cond>), ...)`):
    the check stays, on the device, without waiting for the queued kernels (a failure stops
    the job with a device-side assert at a later sync instead of E). None for any other
    statement."""
    if (
        not isinstance(stmt, ast.If)
        or stmt.orelse
        or len(stmt.body) != 1
        or not isinstance(stmt.body[0], ast.Raise)
    ):
        return None
    test, negated, guards = stmt.test, False, []
    if (
        isinstance(test, ast.BoolOp)
        and isinstance(test.op, ast.And)
        and not any(_outer_reads(v) for v in test.values[:-1])
    ):
        # `if flag and not <cond>.item(): raise`: the host-side flags stay an `if`
        guards, test = test.values[:-1], test.values[-1]
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        test, negated = test.operand, True
    explicit = isinstance(test, ast.Call) and (
        isinstance(test.func, ast.Attribute)
        and test.func.attr == "item"
        and _read_inner(test) is not None
        or isinstance(test.func, ast.Name)
        and test.func.id == "bool"
    )
    inner: ast.expr | None
    if explicit and isinstance(test, ast.Call):
        inner = (
            test.func.value
            if isinstance(test.func, ast.Attribute)
            else (test.args[0] if len(test.args) == 1 and not test.keywords else None)
        )
    elif _tensor_valued(test):
        inner = test  # `if not torch.isfinite(loss).all():` reads it to the host by bool()
    else:
        return None
    if inner is None or stmt.lineno < 1 or (stmt.end_lineno or stmt.lineno) > len(lines):
        return None
    first, last = stmt.lineno, stmt.end_lineno or stmt.lineno
    source = "\n".join(lines[first - 1 : last])
    cond = ast.get_source_segment(source, _relative(inner, first))
    if not cond or "\n" in cond:
        return None
    exc = stmt.body[0].exc
    message = None
    if (
        isinstance(exc, ast.Call)
        and exc.args
        and isinstance(exc.args[0], ast.Constant)
        and isinstance(exc.args[0].value, str)
    ):
        message = exc.args[0].value
    message = message or f"{'not ' if not negated else ''}{cond}"
    checked_value = cond if negated else f"torch.logical_not({cond})"
    after = f"torch._assert_async({checked_value}, {message!r})"
    if guards:
        found = [ast.get_source_segment(source, _relative(g, first)) for g in guards]
        parts = [p for p in found if p]
        if len(parts) < len(found) or any("\n" in p for p in parts):
            return None
        body = lines[stmt.body[0].lineno - 1]
        indent = body[: len(body) - len(body.lstrip())]
        after = f"if {' and '.join(parts)}:\n{indent}{after}"
    change = code_change(path, first, source.strip(), after, last_line=last)
    return dict(change, op="replace") if change else None


# reductions and predicates whose result is a tensor: an `if` on one reads it to the host
_TENSOR_PREDICATES = {"all", "any", "isfinite", "isnan", "isinf", "isneginf", "isposinf", "allclose", "equal"}


def _tensor_valued(node: ast.AST) -> bool:
    """`<x>.all()`, `<x>.any()`, `torch.isfinite(<x>)...`: an expression that is a tensor (not
    `allclose`/`equal`, which return Python bools: excluded below)."""
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
        return False
    name = node.func.attr
    if name in ("allclose", "equal"):
        return False
    if name in ("all", "any") and not node.args and not node.keywords:
        return True
    owner = node.func.value
    return name in _TENSOR_PREDICATES and isinstance(owner, ast.Name) and owner.id == "torch"


def _relative(node: N, first_line: int) -> N:
    """A copy of node's position relative to a source slice starting at `first_line`."""

    node = copy.copy(node)
    node.lineno -= first_line - 1
    node.end_lineno = (node.end_lineno or node.lineno + first_line - 1) - (first_line - 1)
    return node


def device_checks(path: str, line: int, widen: bool = True) -> list[dict[str, Any]]:
    """Edits that keep a per-step guard on the device: `if not <tensor cond>.item(): raise ...`
    (a finiteness or range check read to the host, which waits for every queued kernel) becomes
    `torch._assert_async(<tensor cond>, "<message>")` (torch's asynchronous assert: no sync).
    The statement at `line` when it is one; else those in the innermost loop holding `line`,
    else in its function (a profiler names a function by its first line). Only in a module that
    imports torch, only guards inside a loop (per step or per layer). [code change dicts]."""
    tree, lines = source_tree(path)
    if tree is None or not imports_torch(tree):
        return []
    scopes: list[list[ast.AST]] = []
    stmt = innermost_node(tree, line, ast.If)
    if stmt is not None:
        scopes.append([stmt])
    for kinds in (LOOP_NODES, (ast.FunctionDef, ast.AsyncFunctionDef)) if widen else ():
        node = innermost_node(tree, line, kinds)
        if node is not None:
            scopes.append(list(ast.walk(node)))
    return edits_in_loops(tree, scopes, ast.If, _check_edit, lines, path)


# -- host-to-device copies -------------------------------------------------------------------------
_DTYPES = {
    "float",
    "float16",
    "float32",
    "float64",
    "bfloat16",
    "half",
    "double",
    "int",
    "int8",
    "int16",
    "int32",
    "int64",
    "long",
    "bool",
    "uint8",
    "complex64",
}


def _is_device_copy(call: ast.AST) -> TypeGuard[ast.Call]:
    """`x.to(dev)`, `x.to(device=dev)`, `x.cuda()` not already non_blocking=True (absent, False or
    a variable that can be False): a host-to-device copy (not `x.to(torch.bfloat16)`, a cast)."""
    if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Attribute):
        return False
    if any(
        k.arg == "non_blocking" and isinstance(k.value, ast.Constant) and k.value.value is True
        for k in call.keywords
    ):
        return False
    if call.func.attr == "cuda":
        return True
    if call.func.attr != "to":
        return False
    if any(k.arg == "device" for k in call.keywords):
        return True
    if not call.args:
        return False
    first = call.args[0]
    if isinstance(first, ast.Attribute) and first.attr in _DTYPES:
        return False
    return not (isinstance(first, ast.Name) and first.id in ("dtype",))


def _assigned_once_before(tree: ast.AST, name: str, line: int) -> ast.Assign | None:
    """The single assignment `name = <value>` outside any loop before `line` (a host dataset
    made once), or None. A placeholder (`name = None`) and a re-assignment that pins it already
    (`name = [t.pin_memory() for t in name]`, under a flag) do not count: the value is made once."""
    found = []
    for node in ast.walk(tree):
        targets = (
            node.targets
            if isinstance(node, ast.Assign)
            else [node.target]
            if isinstance(node, (ast.AugAssign, ast.AnnAssign, ast.For))
            else []
        )
        found.extend(
            node for t in targets if any(isinstance(n, ast.Name) and n.id == name for n in ast.walk(t))
        )
    found = [
        n
        for n in found
        if not (
            isinstance(n, ast.Assign)
            and (
                (isinstance(n.value, ast.Constant) and n.value.value is None)
                or any(isinstance(c, ast.Attribute) and c.attr == "pin_memory" for c in ast.walk(n.value))
            )
        )
    ]
    if len(found) != 1 or not isinstance(found[0], ast.Assign) or found[0].lineno >= line:
        return None
    node = found[0]
    loops = [n for n in ast.walk(tree) if isinstance(n, LOOP_NODES)]
    if any(l.lineno <= node.lineno <= (l.end_lineno or l.lineno) for l in loops):
        return None
    if len(node.targets) != 1 or not isinstance(node.targets[0], ast.Name):
        return None
    return node


def async_copy_edits(path: str, line: int, pinned_by_loader: bool = False) -> list[list[dict[str, Any]]]:
    """Ways to make the host-to-device copy at path:line asynchronous, best first, each a list of
    changes made together: non_blocking=True alone where the batch comes from a pinned DataLoader;
    the host tensor pinned once where it is made when the copy takes a slice of it; else
    `x.pin_memory().to(dev, non_blocking=True)` at the line. [] when it holds no device copy."""
    tree, lines = source_tree(path)
    if tree is None:
        return []
    stmt = innermost_node(tree, line, ast.stmt)
    if stmt is None or isinstance(
        stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef) + LOOP_NODES + (ast.If, ast.With, ast.Try)
    ):
        return []
    first, last = stmt.lineno, stmt.end_lineno or stmt.lineno
    text = "".join(l + "\n" for l in lines[first - 1 : last])
    try:
        node = ast.parse(textwrap.dedent(text)).body[0]
    except (SyntaxError, IndexError):
        return []
    copies = [n for n in ast.walk(node) if _is_device_copy(n)]
    if not copies:
        return []
    copy_at = _CopyAt(path=path, first=first, last=last, text=text, copies=copies)
    plain = copy_at.change(pin_receiver=False)
    if pinned_by_loader:
        return [[plain]] if plain else []
    out = []
    pin = _pin_where_made(tree, lines, copy_at) if plain else None
    if pin and plain:
        out.append([pin, plain])
    per_line = copy_at.change(pin_receiver=True)
    if per_line:
        out.append([per_line])
    return out


@dataclass(frozen=True)
class _CopyAt:
    """The statement path:first..last (its text as written) and its device copies (parsed from
    the dedented text)."""

    path: str
    first: int
    last: int
    text: str
    copies: list[ast.Call]

    def edited(self, pin_receiver: bool) -> str | None:
        """The statement with every copy non_blocking=True (and its tensor pinned first)."""
        body = textwrap.dedent(self.text)
        indent = self.text[: len(self.text) - len(self.text.lstrip())]
        out = body
        for call in sorted(self.copies, key=lambda c: (c.lineno, c.col_offset), reverse=True):
            segment = ast.get_source_segment(body, call)
            func = call.func
            receiver = ast.get_source_segment(body, func.value) if isinstance(func, ast.Attribute) else None
            new = set_keywords(segment, {"non_blocking": "True"}) if segment is not None else None
            if new is None or segment is None or receiver is None or not new.startswith(receiver):
                return None
            if pin_receiver:
                new = f"{receiver}.pin_memory(){new[len(receiver) :]}"
            out = out.replace(segment, new, 1)
        return "\n".join(indent + l if l.strip() else l for l in out.rstrip("\n").split("\n"))

    def change(self, pin_receiver: bool) -> dict[str, Any] | None:
        after_text = self.edited(pin_receiver)
        if after_text is None:
            return None
        last = self.last if self.last > self.first else None
        c = code_change(self.path, self.first, self.text.rstrip("\n"), after_text, last_line=last)
        return dict(c, op="replace") if c else None


def _pin_where_made(tree: ast.AST, lines: Sequence[str], copy_at: _CopyAt) -> dict[str, Any] | None:
    """The edit that pins the host tensor the copy slices, once where it is made (`data =
    <value>.pin_memory()`, a list's tensors each); None when it is not made once before."""
    func = copy_at.copies[0].func
    if not isinstance(func, ast.Attribute):
        return None
    base = func.value
    while isinstance(base, ast.Subscript) and isinstance(
        base.slice, (ast.Slice, ast.Constant, ast.Name, ast.BinOp)
    ):
        base = base.value
    if not isinstance(base, ast.Name) or base is func.value:
        return None
    made = _assigned_once_before(tree, base.id, copy_at.first)
    if made is None or made.lineno != made.end_lineno:
        return None
    src = lines[made.lineno - 1]
    value = ast.get_source_segment(src.strip(), shifted_col(made.value, src))
    if not value:
        return None
    made_value = made.value
    elt = (
        ast.get_source_segment(src.strip(), shifted_col(made_value.elt, src))
        if isinstance(made_value, ast.ListComp)
        else None
    )
    if elt and isinstance(made_value, ast.ListComp) and isinstance(made_value.elt, _PINNABLE):
        # each element pinned as it is made: no unpinned copy of the dataset
        pinned = value.replace(elt, f"{elt}.pin_memory()", 1)
    elif isinstance(made_value, (ast.List, ast.ListComp)):
        pinned = f"[t.pin_memory() for t in {value}]"
    elif isinstance(made_value, _PINNABLE):
        pinned = f"{value}.pin_memory()"
    else:
        pinned = f"({value}).pin_memory()"
    pin = code_change(copy_at.path, made.lineno, src.strip(), src.strip().replace(value, pinned, 1))
    return dict(pin, op="replace") if pin else None


# a value `.pin_memory()` can follow as written
_PINNABLE = (ast.Call, ast.Name, ast.Attribute, ast.Subscript)
