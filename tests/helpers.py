"""Running `diagnose` the way a user does: as a separate process on a real example."""

import dataclasses
import enum
import os
import subprocess
import sys
import tarfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
PY = sys.executable


def example(name):
    return os.path.join(EXAMPLES, name)


def _env(env):
    full_env = dict(os.environ)
    full_env.pop("TRAINDX_RUN_DIR", None)
    full_env.update(env or {})
    return full_env


def diagnose(args, cwd, env=None, timeout=600, **kwargs):
    """Run `diagnose <args>` in cwd; returns the CompletedProcess (text)."""
    return subprocess.run(
        [PY, "-m", "traindx", *args],
        cwd=cwd,
        env=_env(env),
        text=True,
        capture_output=True,
        timeout=timeout,
        **kwargs,
    )


def diagnose_side_by_side(runs, cwd, env=None, timeout=600):
    """Several `diagnose <args>` at once, one per entry of runs (lists of arguments): arms whose
    speeds a test compares see the same machine, whatever its load (one after the other, they
    would measure the load's drift between them). Returns their CompletedProcesses, in order."""
    procs = [
        subprocess.Popen(
            [PY, "-m", "traindx", *args],
            cwd=cwd,
            env=_env(env),
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for args in runs
    ]
    done = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=timeout)
            done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return done


def recorded_runs(name, folder):
    """Extract tests/data/<name>.tar.xz (run folders recorded on the device, see its README)
    into folder; returns folder."""
    with tarfile.open(os.path.join(ROOT, "tests", "data", f"{name}.tar.xz")) as tar:
        tar.extractall(folder, filter="data")
    return folder


def recorded_runs_here(name, folder, recorded_root):
    """recorded_runs, then the paths of the checkout the runs were recorded in (recorded_root,
    their READMEs name it) pointed at this one in every text file, so that the jobs' files they
    name (frames, callers, the command) are this checkout's and their lines can be read."""
    recorded_runs(name, folder)
    for dirpath, _, files in os.walk(folder):  # the archive's top folders need not be its name
        for file in files:
            if file.endswith((".json", ".jsonl", ".txt", ".csv")):
                path = os.path.join(dirpath, file)
                with open(path, encoding="utf-8", errors="surrogateescape") as f:
                    text = f.read()
                if recorded_root in text:
                    with open(path, "w", encoding="utf-8", errors="surrogateescape") as f:
                        f.write(text.replace(recorded_root, ROOT))
    return folder


def only_run_dir(out_dir):
    runs = [os.path.join(out_dir, d) for d in os.listdir(out_dir)]
    assert len(runs) == 1, runs
    return runs[0]


# -- a launch config as newer FA4 releases pass one (a frozen dataclass holding another and an enum)
class TileOrder(enum.Enum):
    ROW = "row"
    LONGEST_FIRST = "lpt"


@dataclasses.dataclass(frozen=True)
class Registers:
    producer: int
    consumer: int


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    tile_m: int
    registers: Registers | None
    order: TileOrder = TileOrder.ROW
    split: int | None = None
