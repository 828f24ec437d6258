"""Where the job's own code sets up its data loading: every DataLoader construction and every
Hugging Face `TrainingArguments`, with the caller's file:line in the job's code (never a
framework's: a Trainer or Accelerate builds the DataLoader inside site-packages, and the line
the user owns is the one that called into the framework), the framework in between, and the
settings a prescription changes. One `data_site` event per construction.

The call's full source span is recorded (from the file, parsed with `ast`) so a prescription can
rewrite a call written over several lines.

Which loader the training loop iterates: each DataLoader gets a site id (`data_site.site_id`);
its iterators carry it, and a `data_use` event says, for a site, in how many distinct steps its
__next__ delivered a batch (emitted at 1, 2, 4, 8, ... such steps: a few events per loader). The
loader of the steps is the one with the most; a test loader built after it (pytorch/examples)
has none until the epoch ends.
"""

from __future__ import annotations

import ast
import functools
import linecache
import os
import sys

from . import emit, importhooks, report_error, schema
from .frames import installed_package, is_library_path

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing into the job (mypy knows the name)
if TYPE_CHECKING:
    from types import FrameType, ModuleType
    from typing import Any

MAX_EVENTS = 100
DATA_USE = schema.DATA_USE
_count: dict[str, int] = {"n": 0}
_use: dict[Any, list[Any]] = {}  # site id -> [distinct steps with a batch, last step seen, batches]
_trees: dict[Any, Any] = {}


def _is_library(filename: str) -> bool:
    # frames.is_library_path on the file's real path (a venv may link into a shared install)
    return not filename or filename.startswith("<") or is_library_path(os.path.realpath(filename))


def _package_of(filename: str) -> str | None:
    return installed_package(os.path.realpath(filename))


def _sites(depth: int) -> tuple[FrameType | None, dict[str, Any] | None]:
    """(the innermost frame of the job's own code, the innermost framework frame between it and
    the constructor that is not torch itself)."""
    frame: FrameType | None = sys._getframe(depth + 1)
    via = None
    while frame is not None:
        filename = frame.f_code.co_filename
        if not _is_library(filename):
            return frame, via
        package = _package_of(filename)
        if via is None and package and package not in ("torch",):
            via = {
                "package": package,
                "file": filename,
                "line": frame.f_lineno,
                "function": frame.f_code.co_name,
            }
        frame = frame.f_back
    return None, via


def _call_span(filename: str, line: int, name: str) -> tuple[int, int | None, str | None] | None:
    """(first line, last line, source) of the call of `name` that covers `line`, else None."""
    try:
        tree = _trees.get(filename)
        if tree is None:
            source = "".join(linecache.getlines(filename))
            tree = _trees[filename] = (ast.parse(source), source)
        module, source = tree
        best = None
        for node in ast.walk(module):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if called != name or not node.lineno <= line <= (node.end_lineno or node.lineno):
                continue
            if best is None or node.lineno >= best.lineno:
                best = node
        if best is None:
            return None
        return best.lineno, best.end_lineno, ast.get_source_segment(source, best)
    except Exception:
        return None


def _record(kind: str, name: str, settings: dict[str, Any], depth: int) -> Any:
    if _count["n"] >= MAX_EVENTS:
        return None
    _count["n"] += 1
    site_id = _count["n"]
    frame, via = _sites(depth + 1)
    site = None
    if frame is not None:
        filename, line = frame.f_code.co_filename, frame.f_lineno
        span = _call_span(filename, line, name)
        site = {
            "file": filename,
            "line": line,
            "function": frame.f_code.co_name,
            "source": linecache.getline(filename, line).rstrip("\n") or None,
        }
        if span:
            site.update(call_first_line=span[0], call_last_line=span[1], call_source=span[2])
    emit(schema.DATA_SITE, kind=kind, site=site, via=via, site_id=site_id, **settings)
    return site_id


def _current_step() -> int | None:
    steps = sys.modules.get("_traindx_shim.steps")
    return steps.current_step() if steps is not None else None


def _used(site_id: Any) -> None:
    """A batch of loader `site_id` was delivered: count the distinct steps that saw one."""
    entry = _use.get(site_id)
    if entry is None:
        entry = _use[site_id] = [0, None, 0]
    entry[2] += 1
    step = _current_step()
    if step is not None and step != entry[1]:
        entry[1] = step
        entry[0] += 1
        n = entry[0]
        if n & (n - 1) == 0:  # 1, 2, 4, 8, ...: log-spaced, a few events per loader
            emit(DATA_USE, site_id=site_id, steps=n, batches=entry[2], step=step)


def _on_dataloader(module: Any) -> None:
    cls = module.DataLoader
    original = cls.__init__

    @functools.wraps(original)  # Lightning re-creates DataLoaders from __init__'s signature
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        try:
            site_id = _record(
                "DataLoader",
                "DataLoader",
                {
                    "num_workers": self.num_workers,
                    "pin_memory": self.pin_memory,
                    "batch_size": self.batch_size,
                    "persistent_workers": self.persistent_workers,
                },
                depth=1,
            )
            if site_id is not None:
                object.__setattr__(self, "_traindx_site", site_id)
        except Exception as exc:
            report_error("DataLoader site", exc)

    cls.__init__ = __init__

    original_iter = cls.__iter__

    @functools.wraps(original_iter)
    def __iter__(self: Any) -> Any:
        iterator = original_iter(self)
        try:
            site_id = self.__dict__.get("_traindx_site")
            if site_id is not None:
                iterator._traindx_site = site_id
        except Exception:
            pass
        return iterator

    cls.__iter__ = __iter__

    iter_cls = module._BaseDataLoaderIter
    original_next = iter_cls.__next__

    def __next__(self: Any) -> Any:
        batch = original_next(self)
        site_id = getattr(self, "_traindx_site", None)
        if site_id is not None:
            try:
                _used(site_id)
            except Exception as exc:
                report_error("DataLoader use", exc)
        return batch

    __next__.__wrapped__ = original_next  # type: ignore[attr-defined]
    iter_cls.__next__ = __next__


def _on_training_args(module: ModuleType) -> None:
    cls = module.TrainingArguments
    original = cls.__post_init__

    @functools.wraps(original)
    def __post_init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        try:
            _record(
                "TrainingArguments",
                type(self).__name__,
                {
                    "num_workers": getattr(self, "dataloader_num_workers", None),
                    "pin_memory": getattr(self, "dataloader_pin_memory", None),
                    "batch_size": getattr(self, "per_device_train_batch_size", None),
                    "persistent_workers": getattr(self, "dataloader_persistent_workers", None),
                },
                depth=2,
            )
        except Exception as exc:
            report_error("TrainingArguments site", exc)

    cls.__post_init__ = __post_init__


def register() -> None:
    importhooks.on_import("torch.utils.data.dataloader", _on_dataloader)
    importhooks.on_import("transformers.training_args", _on_training_args)
