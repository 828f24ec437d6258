"""Where the job builds its DataLoaders (and with which settings) and where it calls
torch.cuda.empty_cache: the lines a prescription has to point at."""

from __future__ import annotations

import functools
import linecache

from . import emit, importhooks, report_error, schema, steps
from .frames import first_user_frame

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing into the job (mypy knows the name)
if TYPE_CHECKING:
    from collections.abc import Callable
    from types import ModuleType
    from typing import Any

MAX_EMPTY_CACHE_EVENTS = 1000
_counts: dict[str, int] = {"empty_cache": 0}


def _source_line(where: dict[str, Any] | None) -> str | None:
    if not where:
        return None
    return linecache.getline(where["file"], where["line"]).strip() or None


def _describe_callable(fn: Callable[..., Any]) -> dict[str, Any]:
    code = getattr(fn, "__code__", None) or getattr(getattr(fn, "__call__", None), "__code__", None)  # noqa: B004
    return {
        "name": getattr(fn, "__qualname__", type(fn).__name__),
        "file": getattr(code, "co_filename", None),
        "line": getattr(code, "co_firstlineno", None),
    }


def _on_dataloader(module: ModuleType) -> None:
    cls = module.DataLoader
    original_init = cls.__init__

    @functools.wraps(original_init)  # Lightning re-creates DataLoaders from this signature
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        try:
            where = first_user_frame()
            emit(
                schema.DATALOADER,
                step=steps.current_step(),
                caller=where,
                source=_source_line(where),
                num_workers=self.num_workers,
                batch_size=self.batch_size,
                pin_memory=self.pin_memory,
                prefetch_factor=self.prefetch_factor,
                persistent_workers=self.persistent_workers,
                dataset=type(self.dataset).__name__,
                collate_fn=_describe_callable(self.collate_fn),
            )
        except Exception as exc:
            report_error("DataLoader hook", exc)

    cls.__init__ = __init__


def _on_torch_cuda(module: Any) -> None:
    original = module.empty_cache

    @functools.wraps(original)
    def empty_cache(*args: Any, **kwargs: Any) -> Any:
        if _counts["empty_cache"] < MAX_EMPTY_CACHE_EVENTS:
            _counts["empty_cache"] += 1
            try:
                where = first_user_frame()
                emit(schema.EMPTY_CACHE, step=steps.current_step(), caller=where, source=_source_line(where))
            except Exception as exc:
                report_error("empty_cache hook", exc)
        return original(*args, **kwargs)

    module.empty_cache = empty_cache


def register() -> None:
    importhooks.on_import("torch.utils.data.dataloader", _on_dataloader)
    importhooks.on_import("torch.cuda", _on_torch_cuda)
