"""The job's own modules win over what the shim imported, as they would bare.

Bare, a job's `import numbers` finds numbers.py in the script's folder (sys.path[0]) before the
standard library's. The shim imports standard modules at start-up (json, random, copy, token,
statistics, ...), before sys.path[0] exists: cached in sys.modules, they would hide the job's
files of the same names. So the modules the shim added that the job's first sys.path entry also
holds are dropped from sys.modules (the shim keeps its own references to them); the job's
import then finds its file, as bare."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Sequence

# options of the interpreter that take a value as the next argument
_WITH_VALUE = {"-W", "-X", "--check-hash-based-pycs"}


def first_path_entry(orig_argv: Sequence[str], safe_path: bool) -> str | None:
    """The folder Python will put first on sys.path for this command line (None: none, -P/-I)."""
    if safe_path:
        return None
    args = list(orig_argv[1:])
    i = 0
    while i < len(args):
        arg = args[i]
        if arg in ("-c", "-m") or arg.startswith(("-c", "-m")) and not arg.startswith("--"):
            return os.getcwd()
        if arg == "-" or not arg.startswith("-"):
            if arg == "-":
                return os.getcwd()
            return os.path.dirname(os.path.realpath(arg))
        if arg == "--":
            return os.path.dirname(os.path.realpath(args[i + 1])) if i + 1 < len(args) else os.getcwd()
        i += 2 if arg in _WITH_VALUE else 1
    return os.getcwd()  # the interactive interpreter, or a script on stdin


def _shadowed(name: str, folder: str) -> bool:
    base = os.path.join(folder, name)
    return os.path.isfile(base + ".py") or os.path.isfile(os.path.join(base, "__init__.py"))


def unshadow(before: Iterable[str]) -> list[str]:
    """Drop from sys.modules the top-level modules added since `before` that the job's first
    sys.path folder holds a file of; returns their names."""
    try:
        folder = first_path_entry(
            getattr(sys, "orig_argv", sys.argv), bool(getattr(sys.flags, "safe_path", 0))
        )
    except (OSError, IndexError):
        return []
    if folder is None:
        return []
    known = set(before)
    added = {n for n in list(sys.modules) if n not in known and "." not in n and not n.startswith("_")}
    dropped = sorted(n for n in added if _shadowed(n, folder))
    for name in dropped:
        for key in [k for k in list(sys.modules) if k == name or k.startswith(name + ".")]:
            sys.modules.pop(key, None)
    return dropped
