"""A recipe card from a measured run: tokens/s per GPU, $ per 1M tokens, MFU, step-time CV,
GPU-hours, and the convergence check when the run is a `--fix` candidate arm (comparison.json)."""

from __future__ import annotations

import datetime
import json
import math
import os
import shlex
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from traindx.common.envvars import is_performance_var
from traindx.common.errors import UserError
from traindx.common.hfconfig import load_hf_config
from traindx.recipes.card_model import Author, Gpu, RecipeCard, Result

if TYPE_CHECKING:
    import numpy as np

    from traindx.derive.run import RunRecord

# the packages a card's stack names, when the run's manifest has them
STACK_PACKAGES = (
    "flash-attn-4",
    "nvidia-cutlass-dsl",
    "triton",
    "megatron-core",
    "transformer-engine",
    "flash-linear-attention",
)
CONVERGENCE_RULES = (
    "Megatron-Bridge validate_convergence thresholds: correlation >= 0.95, "
    "pointwise 10/5/2 % by loss level with at most 10 % of points failing, final "
    "loss within 5 %, first 20 % skipped"
)


@dataclass
class CardOptions:
    """What a card needs beyond the run (the `diagnose card` flags, typed)."""

    active_params: float | None = None  # active parameters per token (MFU)
    model: str | None = None  # a HuggingFace config.json (params, attention term)
    seq_len: int | None = None  # T of the attention term, with model
    model_name: str | None = None
    gpu: str | None = None  # GPU type for the peak FLOP/s
    price_per_gpu_hour: float | None = None
    window: str | None = None  # "FIRST:LAST", inclusive, 0-based
    tokens_per_step: float | None = None
    author: str = "traindx"


@dataclass(frozen=True)
class _Throughput:
    """The run's steps, the window measured and the tokens/s per GPU over it."""

    steps: int  # completed steps of the run
    source: str | None  # where the step times came from
    window_times: np.ndarray
    first: int
    last: int
    used: list[int]  # the steps measured
    left_out: dict[int, str]  # {step: why} of the window's steps not measured
    tokens: float  # per step
    n_gpus: int
    seconds: float  # of the window
    window_tokens: int
    tps: float  # tokens/s per GPU


@dataclass(frozen=True)
class _Mfu:
    active: int | None  # active parameters per token
    source_note: str | None  # where `active` came from
    mfu: float | None
    note: str | None
    config: dict[str, Any] | None  # the --model config


def _significant(x: float, digits: int = 4) -> float:
    return float(f"{x:.{digits}g}")


def _gpu_of(run: RunRecord, override: str | None) -> tuple[str | None, str | None]:
    """(the GPU type for the peak FLOP/s, the name the run's manifest gives)."""
    from traindx.derive.throughput import PEAK_BF16_TFLOPS, normalize_gpu  # lazy: not for `card --help`

    if override:
        gpu = normalize_gpu(override)
        if gpu is None:
            raise UserError(f"--gpu {override}: unknown GPU type (known: {', '.join(PEAK_BF16_TFLOPS)})")
        return gpu, None
    names = [g.get("name") for g in run.manifest.get("gpus") or [] if isinstance(g, dict)]
    if names:
        return normalize_gpu(names[0]) or names[0], names[0]
    return None, None


def _convergence(run: RunRecord) -> dict[str, Any]:
    path = os.path.join(run.path, "comparison.json")
    if not os.path.isfile(path):
        return {
            "result": "not run",
            "summary": "no convergence check: this run is not the candidate arm of "
            "`diagnose --fix` (or of a saved `diagnose compare`)",
            "convergence": None,
        }
    try:
        with open(path, encoding="utf-8") as f:
            comparison = json.load(f)
    except ValueError:
        raise UserError(f"{path} is corrupt (not JSON)") from None
    parity = comparison.get("loss_parity")
    if not parity:
        return {"result": "not run", "summary": "compared, but no losses were logged", "convergence": None}
    result = "pass" if parity["passed"] else "fail"
    steps = parity.get("steps") or [None, None]
    return {
        "result": result,
        "summary": f"{result}ed: {parity['points']}-point loss-parity check against the "
        f"baseline arm ({'; '.join(parity['reasons']) or 'every threshold met'})",
        "reference": comparison.get("baseline", {}).get("run"),
        "convergence": {
            "steps": parity["points"] + parity["skipped"],
            "result": result,
            "correlation": parity["correlation"],
            "final_loss_difference": parity["final_loss_difference"],
            "pointwise_failures": parity["pointwise_failures"],
            "note": f"candidate arm: this run; reference arm: {comparison['baseline']['run']}; "
            f"logged steps {steps[0]}-{steps[1]}, the first {parity['skipped']} skipped",
        },
        "rules": CONVERGENCE_RULES,
    }


def _throughput(run: RunRecord, args: CardOptions) -> _Throughput:
    # lazy: pandas and numpy, not for `diagnose card --help`
    from traindx.derive import throughput
    from traindx.derive.gpu_efficiency import tokens_per_step
    from traindx.derive.stats import parse_window, window_positions
    from traindx.derive.steptables import SHIM_SOURCES
    from traindx.recipes.ab import left_out_steps, step_times

    series, source = step_times(run)
    times = series.to_numpy(dtype=float)
    if not len(times):
        raise UserError(f"{run.path}: no completed step was recorded: nothing to measure")
    why = left_out_steps(run, series, source) if source in SHIM_SOURCES else {}
    try:
        window = parse_window(args.window) if args.window else None
        excluded = [i for i, step in enumerate(series.index) if step in why]
        positions, bounds = window_positions(len(times), window, excluded)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    if bounds is None:  # no step inside the window
        raise UserError(f"{run.path}: no completed step was recorded: nothing to measure")
    positions = [i for i in positions if math.isfinite(times[i])]
    steps = [int(s) for s in series.index]
    used = [steps[i] for i in positions]
    left_out = {
        steps[i]: why.get(steps[i], "no step time recorded")
        for i in range(bounds[0], bounds[1] + 1)
        if steps[i] not in used
    }
    tokens = args.tokens_per_step or tokens_per_step(run)
    if not tokens:
        raise UserError(
            "tokens per step unknown (the job's log does not print "
            "'tokens per step: N'): give --tokens-per-step N"
        )
    ranks = run.steps["rank"].nunique() if len(run.steps) else 1
    n_gpus = max(int(ranks), 1)
    window_times = times[positions]
    seconds = float(window_times.sum())
    window_tokens = int(round(tokens * len(window_times)))
    return _Throughput(
        steps=len(times),
        source=source,
        window_times=window_times,
        first=int(bounds[0]),
        last=int(bounds[1]),
        used=used,
        left_out=left_out,
        tokens=tokens,
        n_gpus=n_gpus,
        seconds=seconds,
        window_tokens=window_tokens,
        tps=throughput.tokens_per_s_per_gpu(window_tokens, seconds, n_gpus),
    )


def _mfu_from_run(run: RunRecord, gpu: str | None, tps: float) -> _Mfu:
    """MFU with no flags: 6N with N the parameters the job's optimizer trains (the shim's count),
    else the FLOPs torch.profiler counted per step (derive/gpu_efficiency.py)."""
    from traindx.derive import gpu_efficiency, throughput  # lazy: pandas, not for `diagnose card --help`

    params = gpu_efficiency.trained_parameters(run)
    active = int(params) if params else None
    source = "the parameters the job's optimizer trains (traindx shim)" if active else None
    if active and gpu in throughput.PEAK_BF16_TFLOPS:
        note = f"6N with N = {active} trained parameters (read from the run); peak {throughput.PEAK_BF16_TFLOPS[gpu]:g} TFLOP/s BF16 dense ({gpu})"
        return _Mfu(active, source, _significant(throughput.mfu(tps, gpu, active)), note, None)
    got = gpu_efficiency.model_flops_utilisation(run)
    if not got or got.get("mfu") is None:
        why = (got or {}).get("note") or f"no peak FLOP/s for GPU {gpu or 'none (a CPU run)'}"
        note = f"not computed: {why}; give --active-params N or --model config.json"
        return _Mfu(active, source, None, note, None)
    return _Mfu(active, source, _significant(float(got["mfu"])), str(got["note"]), None)


def _mfu(args: CardOptions, gpu: str | None, tps: float, run: RunRecord | None = None) -> _Mfu:
    from traindx.derive import throughput  # lazy: numpy, not for `diagnose card --help`

    shape, active, source_note, config = None, None, None, None
    if not args.model and not args.active_params and run is not None:
        return _mfu_from_run(run, gpu, tps)
    if args.model:
        try:
            config = load_hf_config(args.model)
            active = int(throughput.active_params_from_config(config))
            shape = throughput.model_shape(config)
        except (ValueError, KeyError) as exc:
            raise UserError(f"--model {args.model}: {exc}") from None
        source_note = os.path.abspath(args.model)
    elif args.active_params:
        active = int(args.active_params)
    if not active:
        note = "not computed: give --active-params N or --model config.json"
        return _Mfu(active, source_note, None, note, config)
    if gpu not in throughput.PEAK_BF16_TFLOPS:
        note = f"not computed: no peak FLOP/s for GPU {gpu or 'none (a CPU run)'}; give --gpu"
        return _Mfu(active, source_note, None, note, config)
    peak = f"peak {throughput.PEAK_BF16_TFLOPS[gpu]:g} TFLOP/s BF16 dense ({gpu})"
    attention: dict[str, int] = {}
    if shape and args.seq_len:
        attention = {
            "layers": shape["layers"],
            "heads": shape["heads"],
            "head_dim": shape["head_dim"],
            "seq_len": args.seq_len,
        }
        note = (
            f"6N + 12·L·H·Q·T with L={shape['layers']}, H={shape['heads']}, "
            f"Q={shape['head_dim']}, T={args.seq_len}; {peak}"
        )
    else:
        note = f"6N only (the attention term needs --model and --seq-len); {peak}"
    mfu = _significant(throughput.mfu(tps, gpu, active, **attention))
    return _Mfu(active, source_note, mfu, note, config)


def _stack(run: RunRecord) -> dict[str, Any]:
    packages = run.manifest.get("packages") or {}
    host = run.manifest.get("host") or {}
    stack = {"pytorch": packages.get("torch"), "python": host.get("python")}
    for name in STACK_PACKAGES:
        if packages.get(name):
            stack[name.replace("-", "_")] = packages[name]
    stack["source"] = f"traindx run manifest ({run.path})"
    return {k: v for k, v in stack.items() if v is not None}


def _performance_env(run: RunRecord) -> dict[str, Any]:
    """The environment variables that shape performance and belong on a card (never secrets)."""
    env = dict((run.manifest.get("options") or {}).get("extra_env") or {})
    for name, value in sorted((run.manifest.get("env") or {}).items()):
        if is_performance_var(name) and "REDACTED" not in str(value):
            env.setdefault(name, value)
    return env


def _model_name(args: CardOptions, config: dict[str, Any] | None, run: RunRecord) -> str:
    model_name = args.model_name
    if not model_name and config is not None:
        model_name = config.get("_name_or_path") or config.get("model_type")
    if not model_name:
        # a run without its manifest has no command: the folder's name stands for it
        script = next((t for t in run.command if t.endswith(".py")), (run.command or [run.path])[0])
        model_name = f"the model of {os.path.basename(script)}"
    return str(model_name)


def _left_out_groups(left_out: dict[int, str]) -> list[dict[str, Any]]:
    """[{steps, why}] of the window's steps not measured, one entry per reason, in step order."""
    groups: dict[str, list[int]] = {}
    for step, why in sorted(left_out.items()):
        groups.setdefault(why, []).append(step)
    return [{"steps": steps, "why": why} for why, steps in groups.items()]


def _notes(run: RunRecord, measured: _Throughput, usd: float | None) -> str:
    first, last, steps = measured.first, measured.last, len(measured.window_times)
    left_out = "".join(
        f"; left out: step{'s' if len(g['steps']) > 1 else ''} {', '.join(map(str, g['steps']))}: {g['why']}"
        for g in _left_out_groups(measured.left_out)
    )
    return (
        f"Generated by traindx from {run.path}; tokens/s over steps {first}-{last} "
        f"({steps} steps measured, {measured.seconds:.3f} s{left_out})."
        + ("" if usd is not None else " $ per 1M tokens: give --price-per-gpu-hour.")
    )


def card(run: RunRecord, options: CardOptions | None = None) -> RecipeCard:
    """The recipe card of a measured run (a loaded RunRecord): tokens/s per GPU, $ per 1M
    tokens, MFU, step-time CV, GPU-hours, and the convergence check when the run is a `--fix`
    candidate arm (its comparison.json). Raises UserError with one line when it cannot."""
    from traindx.derive import throughput  # lazy: numpy, not for `diagnose card --help`
    from traindx.derive.stats import coefficient_of_variation

    args = options or CardOptions()
    measured = _throughput(run, args)
    gpu, gpu_name = _gpu_of(run, args.gpu)
    mfu = _mfu(args, gpu, measured.tps, run)
    usd = (
        _significant(throughput.usd_per_million_tokens(args.price_per_gpu_hour, measured.tps))
        if args.price_per_gpu_hour
        else None
    )
    cv = coefficient_of_variation(measured.window_times)
    start, end = run.manifest.get("start_ns"), run.manifest.get("end_ns")
    hours = round(throughput.gpu_hours(measured.n_gpus, (end - start) / 1e9), 4) if start and end else None
    env = _performance_env(run)
    run_text = "".join(f"export {k}={shlex.quote(str(v))}\n" for k, v in env.items())
    run_text += ("\n" if env else "") + shlex.join(run.command) + "\n"
    n_gpus, tokens = measured.n_gpus, measured.tokens
    label = f"{n_gpus} rank{'s' if n_gpus > 1 else ''}"
    return RecipeCard(
        model=_model_name(args, mfu.config, run),
        gpu=Gpu(type=gpu or gpu_name or "CPU", count=n_gpus),
        author=Author(name=args.author),
        status="measured",
        stack=_stack(run),
        workload={
            "tokens_per_step": int(tokens) if float(tokens).is_integer() else tokens,
            "steps": measured.steps,
            "step_times_from": measured.source,
        },
        layout={
            "label": label,
            "summary": f"{label} (from the run's step events); parallel layout as set by the command",
        },
        result=Result(
            tokens_per_s_per_gpu=round(measured.tps, 2),
            usd_per_million_tokens=usd,
            step_time_cv_percent=None if cv is None else round(cv * 100, 2),
            mfu=mfu.mfu,
            mfu_note=mfu.note,
            active_params=(
                {"count": mfu.active, "source": mfu.source_note or "--active-params"} if mfu.active else None
            ),
            measured=datetime.date.fromtimestamp(start / 1e9) if start else datetime.date.today(),
            steps_per_run=measured.steps,
            window=[measured.first, measured.last],
            window_tokens=measured.window_tokens,
            steps_measured=measured.used,
            steps_left_out=_left_out_groups(measured.left_out),
            runs=1,
            profiler=bool((run.manifest.get("options") or {}).get("pyspy")),
            gpu_hours=hours,
            gpu_hours_note="GPUs x wall time of the recorded run, including startup",
        ),
        correctness=_convergence(run),
        env=env or None,
        run=run_text,
        notes=_notes(run, measured, usd),
    )
