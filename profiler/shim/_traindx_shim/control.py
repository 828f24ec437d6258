"""Requests from `diagnose` while the job runs: small JSON files under $TRAINDX_RUN_DIR/control/
(stop.json: stop every rank at one step; capture.json: a profiler window on an anomaly). Read at
step boundaries, each file at most every POLL_NS (one stat, not one per short step), re-read
only when it changed."""

from __future__ import annotations

import json
import os
import time

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing into the job (mypy knows the name)
if TYPE_CHECKING:
    from typing import Any

POLL_NS = 200_000_000
_DIR = os.path.join(os.environ["TRAINDX_RUN_DIR"], "control") if os.environ.get("TRAINDX_RUN_DIR") else None
_cache: dict[str, list[Any]] = {}  # name -> [checked_ns, mtime_ns, value]


def read(name: str) -> Any:
    """The request in control/<name> as a dict, or None (none yet, unreadable)."""
    if _DIR is None:
        return None
    entry = _cache.setdefault(name, [0, None, None])
    now = time.monotonic_ns()
    if now - entry[0] < POLL_NS:
        return entry[2]
    entry[0] = now
    path = os.path.join(_DIR, name)
    try:
        mtime = os.stat(path).st_mtime_ns
    except OSError:
        return entry[2]
    if mtime != entry[1]:
        try:
            with open(path, encoding="utf-8") as f:
                value = json.load(f)
            entry[1], entry[2] = mtime, value if isinstance(value, dict) else None
        except (OSError, ValueError):
            pass  # written at this moment: the next poll reads it
    return entry[2]
