"""The ladder: global switches a user could flip, tried by `--fix` where a place is slow for no
known reason (judge layer, fix planning; docs/fix.md, "The ladder").

A slow place (`gpu.place_slow`: ≥ 10 % of the step and ≥ 3× what its work needs) that no rule
explains has no prescription of its own. Its evidence (the phase, the kernel classes and
precisions of its time, the device, the memory headroom) says which switches could pay; each
such rung is an arm of its own, best predicted first, at most `LADDER_CAP`, measured and
parity-checked like every other arm. A named mechanism whose fix is one of these switches but
which prescribes it only in prose (forward recomputed in backward, the NCHW layout) gets that
rung as its own arm. A rung that cannot apply (a CUDA switch on a CPU run, no room for the
activations) is not tried: it is listed as skipped with the reason.

Each rung: what the user flips (`switch`), how the arm applies it (a shim patch,
profiler/shim/_traindx_shim/ladder_patches.py and math_patches.py, or an environment variable),
and its predicted saving from the place's evidence (`gain`: seconds a step, or the reason it
does not apply). The factors are deliberately modest: the arm measures the real effect.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from traindx.analyzers.core.findings import NOTE, EnvChange, Finding, Prescription, RuntimePatch
from traindx.fixing.plan import compile_edits
from traindx.fixing.plan.options import is_concrete
from traindx.fixing.plan.source import job_script_files

LADDER_CAP = 3  # ladder arms at most, over the run
SLOW_PLACE = "gpu.place_slow"
MIN_SHARE = 0.2  # of the place's time: the kernel class a switch acts on
ROOM_FACTOR = 2.0  # checkpointing off: the memory's peak may double and still fit
TIGHT_MEMORY = 0.85  # of the device: the allocator works near its limit
_MODE = re.compile(r"""\bmode\s*=\s*["']([\w-]+)["']""")


@dataclass(frozen=True)
class PlaceEvidence:
    """What the ladder reads of one finding's place (its evidence, the job's files)."""

    finding: str
    device: str | None  # "cuda" | "cpu" | None (unknown)
    phase: str | None
    seconds: float  # the place's time a step (GPU, or host on a CPU run)
    saving_cap: float | None  # the finding's own price: no switch saves more than the place loses
    families: Mapping[str, float] = field(default_factory=dict)  # kernel family -> seconds a step
    precisions: Mapping[str, float] = field(default_factory=dict)  # precision -> seconds a step
    memory_peak: float | None = None
    memory_total: float | None = None
    compile_modes: tuple[str, ...] = ()  # torch.compile modes the job's files ask for

    def family(self, *names: str) -> float:
        return sum(float(self.families.get(n) or 0.0) for n in names)

    def fp32_math(self) -> float:
        """Seconds of fp32 / tf32 math (the precision's time, at most the matmul and conv time)."""
        wide = float(self.precisions.get("fp32") or 0.0) + float(self.precisions.get("tf32") or 0.0)
        return min(wide, self.family("matmul", "conv", "attention"))


Gain = tuple[float | None, str]  # (predicted seconds a step, or None; why / why not)


def _share(ev: PlaceEvidence, seconds: float, what: str) -> str | None:
    """None when `what` holds at least MIN_SHARE of the place's time, else why not."""
    if ev.seconds <= 0 or seconds < MIN_SHARE * ev.seconds:
        return f"{what} is under {MIN_SHARE:.0%} of the place's time"
    return None


def _checkpoint_off(ev: PlaceEvidence) -> Gain:
    if ev.phase != "recompute":
        return None, "the place is not forward work run again inside backward"
    if ev.memory_peak is None or not ev.memory_total:
        return None, "the run's memory headroom is unknown (checkpointing off keeps the activations)"
    if ev.memory_peak * ROOM_FACTOR > ev.memory_total:
        return None, (
            f"the memory peaked at {ev.memory_peak / 2**30:.1f} of {ev.memory_total / 2**30:.1f} GiB: "
            "no room to keep the activations"
        )
    return ev.seconds, "the recomputed forward is removed"


def _channels_last(ev: PlaceEvidence) -> Gain:
    conv = ev.family("conv")
    why = _share(ev, conv, "convolution")
    return (None, why) if why else (0.3 * conv, "NHWC convolutions without layout transposes")


def _tf32(ev: PlaceEvidence) -> Gain:
    math = float(ev.precisions.get("fp32") or 0.0)
    math = min(math, ev.family("matmul", "conv"))
    why = _share(ev, math, "fp32 matmul/conv")
    return (None, why) if why else (0.5 * math, "fp32 matmuls on TF32 tensor cores")


def _bf16(ev: PlaceEvidence) -> Gain:
    if ev.phase not in ("forward", "backward", "recompute"):
        return None, f"the place's phase is {ev.phase}, not the forward or backward autocast covers"
    math = ev.fp32_math()
    why = _share(ev, math, "fp32/tf32 math")
    return (None, why) if why else (0.5 * math, "bf16 math at twice TF32's rate, half its bytes")


def _benchmark(ev: PlaceEvidence) -> Gain:
    conv = ev.family("conv")
    why = _share(ev, conv, "convolution")
    return (None, why) if why else (0.15 * conv, "cuDNN picks the fastest algorithm per shape")


def _expandable(ev: PlaceEvidence) -> Gain:
    if ev.memory_peak is None or not ev.memory_total:
        return None, "the device's memory use is unknown"
    if ev.memory_peak < TIGHT_MEMORY * ev.memory_total:
        return None, f"the memory peaked under {TIGHT_MEMORY:.0%} of the device: the allocator is not pressed"
    return 0.1 * ev.seconds, "fewer allocator retries and cache flushes near the memory limit"


def _optimizer(factor: float) -> Callable[[PlaceEvidence], Gain]:
    def gain(ev: PlaceEvidence) -> Gain:
        if ev.phase != "optimizer":
            return None, "the place is not the optimizer's step"
        return factor * ev.seconds, "one multi-tensor (or fused) kernel per parameter group"

    return gain


def _compile_mode(ev: PlaceEvidence) -> Gain:
    other = [m for m in ev.compile_modes if m != "default"]
    if not other:
        return None, "the job does not compile with a mode other than the default"
    return 0.1 * ev.seconds, f"default-mode kernels instead of {other[0]}'s choices"


@dataclass(frozen=True)
class Rung:
    """One global switch: its name, what the user flips, how the arm flips it, whether it needs
    CUDA, the mechanism findings whose own fix it is, and its predicted saving."""

    name: str
    switch: str
    change: RuntimePatch | EnvChange
    cuda_only: bool
    gain: Callable[[PlaceEvidence], Gain]
    explains: tuple[str, ...] = ()


RUNGS: tuple[Rung, ...] = (
    Rung(
        "checkpoint_off",
        "activation checkpointing off (call the checkpointed function directly)",
        RuntimePatch(patch="checkpoint_off"),
        False,
        _checkpoint_off,
        ("gpu.recompute",),
    ),
    Rung(
        "channels_last",
        "model.to(memory_format=torch.channels_last) and 4-D inputs likewise",
        RuntimePatch(patch="channels_last"),
        False,
        _channels_last,
        ("gpu.layout_nchw",),
    ),
    Rung(
        "tf32",
        'torch.set_float32_matmul_precision("high") (TF32 matmuls; cuDNN already allows TF32)',
        RuntimePatch(patch="fp32_matmul_high"),
        True,
        _tf32,
    ),
    Rung(
        "bf16_autocast",
        "torch.autocast(device, dtype=torch.bfloat16) around the forward",
        RuntimePatch(patch="bf16_autocast"),
        True,
        _bf16,
    ),
    Rung(
        "cudnn_benchmark",
        "torch.backends.cudnn.benchmark = True",
        RuntimePatch(patch="cudnn_benchmark_on"),
        True,
        _benchmark,
    ),
    Rung(
        "expandable_segments",
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
        EnvChange(env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}),
        True,
        _expandable,
    ),
    Rung(
        "fused_optimizer",
        "the optimizer built with fused=True",
        RuntimePatch(patch="optimizer_fused"),
        True,
        _optimizer(0.7),
    ),
    Rung(
        "foreach_optimizer",
        "the optimizer built with foreach=True",
        RuntimePatch(patch="optimizer_foreach"),
        False,
        _optimizer(0.5),
    ),
    Rung(
        "compile_default_mode",
        "torch.compile(...) without mode= (the default mode)",
        RuntimePatch(patch="compile_default_mode"),
        False,
        _compile_mode,
    ),
)


@dataclass(frozen=True)
class LadderArm:
    """A rung offered as an arm: the finding it is for, the prescription the planner measures."""

    finding: Finding
    rung: Rung
    prescription: Prescription
    gain: float
    rank: int  # the finding's rank among the run's findings


@dataclass
class Ladder:
    """What the ladder decided: the arms (best first, capped) and one row per rung considered
    (fix.json's `plan.ladder`: finding, rung, switch, status offered | skipped, why, predicted)."""

    arms: list[LadderArm] = field(default_factory=list)
    rows: list[dict[str, Any]] = field(default_factory=list)


def wants(finding: Finding) -> bool:
    """The ladder may offer arms for this finding (a slow place, a mechanism a rung fixes)."""
    return finding.id == SLOW_PLACE or any(finding.id in r.explains for r in RUNGS)


def ladder_switch(patch: str) -> str | None:
    """What a user flips in their own code for a shim patch a rung applies (None: no rung's)."""
    return next((r.switch for r in RUNGS if getattr(r.change, "patch", None) == patch), None)


def rung_summary(rung: Rung) -> str:
    return f"ladder rung {rung.name}: {rung.switch}"


def compile_modes(command: Sequence[str], cwd: str) -> tuple[str, ...]:
    """The torch.compile modes the job's scripts ask for ("default" where a call names none)."""
    out: list[str] = []
    for path in job_script_files(command, cwd):
        for call in compile_edits.compile_calls(path):
            m = _MODE.search(str(call.get("call") or ""))
            out.append(m.group(1) if m else "default")
    return tuple(dict.fromkeys(out))


def evidence_of(finding: Finding, modes: tuple[str, ...] = ()) -> PlaceEvidence:
    e = finding.evidence or {}
    seconds = e.get("gpu_s_per_step") or e.get("recompute_gpu_s_per_step") or finding.seconds_lost_per_step
    phase = e.get("phase") or ("recompute" if finding.id == "gpu.recompute" else None)
    families = e.get("families")
    if not isinstance(families, Mapping):  # an older record: the top kernels' classes
        families = {}
        for k in e.get("top_kernels") or []:
            fam = str(k.get("family") or "?")
            families[fam] = families.get(fam, 0.0) + float(k.get("seconds") or 0.0)
    return PlaceEvidence(
        finding=finding.id,
        device=e.get("device_kind") or ("cuda" if finding.id == SLOW_PLACE else None),
        phase=phase,
        seconds=float(seconds or 0.0),
        saving_cap=finding.seconds_lost_per_step,
        families={str(k): float(v) for k, v in families.items()},
        precisions={str(k): float(v) for k, v in (e.get("precisions") or {}).items()},
        memory_peak=e.get("memory_peak_bytes"),
        memory_total=e.get("memory_total_bytes"),
        compile_modes=modes,
    )


def _names_place(place: Finding, other: Finding) -> bool:
    """Another finding's evidence names this place: its module, its line or a top kernel."""
    mine, theirs = place.evidence or {}, other.evidence or {}
    module = mine.get("module")
    if module and any(
        isinstance(m, str) and (m == module or m.startswith(module + "."))
        for m in [theirs.get("module"), *(theirs.get("modules") or [])]
    ):
        return True
    if mine.get("line") and mine.get("line") == theirs.get("line"):
        return True
    kernels = {k.get("name") for k in mine.get("top_kernels") or [] if isinstance(k, Mapping)}
    named = {k.get("name") for k in theirs.get("top_kernels") or [] if isinstance(k, Mapping)}
    return bool(kernels & named - {None})


def explained_by(place: Finding, findings: Sequence[Finding]) -> Finding | None:
    """A rule that names this place and prescribes a change --fix can make: it owns the place."""
    for other in findings:
        if other is place or other.id == SLOW_PLACE or other.severity == NOTE:
            continue
        if any(is_concrete(p) for p in other.prescriptions) and _names_place(place, other):
            return other
    return None


def _rungs_for(finding: Finding, findings: Sequence[Finding]) -> tuple[list[Rung], str | None]:
    """(the rungs to weigh for this finding, or why none): every rung for an unexplained slow
    place, a mechanism's own rung where it prescribes nothing concrete."""
    if finding.id == SLOW_PLACE:
        owner = explained_by(finding, findings)
        if owner is not None:
            return [], f"[{owner.id}] names this place and prescribes its own fix"
        return list(RUNGS), None
    own = [r for r in RUNGS if finding.id in r.explains]
    if own and not any(is_concrete(p) for p in finding.prescriptions):
        return own, None
    return [], None


def _row(finding: Finding, rung: Rung | None, status: str, why: str, gain: float | None) -> dict[str, Any]:
    return {
        "finding": finding.id,
        "rung": rung.name if rung else None,
        "switch": rung.switch if rung else None,
        "summary": rung_summary(rung) if rung else None,
        "status": status,
        "why": why,
        "predicted_saving_s_per_step": gain,
    }


def weigh(finding: Finding, rung: Rung, ev: PlaceEvidence) -> Gain:
    """A rung's predicted saving for a place (capped by the place's price), or why it cannot apply."""
    if rung.cuda_only and ev.device != "cuda":
        return None, f"CUDA only (this place ran on {ev.device or 'an unknown device'})"
    gain, why = rung.gain(ev)
    if finding.id in rung.explains and gain is not None and finding.seconds_lost_per_step:
        # the mechanism priced its own fix from what it found (the NCHW transposes and kernels
        # channels_last removes): that beats a rung's rule of thumb over kernel families
        gain = finding.seconds_lost_per_step
    if gain is not None and ev.saving_cap is not None:
        gain = min(gain, ev.saving_cap)
    if gain is not None and gain <= 0:
        return None, "nothing to save at this place"
    return gain, why


def plan_ladder(
    findings: Sequence[Finding], command: Sequence[str], cwd: str, cap: int = LADDER_CAP
) -> Ladder:
    """The ladder's arms for the run's findings, best predicted first (one arm per switch: it is
    global), at most `cap`; every rung weighed is a row, offered or skipped with its reason."""
    ladder = Ladder()
    offered: list[tuple[float, int, Finding, Rung, str]] = []  # (gain, rank, ...)
    modes: tuple[str, ...] | None = None
    for rank, finding in enumerate(findings):
        rungs, none_why = _rungs_for(finding, findings)
        if none_why:
            ladder.rows.append(_row(finding, None, "skipped", none_why, None))
        if not rungs:
            continue
        if modes is None:
            modes = compile_modes(command, cwd)
        ev = evidence_of(finding, modes)
        for rung in rungs:
            gain, why = weigh(finding, rung, ev)
            if gain is None:
                ladder.rows.append(_row(finding, rung, "skipped", why, None))
            else:
                offered.append((gain, rank, finding, rung, why))
    offered.sort(key=lambda o: (-o[0], o[1]))
    taken: set[str] = set()
    for gain, rank, finding, rung, why in offered:
        if rung.name in taken:
            ladder.rows.append(
                _row(finding, rung, "skipped", "the same global switch is offered above", gain)
            )
        elif len(taken) >= cap:
            ladder.rows.append(_row(finding, rung, "skipped", f"beyond the ladder's {cap} arms", gain))
        else:
            taken.add(rung.name)
            ladder.rows.append(_row(finding, rung, "offered", why, gain))
            p = Prescription(
                kind="runtime" if isinstance(rung.change, RuntimePatch) else "env",
                summary=rung_summary(rung),
                change=rung.change,
                expected_gain_s_per_step=gain,
                automatic=True,
            )
            ladder.arms.append(LadderArm(finding, rung, p, gain, rank))
    return ladder
