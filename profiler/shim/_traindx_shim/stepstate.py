"""The step tracker's state, shared by steps (the boundaries), forward (the forward spans) and
markers (the step marker's installation): one dict, read on the job's hot paths."""

from __future__ import annotations

import os

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing into the job (mypy knows the name)
if TYPE_CHECKING:
    from typing import Any

MARKER_SPEC = (os.environ.get("TRAINDX_STEP_MARKER") or "").strip()

_state: dict[str, Any] = {
    "step": 0,
    "begin": None,
    "torch": None,
    "megatron": False,
    "mode": "marker" if MARKER_SPEC else "auto",  # "marker": only markers end steps
    "marker_calls": 0,
    "stop_pending": False,
    "train_thread": None,
    "opt_created_t": None,
    "opt_thread": None,  # the first optimizer: arms step 0's begin
    "first_activity": None,  # (t, what) of the first batch/forward/backward since torch import
    "stepped": False,  # an outermost optimizer step completed at least once
    "closer": None,  # key of the optimizer whose outermost step ends an iteration
    "learning": True,  # the closer of the first iteration is not known yet
    "unseen": set(),  # created optimizers not yet seen stepping (learning only)
    "created": 0,
    "nested": set(),
    "skipped": 0,
    "backward_depth": 0,
    "marker_installed": False,
    "marker_in_main": False,
}
