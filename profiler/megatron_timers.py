"""Read Megatron-LM / megatron-core timer blocks from a training log (`--timing-log-level 2`).

With `--timing-log-option all` each log interval prints every rank's time per timer,
normalised per iteration::

    times across ranks (ms):
      forward-compute:
         rank  0: 123.45
         rank  1: 130.02

(`minmax` / `max`, the default, print only the extremes over ranks: no rank to attribute a
straggler to, so those blocks are counted and skipped.) The iteration is the last
`iteration N/ M |` line before the block. Record layer: the rows are returned as read, one per
(interval, timer, rank), in milliseconds; `traindx.derive.optable.from_timers` makes the op table.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import pandas as pd

ALL_HEADER = "times across ranks (ms):"
MINMAX_HEADERS = ("(min, max) time across ranks (ms):", "max time across ranks (ms):")
_ITERATION = re.compile(r"\biteration\s+(\d+)\s*/\s*\d+\s*\|")
_TIMER = re.compile(r"^\s{1,4}([A-Za-z0-9][\w\-]*):\s*$")
_RANK = re.compile(r"^\s+rank\s+(\d+):\s*([0-9.]+)\s*$")


@dataclass
class TimerLog:
    rows: pd.DataFrame  # interval, iteration, timer, rank, ms
    minmax_blocks: int = 0  # blocks with no per-rank times
    notes: list[str] = field(default_factory=list)


def looks_like(path: str, limit: int = 4 << 20) -> bool:
    """The text file holds a Megatron timer block of either kind."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            head = f.read(limit)
    except OSError:
        return False
    return ALL_HEADER in head or any(h in head for h in MINMAX_HEADERS)


def read(path: str) -> TimerLog:
    rows: list[tuple[int, int, str, int, float]] = []
    interval, iteration, minmax = -1, -1, 0
    in_block, timer = False, None
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            line = line.rstrip("\n")
            m = _ITERATION.search(line)
            if m:
                iteration = int(m.group(1))
            if line.rstrip().endswith(ALL_HEADER) and not any(
                line.rstrip().endswith(h) for h in MINMAX_HEADERS
            ):
                interval += 1
                in_block, timer = True, None
                continue
            if any(line.rstrip().endswith(h) for h in MINMAX_HEADERS):
                minmax += 1
                in_block = False
                continue
            if not in_block:
                continue
            r = _RANK.match(line)
            if r and timer is not None:
                rows.append((interval, iteration, timer, int(r.group(1)), float(r.group(2))))
                continue
            t = _TIMER.match(line)
            if t:
                timer = t.group(1)
                continue
            in_block = False
    frame = pd.DataFrame(rows, columns=["interval", "iteration", "timer", "rank", "ms"])
    return TimerLog(rows=frame, minmax_blocks=minmax)
