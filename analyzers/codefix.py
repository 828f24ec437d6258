"""Code prescriptions that are real code: a `before` that is the job's own source (one line, or a
call written over several lines, or a part of them) and an `after` that parses, at a file:line.

Every analyzer that prescribes a code change builds its `change["code"]` through `code_change`;
what fails the check is not a diff and goes into the prescription's prose instead. `apply` and
`unified_diff` turn a change into the edited file and the patch a user applies (`patch -p0`).
"""

from __future__ import annotations

import ast
import copy
import difflib
import functools
import io
import os
import textwrap
import tokenize
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only
    from traindx.analyzers.findings import Finding


_PAIRS = {")": "(", "]": "[", "}": "{"}


def _unmatched(text):
    """(brackets left open, closing brackets without their opener) of a piece of code."""
    opens, missing = [], []
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type != tokenize.OP:
                continue
            if tok.string in "([{":
                opens.append(tok.string)
            elif tok.string in _PAIRS:
                if opens:
                    opens.pop()
                else:
                    missing.append(_PAIRS[tok.string])
    except (tokenize.TokenError, IndentationError, SyntaxError):
        pass
    return opens, missing


def _completed(text):
    """A line cut out of a statement over several lines (`out = f(q, k,` or `  v=v)`), with its
    unmatched brackets closed or opened so that it can be parsed; the text itself otherwise."""
    opens, missing = _unmatched(text)
    if not opens and not missing:
        return text
    head = "".join(("_" + o if o != "{" else o) for o in reversed(missing))
    tail = "".join({"(": ")", "[": "]", "{": "}"}[o] for o in reversed(opens))
    return head + text.strip().rstrip(",") + tail


def parses(text: str) -> bool:
    """True when `text` is Python code: a statement, an expression such as a call written over
    several lines, or one line of such a statement (the line a diff replaces); an empty text (a
    deleted line) parses. Prose (a guard's message, a description) does not."""
    if text is None:
        return False
    for candidate in (textwrap.dedent(text), "(" + text.strip() + "\n)", _completed(text.strip())):
        try:
            ast.parse(candidate)
            return True
        except (SyntaxError, ValueError):
            continue
    return False


def code_change(
    file: str, line: int, before: str, after: str, last_line: int | None = None, op: str | None = None
) -> dict[str, Any] | None:
    """The `change["code"]` dict for replacing `before` by `after` at file:line (to last_line for
    a call over several lines), or None when it would not be a real, applicable diff: no file or
    line, `before` empty, unchanged, or either side not Python.

    op (Prescription.change["code"]["op"]): "replace" (default), "delete" (`after` empty: the
    statement goes; a block left empty gets `pass`), "insert_after" (`after` is new code put
    after the statement file:line..last_line, at its indentation; `before` names that
    statement)."""
    if not file or not isinstance(line, int) or line < 1 or not isinstance(before, str):
        return None
    if not before.strip() or after is None or before == after:
        return None
    if not parses(before) or not parses(after):
        return None
    if op != "insert_after" and after.strip() and _unmatched(before) != _unmatched(after):
        return None  # a replacement line must leave the statement's brackets as they were
    change = {"file": file, "line": line, "before": before, "after": after}
    if op:
        change["op"] = op
    if last_line and last_line > line:
        change["last_line"] = int(last_line)
    return change


def apply(change: Mapping[str, Any], text: str) -> str:
    """The file's text with the change made; ValueError when `before` is not in the lines it
    names or the edited file does not parse."""
    lines = text.splitlines(keepends=True)
    first = change["line"] - 1
    last = change.get("last_line") or change["line"]
    if first < 0 or last > len(lines):
        raise ValueError(f"line {change['line']} is outside the file ({len(lines)} lines)")
    region = "".join(lines[first:last])
    before, after = change["before"], change["after"]
    if before in region:
        edited = region.replace(before, after, 1)
    elif before.strip() and before.strip() in region:
        edited = region.replace(before.strip(), after.strip(), 1)
    else:
        raise ValueError(f"the before-text is not at line {change['line']}: {before!r}")
    if after == "" and not edited.strip():
        edited = ""  # a deleted line leaves no blank line behind
    elif region.endswith("\n") and not edited.endswith("\n"):
        edited += "\n"
    out = "".join(lines[:first]) + edited + "".join(lines[last:])
    try:
        ast.parse(out)
    except SyntaxError as exc:
        raise ValueError(f"the edited file does not parse: {exc}") from None
    return out


def keyword_sources(call_text: str) -> dict[str, str | None]:
    """{keyword: source text} of a call written over one or several lines, else {}; its
    positional arguments are keyed by position ("#0", "#1": `torch.set_num_threads(a.threads)`
    -> {"#0": "a.threads"})."""
    try:
        node = ast.parse("(\n" + call_text + "\n)", mode="eval").body
    except (SyntaxError, ValueError):
        return {}
    if not isinstance(node, ast.Call):
        return {}
    text = "(\n" + call_text + "\n)"
    out = {
        f"#{i}": ast.get_source_segment(text, a)
        for i, a in enumerate(node.args)
        if not isinstance(a, ast.Starred)
    }
    out.update({k.arg: ast.get_source_segment(text, k.value) for k in node.keywords if k.arg})
    return out


def set_keywords(call_text: str, settings: Mapping[str, Any]) -> str | None:
    """The call `call_text` (one line or several, as written in the file) with keyword arguments
    set to the given source texts: an existing one's value replaced, a missing one added after
    the last argument. None when the text is not a single call."""
    prefix = "_ = (\n"
    try:
        tree = ast.parse(prefix + call_text + "\n)")
    except SyntaxError:
        return None
    value = tree.body[0].value if tree.body and isinstance(tree.body[0], ast.Assign) else None
    if not isinstance(value, ast.Call):
        return None
    lines = call_text.split("\n")
    raw = [line.encode("utf-8") for line in lines]

    def offset(lineno, col):  # (ast line in the wrapped text, byte column) -> index in call_text
        i = lineno - 2
        return sum(len(x) + 1 for x in lines[:i]) + len(raw[i][:col].decode("utf-8", "replace"))

    edits = []  # (start, end, replacement)
    existing = {k.arg: k for k in value.keywords if k.arg}
    added = []
    for name, text in settings.items():
        if name in existing:
            v = existing[name].value
            edits.append((offset(v.lineno, v.col_offset), offset(v.end_lineno, v.end_col_offset), text))
        else:
            added.append(f"{name}={text}")
    if added:
        nodes = list(value.args) + list(value.keywords)
        if nodes:
            last = max(nodes, key=lambda n: (n.end_lineno, n.end_col_offset))
            at = offset(last.end_lineno, last.end_col_offset)
            edits.append((at, at, ", " + ", ".join(added)))
        else:
            at = offset(value.func.end_lineno, value.func.end_col_offset)
            rest = call_text[at:]
            at += rest.index("(") + 1
            edits.append((at, at, ", ".join(added)))
    out = call_text
    for start, end, text in sorted(edits, reverse=True):
        out = out[:start] + text + out[end:]
    return out


def unified_diff(change: Mapping[str, Any], text: str) -> str:
    """The change as a unified diff of its file (raises ValueError like `apply`)."""
    edited = apply(change, text)
    name = change["file"]
    return "".join(
        difflib.unified_diff(text.splitlines(keepends=True), edited.splitlines(keepends=True), name, name)
    )


def checked(findings: Sequence[Finding]) -> list[Finding]:
    """The findings with every code prescription checked: a `change["code"]` that is not a real,
    applicable edit (no file:line, prose in `before`, an `after` that does not parse) is taken
    out of the change, and what it said stays in the prescription's prose."""
    from dataclasses import replace

    out = []
    for finding in findings:
        prescriptions, changed = [], False
        for p in finding.prescriptions:
            code = (p.change or {}).get("code")
            if code is None or code.get("autotune_key"):
                # (an autotune-key edit is located and checked by the fix loop itself, at the
                # kernel's decorator: analyzers/fix_source.py)
                prescriptions.append(p)
                continue
            try:
                valid = code_change(
                    code.get("file"),
                    code.get("line"),
                    code.get("before"),
                    code.get("after"),
                    last_line=code.get("last_line"),
                    op=code.get("op"),
                )
            except Exception:  # an edit that cannot be checked is not applied: prose only
                valid = None
            if valid is not None:
                prescriptions.append(p)
                continue
            change = {k: v for k, v in p.change.items() if k != "code"}
            after = str(code.get("after") or "").strip()
            summary = p.summary if not after or after in p.summary else f"{p.summary} ({after})"
            prescriptions.append(
                replace(p, change=change, summary=summary, automatic=p.automatic and bool(change))
            )
            changed = True
        out.append(replace(finding, prescriptions=tuple(prescriptions)) if changed else finding)
    return out


# -- the job's own source, read to place an edit ---------------------------------------------------
def _tree(path):
    """(the file's syntax tree, its lines), parsed once per version of the file: a live
    judgement analyses the same job script at every pass (the tree is only ever read)."""
    try:
        st = os.stat(path)
    except (OSError, ValueError, TypeError):
        return None, []
    return _parsed(path, st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=64)
def _parsed(path, mtime_ns, size):
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        return ast.parse(text), text.splitlines()
    except (OSError, SyntaxError, ValueError):
        return None, []


def _per_version(fn):
    """`fn(path, *args)` computed once per version of the file (its result copied out)."""

    @functools.lru_cache(maxsize=256)
    def once(path, mtime_ns, size, *args):
        return fn(path, *args)

    @functools.wraps(fn)
    def wrapper(path, *args):
        try:
            st = os.stat(path)
        except (OSError, ValueError, TypeError):
            return fn(path, *args)
        return copy.deepcopy(once(path, st.st_mtime_ns, st.st_size, *args))

    return wrapper


def _called(node, name):
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
def calls_in_loops(path, name):
    """[(line, source line)] of every statement that is just a call `name(...)` inside a for or
    while loop of the file (the per-step `gc.collect()`, `torch.cuda.empty_cache()`)."""
    tree, lines = _tree(path)
    out = []
    for loop in ast.walk(tree) if tree is not None else ():
        if not isinstance(loop, (ast.For, ast.While, ast.AsyncFor)):
            continue
        for node in ast.walk(loop):
            if isinstance(node, ast.Expr) and _called(node.value, name) and node.lineno == node.end_lineno:
                out.append((node.lineno, lines[node.lineno - 1].strip()))
    return sorted(set(out))


@_per_version
def calls_of(path: str, name: str) -> list[dict[str, Any]]:
    """[{line, last_line, source, args}] of every call `name(...)` (name dotted from the right)
    in the file: the call's own text as written and its positional arguments' texts, first line
    first (torch.set_num_threads(a.threads) -> args ["a.threads"])."""
    tree, lines = _tree(path)
    text = "\n".join(lines)
    out = []
    for node in ast.walk(tree) if tree is not None else ():
        if isinstance(node, ast.Call) and _called(node, name) and node.lineno == node.end_lineno:
            out.append(
                {
                    "line": node.lineno,
                    "last_line": node.end_lineno,
                    "source": ast.get_source_segment(text, node),
                    "args": [ast.get_source_segment(text, a) for a in node.args],
                }
            )
    return sorted(out, key=lambda c: c["line"])


def _steps_inside(node):
    return any(_called(n, "step") or _called(n, "backward") for n in ast.walk(node))


@_per_version
def before_training_loop(path):
    """(first line, last line, source of the first line, or of the whole statement when it is a
    compound one) of the statement just before the outermost loop that steps an optimizer or calls backward (in the same block), where set-up
    ends; None when there is no such loop or it opens its block."""
    tree, lines = _tree(path)
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


def _innermost(tree, line, kinds):
    """The innermost node of one of `kinds` whose lines hold `line`, or None."""
    best = None
    for node in ast.walk(tree):
        if isinstance(node, kinds) and node.lineno <= line <= (node.end_lineno or node.lineno):
            if best is None or node.lineno >= best.lineno:
                best = node
    return best


HOST_READ_METHODS = ("item", "cpu", "tolist")
_LOOPS = (ast.For, ast.While, ast.AsyncFor)


def _read_inner(node):
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


def _outer_reads(node):
    """The outermost host-read calls inside an expression."""
    out = []

    def visit(n):
        if _read_inner(n) is not None:
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


def _read_edit(stmt, lines, path):
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
    segment = ast.get_source_segment(text, _shifted(read, stmt.lineno))
    inner = ast.get_source_segment(text, _shifted(_read_inner(read), stmt.lineno))
    if not segment or not inner or text.count(segment) != 1:
        return None
    after = text.replace(segment, f"{inner}.detach()").strip()
    change = code_change(path, stmt.lineno, text.strip(), after)
    return dict(change, op="replace") if change else None


def _shifted(node, lineno):
    """A copy of node's position on line 1 (get_source_segment of one line of text)."""
    import copy

    node = copy.copy(node)
    node.lineno = node.end_lineno = 1
    return node


def device_accumulations(path, line, widen=True):
    """Edits that keep a per-step value on the device instead of reading it to the host each
    step (a host read waits for every queued kernel): `total += <expr>.item()` (or `.cpu()`,
    `.tolist()`, `float(<expr>)`) becomes `total += <expr>.detach()`, `losses.append(x.item())`
    becomes `losses.append(x.detach())`; the value is read once, where it is printed or logged.
    The statement at `line` when it is one; else those in the innermost loop holding `line`,
    else in its function (a profiler names a function by its first line), else in the file (a
    script's module-level loop); widen=False: the statement at `line` only (a finding that
    measured that very line). Only statements in a loop (per step). [code change dicts]; []
    when there is none."""
    tree, lines = _tree(path)
    if tree is None:
        return []
    stmt = _innermost(tree, line, ast.stmt)
    scopes = []
    if stmt is not None and not isinstance(
        stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef) + _LOOPS
    ):
        scopes.append([stmt])
    for kinds in (_LOOPS, (ast.FunctionDef, ast.AsyncFunctionDef)) if widen else ():
        node = _innermost(tree, line, kinds)
        if node is not None:
            scopes.append(list(ast.walk(node)))
    if widen:
        scopes.append(list(ast.walk(tree)))  # a module-level loop: the script is the scope
    return _edits_in_loops(tree, scopes, ast.stmt, _read_edit, lines, path)


def _edits_in_loops(tree, scopes, kind, edit, lines, path):
    """The edits `edit(node, lines, path)` makes of the `kind` nodes inside a loop (per step),
    from the first of `scopes` (node lists, narrowest first) that has any, in line order."""
    loops = [n for n in ast.walk(tree) if isinstance(n, _LOOPS)]

    def in_loop(node):
        return any(l.lineno < node.lineno <= (l.end_lineno or l.lineno) for l in loops)

    for nodes in scopes:
        out = []
        for node in nodes:
            if isinstance(node, kind) and in_loop(node):
                change = edit(node, lines, path)
                if change and change not in out:
                    out.append(change)
        if out:
            return sorted(out, key=lambda c: c["line"])
    return []


def _imports_torch(tree):
    """The module binds the name `torch` (import torch, import torch as torch)."""
    return any(
        isinstance(n, ast.Import) and any(a.name == "torch" and a.asname in (None, "torch") for a in n.names)
        for n in ast.walk(tree)
    )


def _check_edit(stmt, lines, path):
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
    if explicit:
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
        parts = [ast.get_source_segment(source, _relative(g, first)) for g in guards]
        if not all(parts) or any("\n" in p for p in parts):
            return None
        body = lines[stmt.body[0].lineno - 1]
        indent = body[: len(body) - len(body.lstrip())]
        after = f"if {' and '.join(parts)}:\n{indent}{after}"
    change = code_change(path, first, source.strip(), after, last_line=last)
    return dict(change, op="replace") if change else None


# reductions and predicates whose result is a tensor: an `if` on one reads it to the host
_TENSOR_PREDICATES = {"all", "any", "isfinite", "isnan", "isinf", "isneginf", "isposinf", "allclose", "equal"}


def _tensor_valued(node):
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


def _relative(node, first_line):
    """A copy of node's position relative to a source slice starting at `first_line`."""
    import copy

    node = copy.copy(node)
    node.lineno -= first_line - 1
    node.end_lineno = (node.end_lineno or node.lineno + first_line - 1) - (first_line - 1)
    return node


def device_checks(path, line, widen=True):
    """Edits that keep a per-step guard on the device: `if not <tensor cond>.item(): raise ...`
    (a finiteness or range check read to the host, which waits for every queued kernel) becomes
    `torch._assert_async(<tensor cond>, "<message>")` (torch's asynchronous assert: no sync).
    The statement at `line` when it is one; else those in the innermost loop holding `line`,
    else in its function (a profiler names a function by its first line). Only in a module that
    imports torch, only guards inside a loop (per step or per layer). [code change dicts]."""
    tree, lines = _tree(path)
    if tree is None or not _imports_torch(tree):
        return []
    scopes = []
    stmt = _innermost(tree, line, ast.If)
    if stmt is not None:
        scopes.append([stmt])
    for kinds in (_LOOPS, (ast.FunctionDef, ast.AsyncFunctionDef)) if widen else ():
        node = _innermost(tree, line, kinds)
        if node is not None:
            scopes.append(list(ast.walk(node)))
    return _edits_in_loops(tree, scopes, ast.If, _check_edit, lines, path)


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


def _is_device_copy(call):
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


def _assigned_once_before(tree, name, line):
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
        for t in targets:
            if any(isinstance(n, ast.Name) and n.id == name for n in ast.walk(t)):
                found.append(node)
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
    loops = [n for n in ast.walk(tree) if isinstance(n, _LOOPS)]
    if any(l.lineno <= node.lineno <= (l.end_lineno or l.lineno) for l in loops):
        return None
    if len(node.targets) != 1 or not isinstance(node.targets[0], ast.Name):
        return None
    return node


def async_copy_edits(path, line, pinned_by_loader=False):
    """Ways to make the host-to-device copy at path:line asynchronous, best first; each one a
    list of code changes made together:
    - the batch comes from a DataLoader whose pin_memory=True is set with it: only
      `.to(dev, non_blocking=True)` here;
    - the copied tensor is a slice of a host tensor made once before the loop: pin that tensor
      once where it is made (`data = <value>.pin_memory()`, a list of tensors each), and copy
      with non_blocking=True;
    - else `x.pin_memory().to(dev, non_blocking=True)` at the line (a pinned staging copy on the
      host, the transfer asynchronous).
    [] when the statement holds no device copy."""
    tree, lines = _tree(path)
    if tree is None:
        return []
    stmt = _innermost(tree, line, ast.stmt)
    if stmt is None or isinstance(
        stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef) + _LOOPS + (ast.If, ast.With, ast.Try)
    ):
        return []
    first, last = stmt.lineno, stmt.end_lineno or stmt.lineno
    text = "".join(l + "\n" for l in lines[first - 1 : last])
    body = textwrap.dedent(text)
    try:
        node = ast.parse(body).body[0]
    except (SyntaxError, IndexError):
        return []
    copies = [n for n in ast.walk(node) if _is_device_copy(n)]
    if not copies:
        return []
    indent = text[: len(text) - len(text.lstrip())]

    def edited(pin_receiver):
        out = body
        for call in sorted(copies, key=lambda c: (c.lineno, c.col_offset), reverse=True):
            segment = ast.get_source_segment(body, call)
            receiver = ast.get_source_segment(body, call.func.value)
            new = set_keywords(segment, {"non_blocking": "True"})
            if new is None or receiver is None or not new.startswith(receiver):
                return None
            if pin_receiver:
                new = f"{receiver}.pin_memory(){new[len(receiver) :]}"
            out = out.replace(segment, new, 1)
        return "\n".join(indent + l if l.strip() else l for l in out.rstrip("\n").split("\n"))

    def change(after_text):
        if after_text is None:
            return None
        c = code_change(path, first, text.rstrip("\n"), after_text, last_line=last if last > first else None)
        return dict(c, op="replace") if c else None

    plain = change(edited(False))
    if pinned_by_loader:
        return [[plain]] if plain else []
    out = []
    base = copies[0].func.value
    while isinstance(base, ast.Subscript) and isinstance(
        base.slice, (ast.Slice, ast.Constant, ast.Name, ast.BinOp)
    ):
        base = base.value
    if isinstance(base, ast.Name) and base is not copies[0].func.value:
        made = _assigned_once_before(tree, base.id, first)
        if made is not None and made.lineno == made.end_lineno and plain:
            src = lines[made.lineno - 1]
            value = ast.get_source_segment(src.strip(), _shifted_col(made.value, src))
            if value:
                elt = (
                    ast.get_source_segment(src.strip(), _shifted_col(made.value.elt, src))
                    if isinstance(made.value, ast.ListComp)
                    else None
                )
                if elt and isinstance(made.value.elt, (ast.Call, ast.Name, ast.Attribute, ast.Subscript)):
                    # each element pinned as it is made: no unpinned copy of the dataset
                    pinned = value.replace(elt, f"{elt}.pin_memory()", 1)
                elif isinstance(made.value, (ast.List, ast.ListComp)):
                    pinned = f"[t.pin_memory() for t in {value}]"
                elif isinstance(made.value, (ast.Call, ast.Name, ast.Attribute, ast.Subscript)):
                    pinned = f"{value}.pin_memory()"
                else:
                    pinned = f"({value}).pin_memory()"
                pin = code_change(path, made.lineno, src.strip(), src.strip().replace(value, pinned, 1))
                if pin:
                    out.append([dict(pin, op="replace"), plain])
    per_line = change(edited(True))
    if per_line:
        out.append([per_line])
    return out


def _shifted_col(node, src):
    """node's position in src.strip() (one line)."""
    import copy

    node = copy.copy(node)
    shift = len(src.encode("utf-8")) - len(src.lstrip().encode("utf-8"))
    node.lineno = node.end_lineno = 1
    node.col_offset -= shift
    node.end_col_offset -= shift
    return node


# -- torch.compile calls ---------------------------------------------------------------------------
