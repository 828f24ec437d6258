"""Running `diagnose` the way a user does: as a separate process on a real example."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
PY = sys.executable


def example(name):
    return os.path.join(EXAMPLES, name)


def diagnose(args, cwd, env=None, timeout=600, **kwargs):
    """Run `diagnose <args>` in cwd; returns the CompletedProcess (text)."""
    full_env = dict(os.environ)
    full_env.pop("TRAINDX_RUN_DIR", None)
    full_env.update(env or {})
    return subprocess.run([PY, "-m", "traindx", *args], cwd=cwd, env=full_env, text=True,
                          capture_output=True, timeout=timeout, **kwargs)


def only_run_dir(out_dir):
    runs = [os.path.join(out_dir, d) for d in os.listdir(out_dir)]
    assert len(runs) == 1, runs
    return runs[0]
