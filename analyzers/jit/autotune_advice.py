"""Prescriptions for Triton autotuning (plain Triton kernels and flash-linear-attention's), in the
installed versions' own terms.

Pure: `advise(events, packages, env, ...)` takes one rank's `triton_autotune` compile events, the
manifest's package versions and environment, and returns what the tuning cost, which key fields
made it tune again, and what to change. Every switch it names was read in the source of the
release named beside it (docs/autotune.md, with file:line); a version not listed in VERIFIED gets
the upgrade to one that is, never a variable it may ignore."""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from traindx.analyzers.core.findings import CacheWarm, EnvChange, PackageVersion, Prescription

# which installed release reads which switch: traindx.common.envvars (kernel-cache warm reads it too)
from traindx.common.envvars import FLA_PACKAGES, VERIFIED, reads, release  # noqa: F401
from traindx.common.envvars import package_version as _version

SOURCE = {
    "TRITON_CACHE_AUTOTUNING": "triton/runtime/autotuner.py:39, triton/knobs.py:375 (3.6.0)",
    "TRITON_CACHE_DIR": "triton/knobs.py:347, triton/runtime/autotuner.py:170-208 (3.6.0)",
    "FLA_CACHE_RESULTS": "fla/utils/env.py:26,112 (0.6.0)",
    "FLA_CACHE_MODE": "fla/ops/utils/cache.py:27-62,271-334 (0.6.0)",
}
Packages = Mapping[str, str]  # the manifest's package versions
Env = Mapping[str, str]  # the job's environment
LENGTH_LIKE_DISTINCT = 3  # a numeric key field with this many values in one run: data-dependent


@dataclass
class KernelTuning:
    kernel: str
    module: str
    is_fla: bool
    tunings: int
    bench_s: float
    first_step: int
    key_names: list[str]
    # [(field, distinct values, examples)]
    changing_fields: list[tuple[str, int, list[Any]]] = field(default_factory=list)
    retune_steps: list[int] = field(default_factory=list)
    retune_bench_s: float = 0.0
    cache_results: bool | None = None  # as the job ran (None: not recorded)
    disk_hits: int = 0
    first_from_disk: bool = False  # its first key was read from Triton's disk cache: warm already


@dataclass
class Advice:
    kernels: list[KernelTuning]  # most expensive first
    cold_bench_s: float  # first tuning of each kernel
    steady_bench_s: float  # tuning again for a new key
    cold: tuple[Prescription, ...] = ()  # warm the choices before the run, keep them
    steady: tuple[Prescription, ...] = ()  # stop the key from changing
    notes: list[str] = field(default_factory=list)

    def evidence(self) -> dict[str, Any]:
        return {
            "autotune_cold_bench_s": round(self.cold_bench_s, 3),
            "autotune_steady_bench_s": round(self.steady_bench_s, 3),
            "autotuned_kernels": [
                {
                    "kernel": k.kernel,
                    "module": k.module,
                    "tunings": k.tunings,
                    "bench_s": round(k.bench_s, 3),
                    "key_names": k.key_names,
                    "changing_key_fields": [f for f, _, _ in k.changing_fields],
                    "retune_steps": k.retune_steps[:20],
                    "cache_results": k.cache_results,
                    "disk_cache_hits": k.disk_hits,
                }
                for k in self.kernels
            ],
            "autotune_notes": self.notes,
        }


def _is_fla(event: Mapping[str, Any]) -> bool:
    module = str(event.get("module") or "")
    caller_file = str((event.get("caller") or {}).get("file") or "")
    return (
        module == "fla"
        or module.startswith("fla.")
        or "/fla/ops/" in caller_file
        or "/fla/modules/" in caller_file
    )


def _seconds(event: Mapping[str, Any]) -> float:
    for name in ("bench_s", "duration_s"):
        value = event.get(name)
        if isinstance(value, (int, float)) and value == value:
            return float(value)
    return 0.0


def _step(event: Mapping[str, Any]) -> int:
    step = event.get("step")
    return int(step) if isinstance(step, (int, float)) and step == step else 0


def _key_values(event: Mapping[str, Any]) -> dict[str, Any]:
    values = dict(event.get("key_fields") or {})
    for arg, dtype in (event.get("key_dtypes") or {}).items():
        values[f"dtype of {arg}"] = dtype
    return values


def _as_number(text: object) -> int | None:
    try:
        return int(str(text))
    except ValueError:
        return None


def summarize(events: Sequence[dict[str, Any]]) -> list[KernelTuning]:
    """Per kernel: tunings, seconds, and the key fields whose value changed between tunings."""
    by_kernel = OrderedDict()
    for event in sorted(events, key=lambda e: e.get("start") or e.get("start_ns") or 0):
        by_kernel.setdefault(str(event.get("kernel") or "?"), []).append(event)
    kernels = []
    for name, group in by_kernel.items():
        first = group[0]
        tuning = KernelTuning(
            kernel=name,
            module=str(first.get("module") or ""),
            is_fla=any(_is_fla(e) for e in group),
            tunings=len(group),
            bench_s=sum(_seconds(e) for e in group),
            first_step=_step(first),
            key_names=list(first.get("key_names") or list((first.get("key_fields") or {}).keys())),
        )
        recorded = [e.get("cache_results") for e in group if e.get("cache_results") is not None]
        tuning.cache_results = all(bool(c) for c in recorded) if recorded else None
        tuning.disk_hits = sum(1 for e in group if e.get("disk_cache_hit"))
        tuning.first_from_disk = bool(first.get("disk_cache_hit"))
        changes, seen = Counter(), {}
        previous = _key_values(first)
        for f, v in previous.items():
            seen.setdefault(f, []).append(v)
        for event in group[1:]:
            current = _key_values(event)
            for f in set(previous) | set(current):
                if previous.get(f) != current.get(f):
                    changes[f] += 1
                if current.get(f) not in seen.setdefault(f, []):
                    seen[f].append(current.get(f))
            previous = current
            if not event.get("disk_cache_hit"):
                tuning.retune_steps.append(_step(event))
                tuning.retune_bench_s += _seconds(event)
        tuning.changing_fields = [
            (f, len(seen.get(f, [])), seen.get(f, [])[:4]) for f, _ in changes.most_common()
        ]
        kernels.append(tuning)
    kernels.sort(key=lambda k: -k.bench_s)
    return kernels


def _field_text(tuning: KernelTuning) -> str:
    parts = []
    for f, distinct, examples in tuning.changing_fields:
        numbers = [_as_number(x) for x in examples]
        if distinct >= LENGTH_LIKE_DISTINCT and all(n is not None for n in numbers):
            parts.append(
                f"{f} ({distinct} values, e.g. {', '.join(map(str, examples[:3]))}: a "
                "size that changes with the data, such as a packed length)"
            )
        else:
            parts.append(f"{f} ({' -> '.join(map(str, examples[:3]))})")
    return "; ".join(parts)


def advise(
    events: Sequence[dict[str, Any]],
    packages: Mapping[str, str] | None = None,
    env: Mapping[str, str] | None = None,
    run_path: str | None = None,
    cache_dir: str | None = None,
    config_dir: str | None = None,
) -> Advice:
    """Advice for one rank's autotune events. `cache_dir`: where a persistent TRITON_CACHE_DIR
    should live (e.g. beside the run folders); `config_dir`: the same for FLA_CONFIG_DIR."""
    env = env or {}
    packages = packages or {}
    events = [e for e in events if isinstance(e, dict)]
    kernels = summarize(events)
    cold_s = sum(k.bench_s - k.retune_bench_s for k in kernels if not k.first_from_disk)
    steady_s = sum(k.retune_bench_s for k in kernels)
    advice = Advice(kernels=kernels, cold_bench_s=cold_s, steady_bench_s=steady_s)
    if not kernels:
        return advice
    warm = [k for k in kernels if k.first_from_disk]
    if warm:
        advice.notes.append(
            f"{len(warm)} of {len(kernels)} autotuned kernel(s) read their first "
            "choice from Triton's disk cache"
        )
    if len(warm) < len(kernels):
        advice.cold = tuple(_cold_prescriptions(advice, packages, env, run_path, cache_dir))
    advice.steady = tuple(_steady_prescriptions(advice, packages, env, config_dir))
    return advice


@dataclass(frozen=True)
class _ColdStart:
    """What keeps the cold kernels' choices across runs, in the installed versions' terms."""

    cold: list[KernelTuning]  # the kernels that tuned from nothing
    plain: list[KernelTuning]  # those whose persistence is Triton's switch (FLA's where unnamed)
    persist: dict[str, str]  # the variables that keep them
    triton_ok: bool  # the installed Triton reads TRITON_CACHE_AUTOTUNING
    fla_ok: bool  # the installed FLA reads FLA_CACHE_RESULTS


def _cold_start(advice: Advice, packages: Packages, env: Env, cache_dir: str) -> _ColdStart:
    notes = advice.notes
    cold = [k for k in advice.kernels if not k.first_from_disk]
    persist = {"TRITON_CACHE_DIR": cache_dir}
    triton_ok = reads(packages, "triton", "TRITON_CACHE_AUTOTUNING")
    fla_ok = reads(packages, "fla", "FLA_CACHE_RESULTS")
    # FLA kernels are Triton autotuners too: where FLA's own switch cannot be named, Triton's
    plain = [k for k in cold if not k.is_fla or not fla_ok]
    if plain and any(k.cache_results is not True for k in plain):
        if triton_ok:
            persist["TRITON_CACHE_AUTOTUNING"] = "1"
        else:
            notes.append(
                f"triton {_version(packages, 'triton') or '(version not recorded)'}: "
                "TRITON_CACHE_AUTOTUNING was checked in Triton >= "
                f"{VERIFIED[('triton', 'TRITON_CACHE_AUTOTUNING')]} only"
            )
    if any(k.is_fla for k in cold):
        if fla_ok and str(env.get("FLA_CACHE_RESULTS", "1")) != "1":
            persist["FLA_CACHE_RESULTS"] = "1"  # the job turned FLA's default off
        elif fla_ok:
            notes.append(
                f"flash-linear-attention {_version(packages, 'fla')} already asks Triton to "
                f"keep its autotune results (FLA_CACHE_RESULTS defaults to 1, "
                f"{SOURCE['FLA_CACHE_RESULTS']}): they were lost with TRITON_CACHE_DIR "
                f"({env.get('TRITON_CACHE_DIR') or 'default ~/.triton/cache'})"
            )
    return _ColdStart(cold=cold, plain=plain, persist=persist, triton_ok=triton_ok, fla_ok=fla_ok)


def _warm_prescription(advice: Advice, start: _ColdStart, run_path: str, cache_dir: str) -> Prescription:
    cold, persist = start.cold, start.persist
    names = ", ".join(k.kernel for k in cold[:4]) + (" …" if len(cold) > 4 else "")
    said = " ".join(f"{k}={v}" for k, v in persist.items())
    return Prescription(
        kind="precompile",
        summary=(
            f"warm Triton's cache before training: `kernel-cache warm --from-run {run_path}` "
            f"replays the calls that tuned {names} ({advice.cold_bench_s:.1f} s of benchmarking) so the "
            "choices and the compiled kernels are on disk; then run with " + said
        ),
        change=CacheWarm(from_run=str(run_path), env=dict(persist), options={"triton_cache_dir": cache_dir}),
        automatic=True,
        command=said + f" kernel-cache warm --from-run {run_path}",
    )


def _persist_prescription(start: _ColdStart, env: Env, run_path: str | None) -> Prescription:
    persist = start.persist
    what = []
    if "TRITON_CACHE_AUTOTUNING" in persist:
        what.append(
            f"TRITON_CACHE_AUTOTUNING=1 makes Triton write and read its autotune choices "
            f"({SOURCE['TRITON_CACHE_AUTOTUNING']})"
        )
    if "FLA_CACHE_RESULTS" in persist:
        what.append(
            f"FLA_CACHE_RESULTS=1 is FLA's default; the job set it to "
            f"{env.get('FLA_CACHE_RESULTS')!r} ({SOURCE['FLA_CACHE_RESULTS']})"
        )
    return Prescription(
        kind="env",
        summary=(
            "keep autotune choices and compiled kernels across runs: "
            + " ".join(f"{k}={v}" for k, v in persist.items())
            + " on a disk that outlives the job ("
            + ("; ".join(what) or "the persistent cache serves every key it has seen")
            + ")"
        ),
        change=EnvChange(env=dict(persist)),
        automatic=not run_path,
    )


def _cold_upgrades(advice: Advice, start: _ColdStart, packages: Packages) -> list[Prescription]:
    out = []
    if (
        not start.triton_ok
        and _version(packages, "triton")
        and start.plain
        and any(k.cache_results is not True for k in start.plain)
    ):
        out.append(
            Prescription(
                kind="upgrade",
                summary="upgrade Triton to >= 3.6.0 to keep autotune choices on disk "
                "(TRITON_CACHE_AUTOTUNING=1)",
                change=PackageVersion(package="triton", min_version="3.6.0"),
            )
        )
    fla = any(k.is_fla for k in start.cold)
    if fla and not start.fla_ok and not _version(packages, "fla"):
        advice.notes.append(
            "flash-linear-attention's version is not in the run's manifest: its own "
            "switches are left out (they were read in fla-core 0.6.0)"
        )
    elif fla and not start.fla_ok:
        out.append(
            Prescription(
                kind="upgrade",
                summary="upgrade flash-linear-attention (fla-core) to >= 0.6.0: it keeps "
                "its autotune choices in TRITON_CACHE_DIR by default",
                change=PackageVersion(package="flash-linear-attention", min_version="0.6.0"),
            )
        )
    return out


def _cold_prescriptions(
    advice: Advice, packages: Packages, env: Env, run_path: str | None, cache_dir: str | None
) -> list[Prescription]:
    cache_dir = cache_dir or env.get("TRITON_CACHE_DIR") or "<a persistent dir>"
    start = _cold_start(advice, packages, env, cache_dir)
    out = [_warm_prescription(advice, start, run_path, cache_dir)] if run_path else []
    out.append(_persist_prescription(start, env, run_path))
    return out + _cold_upgrades(advice, start, packages)


def _steady_prescriptions(
    advice: Advice, packages: Packages, env: Env, config_dir: str | None
) -> list[Prescription]:
    out = []
    retuning = [k for k in advice.kernels if k.retune_steps and k.changing_fields]
    for k in retuning:
        fields = [f for f, _, _ in k.changing_fields]
        where = f" ({k.module})" if k.module else ""
        out.append(
            Prescription(
                kind="code",
                summary=(
                    f"{k.kernel}{where} tunes again for every new value of {_field_text(k)}: "
                    f"{len(k.retune_steps)} re-tuning(s), {k.retune_bench_s:.1f} s. Keep "
                    f"{', '.join(fields)} out of its autotune key, or round it up to a few "
                    "buckets (pad the pack) where the caller computes it"
                ),
                change={
                    "code": {
                        "file": None,
                        "line": None,
                        "before": f"key={k.key_names}",
                        "after": f"key without {', '.join(fields)} (or a bucketed value)",
                    }
                },
                expected_gain_s_per_step=k.retune_bench_s / max(len(set(k.retune_steps)), 1),
            )
        )
    fla_retuning = [k for k in retuning if k.is_fla]
    if fla_retuning and reads(packages, "fla", "FLA_CACHE_MODE"):
        numeric = all(
            _as_number(v) is not None for k in fla_retuning for _, _, ex in k.changing_fields for v in ex
        )
        if numeric:
            names = ", ".join(k.kernel for k in fla_retuning)
            cfg = config_dir or env.get("FLA_CONFIG_DIR") or "<dir>"
            out.append(
                Prescription(
                    kind="env",
                    summary=(
                        f"flash-linear-attention {_version(packages, 'fla')}: FLA_CACHE_MODE=fuzzy "
                        f"with FLA_CONFIG_DIR={cfg} holding <kernel>.json for {names} "
                        "(`kernel-cache warm --from-run` writes them from the run's choices): its "
                        "fla_cache_autotune kernels then reuse a tuned config when only a number in "
                        f"the key differs ({SOURCE['FLA_CACHE_MODE']}); kernels FLA decorates with "
                        "plain triton.autotune still tune"
                    ),
                    change=EnvChange(env={"FLA_CACHE_MODE": "fuzzy", "FLA_CONFIG_DIR": cfg}),
                )
            )
    elif fla_retuning and _version(packages, "fla") and not reads(packages, "fla", "FLA_CACHE_MODE"):
        out.append(
            Prescription(
                kind="upgrade",
                summary="upgrade flash-linear-attention (fla-core) to >= 0.6.0: the gated-delta-rule "
                "forward kernels' autotune keys there hold no sequence length, and "
                "FLA_CACHE_MODE=fuzzy can reuse configs across lengths",
                change=PackageVersion(package="flash-linear-attention", min_version="0.6.0"),
            )
        )
    return out
