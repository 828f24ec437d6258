"""NVML sampling: GPU utilisation, SM clock, memory, power and clock-event reasons over time.

Only the job's GPUs are sampled: those CUDA_VISIBLE_DEVICES of the job's environment names
(indices, GPU-UUIDs or unique UUID prefixes, MIG-UUIDs; CUDA's own rule that an entry it cannot
resolve hides it and every entry after it), narrowed to the ranks' devices when those are known.
NVML sees the whole node, so without this a shared node's other jobs would be read as ours.
"""

from __future__ import annotations

import io
import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from traindx.common import untrusted

COLUMNS = ["t", "gpu", "util", "mem_util", "sm_clock_mhz", "mem_used_bytes", "power_w", "clock_event_reasons"]


def gpu_inventory() -> list[dict[str, Any]]:
    """[{index, name, uuid, memory_bytes, max_sm_clock_mhz}] or raises the reason NVML is
    unusable."""
    import pynvml  # only where NVML is read: a machine without it runs on

    pynvml.nvmlInit()
    gpus = []
    for i in range(pynvml.nvmlDeviceGetCount()):
        h = pynvml.nvmlDeviceGetHandleByIndex(i)
        name = pynvml.nvmlDeviceGetName(h)
        gpu = {
            "index": i,
            "name": name.decode() if isinstance(name, bytes) else name,
            "uuid": _text(pynvml.nvmlDeviceGetUUID(h)),
            "memory_bytes": pynvml.nvmlDeviceGetMemoryInfo(h).total,
        }
        try:  # the clock a throttled GPU is compared with when no sample ran unthrottled
            gpu["max_sm_clock_mhz"] = int(pynvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_SM))
        except (pynvml.NVMLError, AttributeError):
            pass
        migs = _mig_uuids(pynvml, h)
        if migs:
            gpu["mig_uuids"] = migs
        gpus.append(gpu)
    return gpus


def _mig_uuids(pynvml: Any, handle: Any) -> list[str]:
    """UUIDs of the MIG instances of a GPU in MIG mode ([] otherwise, or when NVML cannot say)."""
    try:
        current, _ = pynvml.nvmlDeviceGetMigMode(handle)
        if current != pynvml.NVML_DEVICE_MIG_ENABLE:
            return []
        out = []
        for j in range(pynvml.nvmlDeviceGetMaxMigDeviceCount(handle)):
            try:
                out.append(
                    _text(pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, j)))
                )
            except pynvml.NVMLError:
                continue
        return out
    except Exception:  # no MIG support in this driver/library: a plain GPU
        return []


def _resolve(entry: str, inventory: list[dict[str, Any]]) -> tuple[int | None, str]:
    """(NVML index, how) of one CUDA_VISIBLE_DEVICES entry, or (None, why not)."""
    if entry.lstrip("-").isdigit():
        n = int(entry)
        if 0 <= n < len(inventory):
            return inventory[n]["index"], f"{entry}: index"
        return None, f"{entry}: no such GPU index"
    low = entry.lower()
    if low.startswith("mig-"):
        # MIG-<uuid>, or the legacy MIG-GPU-<gpu uuid>/<gi>/<ci>: NVML samples the parent GPU
        legacy = low[len("mig-") :].split("/")[0]
        for gpu in inventory:
            if legacy.startswith("gpu-") and gpu.get("uuid", "").lower() == legacy:
                return gpu[
                    "index"
                ], f"{entry}: a MIG instance of GPU {gpu['index']} (its whole GPU is sampled)"
            if any(m.lower() == low for m in gpu.get("mig_uuids", ())):
                return gpu[
                    "index"
                ], f"{entry}: a MIG instance of GPU {gpu['index']} (its whole GPU is sampled)"
        return None, f"{entry}: no such MIG instance"
    prefix = low if low.startswith("gpu-") else "gpu-" + low
    hits = [g for g in inventory if g.get("uuid", "").lower().startswith(prefix)]
    if len(hits) == 1:
        return hits[0]["index"], f"{entry}: UUID"
    return None, f"{entry}: {'ambiguous' if hits else 'no such'} GPU UUID"


def select_gpus(
    inventory: list[dict[str, Any]],
    visible: str | None = None,
    rank_devices: Any = None,
    device_order: str | None = None,
) -> tuple[list[int], str]:
    """(NVML indices to sample, why) for a job.

    inventory: gpu_inventory()'s list. visible: the job's CUDA_VISIBLE_DEVICES (None: unset).
    rank_devices: the CUDA device ordinals the ranks use, in the job's numbering (e.g. LOCAL_RANK
    with one GPU per rank), when known. device_order: the job's CUDA_DEVICE_ORDER.
    """
    if visible is None:
        chosen, why = (
            [g["index"] for g in inventory],
            "CUDA_VISIBLE_DEVICES is unset: the job sees every GPU of the node",
        )
    else:
        chosen, notes = [], []
        for entry in (e.strip() for e in visible.split(",")):
            if not entry:
                continue
            index, how = _resolve(entry, inventory)
            if index is None:
                # CUDA ignores an entry it cannot resolve and every entry after it
                notes.append(f"{how}; CUDA hides it and the entries after it")
                break
            if index not in chosen:
                chosen.append(index)
                notes.append(how)
        why = f"CUDA_VISIBLE_DEVICES={visible!r}: " + ("; ".join(notes) if notes else "the job sees no GPU")
        names = {g.get("name") for g in inventory}
        if len(names) > 1 and device_order != "PCI_BUS_ID":
            why += (
                " (mixed GPU models and CUDA_DEVICE_ORDER is not PCI_BUS_ID: CUDA may number "
                "them differently from NVML)"
            )
    if rank_devices:
        ranked = [chosen[d] for d in sorted(set(rank_devices)) if 0 <= d < len(chosen)]
        if ranked:
            why += f"; the ranks use devices {sorted(set(rank_devices))} of those: NVML GPUs {ranked}"
            chosen = ranked
    return chosen, why


def _text(value: Any) -> Any:
    return value.decode() if isinstance(value, bytes) else value


class NvmlSampler:
    """Samples the job's GPUs (select_gpus) every `interval_s` into a CSV, the `gpu` column being
    the NVML index (as in the manifest's `gpus`); a missing driver leaves `error` set."""

    def __init__(
        self,
        path: str,
        interval_s: float = 0.5,
        env: Mapping[str, str] | None = None,
        rank_devices: Any = None,
    ) -> None:
        self.path = path
        self.interval_s = interval_s
        self.error: str | None = None
        # the job's environment decides which GPUs are its own (default: this process's)
        self.env = os.environ if env is None else env
        self.rank_devices = rank_devices
        self.selection: dict[str, Any] | None = None  # {"gpus": [NVML index], "why": text}: for the manifest
        self.write_error: str | None = None  # what a failed write of nvml.csv left out
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._handles: list[tuple[int, Any]] = []

    def start(self) -> bool:
        try:
            import pynvml  # only where NVML is read: a machine without it runs on

            inventory = gpu_inventory()
            indices, why = select_gpus(
                inventory,
                self.env.get("CUDA_VISIBLE_DEVICES"),
                self.rank_devices,
                self.env.get("CUDA_DEVICE_ORDER"),
            )
            self.selection = {"gpus": indices, "why": why}
            self._handles = [(i, pynvml.nvmlDeviceGetHandleByIndex(i)) for i in indices]
        except Exception as exc:  # no driver, no library, no GPU: the job runs on without NVML
            self.error = f"NVML unavailable: {type(exc).__name__}: {exc}"
            return False
        if not self._handles:
            self.error = "NVML sampled no GPU: " + (why if inventory else "NVML found no GPU")
            return False
        self._thread = threading.Thread(target=self._loop, name="traindx-nvml", daemon=True)
        self._thread.start()
        return True

    def _sample(self, pynvml: Any, index: int, h: Any) -> list[Any]:
        def safe(fn: Callable[[], Any], default: Any = "") -> Any:
            try:
                return fn()
            except pynvml.NVMLError:
                return default

        util = safe(lambda: pynvml.nvmlDeviceGetUtilizationRates(h), None)
        return [
            time.time_ns(),
            index,
            "" if util is None else util.gpu,
            "" if util is None else util.memory,
            safe(lambda: pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM)),
            safe(lambda: pynvml.nvmlDeviceGetMemoryInfo(h).used),
            safe(lambda: pynvml.nvmlDeviceGetPowerUsage(h) / 1000.0),
            safe(lambda: pynvml.nvmlDeviceGetCurrentClocksEventReasons(h)),
        ]

    def _loop(self) -> None:
        import pynvml  # only where NVML is read: a machine without it runs on

        out = None
        try:
            out = open(self.path, "w", encoding="utf-8")
            out.write(",".join(COLUMNS) + "\n")
            while not self._stop.is_set():
                for index, h in self._handles:
                    out.write(",".join(map(str, self._sample(pynvml, index, h))) + "\n")
                out.flush()
                self._stop.wait(self.interval_s)
        except OSError as exc:  # a full disk: the samples so far stay, the loss is said once
            self.write_error = (
                f"nvml.csv: the GPU samples from {time.strftime('%H:%M:%S')} on ({exc.strerror or exc})"
            )
        finally:
            if out is not None:
                try:
                    out.close()
                except OSError:
                    pass

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


def load_csv(path: str) -> tuple[Any, str | None]:
    """(DataFrame of COLUMNS, problem or None) of an nvml.csv: rows that are not samples (a cut
    last line, garbage bytes) are dropped; a file that holds none is reported, never raised."""
    import pandas as pd  # pandas: kept out of the launcher, which samples with this module

    empty = pd.DataFrame(columns=COLUMNS)
    try:
        raw = untrusted.read_bytes(path)  # a run folder's file: no link, FIFO or device
    except OSError as exc:
        return empty, f"{path}: unreadable ({exc.strerror}); GPU metrics skipped"
    if not raw.strip():
        return empty, None
    text = raw.decode("utf-8", errors="replace").replace("\x00", "")
    try:
        df = pd.read_csv(io.StringIO(text), on_bad_lines="skip", dtype=str)
    except (ValueError, pd.errors.ParserError, pd.errors.EmptyDataError) as exc:
        return empty, f"{path}: not a CSV of NVML samples ({type(exc).__name__}); GPU metrics skipped"
    if "t" not in df.columns or "gpu" not in df.columns:
        return empty, f"{path}: no NVML header (t,gpu,...): not an nvml.csv; GPU metrics skipped"
    rows = len(df)
    df = df.apply(pd.to_numeric, errors="coerce").dropna(subset=["t", "gpu"])
    problem = None
    if rows and len(df) < rows:
        problem = (
            f"{path}: {rows - len(df)} of {rows} rows are not NVML samples; "
            f"{'they were' if len(df) else 'GPU metrics'} skipped"
        )
    for col in COLUMNS:
        if col not in df:
            df[col] = float("nan")
    return df.reset_index(drop=True), problem
