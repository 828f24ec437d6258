"""Where the job builds its DataLoaders (and with which settings) and where it calls
torch.cuda.empty_cache: the lines a prescription has to point at."""

import functools
import linecache

from . import emit, importhooks, report_error, schema, steps
from .frames import first_user_frame

MAX_EMPTY_CACHE_EVENTS = 1000
_counts = {"empty_cache": 0}


def _source_line(where):
    if not where:
        return None
    return linecache.getline(where["file"], where["line"]).strip() or None


def _describe_callable(fn):
    code = getattr(fn, "__code__", None) or getattr(getattr(fn, "__call__", None), "__code__", None)  # noqa: B004
    return {
        "name": getattr(fn, "__qualname__", type(fn).__name__),
        "file": getattr(code, "co_filename", None),
        "line": getattr(code, "co_firstlineno", None),
    }


def _on_dataloader(module):
    cls = module.DataLoader
    original_init = cls.__init__

    @functools.wraps(original_init)  # Lightning re-creates DataLoaders from this signature
    def __init__(self, *args, **kwargs):
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


def _on_torch_cuda(module):
    original = module.empty_cache

    @functools.wraps(original)
    def empty_cache(*args, **kwargs):
        if _counts["empty_cache"] < MAX_EMPTY_CACHE_EVENTS:
            _counts["empty_cache"] += 1
            try:
                where = first_user_frame()
                emit(schema.EMPTY_CACHE, step=steps.current_step(), caller=where, source=_source_line(where))
            except Exception as exc:
                report_error("empty_cache hook", exc)
        return original(*args, **kwargs)

    module.empty_cache = empty_cache


def register():
    importhooks.on_import("torch.utils.data.dataloader", _on_dataloader)
    importhooks.on_import("torch.cuda", _on_torch_cuda)
