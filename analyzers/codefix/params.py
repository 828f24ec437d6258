"""Edits of the job's own code for work nobody uses (judge layer, fix planning): a module whose
parameters get gradients no optimizer uses frozen where it is built, and an optimizer step taken
every micro-batch put under the accumulation condition the loss is scaled for."""

from __future__ import annotations

import ast
import re
from typing import Any

from traindx.analyzers.codefix.edit import code_change
from traindx.analyzers.codefix.source import innermost_node, source_tree

ACCUMULATION = re.compile(r"accum", re.IGNORECASE)  # how frameworks and scripts name the setting
OPTIMIZER_CALLS = ("step", "zero_grad", "clip_grad_norm_", "clip_grad_value_", "update", "unscale_")


def _segment(lines: list[str], node: ast.AST) -> str:
    first, last = node.lineno, node.end_lineno or node.lineno  # type: ignore[attr-defined]
    return "\n".join(lines[first - 1 : last])


def attribute_access(path: str) -> str:
    """`encoder.layer.0` as Python reaches it from the object: `.encoder.layer[0]`."""
    return "".join(f"[{p}]" if p.isdigit() else f".{p}" for p in path.split(".") if p)


def freeze_edit(path: str, line: int, inner: str = "") -> dict[str, Any] | None:
    """`<target>.requires_grad_(False)` inserted after the assignment at path:line that builds
    the module (`self.encoder = Encoder(...)`), or None when that line assigns no single name
    or attribute. `inner`: the module's path inside what that line builds (`encoder` of a model
    an installed package builds: `model.encoder.requires_grad_(False)` after `model = ...`)."""
    tree, lines = source_tree(path)
    if tree is None:
        return None
    stmt = innermost_node(tree, line, (ast.Assign, ast.AnnAssign))
    if stmt is None:
        return None
    targets = (
        stmt.targets
        if isinstance(stmt, ast.Assign)
        else [stmt.target]
        if isinstance(stmt, ast.AnnAssign)
        else []
    )
    if len(targets) != 1 or not isinstance(targets[0], (ast.Name, ast.Attribute)):
        return None
    value = stmt.value if isinstance(stmt, (ast.Assign, ast.AnnAssign)) else None
    inside = _container_path(value, line) if value is not None else None
    if inside is None:
        return None  # built inside something else the line assigns: freezing that freezes more
    target = ast.unparse(targets[0]) + attribute_access(".".join(p for p in (inside, inner) if p))
    return code_change(
        path,
        stmt.lineno,
        _segment(lines, stmt),
        f"{target}.requires_grad_(False)",
        last_line=stmt.end_lineno,
        op="insert_after",
    )


def _is_mapping_call(node: ast.AST) -> bool:
    f = node.func if isinstance(node, ast.Call) else None
    name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
    return name == "dict" or name.endswith("ModuleDict")


def _container_path(value: ast.expr, line: int) -> str | None:
    """The attribute path, inside what an assignment builds, of the module built at `line`: ""
    for the assigned value itself (it starts at that line), `h` for `nn.ModuleDict(dict(h=
    nn.ModuleList(...)))` or `{"h": ...}`; None when the line is inside anything else."""
    if value.lineno == line:
        return ""
    if isinstance(value, ast.Dict):
        for key, item in zip(value.keys, value.values, strict=True):
            if (
                isinstance(key, ast.Constant)
                and isinstance(key.value, str)
                and item.lineno <= line <= (item.end_lineno or item.lineno)
            ):
                rest = _container_path(item, line)
                return None if rest is None else ".".join(p for p in (key.value, rest) if p)
        return None
    if not _is_mapping_call(value):
        return None
    assert isinstance(value, ast.Call)
    for arg in value.args[:1]:
        if arg.lineno <= line <= (arg.end_lineno or arg.lineno):
            return _container_path(arg, line)
    for kw in value.keywords:
        if kw.arg and kw.value.lineno <= line <= (kw.value.end_lineno or kw.value.lineno):
            rest = _container_path(kw.value, line)
            return None if rest is None else ".".join(p for p in (kw.arg, rest) if p)
    return None


def calls_optimizer_at(path: str, line: int) -> bool:
    """The statement at path:line itself calls the optimizer (step, clipping, zero_grad), rather
    than reaching it through a framework (`trainer.fit(...)`)."""
    tree, _ = source_tree(path)
    stmt = innermost_node(tree, line, ast.stmt) if tree is not None else None
    return isinstance(stmt, ast.stmt) and _calls_optimizer(stmt)


def constructor_line(path: str, cls: str) -> int | None:
    """The first line of path that calls `cls(...)` (or `<module>.cls(...)`): where the job builds
    a framework's object whose argument is prescribed."""
    tree, _ = source_tree(path)
    for node in ast.walk(tree) if tree is not None else ():
        if isinstance(node, ast.Call):
            f = node.func
            if (isinstance(f, ast.Name) and f.id == cls) or (isinstance(f, ast.Attribute) and f.attr == cls):
                return int(node.lineno)
    return None


def _calls_optimizer(stmt: ast.stmt) -> bool:
    for node in ast.walk(stmt):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            if name in OPTIMIZER_CALLS:
                return True
    return False


def _calls_backward(stmt: ast.stmt) -> bool:
    """A backward in the statement: the step around it cannot be put under the condition whole."""
    return any(
        isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and "backward" in node.func.attr
        for node in ast.walk(stmt)
    )


def _block_of(body: list[ast.stmt], line: int) -> tuple[list[ast.stmt], int | None]:
    """The list of statements (a loop's, an if's or else's, a with's body) holding line, and
    the index of the statement there that holds it: the innermost one whose statement holds
    no backward."""
    at = next((i for i, s in enumerate(body) if s.lineno <= line <= (s.end_lineno or s.lineno)), None)
    if at is None:
        return body, None
    stmt = body[at]
    # a compound statement is put under the condition whole unless the backward is in it too
    if isinstance(stmt, (ast.If, ast.With, ast.Try)) and stmt.lineno != line and _calls_backward(stmt):
        for inner in (stmt.body, getattr(stmt, "orelse", []), getattr(stmt, "finalbody", [])):
            found, i = _block_of(inner, line)
            if i is not None:
                return found, i
    return body, at


def _counter(loop: ast.For) -> str | None:
    """The loop's micro-batch counter: `for i in ...` or `for i, batch in enumerate(...)`."""
    target = loop.target
    if isinstance(target, ast.Name):
        return target.id
    if (
        isinstance(target, ast.Tuple)
        and target.elts
        and isinstance(target.elts[0], ast.Name)
        and isinstance(loop.iter, ast.Call)
        and isinstance(loop.iter.func, ast.Name)
        and loop.iter.func.id == "enumerate"
    ):
        return target.elts[0].id
    return None


def accumulation_divisor(path: str, line: int, scale: float) -> str | None:
    """The expression the loss is divided by in the loop holding path:line when it names the
    job's accumulation setting (or is the number `scale` itself, in a file that names one)."""
    tree, lines = source_tree(path)
    if tree is None:
        return None
    loop = innermost_node(tree, line, (ast.For, ast.While))
    scope = loop if loop is not None else tree
    text = "\n".join(lines)
    for node in ast.walk(scope):
        if isinstance(node, (ast.BinOp, ast.AugAssign)) and isinstance(node.op, ast.Div):
            right = ast.unparse(node.right if isinstance(node, ast.BinOp) else node.value)
            if ACCUMULATION.search(right):
                return right
            try:
                value = float(ast.literal_eval(right))
            except (ValueError, SyntaxError, TypeError):
                continue
            if value == scale and ACCUMULATION.search(text):
                return right
    return None


def _only_zero_grad(stmt: ast.stmt) -> bool:
    calls = [n for n in ast.walk(stmt) if isinstance(n, ast.Call)]
    return bool(calls) and all(
        (n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", "")) == "zero_grad"
        for n in calls
    )


def _assigned_after(loop: ast.For, line: int, expr: str) -> bool:
    """A name of expr is (re)assigned in the loop's body after line: not yet bound there."""
    try:
        names = {n.id for n in ast.walk(ast.parse(expr, mode="eval")) if isinstance(n, ast.Name)}
    except SyntaxError:
        return True
    for node in ast.walk(loop):
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)) and node.lineno > line:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id in names for t in targets):
                return True
    return False


def accumulate_edits(
    path: str, step_line: int, divisor: str, value: int | None = None
) -> list[dict[str, Any]]:
    """accumulate_edit, and a zero_grad the loop's body runs before its backward (at the top of
    each micro-batch, where it would drop the gradients accumulated so far) put under
    `if <counter> % <divisor> == 0:`: the gradients are zeroed at the start of each N micro-batches.
    Empty when the step cannot be put under the condition."""
    main = accumulate_edit(path, step_line, divisor)
    if main is None:
        return []
    tree, lines = source_tree(path)
    loop = innermost_node(tree, step_line, ast.For) if tree is not None else None
    counter = _counter(loop) if loop is not None else None
    if loop is None or counter is None:
        return [main]
    edits = [main]
    for stmt in loop.body:
        if _calls_backward(stmt) or stmt.lineno >= main["line"]:
            break
        if _only_zero_grad(stmt):
            first, last = stmt.lineno, stmt.end_lineno or stmt.lineno
            original = lines[first - 1 : last]
            indent = original[0][: len(original[0]) - len(original[0].lstrip())]
            n = str(value) if value is not None and _assigned_after(loop, first, divisor) else divisor
            after = [f"{indent}if {counter} % {n} == 0:  # zero at the first of N micro-batches"]
            after += ["    " + ln if ln.strip() else ln for ln in original]
            zero = code_change(path, first, "\n".join(original), "\n".join(after), last_line=last)
            if zero is not None:
                edits.insert(0, zero)
    return edits


def accumulate_edit(path: str, step_line: int, divisor: str) -> dict[str, Any] | None:
    """The run of statements of the loop's body around the optimizer step at path:step_line
    (the clipping before it, the step, a zero_grad after it) put under
    `if (i + 1) % <divisor> == 0:` of the loop's counter; None when the loop has no counter."""
    tree, lines = source_tree(path)
    if tree is None:
        return None
    loop = innermost_node(tree, step_line, ast.For)
    if loop is None:
        return None
    counter = _counter(loop)
    body, at = _block_of(loop.body, step_line)
    if counter is None or at is None or not _calls_optimizer(body[at]) or _calls_backward(body[at]):
        # the job's line only reaches the step through a framework (`trainer.fit()` in a loop
        # over folds): the loop there is not the micro-batches'
        return None
    first_i = last_i = at
    while first_i > 0 and _calls_optimizer(body[first_i - 1]) and not _calls_backward(body[first_i - 1]):
        first_i -= 1
    while (
        last_i + 1 < len(body)
        and _calls_optimizer(body[last_i + 1])
        and not _calls_backward(body[last_i + 1])
    ):
        last_i += 1
    first, last = body[first_i].lineno, body[last_i].end_lineno or body[last_i].lineno
    original = lines[first - 1 : last]
    indent = original[0][: len(original[0]) - len(original[0].lstrip())]
    after = [f"{indent}if ({counter} + 1) % {divisor} == 0:"] + [
        "    " + ln if ln.strip() else ln for ln in original
    ]
    return code_change(path, first, "\n".join(original), "\n".join(after), last_line=last)


def every_nth_call_edit(path: str, line: int, n: int) -> dict[str, Any] | None:
    """The function holding path:line (a callback the framework calls every step) made to do its
    work on every n-th call only: a call counter and an early return put before its first
    statement (after its docstring); on `self` for a method, on the function itself otherwise.
    None when the line is in no function or the function has no statement to put it before."""
    tree, lines = source_tree(path)
    if tree is None:
        return None
    fn = innermost_node(tree, line, (ast.FunctionDef, ast.AsyncFunctionDef))
    if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) or not fn.body:
        return None
    body = fn.body
    first = body[1] if len(body) > 1 and _is_docstring(body[0]) else body[0]
    if _is_docstring(first):
        return None
    args = fn.args.posonlyargs + fn.args.args
    holder = "self" if args and args[0].arg == "self" else fn.name
    original = lines[first.lineno - 1 : first.end_lineno or first.lineno]
    indent = original[0][: len(original[0]) - len(original[0].lstrip())]
    guard = [
        f'{indent}{holder}._calls = getattr({holder}, "_calls", 0) + 1  # its work on every {n}th call only',
        f"{indent}if {holder}._calls % {n}:",
        f"{indent}    return None",
    ]
    change = code_change(
        path, first.lineno, "\n".join(original), "\n".join(guard + original), last_line=first.end_lineno
    )
    if change is not None:
        change["callback"] = fn.name
    return change


def _is_docstring(stmt: ast.stmt) -> bool:
    return (
        isinstance(stmt, ast.Expr)
        and isinstance(stmt.value, ast.Constant)
        and isinstance(stmt.value.value, str)
    )
