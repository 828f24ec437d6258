"""The compiler process: runs FA4's own forward/backward entry points with its persistent cache
enabled, so FA4 itself writes the entries an unmodified job loads later.

Runs in a spawned process (a CuTe DSL compile holds the GIL: threads would not overlap). Nothing
here is imported by the parent: torch and FA4 are imported after `init` has set the environment,
because FA4 reads its cache switches at import time.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib
import inspect
import os
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

_state: dict[str, Any] = {"ready": False, "lookups": [], "exports": {}, "fake": True, "held": {}}
REJECT_TYPES = (AssertionError, ValueError, NotImplementedError, TypeError)


def init(env: Mapping[str, str], log_path: str | None = None, fake: bool = True) -> None:
    os.environ.update(env)
    _state["fake"] = fake
    if log_path:
        # CuTe DSL and torch print warnings from C++ and Python; keep them off the progress bar
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)


def _setup() -> None:
    if _state["ready"]:
        return
    warnings.filterwarnings("ignore")
    # after init set the environment: FA4 reads its cache switches at import time
    import flash_attn.cute.cache_utils as cache_utils
    import flash_attn.cute.interface  # noqa: F401

    if not cache_utils.CUTE_DSL_CACHE_ENABLED:
        raise RuntimeError("FA4's persistent cache is not enabled in the worker")
    _instrument(cache_utils)
    _state["ready"] = True


def _instrument(cache_utils: Any) -> None:
    """Observe FA4's persistent cache (which keys each call looked up, what each export did), and
    make parallel workers take turns on a key: the second one waits, then loads the first's entry
    instead of compiling the same kernel again."""
    cls = cache_utils.JITPersistentCache
    base_contains = cache_utils.JITCache.__contains__
    original_contains = cls.__contains__
    original_export = cls._try_export_to_storage

    def __contains__(self: Any, key: Any) -> bool:
        in_memory = base_contains(self, key)
        found = original_contains(self, key)
        digest = self._key_to_hash(key)
        status = "memory" if in_memory else ("disk" if found else "miss")
        if status == "miss" and (self.cache_path.name, digest) not in _state["held"]:
            lock = _take_turn(self.cache_path / f"{digest}.warming.lock")
            if lock is not None:
                _state["held"][(self.cache_path.name, digest)] = lock
                if original_contains(self, key):  # another worker compiled it meanwhile
                    _release(self.cache_path.name, digest)
                    found, status = True, "disk"
        _state["lookups"].append((self.cache_path.name, digest, key, status))
        return bool(found)

    def _try_export_to_storage(self: Any, key: Any, fn: Any) -> None:
        digest = self._key_to_hash(key)
        path = self.cache_path / f"{digest}.o"
        exported: list[bool] = []

        class Probe:  # sees whether FA4 exports or finds the entry already written
            def __getattr__(self, name: str) -> Any:
                return getattr(fn, name)

            def export_to_c(self, *args: Any, **kwargs: Any) -> Any:
                exported.append(True)
                return fn.export_to_c(*args, **kwargs)

        try:
            original_export(self, key, Probe())
        finally:
            _release(self.cache_path.name, digest)
        if not exported:
            status = "present"  # another process exported the same key first
        elif path.exists() and path.stat().st_size > 0:
            status = "written"
        else:
            status = "export failed"
        _state["exports"][(self.cache_path.name, digest)] = status

    def get(self: Any, key: Any) -> Any:  # newer releases look a key up once with get() instead of `in`
        return cache_utils.JITCache.get(self, key) if __contains__(self, key) else None

    cls.__contains__ = __contains__
    cls._try_export_to_storage = _try_export_to_storage
    if hasattr(cls, "get") and hasattr(cache_utils.JITCache, "get"):
        cls.get = get


TURN_TIMEOUT_S = 900  # longer than any single compile; after it, compile anyway


def _take_turn(path: str | os.PathLike[str]) -> int | None:
    try:
        fd = os.open(str(path), os.O_WRONLY | os.O_CREAT, 0o644)
    except OSError:
        return None
    deadline = time.monotonic() + TURN_TIMEOUT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except OSError:
            if time.monotonic() > deadline:
                os.close(fd)
                return None
            time.sleep(0.1)


def _release(family: str, digest: str) -> None:
    fd = _state["held"].pop((family, digest), None)
    if fd is not None:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _release_all() -> None:
    for family, digest in list(_state["held"]):
        _release(family, digest)


# -- tensors ---------------------------------------------------------------------------------------
def _torch_dtype(name: str) -> Any:
    import torch

    name = str(name).replace("torch.", "")
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise Unreplayable(f"unknown dtype {name!r}")
    return dtype


class Unreplayable(Exception):
    """A recorded argument that cannot be rebuilt (a callable, a custom object)."""


def _empty(shape: Sequence[int], dtype: Any, requires_grad: bool = False, device: str = "cuda") -> Any:
    import torch

    t = torch.zeros(tuple(shape), dtype=dtype, device=device)
    if requires_grad:
        t.requires_grad_(True)
    return t


def _cu_seqlens(batch: int, total: int, device: str = "cuda") -> Any:
    import torch

    # even split of `total` tokens into `batch` sequences (real mode needs valid offsets)
    bounds = [round(i * total / batch) for i in range(batch + 1)]
    return torch.tensor(bounds, dtype=torch.int32, device=device)


def _rebuild(name: str, value: Any, args: Mapping[str, Any]) -> Any:
    if isinstance(value, dict):
        if value.get("tensor"):
            shape = value.get("shape") or []
            dtype = _torch_dtype(value.get("dtype", "float32"))
            if not _state["fake"] and name.startswith("cu_seqlens") and len(shape) == 1:
                ref = args.get("q" if name.endswith("_q") else "k") or {}
                total = (ref.get("shape") or [shape[0] - 1])[0]
                return _cu_seqlens(shape[0] - 1, total)
            if not _state["fake"] and name.startswith("max_seqlen") and not shape:
                import torch

                return torch.tensor(_max_seqlen_guess(name, args), dtype=dtype, device="cuda")
            # a host tensor stays on the host (e.g. a max_seqlen some frameworks keep on the CPU)
            device = "cpu" if str(value.get("device", "")).startswith("cpu") else "cuda"
            return _empty(shape, dtype, requires_grad=bool(value.get("requires_grad")), device=device)
        if "class" in value and ("enum" in value or "fields" in value):
            return _rebuild_object(name, value, args)
        if "callable" in value:
            numeric = _cutlass_type(value["callable"])
            if numeric is not None:  # FA4's pre/post kernels take cutlass dtypes (BFloat16, ...)
                return numeric
            raise Unreplayable(
                f"argument {name} is a function ({value['callable']}): "
                "score/mask mods cannot be rebuilt from a recording"
            )
        raise Unreplayable(
            f"argument {name} is a {value.get('type', 'custom object')}, "
            "which cannot be rebuilt from a recording"
        )
    if isinstance(value, list):
        return [_rebuild(name, v, args) for v in value]
    return value


def _rebuild_object(name: str, value: Mapping[str, Any], args: Mapping[str, Any]) -> Any:
    """An enum member or a dataclass instance the shim recorded with its class and fields (FA4's
    resolved launch configs, its preprocess's PackGQA mode): the same class, imported again."""
    module_name, _, qualname = str(value["class"]).partition(":")
    try:
        cls: Any = importlib.import_module(module_name)
        for part in qualname.split("."):
            cls = getattr(cls, part)
    except (ImportError, AttributeError) as exc:
        raise Unreplayable(
            f"argument {name} is a {value['class']}, which this environment lacks ({exc})"
        ) from None
    try:
        if "enum" in value:
            return cls[value["enum"]]
        fields = {field: _rebuild(field, recorded, args) for field, recorded in value["fields"].items()}
        return cls(**fields)
    except (KeyError, TypeError) as exc:  # another release's fields or members
        raise Unreplayable(
            f"argument {name} ({value['class']}) does not rebuild in this release: {exc}"
        ) from None


def _cutlass_type(name: str) -> type | None:
    import cutlass

    value = getattr(cutlass, str(name), None)
    return value if isinstance(value, type) else None


def _max_seqlen_guess(name: str, args: Mapping[str, Any]) -> int:
    ref = args.get("q" if name.endswith("_q") else "k") or {}
    cu = args.get("cu_seqlens_q" if name.endswith("_q") else "cu_seqlens_k") or {}
    total = (ref.get("shape") or [1])[0]
    batch = max(1, (cu.get("shape") or [2])[0] - 1)
    guess: int = -(-total // batch)
    return guess


# -- the two kinds of work ---------------------------------------------------------------------------
def _run_shape(item: dict[str, Any]) -> str | None:
    import torch
    from flash_attn.cute import interface as fa

    dtype = torch.bfloat16 if item["dtype"] == "bf16" else torch.float16
    seqlen, batch = item["seqlen"], item["batch"]
    hq, hkv, hd, hdv = item["hq"], item["hkv"], item["hd"], item["hdv"]
    grad = not item["fwd"]
    if item["varlen"]:
        total = seqlen * batch
        q, k, v = (_empty((total, h, d), dtype, grad) for h, d in ((hq, hd), (hkv, hd), (hkv, hdv)))
        cu = _cu_seqlens(batch, total)
        max_seqlen = (
            torch.tensor(seqlen, dtype=torch.int32, device="cuda") if item["tensor_maxseqlen"] else seqlen
        )
        varlen = {
            "cu_seqlens_q": cu,
            "cu_seqlens_k": cu,
            "max_seqlen_q": max_seqlen,
            "max_seqlen_k": max_seqlen,
        }
    else:
        q, k, v = (_empty((batch, seqlen, h, d), dtype, grad) for h, d in ((hq, hd), (hkv, hd), (hkv, hdv)))
        varlen = {}
    left, right = item["window"] or (None, None)
    # the arguments FlashAttnFunc / FlashAttnVarlenFunc pass (flash_attn/cute/interface.py)
    out, lse, *_ = fa._flash_attn_fwd(
        q,
        k,
        v,
        softmax_scale=None,
        causal=item["causal"],
        window_size_left=left,
        window_size_right=right,
        learnable_sink=None,
        softcap=item["softcap"],
        num_splits=1,
        pack_gqa=None,
        score_mod=None,
        mask_mod=None,
        aux_tensors=None,
        aux_scalars=None,
        return_lse=False,
        **varlen,
    )
    if not grad:
        return None
    dout = torch.zeros_like(out)
    fa._flash_attn_bwd(
        q,
        k,
        v,
        out,
        dout,
        lse,
        None,
        item["causal"],
        item["softcap"],
        window_size_left=left,
        window_size_right=right,
        deterministic=item["deterministic"],
        score_mod=None,
        score_mod_bwd=None,
        mask_mod=None,
        aux_tensors=None,
        aux_scalars=None,
        dlse=None,
        learnable_sink=None,
        **varlen,
    )
    return None


def _run_replay(item: dict[str, Any], variant: Mapping[str, Any] | None = None) -> str:
    from flash_attn.cute import interface as fa

    function = getattr(fa, item["function"], None)
    if function is None or not hasattr(function, "compile_cache"):
        raise Unreplayable(f"this FA4 has no {item['function']} to replay")
    recorded = dict(item.get("args") or {}, **(variant or {}))
    recorded = _fit_signature(function, recorded)
    if item.get("int_max_seqlen"):
        # as if the job passed max_seqlen as a Python int (the fix for FA4 <= b21's tensor keys)
        recorded.update(
            {
                name: _max_seqlen_guess(name, recorded)
                for name, value in recorded.items()
                if name.startswith("max_seqlen") and isinstance(value, dict) and value.get("tensor")
            }
        )
    kwargs = {name: _rebuild(name, value, recorded) for name, value in recorded.items()}
    if "fake_mode" in inspect.signature(function).parameters:  # b36's pre/post kernels ask
        kwargs["fake_mode"] = _state["fake"]
    function(**kwargs)
    name: str = item["function"]
    return name


def _fit_signature(function: Callable[..., Any], recorded: dict[str, Any]) -> dict[str, Any]:
    """A run recorded with another FA4 release may name arguments this one lacks: unset ones
    (None/False/0) are dropped; one that carries a value cannot be replayed faithfully."""
    params = inspect.signature(function).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return recorded
    unknown = {k: v for k, v in recorded.items() if k not in params}
    meaningful = [k for k, v in unknown.items() if v not in (None, False, 0, 0.0, [], {})]
    if meaningful:
        raise Unreplayable(
            f"this FA4's {function.__name__} has no argument "
            f"{', '.join(meaningful)} (recorded with another release)"
        )
    return {k: v for k, v in recorded.items() if k in params}


def replay_variants(item: dict[str, Any]) -> list[dict[str, None]]:
    """Other readings of a recorded call. The shim records FA4's locals when the compile starts;
    on sm_100 varlen, forward has by then replaced a tensor (or missing) max_seqlen by the token
    count, which as an int can select another key. Tried only when the key differs."""
    args = item.get("args") or {}
    if item["function"] != "_flash_attn_fwd" or args.get("cu_seqlens_q") is None:
        return []
    return [
        dict.fromkeys(names)
        for names in (("max_seqlen_q",), ("max_seqlen_k",), ("max_seqlen_q", "max_seqlen_k"))
        if all(isinstance(args.get(n), int) for n in names)
    ]


def _key_text(value: object, limit: int) -> str:
    """A compile key as the shim wrote it (its text never reads a tensor's data), so the two
    compare."""
    from traindx.profiler.shim._traindx_shim.compiles import safe_repr

    text: str = safe_repr(value, limit)
    return text


def _key_check(
    item: dict[str, Any], lookups: list[tuple[str, str, Any, str]]
) -> tuple[bool | None, list[str]]:
    """Compare the key this replay produced with the recorded one (field by field if it differs)."""
    expect = item.get("expect_key")
    if not expect:
        return None, []
    from flash_attn.cute import interface as fa

    family = getattr(fa, item["function"]).compile_cache.cache_path.name
    produced = next((key for fam, _, key, _ in lookups if fam == family), None)
    if produced is None:
        return False, ["no compile key was looked up"]
    if _key_text(produced, 4000) == expect:
        return True, []
    names = list((item.get("expect_fields") or {}).keys())
    fields = item.get("expect_fields") or {}
    diffs = []
    if isinstance(produced, tuple) and len(names) == len(produced):
        for name, value in zip(names, produced):
            if _key_text(value, 300) != fields.get(name):
                diffs.append(f"{name}: recorded {fields.get(name)}, replayed {_key_text(value, 80)}")
    return False, diffs or ["key differs"]


def _reason(exc: BaseException) -> tuple[bool, str]:
    frames = traceback.extract_tb(exc.__traceback__)
    last = frames[-1] if frames else None
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    if not message and last is not None:
        message = f"{os.path.basename(last.filename)}:{last.lineno}: {last.line}"
    in_fa4 = any("flash_attn" in f.filename for f in frames[-3:])
    rejected = isinstance(exc, REJECT_TYPES) and in_fa4 and not any("cutlass" in f.filename for f in frames)
    return rejected, f"{type(exc).__name__}: {message}" if not rejected else message


def _mode() -> contextlib.AbstractContextManager[Any]:
    if _state["fake"]:
        from torch._subclasses.fake_tensor import FakeTensorMode

        fake_mode: contextlib.AbstractContextManager[Any] = FakeTensorMode()
        return fake_mode

    return contextlib.nullcontext()


def run_item(item: dict[str, Any]) -> dict[str, Any]:
    """Compile one work item; returns what happened to each kernel it needed."""
    start = time.perf_counter()
    result = {
        "label": item["label"],
        "ok": False,
        "rejected": False,
        "error": None,
        "kernels": [],
        "key_match": None,
        "key_diff": [],
        "pid": os.getpid(),
    }
    lookups = []
    try:
        _setup()
        start = time.perf_counter()  # the FA4 import (once per process) is not this item's time
        _state["exports"] = {}
        lookups = _attempt(item)
        result["ok"] = True
    except Unreplayable as exc:
        result["error"] = f"cannot replay: {exc}"
    except Exception as exc:  # FA4 refusing the input, or a compile failure: reported per item
        result["rejected"], result["error"] = _reason(exc)
        lookups = _state["lookups"]
        print(f"--- {item['label']}: {result['error']}", file=sys.stderr)  # into the worker log
        traceback.print_exc()
        sys.stderr.flush()
    if item["kind"] == "replay" and result["ok"]:
        result["key_match"], result["key_diff"] = _key_check(item, lookups)
        for variant in replay_variants(item) if result["key_match"] is False else []:
            try:
                more = _attempt(item, variant)
            except Exception:
                continue
            lookups += more
            if _key_check(item, more)[0]:
                result["key_match"], result["key_diff"] = True, []
                result["replayed_as"] = variant
                break
    result["kernels"] = _kernel_statuses(lookups)
    if any(k["status"] == "export failed" for k in result["kernels"]) and result["ok"]:
        result["ok"] = False
        result["error"] = "compiled, but FA4 could not write the entry (see FA_LOG_LEVEL=1)"
    result["seconds"] = time.perf_counter() - start
    return result


def _attempt(
    item: dict[str, Any], variant: Mapping[str, Any] | None = None
) -> list[tuple[str, str, Any, str]]:
    """Run the item's FA4 calls once; returns the cache lookups they made."""
    _state["lookups"] = []
    try:
        with _mode():
            if item["kind"] == "replay":
                _run_replay(item, variant)
            else:
                _run_shape(item)
    finally:
        _release_all()  # a compile that failed never reached the export
    lookups: list[tuple[str, str, Any, str]] = _state["lookups"]
    return lookups


def _kernel_statuses(lookups: list[tuple[str, str, Any, str]]) -> list[dict[str, Any]]:
    seen: dict[tuple[str, str], str] = {}
    keys: dict[tuple[str, str], str] = {}
    for family, digest, key, status in lookups:
        if (family, digest) in seen:
            continue
        keys[(family, digest)] = _key_text(key, 4000)
        export = _state["exports"].get((family, digest))
        if export is not None:
            status = export
        elif status in ("disk", "memory"):
            status = "present"
        else:
            status = "not compiled"  # the call failed before compiling this kernel
        seen[(family, digest)] = status
    return [{"family": f, "hash": h, "status": s, "key": keys[(f, h)]} for (f, h), s in seen.items()]
