"""What every `kernel-cache` command prints with: its name, a console, the exports a job needs."""

from __future__ import annotations

import sys
from pathlib import Path

from traindx.common.console import Console
from traindx.kernel_cache.store import cache as store

PROG = "kernel-cache"


def console(stderr: bool = False) -> Console:
    stream = sys.stderr if stderr else sys.stdout
    # piped output (logs, CI) gets a wide fixed width instead of rich's 80-column fallback
    return Console(stderr=stderr, highlight=False, width=None if stream.isatty() else 200)


def exports(cache_dir: str | Path) -> list[str]:
    return [f"export {store.ENABLE_VAR}=1", f"export {store.DIR_VAR}={cache_dir}"]
