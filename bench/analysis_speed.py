"""How fast two analysis kernels are at scale (the timing checks moved out of the test suite,
where another job's load could fail them; the tests keep the results' correctness):

  find_period     the periodic slow-step search over 20,000 steps (a save every 50th step);
                  the O(N^3) search it replaced took hours, this one takes milliseconds
                  (tests/test_scale.py checked < 5 s)
  ledger          the time ledger (traindx.derive.ledger.compute) over 64 ranks x 2,000 steps
                  x 3 spans a step (tests/test_ledger.py checked < 30 s)

    OMP_NUM_THREADS=1 .venv/bin/python bench/analysis_speed.py [--repeat 3] [--json OUT.json]

Prints (and with --json writes) the wall seconds of each repeat, their median, whether the
median is under the bound the tests used to assert, and the machine's load average.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np
import pandas as pd

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from traindx.analyzers.model.stability import find_period  # noqa: E402
from traindx.derive import ledger as L  # noqa: E402

BOUNDS_S = {"find_period": 5.0, "ledger": 30.0}  # what the tests asserted before the move


def period_case() -> tuple[list[int], list[float]]:
    steps = list(range(20_000))
    durations = [0.25 + (1.5 if s % 50 == 7 else 0.0) + (s % 13) * 1e-4 for s in steps]
    return steps, durations


def time_find_period() -> float:
    steps, durations = period_case()
    t = time.perf_counter()
    period, residue, hits = find_period(steps, durations)
    elapsed = time.perf_counter() - t
    assert (period, residue, len(hits)) == (50, 7, 400)
    return elapsed


def ledger_tables(n_ranks: int, n_steps: int, seed: int = 0) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Steps of ~1 ms with a data wait, a backward and an optimizer span each (the shape of
    tests/test_ledger.py's scale check)."""
    rng = np.random.default_rng(seed)
    step_rows, span_rows = [], []
    for r in range(n_ranks):
        edges = np.cumsum(rng.integers(900_000, 1_100_000, n_steps + 1))
        for i in range(n_steps):
            a, b = int(edges[i]), int(edges[i + 1])
            step_rows.append((str(r), i, a, b, (b - a) / 1e9))
            span_rows += [
                (str(r), "data", a, a + 100_000, 1, None, None),
                (str(r), "backward", a + 300_000, a + 700_000, 1, None, None),
                (str(r), "optimizer", a + 700_000, a + 800_000, 1, None, None),
            ]
    steps = pd.DataFrame(step_rows, columns=["rank", "step", "start_ns", "end_ns", "duration_s"])
    spans = pd.DataFrame(span_rows, columns=["rank", "cat", "start_ns", "end_ns", "tid", "caller", "call"])
    return steps, spans


def time_ledger() -> float:
    steps, spans = ledger_tables(64, 2000)
    t = time.perf_counter()
    led, _ = L.compute(
        steps, spans, pd.DataFrame(columns=["rank", "kind", "start_ns", "end_ns"]), pd.DataFrame()
    )
    elapsed = time.perf_counter() - t
    assert len(led) == 64 * 2000
    return elapsed


CASES: dict[str, Callable[[], float]] = {"find_period": time_find_period, "ledger": time_ledger}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", help="write the result here as well")
    args = parser.parse_args()
    result: dict[str, object] = {"loadavg_1m": os.getloadavg()[0]}
    for name, case in CASES.items():
        seconds = [case() for _ in range(args.repeat)]
        median = statistics.median(seconds)
        result[name] = {
            "seconds": [round(s, 4) for s in seconds],
            "median_s": round(median, 4),
            "bound_s": BOUNDS_S[name],
            "within_bound": median < BOUNDS_S[name],
        }
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
