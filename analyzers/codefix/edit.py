"""A code change checked as real code (judge layer, fix planning): a `before` that is the job's
own source (one line, a call written over several lines, or a part of them) and an `after` that
parses, at a file:line (`code_change`); the edited text and its unified diff (`apply`,
`unified_diff`); a call's keywords read and set (`keyword_sources`, `set_keywords`)."""

from __future__ import annotations

import ast
import difflib
import io
import textwrap
import tokenize
from collections.abc import Mapping
from typing import Any

_PAIRS = {")": "(", "]": "[", "}": "{"}


def _unmatched(text: str) -> tuple[list[str], list[str]]:
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


def _completed(text: str) -> str:
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
    file: str | None,
    line: int | None,
    before: str | None,
    after: str | None,
    last_line: int | None = None,
    op: str | None = None,
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
    change: dict[str, Any] = {"file": file, "line": line, "before": before, "after": after}
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

    def offset(lineno: int | None, col: int | None) -> int:
        """(ast line in the wrapped text, byte column) -> index in call_text."""
        i = (lineno or 0) - 2
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
