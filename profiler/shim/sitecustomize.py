"""traindx's in-process shim, loaded by Python at start-up because `diagnose` puts this folder
first on PYTHONPATH.

It must never harm the job: every failure is swallowed (and reported in the run's events), and
it chains to the sitecustomize this file shadows so a job's own start-up code still runs.
"""

from __future__ import annotations

import os
import sys

_BEFORE = set(sys.modules)  # what the interpreter loaded before the shim (see shadowing.py)


def _chain_shadowed_sitecustomize() -> None:
    # Python imports the first sitecustomize on sys.path; ours shadows any later one.
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


try:
    _chain_shadowed_sitecustomize()
except Exception as exc:  # the job's own sitecustomize failed: Python would print and go on too
    print(f"traindx: the job's sitecustomize raised {exc!r}", file=sys.stderr)


def _interrupted_at_start() -> None:
    # Ctrl-C while the shim starts (the job's code not yet running): the process ends as Python
    # ends on an uncaught KeyboardInterrupt, killed by SIGINT; raised out of here it would be a
    # "Fatal Python error: init_import_site", exit 1, a failure bare Python never showed the job
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGINT)


if os.environ.get("TRAINDX_RUN_DIR"):
    try:
        import _traindx_shim

        _traindx_shim.activate()
        from _traindx_shim import shadowing

        shadowing.unshadow(_BEFORE)
    except KeyboardInterrupt:
        _interrupted_at_start()
    except Exception as exc:
        print(f"traindx: shim disabled: {exc!r}", file=sys.stderr)
