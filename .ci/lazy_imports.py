"""Every import inside a function says why it is not at the module's top (start-up cost, an optional
package, torch only once the job imported it): a comment on the import block or the line before it,
or a module or function docstring that says where its imports happen. Prints the ones that do not and
exits 1."""

from __future__ import annotations

import ast
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("traindx", "profiler", "derive", "analyzers", "fixing", "recipes", "report", "kernel_cache")
SAYS_WHY = re.compile(r"import(ed|s)? (here|only|where|when|lazily|after)|lazy", re.IGNORECASE)


def _in_import_block(line: str) -> bool:
    text = line.strip()
    return (
        text.startswith(("import ", "from "))
        or text in ("", ")")
        or (line.startswith(" ") and text.endswith(","))
    )


def unexplained(path: pathlib.Path) -> list[str]:
    """`path:line: import` for each function-level import of `path` that gives no reason."""
    lines = path.read_text(encoding="utf-8").splitlines()
    tree = ast.parse("\n".join(lines))
    if SAYS_WHY.search(ast.get_docstring(tree) or ""):
        return []
    found = []
    for function in ast.walk(tree):
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if SAYS_WHY.search(ast.get_docstring(function) or ""):
            continue
        for node in ast.walk(function):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            first = last = node.lineno - 1
            while first > 0 and _in_import_block(lines[first - 1]):
                first -= 1
            while last + 1 < len(lines) and lines[last + 1].strip().startswith(("import ", "from ")):
                last += 1
            if not any("#" in line for line in lines[max(0, first - 1) : last + 1]):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {lines[node.lineno - 1].strip()}")
    return found


def main() -> int:
    found = [
        row
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
        for row in unexplained(path)
    ]
    for row in dict.fromkeys(found):
        print(row)
    if found:
        print(f"{len(found)} imports inside functions give no reason (start-up cost, optional package ...)")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
