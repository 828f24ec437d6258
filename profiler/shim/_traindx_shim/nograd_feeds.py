"""Does training read what a no-grad phase saw? A run of no-grad forwards of the training thread
is an evaluation when nothing trains on its rows; it is the training algorithm's own data
collection (an RL rollout, a pseudo-labelling pass) when the optimizer steps after it train on
rows it produced, new each time.

Mechanism: for the first MAX_PHASES runs of no-grad forwards, each forward's first tensor input
leaves a fingerprint per row (its first FINGER values, a copy on the tensor's own device: no
sync). At the next forward with grad, its first input row is looked up among them (`fed`), and
the run's first row among the previous run's (`fresh`: False when the same rows come back, as
a metric over a fixed data set's). One `nograd_phase` event per run checked: rows, fed, fresh.

Cost: a slice and a copy per no-grad forward of the first runs; one read of two booleans per
run checked (a sync on a GPU, MAX_PHASES times a job). Nothing after that.
"""

from __future__ import annotations

from . import emit, forward, report_error, schema
from .stepstate import _state as _steps

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing into the job (mypy knows the name)
if TYPE_CHECKING:
    from typing import Any

MAX_PHASES = 3
FINGER = 8  # values per row: exact equality of 8 values does not happen by chance
MAX_ROWS = 1 << 16  # rows kept per run (a rollout's observations; more is not needed)
_state: dict[str, Any] = {"phases": 0, "rows": [], "n": 0, "previous": None}


def _first_tensor(args: Any) -> Any:
    for arg in args if isinstance(args, tuple) else ():
        if hasattr(arg, "detach") and hasattr(arg, "reshape") and getattr(arg, "ndim", 0) >= 1:
            return arg
    return None


def _rows(x: Any) -> Any:
    """(rows, FINGER) values of a tensor's rows; a 1-D tensor is one row."""
    x = x.detach()
    flat = x.reshape(1, -1) if x.ndim == 1 else x.reshape(x.shape[0], -1)
    return flat[:, :FINGER]


def _on_forward(args: Any, grad: bool) -> None:
    if _state["phases"] >= MAX_PHASES:
        return
    try:
        if not grad:
            x = _first_tensor(args)
            if x is not None and x.numel() and _state["n"] < MAX_ROWS:
                rows = _rows(x).clone()  # its own copy: a buffer the job refills in place
                kept = _state["rows"]
                if kept and kept[0].shape[1] != rows.shape[1]:
                    return  # another model's inputs: the run's first kind of row is the one compared
                kept.append(rows)
                _state["n"] += int(rows.shape[0])
            return
        if not _state["rows"]:
            return
        _check(_first_tensor(args))
    except Exception as exc:
        _state["phases"] = MAX_PHASES  # checked no further: the job runs on untouched
        report_error("nograd phase", exc)


def _same_row(rows: Any, row: Any) -> Any:
    if row.shape[-1] != rows.shape[-1]:
        return None
    return (rows == row.to(rows.device)).all(dim=1).any()


def _check(x: Any) -> None:
    """The run of no-grad forwards ended at this grad forward: did it feed training?"""
    kept = _state["rows"]
    seen = _steps["torch"].cat(kept) if len(kept) > 1 else kept[0]
    fed = _same_row(seen, _rows(x)[:1]) if x is not None and x.numel() else None
    previous = _state["previous"]
    fresh = None if previous is None else _same_row(previous, seen[:1])
    emit(
        schema.NOGRAD_PHASE,
        rows=int(seen.shape[0]),
        fed=None if fed is None else bool(fed),
        fresh=None if fresh is None else not bool(fresh),
    )
    _state.update(phases=_state["phases"] + 1, rows=[], n=0, previous=seen)


def register() -> None:
    forward.input_hooks.append(_on_forward)
