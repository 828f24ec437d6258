"""The job's line of a place in a torch.profiler window without Python stacks (the retry of a
window that stood down for its cost: most of a launch-bound step's trace is its stacks). Such a
window names no module and no line: every place is "(no module)" and a phase. The shim's own
samples of the training thread (hostsample.py, a stack every few ms, on the trace's clock) still
saw where the job was: a place outside backward takes the job's frame its samples saw most
inside the place's host ops (each run of consecutive ops of the place on a thread, from its
first op's start to its last op's end: the Python between the ops of a loop is the place's too).

Backward places stay without a line: their ops run on autograd's thread while the training
thread sits in backward(), so its samples name the backward call, not the forward line that
made the ops (a window with stacks takes that through the sequence number).

Derive layer: tables and arithmetic, no judgement.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pandas as pd

NO_LINE_PHASES = ("backward", "recompute")
MIN_SAMPLES = 2  # samples inside a place's runs: fewer name no line


def sample_frames(samples: pd.DataFrame, cwd: str | None) -> pd.DataFrame:
    """(t_ns, frame) of the samples, each frame named as the tracer names one:
    'bench/model.py(93): EMA.update' (its path under the job's directory where it is there)."""
    if not len(samples):
        return pd.DataFrame({"t_ns": pd.Series(dtype="int64"), "frame": pd.Series(dtype=object)})
    files = samples["file"].astype(str)
    if cwd:
        root = cwd.rstrip("/") + "/"
        files = files.map(lambda f: f[len(root) :] if f.startswith(root) else f)
    frame = files + "(" + samples["line"].astype(str) + "): " + samples["function"].astype(str)
    out = pd.DataFrame({"t_ns": samples["t_ns"].astype("int64").to_numpy(), "frame": frame.to_numpy()})
    return out.sort_values("t_ns", kind="stable").reset_index(drop=True)


def _runs(ops: pd.DataFrame) -> list[tuple[int, int, np.ndarray[Any, Any]]]:
    """(start, end, row labels) of each run of consecutive ops of one place on a thread (`ops`:
    every host op of the window, `mine` marking the place's)."""
    out = []
    for _, g in ops.groupby("tid", sort=False):
        g = g.sort_values("start_ns", kind="stable")
        mine = g["mine"].to_numpy(bool)
        run = np.cumsum(np.r_[True, mine[1:] != mine[:-1]])
        for _, r in g[mine].groupby(run[mine]):
            out.append((int(r["start_ns"].min()), int(r["end_ns"].max()), r.index.to_numpy()))
    return out


def name_lines(
    host: pd.DataFrame, events: pd.DataFrame, frames: pd.DataFrame
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """host ops and GPU events with the sampled line of each line-less place outside backward:
    each run of the place's ops takes the frame its samples saw most (a loop after the model's
    forward, in the same phase, is a run of its own), a run no sample saw the place's; the GPU
    events, whose launches hold no time here, the place's."""
    if not len(host) or not len(frames) or host["line"].notna().any():
        return host, events
    t, names = frames["t_ns"].to_numpy(np.int64), frames["frame"].to_numpy(object)
    host, events = host.copy(), events.copy()
    for (module, phase), _ in host.groupby(["module", "phase"], sort=False):
        if phase in NO_LINE_PHASES:
            continue
        mine = ((host["module"] == module) & (host["phase"] == phase)).to_numpy()
        runs = _runs(host.assign(mine=mine))
        seen = [names[np.searchsorted(t, a, "left") : np.searchsorted(t, b, "right")] for a, b, _ in runs]
        counts = pd.Series(np.concatenate(seen) if seen else [], dtype=object).value_counts()
        if counts.sum() < MIN_SAMPLES:
            continue
        line = str(counts.index[0])
        for (_, _, rows), frames_in in zip(runs, seen):
            host.loc[rows, "line"] = pd.Series(frames_in).value_counts().index[0] if len(frames_in) else line
        if len(events):
            at = (
                (events["module"] == module) & (events["phase"] == phase) & events["line"].isna()
            ).to_numpy()
            events.loc[at, "line"] = line
    return host, events


def cwd_of(manifest: Any) -> str | None:
    cwd = manifest.get("cwd") if isinstance(manifest, dict) else None
    return os.path.normpath(cwd) if isinstance(cwd, str) and cwd else None
