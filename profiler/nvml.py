"""NVML sampling: GPU utilisation, SM clock, memory, power and clock-event reasons over time."""
import threading
import time

COLUMNS = ["t", "gpu", "util", "mem_util", "sm_clock_mhz", "mem_used_bytes", "power_w",
           "clock_event_reasons"]


def gpu_inventory():
    """[{index, name, uuid, memory_bytes}] or raises the reason NVML is unusable."""
    import pynvml

    pynvml.nvmlInit()
    gpus = []
    for i in range(pynvml.nvmlDeviceGetCount()):
        h = pynvml.nvmlDeviceGetHandleByIndex(i)
        name = pynvml.nvmlDeviceGetName(h)
        gpus.append({"index": i, "name": name.decode() if isinstance(name, bytes) else name,
                     "uuid": _text(pynvml.nvmlDeviceGetUUID(h)),
                     "memory_bytes": pynvml.nvmlDeviceGetMemoryInfo(h).total})
    return gpus


def _text(value):
    return value.decode() if isinstance(value, bytes) else value


class NvmlSampler:
    """Samples every GPU every `interval_s` into a CSV; a missing driver leaves `error` set."""

    def __init__(self, path, interval_s=0.5):
        self.path = path
        self.interval_s = interval_s
        self.error = None
        self._stop = threading.Event()
        self._thread = None

    def start(self):
        try:
            import pynvml

            pynvml.nvmlInit()
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i)
                             for i in range(pynvml.nvmlDeviceGetCount())]
        except Exception as exc:  # no driver, no library, no GPU: the job runs on without NVML
            self.error = f"NVML unavailable: {type(exc).__name__}: {exc}"
            return False
        if not self._handles:
            self.error = "NVML found no GPU"
            return False
        self._thread = threading.Thread(target=self._loop, name="traindx-nvml", daemon=True)
        self._thread.start()
        return True

    def _sample(self, pynvml, index, h):
        def safe(fn, default=""):
            try:
                return fn()
            except pynvml.NVMLError:
                return default

        util = safe(lambda: pynvml.nvmlDeviceGetUtilizationRates(h), None)
        return [time.time_ns(), index,
                "" if util is None else util.gpu, "" if util is None else util.memory,
                safe(lambda: pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM)),
                safe(lambda: pynvml.nvmlDeviceGetMemoryInfo(h).used),
                safe(lambda: pynvml.nvmlDeviceGetPowerUsage(h) / 1000.0),
                safe(lambda: pynvml.nvmlDeviceGetCurrentClocksEventReasons(h))]

    def _loop(self):
        import pynvml

        with open(self.path, "w", encoding="utf-8") as out:
            out.write(",".join(COLUMNS) + "\n")
            while not self._stop.is_set():
                for index, h in enumerate(self._handles):
                    out.write(",".join(map(str, self._sample(pynvml, index, h))) + "\n")
                out.flush()
                self._stop.wait(self.interval_s)

    def stop(self):
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
