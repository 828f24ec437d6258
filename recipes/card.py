"""Recipe cards: the YAML format of the reference cards (reference/003_*.txt), as a model.

A card has the sections schema_version, model, gpu, author, status, stack, workload, layout,
result, correctness, env, patches, run and notes. `gpu`, `author` and `result` are typed
(dataclasses); the free-form sections stay mappings, checked by the schema where they have
known fields. `RecipeCard.from_yaml(text)` validates and raises CardError with every problem,
one per line, each naming the field path; `to_yaml()` writes the same format back (the
reference cards round-trip: same data, same section order, the leading comment kept).
"""

from __future__ import annotations

import datetime
import io
import json
import os
import shlex
from dataclasses import dataclass, field, fields
from importlib import resources
from typing import Any

import yaml

from traindx.common.envvars import is_performance_var
from traindx.common.errors import UserError

SCHEMA_VERSION = 1
STATUSES = ("verified", "measured", "draft", "unverified")
CHECK_RESULTS = ("pass", "fail", "not run", "skipped")


class CardError(UserError):
    """A card that does not follow the schema: every problem, one per line."""

    def __init__(self, problems, source=None):
        self.problems = list(problems)
        where = f"{source}: " if source else ""
        lines = "; ".join(self.problems)
        super().__init__(f"{where}invalid recipe card: {lines}")


# -- the schema --------------------------------------------------------------------------------
# A spec is a type name, or a dict of {field: (spec, required)} for a mapping, or
# ("list", spec) / ("map", spec) / ("enum", values) / ("nullable", spec).
NUM = "number"
INT = "integer"
STR = "string"
BOOL = "boolean"
DATE = "date"
ANY = "any"
SCALAR = "scalar"

_CONVERGENCE = {
    "steps": (INT, True),
    "result": (("enum", CHECK_RESULTS), True),
    "correlation": (("nullable", NUM), False),
    "final_loss_difference": (("nullable", NUM), False),
    "pointwise_failures": (("nullable", INT), False),
    "note": (("nullable", STR), False),
}
_COMPONENT_TEST = {
    "test": (STR, True),
    "shape": (STR, False),
    "gpu": (STR, False),
    "date": (DATE, False),
    "result": (("enum", CHECK_RESULTS), True),
    "detail": (STR, False),
    "note": (STR, False),
}
SCHEMA = {
    "schema_version": (INT, True),
    "model": (STR, True),
    "gpu": (
        {
            "type": (STR, True),
            "memory_gb": (("nullable", NUM), False),
            "count": (INT, True),
            "per_node": (("nullable", INT), False),
            "instance": (("nullable", STR), False),
        },
        True,
    ),
    "author": ({"name": (STR, True), "url": (("nullable", STR), False)}, True),
    "status": (("enum", STATUSES), False),
    "stack": (("map", ("nullable", SCALAR)), True),
    "workload": (("map", ANY), True),
    "layout": (
        {
            "label": (STR, False),
            "summary": (STR, False),
            "highlights": (STR, False),
            "tp": (INT, False),
            "pp": (INT, False),
            "vpp": (INT, False),
            "cp": (INT, False),
            "ep": (INT, False),
            "etp": (INT, False),
            "dp": (INT, False),
            "sequence_parallel": (BOOL, False),
        },
        True,
    ),
    "result": (
        {
            "tokens_per_s_per_gpu": (NUM, True),
            "usd_per_million_tokens": (("nullable", NUM), False),
            "step_time_cv_percent": (("nullable", NUM), False),
            "mfu": (("nullable", NUM), False),
            "mfu_note": (("nullable", STR), False),
            "active_params": (
                (
                    "nullable",
                    {
                        "count": (INT, True),
                        "source": (("nullable", STR), False),
                        "revision": (("nullable", STR), False),
                    },
                ),
                False,
            ),
            "measured": (DATE, True),
            "steps_per_run": (INT, False),
            "window": (("list", INT), False),
            "window_tokens": (("nullable", INT), False),
            "runs": (INT, False),
            "profiler": (BOOL, False),
            "gpu_hours": (("nullable", NUM), False),
            "gpu_hours_note": (("nullable", STR), False),
        },
        True,
    ),
    "correctness": (
        {
            "result": (("enum", CHECK_RESULTS), True),
            "summary": (STR, False),
            "reference": (("nullable", STR), False),
            "configuration": (("nullable", STR), False),
            "component_tests": (("list", _COMPONENT_TEST), False),
            "convergence": (("nullable", _CONVERGENCE), False),
            "rules": (("nullable", STR), False),
        },
        True,
    ),
    "env": (("map", ("nullable", SCALAR)), False),
    "patches": (("list", STR), False),
    "run": (STR, True),
    "notes": (("nullable", STR), False),
}


def _type_name(value):
    return type(value).__name__ if value is not None else "null"


def _check(value, spec, path, problems):
    if isinstance(spec, dict):
        if not isinstance(value, dict):
            problems.append(f"{path}: expected a mapping, got {_type_name(value)}")
            return
        for key, (sub, required) in spec.items():
            if key not in value:
                if required:
                    problems.append(f"{path}.{key}: required" if path else f"{key}: required")
                continue
            _check(value[key], sub, f"{path}.{key}" if path else key, problems)
        return
    if isinstance(spec, tuple):
        kind, sub = spec
        if kind == "nullable":
            if value is not None:
                _check(value, sub, path, problems)
        elif kind == "enum":
            if value not in sub:
                problems.append(f"{path}: {value!r} is not one of {', '.join(sub)}")
        elif kind == "list":
            if not isinstance(value, list):
                problems.append(f"{path}: expected a list, got {_type_name(value)}")
            else:
                for i, item in enumerate(value):
                    _check(item, sub, f"{path}[{i}]", problems)
        elif kind == "map":
            if not isinstance(value, dict):
                problems.append(f"{path}: expected a mapping, got {_type_name(value)}")
            else:
                for key, item in value.items():
                    _check(item, sub, f"{path}.{key}", problems)
        return
    ok = {
        NUM: isinstance(value, (int, float)) and not isinstance(value, bool),
        INT: isinstance(value, int) and not isinstance(value, bool),
        STR: isinstance(value, str),
        BOOL: isinstance(value, bool),
        DATE: isinstance(value, datetime.date) or (isinstance(value, str) and _is_iso_date(value)),
        SCALAR: isinstance(value, (str, int, float, bool)),
        ANY: True,
    }[spec]
    if not ok:
        want = {DATE: "a date (YYYY-MM-DD)", SCALAR: "a scalar", INT: "an integer"}.get(spec, f"a {spec}")
        problems.append(f"{path}: expected {want}, got {_type_name(value)} ({value!r})"[:200])


def _is_iso_date(text):
    try:
        datetime.date.fromisoformat(text)
        return True
    except ValueError:
        return False


def validate(data: Any) -> list[str]:
    """Every problem of a card's data (a dict), as 'path: what is wrong' lines; [] when valid."""
    if not isinstance(data, dict):
        return [f"a card is a mapping of sections, got {_type_name(data)}"]
    problems = []
    _check(data, SCHEMA, "", problems)
    if data.get("schema_version") not in (None, SCHEMA_VERSION) and isinstance(
        data.get("schema_version"), int
    ):
        problems.append(
            f"schema_version: {data['schema_version']} is not supported (this traindx reads {SCHEMA_VERSION})"
        )
    result = data["result"] if isinstance(data.get("result"), dict) else {}
    window = result.get("window")
    if isinstance(window, list) and (
        len(window) != 2 or (all(isinstance(x, int) for x in window) and window[0] > window[1])
    ):
        problems.append(f"result.window: expected [FIRST, LAST] with FIRST <= LAST, got {window}")
    mfu = result.get("mfu")
    if isinstance(mfu, (int, float)) and not 0 <= mfu <= 1:
        problems.append(f"result.mfu: {mfu} is a fraction between 0 and 1 (27.4 % is 0.274)")
    gpu = data["gpu"] if isinstance(data.get("gpu"), dict) else {}
    if isinstance(gpu.get("count"), int) and gpu["count"] < 1:
        problems.append(f"gpu.count: must be at least 1, got {gpu['count']}")
    return problems


# -- the model ---------------------------------------------------------------------------------
def _split(data, cls):
    """Known fields of a dataclass from a mapping, and the rest (kept, in order)."""
    names = [f.name for f in fields(cls) if f.name not in ("extra", "present")]
    known = {k: data[k] for k in names if k in data}
    extra = {k: v for k, v in data.items() if k not in names}
    return known, extra, list(data)


def _join(obj, canonical):
    """Back to a mapping: the keys read from the file first, in their order (an explicit null
    stays), then the other fields in the canonical order, None ones left out."""
    out = {}
    values = {
        f.name: getattr(obj, f.name) for f in fields(obj) if f.name not in ("extra", "present", "header")
    }
    values.update(obj.extra)
    keys = list(obj.present) + [k for k in list(canonical) + list(values) if k not in obj.present]
    for key in dict.fromkeys(keys):
        if key not in values:
            continue
        value = values[key]
        if value is not None or key in obj.present:
            out[key] = value.to_dict() if hasattr(value, "to_dict") else value
    return out


class _Section:
    """A card section: its known fields, the unknown keys kept, the file's key order kept."""

    ORDER: tuple[str, ...] | list[str] = ()

    @classmethod
    def from_dict(cls, data):
        known, extra, order = _split(data, cls)
        return cls(**known, extra=extra, present=order)

    def to_dict(self):
        return _join(self, self.ORDER)


@dataclass
class Gpu(_Section):
    type: str
    count: int
    memory_gb: float | None = None
    per_node: int | None = None
    instance: str | None = None
    extra: dict = field(default_factory=dict)
    present: list = field(default_factory=list)  # keys as read, in order (round trip)
    ORDER = ("type", "memory_gb", "count", "per_node", "instance")


@dataclass
class Author(_Section):
    name: str
    url: str | None = None
    extra: dict = field(default_factory=dict)
    present: list = field(default_factory=list)
    ORDER = ("name", "url")


RESULT_ORDER = [
    "tokens_per_s_per_gpu",
    "usd_per_million_tokens",
    "step_time_cv_percent",
    "mfu",
    "mfu_note",
    "active_params",
    "measured",
    "steps_per_run",
    "window",
    "window_tokens",
    "runs",
    "profiler",
    "gpu_hours",
    "gpu_hours_note",
]


@dataclass
class Result(_Section):
    tokens_per_s_per_gpu: float
    measured: object  # datetime.date
    usd_per_million_tokens: float | None = None
    step_time_cv_percent: float | None = None
    mfu: float | None = None  # a fraction
    mfu_note: str | None = None
    active_params: dict | None = None  # {count, source, revision}
    steps_per_run: int | None = None
    window: list | None = None  # [first, last], inclusive, 0-based steps
    window_tokens: int | None = None
    runs: int | None = None
    profiler: bool | None = None
    gpu_hours: float | None = None
    gpu_hours_note: str | None = None
    extra: dict = field(default_factory=dict)
    present: list = field(default_factory=list)
    ORDER = RESULT_ORDER

    @property
    def active_param_count(self):
        return (self.active_params or {}).get("count")


CARD_ORDER = [
    "schema_version",
    "model",
    "gpu",
    "author",
    "status",
    "stack",
    "workload",
    "layout",
    "result",
    "correctness",
    "env",
    "patches",
    "run",
    "notes",
]


@dataclass
class RecipeCard:
    model: str
    gpu: Gpu
    author: Author
    stack: dict
    workload: dict
    layout: dict
    result: Result
    correctness: dict
    run: str
    schema_version: int = SCHEMA_VERSION
    status: str | None = None
    env: dict | None = None
    patches: list | None = None
    notes: str | None = None
    header: str = ""  # leading comment lines of the file, kept verbatim
    extra: dict = field(default_factory=dict)
    present: list = field(default_factory=list)

    # -- reading -------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data, source=None, header=""):
        problems = validate(data)
        if problems:
            raise CardError(problems, source)
        names = [f.name for f in fields(cls) if f.name not in ("extra", "present", "header")]
        known = {k: data[k] for k in names if k in data}
        known["gpu"] = Gpu.from_dict(data["gpu"])
        known["author"] = Author.from_dict(data["author"])
        known["result"] = Result.from_dict(data["result"])
        extra = {k: v for k, v in data.items() if k not in names}
        return cls(**known, extra=extra, present=list(data), header=header)

    @classmethod
    def from_yaml(cls, text, source=None):
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" at line {mark.line + 1}" if mark else ""
            raise CardError([f"not YAML{where}: {getattr(exc, 'problem', exc)}"], source) from None
        header = []
        for line in text.splitlines():
            if line.startswith("#"):
                header.append(line)
            elif line.strip():
                break
        return cls.from_dict(data, source, "\n".join(header))

    @classmethod
    def load(cls, path):
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError as exc:
            raise UserError(f"cannot read recipe card {path}: {exc.strerror}") from None
        return cls.from_yaml(text, source=path)

    # -- writing -------------------------------------------------------------------------------
    def to_dict(self):
        return _join(self, CARD_ORDER)

    def to_yaml(self):
        data = self.to_dict()
        problems = validate(data)
        if problems:
            raise CardError(problems, "card to write")
        stream = io.StringIO()
        if self.header:
            stream.write(self.header.rstrip("\n") + "\n")
        yaml.dump(
            data,
            stream,
            Dumper=_CardDumper,
            sort_keys=False,
            allow_unicode=True,
            width=116,
            default_flow_style=False,
        )
        return stream.getvalue()

    def save(self, path):
        text = self.to_yaml()
        tmp = f"{path}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
        return path

    # -- conveniences --------------------------------------------------------------------------
    @property
    def convergence(self):
        return (self.correctness or {}).get("convergence")


class _CardDumper(yaml.SafeDumper):
    """Multi-line strings as literal blocks (`run: |`), as in the reference cards."""


def _str_representer(dumper, value):
    if "\n" in value:
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|")
    return dumper.represent_scalar("tag:yaml.org,2002:str", value)


_CardDumper.add_representer(str, _str_representer)


def reference_cards() -> dict[str, RecipeCard]:
    """The reference cards shipped with traindx: {file name: RecipeCard}."""
    out = {}
    folder = resources.files("traindx.recipes").joinpath("cards")
    for entry in sorted(folder.iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".yaml"):
            out[entry.name] = RecipeCard.from_yaml(entry.read_text(encoding="utf-8"), source=entry.name)
    return out


Card = RecipeCard  # what `card()` returns


# -- a card from a measured run -----------------------------------------------------------------
# environment variables that shape performance and belong on a card (never secrets)


def _significant(x, digits=4):
    return float(f"{x:.{digits}g}")


def _gpu_of(run, override):
    from traindx.derive.throughput import normalize_gpu

    if override:
        gpu = normalize_gpu(override)
        if gpu is None:
            raise UserError(
                f"--gpu {override}: unknown GPU type (known: A100, H100, H200, B200, B300, GB200)"
            )
        return gpu, None
    names = [g.get("name") for g in run.manifest.get("gpus") or [] if isinstance(g, dict)]
    if names:
        return normalize_gpu(names[0]) or names[0], names[0]
    return None, None


def _convergence(run):
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
        "rules": "Megatron-Bridge validate_convergence thresholds: correlation >= 0.95, "
        "pointwise 10/5/2 % by loss level with at most 10 % of points failing, final "
        "loss within 5 %, first 20 % skipped",
    }


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


def card(run, options: CardOptions | None = None) -> RecipeCard:
    """The recipe card of a measured run (a loaded RunRecord): tokens/s per GPU, $ per 1M
    tokens, MFU, step-time CV, GPU-hours, and the convergence check when the run is a `--fix`
    candidate arm (its comparison.json). Raises UserError with one line when it cannot."""
    args = options or CardOptions()
    from traindx.common.hfconfig import load_hf_config
    from traindx.derive import throughput
    from traindx.derive.stats import coefficient_of_variation, parse_window, window_values
    from traindx.recipes.ab import SHIM_SOURCES, profiled_positions, step_times, tokens_per_step

    series, source = step_times(run)
    times = series.to_numpy(dtype=float)
    if not len(times):
        raise UserError(f"{run.path}: no completed step was recorded: nothing to measure")
    try:
        window = parse_window(args.window) if args.window else None
        window_times, (first, last) = window_values(
            times, window, profiled_positions(run, series, source) if source in SHIM_SOURCES else ()
        )
    except ValueError as exc:
        raise UserError(str(exc)) from None
    tokens = args.tokens_per_step or tokens_per_step(run)
    if not tokens:
        raise UserError(
            "tokens per step unknown (the job's log does not print "
            "'tokens per step: N'): give --tokens-per-step N"
        )
    ranks = run.steps["rank"].nunique() if len(run.steps) else 1
    n_gpus = max(int(ranks), 1)
    seconds = float(window_times.sum())
    window_tokens = int(round(tokens * len(window_times)))
    tps = throughput.tokens_per_s_per_gpu(window_tokens, seconds, n_gpus)

    gpu, gpu_name = _gpu_of(run, args.gpu)
    shape, active, source_note = None, None, None
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
    mfu = mfu_note = None
    if active and gpu in throughput.PEAK_BF16_TFLOPS:
        attention = {}
        if shape and args.seq_len:
            attention = {
                "layers": shape["layers"],
                "heads": shape["heads"],
                "head_dim": shape["head_dim"],
                "seq_len": args.seq_len,
            }
            mfu_note = (
                f"6N + 12·L·H·Q·T with L={shape['layers']}, H={shape['heads']}, "
                f"Q={shape['head_dim']}, T={args.seq_len}; peak "
                f"{throughput.PEAK_BF16_TFLOPS[gpu]:g} TFLOP/s BF16 dense ({gpu})"
            )
        else:
            mfu_note = (
                f"6N only (the attention term needs --model and --seq-len); peak "
                f"{throughput.PEAK_BF16_TFLOPS[gpu]:g} TFLOP/s BF16 dense ({gpu})"
            )
        mfu = _significant(throughput.mfu(tps, gpu, active, **attention))
    elif not active:
        mfu_note = "not computed: give --active-params N or --model config.json"
    else:
        mfu_note = f"not computed: no peak FLOP/s for GPU {gpu or 'none (a CPU run)'}; give --gpu"
    usd = (
        _significant(throughput.usd_per_million_tokens(args.price_per_gpu_hour, tps))
        if args.price_per_gpu_hour
        else None
    )
    cv = coefficient_of_variation(window_times)
    start, end = run.manifest.get("start_ns"), run.manifest.get("end_ns")
    hours = round(throughput.gpu_hours(n_gpus, (end - start) / 1e9), 4) if start and end else None
    measured = datetime.date.fromtimestamp(start / 1e9) if start else datetime.date.today()

    packages = run.manifest.get("packages") or {}
    host = run.manifest.get("host") or {}
    stack = {"pytorch": packages.get("torch"), "python": host.get("python")}
    for name in (
        "flash-attn-4",
        "nvidia-cutlass-dsl",
        "triton",
        "megatron-core",
        "transformer-engine",
        "flash-linear-attention",
    ):
        if packages.get(name):
            stack[name.replace("-", "_")] = packages[name]
    stack["source"] = f"traindx run manifest ({run.path})"
    stack = {k: v for k, v in stack.items() if v is not None}

    env = dict((run.manifest.get("options") or {}).get("extra_env") or {})
    for name, value in sorted((run.manifest.get("env") or {}).items()):
        if is_performance_var(name) and "REDACTED" not in str(value):
            env.setdefault(name, value)
    command = shlex.join(run.command)
    run_text = "".join(f"export {k}={shlex.quote(str(v))}\n" for k, v in env.items())
    run_text += ("\n" if env else "") + command + "\n"

    model_name = args.model_name
    if not model_name and args.model:
        model_name = config.get("_name_or_path") or config.get("model_type")
    if not model_name:
        script = next((t for t in run.command if t.endswith(".py")), run.command[0])
        model_name = f"the model of {os.path.basename(script)}"
    label = f"{n_gpus} rank{'s' if n_gpus > 1 else ''}"
    result = RecipeCard(
        model=str(model_name),
        gpu=Gpu(type=gpu or gpu_name or "CPU", count=n_gpus),
        author=Author(name=args.author),
        status="measured",
        stack=stack,
        workload={
            "tokens_per_step": int(tokens) if float(tokens).is_integer() else tokens,
            "steps": int(len(times)),
            "step_times_from": source,
        },
        layout={
            "label": label,
            "summary": f"{label} (from the run's step events); parallel layout as set by the command",
        },
        result=Result(
            tokens_per_s_per_gpu=round(tps, 2),
            usd_per_million_tokens=usd,
            step_time_cv_percent=None if cv is None else round(cv * 100, 2),
            mfu=mfu,
            mfu_note=mfu_note,
            active_params=({"count": active, "source": source_note or "--active-params"} if active else None),
            measured=measured,
            steps_per_run=int(len(times)),
            window=[int(first), int(last)],
            window_tokens=window_tokens,
            runs=1,
            profiler=bool((run.manifest.get("options") or {}).get("pyspy")),
            gpu_hours=hours,
            gpu_hours_note="GPUs x wall time of the recorded run, including startup",
        ),
        correctness=_convergence(run),
        env=env or None,
        run=run_text,
        notes=f"Generated by traindx from {run.path}; tokens/s over steps {first}-{last} "
        f"({len(window_times)} steps, {seconds:.3f} s"
        + (
            f"; {last - first + 1 - len(window_times)} step(s) inside the torch.profiler window left out"
            if last - first + 1 > len(window_times)
            else ""
        )
        + ")."
        + ("" if usd is not None else " $ per 1M tokens: give --price-per-gpu-hour."),
    )
    return result
