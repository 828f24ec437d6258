"""Where the job's own code sets up its data loading: every DataLoader construction and every
Hugging Face `TrainingArguments`, with the caller's file:line in the job's code (never a
framework's: a Trainer or Accelerate builds the DataLoader inside site-packages, and the line
the user owns is the one that called into the framework), the framework in between, and the
settings a prescription changes. One `data_site` event per construction.

The call's full source span is recorded (from the file, parsed with `ast`) so a prescription can
rewrite a call written over several lines.
"""
import ast
import functools
import linecache
import os
import sys

from . import emit, importhooks, report_error

MAX_EVENTS = 100
_count = {"n": 0}
_trees = {}
_LIBRARY_DIRS = ("site-packages", "dist-packages")


def _is_library(filename):
    if not filename or filename.startswith("<"):
        return True
    parts = os.path.realpath(filename).split(os.sep)
    if any(p in _LIBRARY_DIRS for p in parts) or "_traindx_shim" in parts:
        return True
    return filename.startswith((sys.prefix, sys.base_prefix)) and "lib" in parts


def _package_of(filename):
    parts = os.path.realpath(filename).split(os.sep)
    for marker in _LIBRARY_DIRS:
        if marker in parts:
            i = parts.index(marker)
            if i + 1 < len(parts):
                name = parts[i + 1]
                return name[:-3] if name.endswith(".py") else name
    return None


def _sites(depth):
    """(the innermost frame of the job's own code, the innermost framework frame between it and
    the constructor that is not torch itself)."""
    frame = sys._getframe(depth + 1)
    via = None
    while frame is not None:
        filename = frame.f_code.co_filename
        if not _is_library(filename):
            return frame, via
        package = _package_of(filename)
        if via is None and package and package not in ("torch",):
            via = {"package": package, "file": filename, "line": frame.f_lineno,
                   "function": frame.f_code.co_name}
        frame = frame.f_back
    return None, via


def _call_span(filename, line, name):
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


def _record(kind, name, settings, depth):
    if _count["n"] >= MAX_EVENTS:
        return
    _count["n"] += 1
    frame, via = _sites(depth + 1)
    site = None
    if frame is not None:
        filename, line = frame.f_code.co_filename, frame.f_lineno
        span = _call_span(filename, line, name)
        site = {"file": filename, "line": line, "function": frame.f_code.co_name,
                "source": linecache.getline(filename, line).rstrip("\n") or None}
        if span:
            site.update(call_first_line=span[0], call_last_line=span[1], call_source=span[2])
    emit("data_site", kind=kind, site=site, via=via, **settings)


def _on_dataloader(module):
    cls = module.DataLoader
    original = cls.__init__

    @functools.wraps(original)  # Lightning re-creates DataLoaders from __init__'s signature
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        try:
            _record("DataLoader", "DataLoader",
                    {"num_workers": self.num_workers, "pin_memory": self.pin_memory,
                     "batch_size": self.batch_size, "persistent_workers": self.persistent_workers},
                    depth=1)
        except Exception as exc:
            report_error("DataLoader site", exc)

    cls.__init__ = __init__


def _on_training_args(module):
    cls = module.TrainingArguments
    original = cls.__post_init__

    @functools.wraps(original)
    def __post_init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        try:
            _record("TrainingArguments", type(self).__name__,
                    {"num_workers": getattr(self, "dataloader_num_workers", None),
                     "pin_memory": getattr(self, "dataloader_pin_memory", None),
                     "batch_size": getattr(self, "per_device_train_batch_size", None),
                     "persistent_workers": getattr(self, "dataloader_persistent_workers", None)},
                    depth=2)
        except Exception as exc:
            report_error("TrainingArguments site", exc)

    cls.__post_init__ = __post_init__


def register():
    importhooks.on_import("torch.utils.data.dataloader", _on_dataloader)
    importhooks.on_import("transformers.training_args", _on_training_args)
