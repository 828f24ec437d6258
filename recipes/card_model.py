"""The recipe card as a model: `gpu`, `author` and `result` typed (dataclasses); the free-form
sections stay mappings, checked by the schema (recipes/card_schema.py) where they have known
fields. Reading keeps what it does not know and the file's key order, so the reference cards
round-trip: same data, same section order, the leading comment kept."""

from __future__ import annotations

import io
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, fields
from importlib import resources
from typing import Any, ClassVar, TypeVar

import yaml

from traindx.common.atomic import write_text
from traindx.common.errors import UserError
from traindx.common.redact import redact_value
from traindx.recipes.card_schema import SCHEMA_VERSION, CardError, validate

S = TypeVar("S", bound="_Section")


# -- the model ---------------------------------------------------------------------------------
def _split(data: dict[str, Any], cls: type) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """Known fields of a dataclass from a mapping, and the rest (kept, in order)."""
    names = [f.name for f in fields(cls) if f.name not in ("extra", "present", "header")]
    known = {k: data[k] for k in names if k in data}
    extra = {k: v for k, v in data.items() if k not in names}
    return known, extra, list(data)


def _join(obj: Any, canonical: Iterable[str]) -> dict[str, Any]:
    """Back to a mapping: the keys read from the file first, in their order (an explicit null
    stays), then the other fields in the canonical order, None ones left out."""
    out: dict[str, Any] = {}
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

    ORDER: ClassVar[tuple[str, ...] | list[str]] = ()

    @classmethod
    def from_dict(cls: type[S], data: dict[str, Any]) -> S:
        known, extra, order = _split(data, cls)
        make: Callable[..., S] = cls  # a dataclass subclass: its fields include extra and present
        return make(**known, extra=extra, present=order)

    def to_dict(self) -> dict[str, Any]:
        return _join(self, self.ORDER)


@dataclass
class Gpu(_Section):
    type: str
    count: int
    memory_gb: float | None = None
    per_node: int | None = None
    instance: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    present: list[str] = field(default_factory=list)  # keys as read, in order (round trip)
    ORDER: ClassVar[tuple[str, ...] | list[str]] = ("type", "memory_gb", "count", "per_node", "instance")


@dataclass
class Author(_Section):
    name: str
    url: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    present: list[str] = field(default_factory=list)
    ORDER: ClassVar[tuple[str, ...] | list[str]] = ("name", "url")


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
    "steps_measured",
    "steps_left_out",
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
    active_params: dict[str, Any] | None = None  # {count, source, revision}
    steps_per_run: int | None = None
    window: list[int] | None = None  # [first, last], inclusive, 0-based steps
    window_tokens: int | None = None
    steps_measured: list[int] | None = None  # the window's steps the figures are over
    steps_left_out: list[dict[str, Any]] | None = None  # [{steps: [...], why: "..."}] of the window's others
    runs: int | None = None
    profiler: bool | None = None
    gpu_hours: float | None = None
    gpu_hours_note: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    present: list[str] = field(default_factory=list)
    ORDER: ClassVar[tuple[str, ...] | list[str]] = RESULT_ORDER

    @property
    def active_param_count(self) -> int | None:
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
    stack: dict[str, Any]
    workload: dict[str, Any]
    layout: dict[str, Any]
    result: Result
    correctness: dict[str, Any]
    run: str
    schema_version: int = SCHEMA_VERSION
    status: str | None = None
    env: dict[str, Any] | None = None
    patches: list[str] | None = None
    notes: str | None = None
    header: str = ""  # leading comment lines of the file, kept verbatim
    extra: dict[str, Any] = field(default_factory=dict)
    present: list[str] = field(default_factory=list)

    # -- reading -------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: Any, source: str | None = None, header: str = "") -> RecipeCard:
        problems = validate(data)
        if problems:
            raise CardError(problems, source)
        known, extra, order = _split(data, cls)
        known.update(gpu=Gpu.from_dict(data["gpu"]), author=Author.from_dict(data["author"]))
        known["result"] = Result.from_dict(data["result"])
        return cls(**known, extra=extra, present=order, header=header)

    @classmethod
    def from_yaml(cls, text: str, source: str | None = None) -> RecipeCard:
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" at line {mark.line + 1}" if mark else ""
            raise CardError([f"not YAML{where}: {getattr(exc, 'problem', exc)}"], source) from None
        header: list[str] = []
        for line in text.splitlines():
            if line.startswith("#"):
                header.append(line)
            elif line.strip():
                break
        return cls.from_dict(data, source, "\n".join(header))

    @classmethod
    def load(cls, path: str) -> RecipeCard:
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError as exc:
            raise UserError(f"cannot read recipe card {path}: {exc.strerror}") from None
        return cls.from_yaml(text, source=path)

    # -- writing -------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return _join(self, CARD_ORDER)

    def to_yaml(self) -> str:
        # a card is shared: no secret in it (a model name from a config's URL with a password)
        data = redact_value(self.to_dict())
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

    def save(self, path: str) -> str:
        write_text(path, self.to_yaml(), user_path=True)
        return path

    # -- conveniences --------------------------------------------------------------------------
    @property
    def convergence(self) -> dict[str, Any] | None:
        return (self.correctness or {}).get("convergence")


class _CardDumper(yaml.SafeDumper):  # type: ignore[misc]  # PyYAML has no type stubs installed: Any
    """Multi-line strings as literal blocks (`run: |`), as in the reference cards."""


def _str_representer(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
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
