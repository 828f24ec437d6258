"""traindx: finds why a training run is slow, prescribes the fix, applies it, proves it.

Notebook API: `run = traindx.load_run(path)`; `findings = traindx.analyze(run)`.
"""
from traindx.record import RunRecord, load_run

__version__ = "0.1.0"


def analyze(run):
    """Ranked findings of every registered analyzer for a loaded run (or a run folder path)."""
    from traindx.analyzers import analyze as _analyze

    if not isinstance(run, RunRecord):
        run = load_run(run)
    return _analyze(run)


__all__ = ["RunRecord", "analyze", "load_run"]
