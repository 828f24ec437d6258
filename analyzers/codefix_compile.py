"""The planner's torch.compile edits of a job's file (ast): the compile calls it makes, their
`dynamic=`/`mode=` set, `torch._dynamo.mark_dynamic` before the calls of a compiled model, and
the model compiled where it is made in a job that compiles nothing (traindx.analyzers.fix_source)."""

from __future__ import annotations

import ast
import collections
from collections.abc import Sequence
from typing import Any

from traindx.analyzers.codefix_edit import code_change, set_keywords
from traindx.analyzers.codefix_source import _LOOPS, _called, _imports_torch, _tree

# a torch.compile of the job's file: {"line", "last_line", "source", "call", "target", "compiled", "dynamic"}
CompileCall = dict[str, Any]


def compile_calls(path: str) -> list[CompileCall]:
    """Every `torch.compile(...)` of the file (a call or a decorator): [{"line", "last_line",
    "source" (the lines as written), "call" (the call's text), "target" (the name it is assigned
    to, or the decorated function's), "compiled" (the first argument's text), "dynamic" (the
    keyword's text or None)}]."""
    tree, lines = _tree(path)
    if tree is None:
        return []
    out = []
    owners = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            owners[id(node.value)] = node.targets[0]
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for d in node.decorator_list:
                owners[id(d)] = node
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for d in node.decorator_list:
                if (
                    isinstance(d, ast.Attribute)
                    and d.attr == "compile"
                    and isinstance(d.value, ast.Name)
                    and d.value.id == "torch"
                ):
                    out.append(
                        {
                            "line": d.lineno,
                            "last_line": d.lineno,
                            "source": lines[d.lineno - 1],
                            "call": "torch.compile",
                            "target": node.name,
                            "compiled": None,
                            "dynamic": None,
                            "mode": None,
                        }
                    )
        if not _called(node, "torch.compile") and not (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "compile"
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "torch"
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


def _segment_of(lines: Sequence[str], node: ast.AST) -> str:
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
    tree, _ = _tree(path)
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
    tree, lines = _tree(path)
    if tree is None or not compiled:
        return []
    loops = [n for n in ast.walk(tree) if isinstance(n, _LOOPS)]
    out = []
    for loop in loops:
        for stmt in ast.walk(loop):
            if (
                not isinstance(stmt, (ast.Assign, ast.Expr, ast.AugAssign, ast.AnnAssign))
                or stmt.lineno != stmt.end_lineno
            ):
                continue
            for call in ast.walk(stmt):
                if (
                    isinstance(call, ast.Call)
                    and ast.unparse(call.func) == compiled
                    and len(call.args) > index
                    and isinstance(call.args[index], ast.Name)
                ):
                    text = lines[stmt.lineno - 1]
                    indent = text[: len(text) - len(text.lstrip())]
                    after = f"{indent}torch._dynamo.mark_dynamic({call.args[index].id}, {dim})\n{text}"
                    change = code_change(path, stmt.lineno, text, after)
                    if change and change not in out:
                        out.append(dict(change, op="replace"))
                    break
    return out


_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Module)


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
    tree, lines = _tree(path)
    if tree is None or not _imports_torch(tree) or compile_calls(path):
        return []
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
        return []
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}

    def scope_of(node):
        up = parents.get(node)
        while up is not None and not isinstance(up, _SCOPES):
            up = parents.get(up)
        return up

    assigned = collections.defaultdict(list)
    aliases = collections.defaultdict(set)  # name -> the names bound to it (`step_fn = model`)
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            assigned[node.targets[0].id].append(node)
            if isinstance(node.value, ast.Name):
                aliases[node.value.id].add(node.targets[0].id)
    loops_calling = collections.defaultdict(list)  # called name -> the loops that call it
    for loop in ast.walk(tree):
        if isinstance(loop, _LOOPS):
            for c in ast.walk(loop):
                if isinstance(c, ast.Call) and isinstance(c.func, ast.Name):
                    loops_calling[c.func.id].append(loop)
    out = []
    for name in sorted(trained):
        loops = [loop for n in {name} | aliases[name] for loop in loops_calling.get(n, ())]
        made = [a for a in assigned.get(name, ()) if isinstance(a.value, ast.Call)]
        if not loops or not made:
            continue
        # where it is first made: compiled in place there, it stays compiled through `.to()`
        # and inside a wrapper made later (DataParallel); a later `model = torch.load(...)`
        # (reloading the best one after training) is no place to compile it
        first = min(made, key=lambda a: a.lineno)
        scope = scope_of(first)
        anchor = first  # its statement in that scope's own body
        while parents.get(anchor) is not scope:
            anchor = parents[anchor]
            if isinstance(anchor, _LOOPS):
                break
        if isinstance(anchor, _LOOPS) or any(
            scope_of(loop) is scope and loop.lineno <= anchor.lineno for loop in loops
        ):
            continue  # made per iteration, or called by a loop before it is made
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
