"""The planner's torch.compile edits of a job's file (ast): the compile calls it makes, their
`dynamic=`/`mode=` set, `torch._dynamo.mark_dynamic` before the calls of a compiled model, and
the model compiled where it is made in a job that compiles nothing (traindx.fixing.plan.source)."""

from __future__ import annotations

import ast
import collections
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from traindx.analyzers.codefix.edit import code_change, set_keywords
from traindx.analyzers.codefix.source import LOOP_NODES, imports_torch, is_call_of, source_tree

# a torch.compile of the job's file: {"line", "last_line", "source", "call", "target", "compiled", "dynamic"}
CompileCall = dict[str, Any]


def _is_torch_compile(node: ast.AST) -> bool:
    """`torch.compile` as written (a bare decorator)."""
    return (
        isinstance(node, ast.Attribute)
        and node.attr == "compile"
        and isinstance(node.value, ast.Name)
        and node.value.id == "torch"
    )


def _bare_decorator(
    fn: ast.FunctionDef | ast.AsyncFunctionDef, d: ast.expr, lines: Sequence[str]
) -> CompileCall:
    return {
        "line": d.lineno,
        "last_line": d.lineno,
        "source": lines[d.lineno - 1],
        "call": "torch.compile",
        "target": fn.name,
        "compiled": None,
        "dynamic": None,
        "mode": None,
    }


def compile_calls(path: str) -> list[CompileCall]:
    """Every `torch.compile(...)` of the file (a call or a decorator): [{"line", "last_line",
    "source" (the lines as written), "call" (the call's text), "target" (the name it is assigned
    to, or the decorated function's), "compiled" (the first argument's text), "dynamic" (the
    keyword's text or None)}]."""
    tree, lines = source_tree(path)
    if tree is None:
        return []
    out: list[CompileCall] = []
    owners: dict[int, ast.AST] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            owners[id(node.value)] = node.targets[0]
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for d in node.decorator_list:
                owners[id(d)] = node
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out.extend(_bare_decorator(node, d, lines) for d in node.decorator_list if _is_torch_compile(d))
        if not isinstance(node, ast.Call) or not (
            is_call_of(node, "torch.compile") or _is_torch_compile(node.func)
        ):
            continue
        first, last = node.lineno, node.end_lineno or node.lineno
        region = "\n".join(lines[first - 1 : last])
        call = _segment_of(lines, node)
        owner = owners.get(id(node))
        target = (
            owner.name
            if isinstance(owner, (ast.FunctionDef, ast.AsyncFunctionDef))
            else ast.unparse(owner)
            if owner is not None
            else None
        )
        kw = {k.arg: ast.unparse(k.value) for k in node.keywords if k.arg}
        out.append(
            {
                "line": first,
                "last_line": last,
                "source": region,
                "call": call,
                "target": target,
                "compiled": ast.unparse(node.args[0]) if node.args else None,
                "dynamic": kw.get("dynamic"),
                "mode": kw.get("mode"),
            }
        )
    return sorted(out, key=lambda c: c["line"])


def _segment_of(lines: Sequence[str], node: ast.expr) -> str:
    """The exact source text of a node (over one or several lines)."""
    first, last = node.lineno - 1, (node.end_lineno or node.lineno) - 1
    raw = [l.encode("utf-8") for l in lines[first : last + 1]]
    if first == last:
        return raw[0][node.col_offset : node.end_col_offset].decode("utf-8", "replace")
    parts = [raw[0][node.col_offset :]] + raw[1:-1] + [raw[-1][: node.end_col_offset]]
    return b"\n".join(parts).decode("utf-8", "replace")


def compile_mode_edit(path: str, call: CompileCall, mode: str = "reduce-overhead") -> dict[str, Any] | None:
    """The torch.compile call with `mode=` set (reduce-overhead: CUDA graphs replay the step's
    kernels, one launch instead of hundreds), or None when it says so already."""
    if call.get("mode") in (repr(mode), f'"{mode}"'):
        return None
    text = (
        f"{call['call']}(mode={mode!r})"
        if call["call"] in ("torch.compile", "compile")
        else set_keywords(call["call"], {"mode": repr(mode)})
    )
    change = code_change(
        path,
        call["line"],
        call["call"],
        text,
        last_line=call["last_line"] if call["last_line"] > call["line"] else None,
    )
    return dict(change, op="replace") if change else None


def compile_arg_edits(path: str, call: CompileCall) -> list[tuple[str, dict[str, Any]]]:
    """Code changes of one torch.compile call (from compile_calls) that stop a steady recompile
    on changing shapes, best first: (label, change) for `dynamic=True` (symbolic shapes from the
    first compile) and, where the call says `dynamic=False`, `dynamic=None` (automatic dynamic:
    one recompile, then symbolic)."""
    out = []
    options = [("dynamic=True", "True")]
    if call.get("dynamic") not in (None, "None"):
        options.append(("dynamic=None", "None"))
    for label, value in options:
        if call.get("dynamic") == value:
            continue
        after_call: str | None
        if call["call"] in ("torch.compile", "compile"):
            after_call = f"{call['call']}(dynamic={value})"  # a bare @torch.compile
        else:
            after_call = set_keywords(call["call"], {"dynamic": value})
        if after_call is None:
            continue
        change = code_change(
            path,
            call["line"],
            call["call"],
            after_call,
            last_line=call["last_line"] if call["last_line"] > call["line"] else None,
        )
        if change:
            out.append((label, dict(change, op="replace")))
    return out


def parameter_index(path: str, line: int, name: str) -> int | None:
    """The position of parameter `name` among the positional parameters of the function defined
    at path:line (`self` not counted), or None."""
    tree, _ = source_tree(path)
    for node in ast.walk(tree) if tree is not None else ():
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.lineno <= line <= (
            node.body[0].lineno if node.body else node.lineno
        ):
            names = [a.arg for a in node.args.posonlyargs + node.args.args]
            if names and names[0] in ("self", "cls"):
                names = names[1:]
            return names.index(name) if name in names else None
    return None


def mark_dynamic_edits(path: str, compiled: str, index: int, dim: int) -> list[dict[str, Any]]:
    """Code changes that mark dimension `dim` of the tensor passed at position `index` to the
    compiled callable `compiled` dynamic, on the line before each call of it inside a loop
    (`torch._dynamo.mark_dynamic(x, 1)` before `logits = compiled(x)`); only where that
    argument is a plain name. [] when there is none."""
    tree, lines = source_tree(path)
    if tree is None or not compiled:
        return []
    loops = [n for n in ast.walk(tree) if isinstance(n, LOOP_NODES)]
    out = []
    for loop in loops:
        for stmt in ast.walk(loop):
            if (
                not isinstance(stmt, (ast.Assign, ast.Expr, ast.AugAssign, ast.AnnAssign))
                or stmt.lineno != stmt.end_lineno
            ):
                continue
            for call in ast.walk(stmt):
                arg = call.args[index] if isinstance(call, ast.Call) and len(call.args) > index else None
                if (
                    isinstance(call, ast.Call)
                    and ast.unparse(call.func) == compiled
                    and isinstance(arg, ast.Name)
                ):
                    text = lines[stmt.lineno - 1]
                    indent = text[: len(text) - len(text.lstrip())]
                    after = f"{indent}torch._dynamo.mark_dynamic({arg.id}, {dim})\n{text}"
                    change = code_change(path, stmt.lineno, text, after)
                    if change and change not in out:
                        out.append(dict(change, op="replace"))
                    break
    return out


_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Module)


def _trained_names(tree: ast.AST) -> set[str] | None:
    """The names whose parameters the job trains (`<name>.parameters()`); None when one of them
    is compiled already (`<name>.compile()`)."""
    trained = {
        n.value.id
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute) and n.attr == "parameters" and isinstance(n.value, ast.Name)
    }
    if any(
        isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and n.func.attr == "compile"
        and isinstance(n.func.value, ast.Name)
        and n.func.value.id in trained
        for n in ast.walk(tree)
    ):
        return None
    return trained


@dataclass
class _Bindings:
    """How a file binds and calls its names: the assignments of each name, the names bound to
    it (`step_fn = model`), the loops that call each name, every node's parent."""

    assigned: dict[str, list[ast.Assign]]
    aliases: dict[str, set[str]]
    loops_calling: dict[str, list[ast.AST]]
    parents: dict[ast.AST, ast.AST]

    def scope_of(self, node: ast.AST) -> ast.AST | None:
        up = self.parents.get(node)
        while up is not None and not isinstance(up, _SCOPES):
            up = self.parents.get(up)
        return up


def _bindings(tree: ast.AST) -> _Bindings:
    assigned: dict[str, list[ast.Assign]] = collections.defaultdict(list)
    aliases: dict[str, set[str]] = collections.defaultdict(set)
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            assigned[node.targets[0].id].append(node)
            if isinstance(node.value, ast.Name):
                aliases[node.value.id].add(node.targets[0].id)
    loops_calling: dict[str, list[ast.AST]] = collections.defaultdict(list)
    for loop in ast.walk(tree):
        if isinstance(loop, LOOP_NODES):
            for c in ast.walk(loop):
                if isinstance(c, ast.Call) and isinstance(c.func, ast.Name):
                    loops_calling[c.func.id].append(loop)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    return _Bindings(assigned=assigned, aliases=aliases, loops_calling=loops_calling, parents=parents)


def _compile_anchor(name: str, found: _Bindings) -> ast.stmt | None:
    """The statement of its scope's own body after which `name` is compiled: the one holding its
    first assignment by a call; None when it is made per iteration, or a loop of that scope
    calls it before."""
    loops = [loop for n in {name} | found.aliases[name] for loop in found.loops_calling.get(n, ())]
    made = [a for a in found.assigned.get(name, ()) if isinstance(a.value, ast.Call)]
    if not loops or not made:
        return None
    # where it is first made: compiled in place there, it stays compiled through `.to()`
    # and inside a wrapper made later (DataParallel); a later `model = torch.load(...)`
    # (reloading the best one after training) is no place to compile it
    first = min(made, key=lambda a: a.lineno)
    scope = found.scope_of(first)
    anchor: ast.AST = first  # its statement in that scope's own body
    while found.parents.get(anchor) is not scope:
        anchor = found.parents[anchor]
        if isinstance(anchor, LOOP_NODES):
            break
    if not isinstance(anchor, ast.stmt) or isinstance(anchor, LOOP_NODES):
        return None
    if any(found.scope_of(loop) is scope and getattr(loop, "lineno", 0) <= anchor.lineno for loop in loops):
        return None  # called by a loop before it is made
    return anchor


def compile_model_edits(path: str, mode: str = "reduce-overhead") -> list[dict[str, Any]]:
    """Edits that compile the job's model where it is made, for a job that compiles nothing:
    `model.compile(mode="reduce-overhead")` (in place: the same object, so an alias and a saved
    state_dict stay what they were) for each name whose parameters the job trains
    (`<name>.parameters()`) and that a loop calls, directly or through an alias (`out =
    <name>(x)`, `step_fn = <name>` ... `step_fn(x)`, in any function: a `train(model, ...)`
    helper's loop too). It goes after the statement of the assignment's own function (or
    module) that holds the first assignment of the name by a call — after a whole if/else that
    makes the model in each branch. [] when the file compiles something already (torch.compile,
    a module's .compile()), does not `import torch`, the model is made inside a loop, or a loop
    of that function calls it before that statement."""
    tree, lines = source_tree(path)
    if tree is None or not imports_torch(tree) or compile_calls(path):
        return []
    trained = _trained_names(tree)
    if trained is None:
        return []
    found = _bindings(tree)
    out = []
    for name in sorted(trained):
        anchor = _compile_anchor(name, found)
        if anchor is None:
            continue
        end = anchor.end_lineno or anchor.lineno
        before = "\n".join(line.rstrip("\r\n") for line in lines[anchor.lineno - 1 : end])
        change = code_change(
            path,
            anchor.lineno,
            before.strip() if anchor.lineno == end else before,
            f"{name}.compile(mode={mode!r})",
            last_line=end,
            op="insert_after",
        )
        if change:
            out.append(change)
    return out
