"""Shared pieces of the JIT analyzers (jit.py, jit_autotune.py, jit_dynamo.py): FA4's package
names and cache switches, compile-key history, the ledger's cost of a kernel's compiles, and the
FA4 precompile prescription."""

from __future__ import annotations

import collections
import os
import re
from typing import TYPE_CHECKING, Any

import pandas as pd

from traindx.analyzers.core import evidence as ev
from traindx.analyzers.core.findings import Prescription

FA4_PACKAGE = "flash-attn-4"
FA4_FIXED = "4.0.0b26"  # forward and backward (PR #2762); b22 fixed backward only (PR #2507)
FA4_BWD_FIXED = "4.0.0b22"
# FA4's cache variables are the kernel cache's (FA4's own names)
from traindx.kernel_cache.store.cache import DIR_VAR as CACHE_DIR_VAR  # noqa: E402
from traindx.kernel_cache.store.cache import ENABLE_VAR as CACHE_ENABLE_VAR  # noqa: E402

if TYPE_CHECKING:  # annotations only
    from traindx.derive.run import RunRecord

SINGLE_BLOCK_FIELDS = ("single_q_block", "single_k_block")
_TENSOR_REPR = re.compile(r"\b(Fake)?Tensor\(|\btensor\(")


def frame_where(frame: Any, run: RunRecord | None = None) -> str | None:
    if not isinstance(frame, dict) or not frame.get("file"):
        return None
    cwd = run.manifest.get("cwd") if run is not None else None
    return f"{display_path(frame['file'], cwd)}:{frame.get('line')}"


def display_path(path: str, cwd: str | None = None) -> Any:
    """A path relative to the job's folder when it is inside it (what a user types)."""
    if cwd and path.startswith(cwd.rstrip(os.sep) + os.sep):
        return os.path.relpath(path, cwd)
    return path


def _release_number(version: Any) -> Any:
    """4.0.0b17 -> (4, 0, 0, 17); a final release sorts after every beta."""
    m = re.match(r"^(\d+)\.(\d+)\.(\d+)(?:b(\d+))?", str(version or ""))
    if not m:
        return None
    return (int(m[1]), int(m[2]), int(m[3]), int(m[4]) if m[4] is not None else 10**6)


def fa4_version_before(run: RunRecord, release: Any) -> Any:
    have = _release_number((run.manifest.get("packages") or {}).get(FA4_PACKAGE))
    return None if have is None else have < _release_number(release)


def compile_severity(share: float | None, steady: bool = False) -> str:
    severity = ev.severity_for_share(share)
    if steady and share is not None and share >= 0.5:
        return "critical"
    return severity


def is_tensor_field(value: Any, type_name: Any) -> Any:
    return type_name == "Tensor" or bool(_TENSOR_REPR.search(str(value)))


def diff_keys(previous: Any, current: Any, previous_types: Any = None, current_types: Any = None) -> Any:
    """(fields whose value changed, fields that compare equal by text but hold a tensor: the key
    differs by object identity) between two compile keys given as {field: repr}."""
    previous, current = previous or {}, current or {}
    changed = [k for k in current if k in previous and previous[k] != current[k]]
    changed += [k for k in current if k not in previous] + [k for k in previous if k not in current]
    identity = []
    if not changed:
        types = {**(previous_types or {}), **(current_types or {})}
        identity = [k for k, v in current.items() if is_tensor_field(v, types.get(k))]
    return changed, identity


def col(row: Any, name: Any) -> Any:
    value = getattr(row, name, None)
    if isinstance(value, float) and value != value:
        return None
    return value


def precompile_prescription(run: RunRecord, gain: float | None = None, note: Any = "") -> Prescription:
    env = run.manifest.get("env") or run.manifest.get("environment") or {}
    cache_dir = env.get(CACHE_DIR_VAR)
    if not cache_dir or cache_dir == "<redacted>":
        try:  # FA4's own default, so the warm-up and the training agree on one folder
            from traindx.kernel_cache.store.cache import default_cache_dir

            cache_dir = str(default_cache_dir({}))
        except Exception:
            cache_dir = None
    change_env = {CACHE_ENABLE_VAR: "1"}
    if cache_dir:
        change_env[CACHE_DIR_VAR] = cache_dir
    return Prescription(
        kind="precompile",
        summary="precompile the FA4 kernels before training: kernel-cache warm --from-run "
        f"{run.path}, then train with {CACHE_ENABLE_VAR}=1 and {CACHE_DIR_VAR} set" + note,
        change={"precompile": {"from_run": run.path}, "env": change_env},
        command=f"kernel-cache warm --from-run {run.path} && export {CACHE_ENABLE_VAR}=1 "
        f"{CACHE_DIR_VAR}=$(kernel-cache env --dir)",
        expected_gain_s_per_step=gain,
        automatic=True,
    )


def steps_after(steps: pd.DataFrame, first_step: Any) -> Any:
    return steps[steps["step"] > first_step]


def kernel_rows(compiles: pd.DataFrame) -> Any:
    """{(kind, kernel): DataFrame of its compiles in time order}."""
    out = collections.OrderedDict()
    for (kind, kernel), group in compiles.sort_values("start_ns").groupby(["kind", "kernel"], sort=False):
        out[(kind, kernel)] = group
    return out


def key_history(group: pd.DataFrame) -> Any:
    """Changed fields over consecutive compiles: Counter of field -> times it changed, Counter of
    identity-only tensor fields, an example of one change, and how many pairs had no visible
    change at all."""
    changed_count, identity_count = collections.Counter(), collections.Counter()
    example, identical_pairs = None, 0
    rows = list(group.itertuples())
    for a, b in zip(rows, rows[1:]):
        fa, fb = col(a, "key_fields"), col(b, "key_fields")
        if not isinstance(fa, dict) or not isinstance(fb, dict):
            if col(a, "key") is not None and col(a, "key") == col(b, "key"):
                identical_pairs += 1
            continue
        changed, identity = diff_keys(fa, fb, col(a, "key_types"), col(b, "key_types"))
        changed_count.update(changed)
        identity_count.update(identity)
        if not changed:
            identical_pairs += 1
        if changed and example is None:
            example = {k: {"before": fa.get(k), "after": fb.get(k)} for k in changed[:4]}
    return changed_count, identity_count, example, identical_pairs


def ledger_cost(
    run: RunRecord, rank: str, after: Any, lost: float | None, share: float | None, category: Any
) -> Any:
    """(seconds per step, share of the step) of a recompiling kernel, from the time ledger: its
    own compile seconds per step, but never more than the exclusive `category` seconds of the
    ledger over the same steps (nested or overlapping compile events count once), as a share
    of those steps' wall time. Unchanged when the ledger has none of these steps."""
    if lost is None or not len(after):
        return lost, share
    led = run.rank_rows("ledger", rank)
    led = led[led["step"].isin({int(s) for s in after["step"]})]
    if not len(led):
        return lost, share
    exclusive = float(led[f"{category}_s"].mean())
    wall = float(led["wall_s"].mean())
    lost = min(lost, exclusive)
    return lost, (min(1.0, lost / wall) if wall else share)
