"""Run records built in code: a run folder in the documented format (docs/run-record.md) that the
test writes itself, on fake clocks that only the test moves, so that no load on the machine can
change what the judge reads. For judgement and derivation logic; what a real job records is
the integration tests' (tests/helpers.py: diagnose, recorded_runs).

    b = RunBuilder(tmp_path / "run", command=["python", "train.py"])
    for s in range(6):
        b.step(0.1, spans=[("data", 0.04), ("forward", 0.03)])      # rank 0
        b.step(0.15, rank="1", spans=[("gc", 0.05, {"generation": 2})])
    b.compile(step=0, seconds=0.4, kernel="k", key_fields={"T": "64"})
    b.kernels("0", [(start_ns, dur_ns, "gemm")])                  # a kineto trace of rank 0
    run = b.load()
"""

import gzip
import json
import os

import traindx

T0 = 1_700_000_000_000_000_000  # ns: a fixed wall clock, so a built record is the same every time
PID0 = 1000  # rank r is process PID0 + r
MAIN_TID = 1


class FakeClock:
    """Nanoseconds since a fixed epoch that move only when the test moves them. Called, it gives
    seconds, for code that takes a clock (LiveJudge(clock=...))."""

    def __init__(self, t0_ns: int = T0) -> None:
        self.ns = t0_ns

    def advance(self, seconds: float) -> int:
        self.ns += round(seconds * 1e9)
        return self.ns

    def __call__(self) -> float:
        return self.ns / 1e9


class RunBuilder:
    """A run folder of one or more ranks, each one process with its own events file and its own
    fake clock (ranks start together at t0_ns). Events are kept in memory and written by write()
    (or load()), each file in t order as the shim writes it."""

    def __init__(
        self, path, command=("python", "train.py"), cwd="/job", packages=None, t0_ns=T0, manifest=None
    ):
        self.path = str(path)
        self.t0_ns = t0_ns
        self.manifest = {
            "command": list(command),
            "cwd": cwd,
            "packages": dict(packages or {}),
            **(manifest or {}),
        }
        self.events: dict[str, list[dict]] = {}
        self.clocks: dict[str, FakeClock] = {}
        self.next_step: dict[str, int] = {}
        self.traces: dict[str, list[dict]] = {}

    # -- ranks and their clocks ------------------------------------------------------------------
    def clock(self, rank: str = "0") -> FakeClock:
        """Rank's clock; the first use of a rank writes its process_start."""
        if rank not in self.clocks:
            self.clocks[rank] = FakeClock(self.t0_ns)
            self.next_step[rank] = 0
            pid = PID0 + int(rank)
            self.events[rank] = [
                {"type": "process_start", "t": self.t0_ns, "pid": pid, "rank": rank, "main_thread": MAIN_TID}
            ]
        return self.clocks[rank]

    def event(self, type_: str, rank: str = "0", t: int | None = None, **fields) -> dict:
        """Any event, at rank's clock unless t (ns) is given."""
        now = self.clock(rank).ns if t is None else t
        event = {"type": type_, "t": now, **fields}
        self.events[rank].append(event)
        return event

    # -- steps, spans, compiles --------------------------------------------------------------------
    def step(self, duration_s: float, rank: str = "0", spans=(), source="torch.optim", **end_fields) -> int:
        """One step on rank: step_begin now, the spans laid end to end from its start (each
        (cat, seconds) or (cat, seconds, {fields})), step_end duration_s later; rank's clock
        moves to the step's end. Returns the step's number."""
        clock = self.clock(rank)
        step, begin = self.next_step[rank], clock.ns
        self.next_step[rank] += 1
        self.event("step_begin", rank, step=step)
        at = begin
        for cat, seconds, *fields in spans:
            end = at + round(seconds * 1e9)
            self.event("span", rank, t=end, cat=cat, start=at, tid=MAIN_TID, **(fields[0] if fields else {}))
            at = end
        clock.advance(duration_s)
        self.event("step_end", rank, step=step, duration_s=duration_s, source=source, **end_fields)
        return step

    def step_bounds(self, step: int, rank: str = "0") -> tuple[int, int]:
        """(start, end) ns of a step written on rank."""
        ev = self.events[rank]
        begin = next(e["t"] for e in ev if e["type"] == "step_begin" and e["step"] == step)
        end = next(e["t"] for e in ev if e["type"] == "step_end" and e["step"] == step)
        return begin, end

    def compile(
        self, step, seconds, kernel="kernel", kind="triton", key_fields=None, rank="0", at_s=0.0, **extra
    ):
        """A compile event inside a written step: it starts at_s seconds into the step."""
        start = self.step_bounds(step, rank)[0] + round(at_s * 1e9)
        fields = dict(key_fields or {})
        return self.event(
            "compile",
            rank,
            t=start + round(seconds * 1e9),
            kind=kind,
            kernel=kernel,
            step=step,
            start=start,
            duration_s=seconds,
            thread="MainThread",
            is_main_thread=True,
            key_fields=fields,
            key=repr(fields),
            **extra,
        )

    # -- kernels (a kineto trace, as torch.profiler writes it) ---------------------------------------
    def kernels(self, rank: str, kernels, stream: int = 7) -> None:
        """GPU kernels of rank's torch.profiler window: (start ns, duration ns, name) each."""
        self.traces.setdefault(rank, []).extend(
            {
                "ph": "X",
                "cat": "kernel",
                "name": name,
                "pid": 0,
                "tid": stream,
                "ts": (start - self.t0_ns) / 1000,
                "dur": dur / 1000,
                "args": {"device": 0, "stream": stream},
            }
            for start, dur, name in kernels
        )

    # -- the folder ----------------------------------------------------------------------------------
    def write(self) -> str:
        os.makedirs(os.path.join(self.path, "events"), exist_ok=True)
        ranks = {}
        for rank, events in self.events.items():
            pid = PID0 + int(rank)
            ranks[rank] = pid
            ordered = sorted(events, key=lambda e: e["t"])  # stable: ties keep their order
            with open(os.path.join(self.path, "events", f"p{pid}.jsonl"), "w") as f:
                f.writelines(json.dumps(e) + "\n" for e in ordered)
        for rank, events in self.traces.items():
            os.makedirs(os.path.join(self.path, "trace"), exist_ok=True)
            doc = {"schemaVersion": 1, "baseTimeNanoseconds": self.t0_ns, "traceEvents": events}
            with gzip.open(os.path.join(self.path, "trace", f"{rank}.json.gz"), "wt") as f:
                json.dump(doc, f)
        with open(os.path.join(self.path, "manifest.json"), "w") as f:
            json.dump({"ranks": ranks, **self.manifest}, f)
        return self.path

    def load(self):
        return traindx.load_run(self.write())
