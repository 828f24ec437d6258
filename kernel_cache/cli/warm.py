"""`kernel-cache warm`: compile work items in parallel processes into FA4's persistent cache.

Each process (spawned, `--jobs N`) imports FA4 once with the cache enabled and compiles items one
after another; FA4 itself exports every compiled kernel. Processes, not threads: a CuTe DSL
compile holds the GIL. Two processes that meet the same key are safe: FA4 writes entries under a
file lock, to a temporary name renamed into place.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from traindx.kernel_cache.cli import worker
from traindx.kernel_cache.store import cache as store


@dataclass
class WarmReport:
    results: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0
    jobs: int = 1
    log_dir: str = ""

    @property
    def written(self) -> int:
        return sum(1 for r in self.results for k in r["kernels"] if k["status"] == "written")

    @property
    def present(self) -> int:
        return sum(1 for r in self.results for k in r["kernels"] if k["status"] == "present")

    @property
    def failed(self) -> list[dict[str, Any]]:
        return [r for r in self.results if not r["ok"]]


def worker_env(
    cache_dir: str | Path, arch_vars: Mapping[str, str], extra_env: Mapping[str, str] | None = None
) -> dict[str, str]:
    env = {
        store.ENABLE_VAR: "1",
        store.DIR_VAR: str(cache_dir),
        "TORCH_CPP_LOG_LEVEL": "ERROR",
        "PYTHONWARNINGS": "ignore",
    }
    env.update(extra_env or {})
    env.update(arch_vars)
    return env


def run_warm(
    items: Sequence[dict[str, Any]],
    cache_dir: str | Path,
    arch_vars: Mapping[str, str],
    jobs: int = 1,
    fake: bool = True,
    extra_env: Mapping[str, str] | None = None,
    progress: Callable[[dict[str, Any]], None] | None = None,
) -> WarmReport:
    """Compile `items`; `progress(result)` is called as each finishes. Returns a WarmReport."""
    jobs = max(1, min(jobs, len(items)))
    env = worker_env(cache_dir, arch_vars, extra_env)
    log_dir = tempfile.mkdtemp(prefix="kernel-cache-")
    report = WarmReport(jobs=jobs, log_dir=log_dir)
    start = time.perf_counter()
    pool = ProcessPoolExecutor(
        max_workers=jobs,
        mp_context=multiprocessing.get_context("spawn"),
        initializer=worker.init,
        initargs=(env, os.path.join(log_dir, "workers.log"), fake),
    )
    try:
        futures = {pool.submit(worker.run_item, item): item for item in items}
        for future in as_completed(futures):
            item = futures[future]
            try:
                result = future.result()
            except Exception as exc:  # a dead pool, or a worker-side bug: keep the other items
                error = (
                    f"the compiler process died (out of memory or a crash; see {log_dir}/workers.log)"
                    if isinstance(exc, BrokenProcessPool)
                    else f"{type(exc).__name__}: {exc}"
                )
                result = {
                    "label": item["label"],
                    "ok": False,
                    "rejected": False,
                    "kernels": [],
                    "error": error,
                    "key_match": None,
                    "key_diff": [],
                    "seconds": 0.0,
                }
            result["item"] = item
            report.results.append(result)
            if progress is not None:
                progress(result)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    order = {item["label"]: i for i, item in enumerate(items)}
    report.results.sort(key=lambda r: order.get(r["label"], 0))
    report.seconds = time.perf_counter() - start
    if not report.failed:
        shutil.rmtree(log_dir, ignore_errors=True)
        report.log_dir = ""
    return report


def default_jobs(n_items: int) -> int:
    return max(1, min(n_items, os.cpu_count() or 1, 8))


def gpu_arch() -> tuple[int, int] | None:
    """(arch number, SM count) of the visible GPU, or None on a machine without one."""
    try:
        import torch  # lazy: optional, and seconds to import

        if not torch.cuda.is_available():
            return None
        major, minor = torch.cuda.get_device_capability()
        return major * 10 + minor, torch.cuda.get_device_properties(0).multi_processor_count
    except Exception:
        return None
