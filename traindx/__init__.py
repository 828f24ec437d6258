"""traindx: finds why a training run is slow, prescribes the fix, applies it, proves it.

Notebook API: `run = traindx.load_run(path)`; `findings = traindx.analyze(run)`.
In a training loop: `traindx.step()` at the end of each iteration marks a step (see
docs/run-record.md, "What a step is"); it does nothing when the job is not run under `diagnose`.
"""
import sys

__version__ = "0.1.0"


def step():
    """Mark the end of one training iteration for `diagnose` (a no-op when not recording).

    Use it where traindx cannot see an iteration by itself: no torch optimizer, several
    optimizers stepped at different rates, or a step that is not an optimizer step. Once called,
    only these calls end steps in the run. Call it after the iteration's own logging.
    """
    # the shim publishes itself in sys.modules only when it records this process; importing
    # traindx must not be needed by the job, and this call must stay cheap in every iteration
    steps = sys.modules.get("_traindx_shim.steps")
    if steps is not None:
        steps.marker()


def analyze(run):
    """Ranked findings of every registered analyzer for a loaded run (or a run folder path)."""
    from traindx.analyzers import analyze as _analyze
    from traindx.record import RunRecord, load_run

    if not isinstance(run, RunRecord):
        run = load_run(run)
    return _analyze(run)


def __getattr__(name):
    # the run record pulls in pandas: load it on first use, so `import traindx; traindx.step()`
    # in a training job stays light
    if name in ("RunRecord", "load_run"):
        from traindx import record

        return getattr(record, name)
    raise AttributeError(f"module 'traindx' has no attribute {name!r}")


__all__ = ["RunRecord", "analyze", "load_run", "step"]
