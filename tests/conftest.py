"""Shared fixtures. FA4: the newest flash-attn-4 comes with the `fa4` extra; the buggy 4.0.0b17
(the seed case) is installed on demand into a cache folder that a job puts first on PYTHONPATH,
so CI exercises both releases."""

import contextlib
import fcntl
import glob
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))

# Every job the tests start (they inherit this environment) runs one intra-op thread: on the
# 2-core CI machine torch's default (a thread per core) makes a tiny job contend with the
# diagnose process, its samplers and the other test's job, and its steps slow down unevenly.
# A test about threads sets its own.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# a suite started in the background of a non-interactive shell (`pytest ... &`, nohup) inherits
# SIGINT ignored, and so would every job a test starts (Python keeps an inherited SIG_IGN): the
# Ctrl-C rows would test the caller's shell, not traindx. A handler of ours becomes the default
# in each child at exec.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
# the recorded runs under tests/data name this checkout's files in their frames (their READMEs)
# but were recorded on another machine: their source lines are read here as the user who copied
# their own run says so (traindx.common.untrusted.TRUST_ENV; test_faults_folder.py unsets it)
os.environ.setdefault("TRAINDX_TRUST_RUN", "1")

FA4_B17 = "4.0.0b17"
FA4_B17_DIR = os.environ.get("TRAINDX_TEST_FA4_B17_DIR") or os.path.join(TESTS, ".cache", "fa4-b17")


def fa4_available():
    """flash-attn-4 and the CuTe DSL are importable (the `fa4` extra is installed)."""
    return all(importlib.util.find_spec(m) is not None for m in ("flash_attn", "cutlass", "torch"))


def _b17_installed(folder):
    return os.path.isfile(os.path.join(folder, "flash_attn", "cute", "interface.py")) and any(
        n.startswith(f"flash_attn_4-{FA4_B17}") for n in os.listdir(folder)
    )


@pytest.fixture(scope="session")
def fa4_b17_path():
    """A folder holding flash-attn-4 4.0.0b17 alone (no dependencies: the venv's serve it), to
    put first on a job's PYTHONPATH. Installed with pip --target once, then reused."""
    if not fa4_available():
        pytest.skip("flash-attn-4 is not installed (pip install '.[fa4]')")
    if os.path.isdir(FA4_B17_DIR) and _b17_installed(FA4_B17_DIR):
        return FA4_B17_DIR
    os.makedirs(os.path.dirname(FA4_B17_DIR), exist_ok=True)
    # parallel workers (pytest -n) install it once: the first holds the lock, the others find it
    with open(FA4_B17_DIR + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _b17_installed(FA4_B17_DIR):
            return FA4_B17_DIR
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "-q",
                "--no-deps",
                "--target",
                FA4_B17_DIR,
                f"flash-attn-4=={FA4_B17}",
            ],
            capture_output=True,
            text=True,
            timeout=600,
        )
    if proc.returncode != 0 or not _b17_installed(FA4_B17_DIR):
        pytest.skip(f"could not install flash-attn-4=={FA4_B17}: {proc.stderr.strip()[-300:]}")
    return FA4_B17_DIR


# -- the suite in parallel (README's command: pytest -n 3) ----------------------------------------
# Three rules keep a parallel run as meaningful as a serial one, for tests written later too:
# tests that share a module-scoped fixture (one diagnose run checked for several things) go to
# one worker, so the run is made once; a test marked `serial` runs with no other test beside it
# (it loads the CPU on purpose or compares a quiet machine with a loaded one), after all others;
# slow tests start first, so the run does not end with one worker on a long test while the
# others idle.
# (xdist's own --dist loadgroup cannot group here: it renames items, which pytest 9.2 ignores.)


def _worker(config):
    """This process's xdist worker id, or None in the controller or a run without xdist."""
    return getattr(config, "workerinput", {}).get("workerid")


def _run_file(suffix):
    """A file of this run, shared by the controller and its workers (they inherit its env)."""
    run = os.environ.get("TRAINDX_TESTS_RUN", f"{os.getpid()}")
    return os.path.join(tempfile.gettempdir(), f"traindx-tests-{run}{suffix}")


# traindx's own packages (pyproject's package-dir), imported by every diagnose process and, for
# the shim, by every job process the suite starts
PACKAGES = ("traindx", "profiler", "analyzers", "kernel_cache", "recipes", "report")


def _compile_packages():
    """Bytecode for traindx's modules, once per run. With PYTHONDONTWRITEBYTECODE set (CI's
    environment) no process writes it, and every diagnose process compiled each module from its
    source again: ~0.25 s of CPU per run, hundreds of runs on two cores. compileall writes it
    whatever that setting says; up-to-date files cost one stat."""
    import compileall

    root = os.path.dirname(TESTS)
    for name in PACKAGES:
        with contextlib.suppress(OSError):
            compileall.compile_dir(os.path.join(root, name), quiet=2, workers=1)


def pytest_configure(config):
    if not _worker(config):
        os.environ["TRAINDX_TESTS_RUN"] = f"{os.getpid()}-{time.time_ns()}"
        _compile_packages()


def pytest_unconfigure(config):
    if not _worker(config):  # the run's unit map and lock files
        for path in glob.glob(_run_file("*")):
            with contextlib.suppress(OSError):
                os.remove(path)


def _shared_fixture_keys(item):
    """The module-, class- and package-scoped fixtures this test uses: one instance per worker."""
    info = getattr(item, "_fixtureinfo", None)
    keys = []
    for name in item.fixturenames:
        defs = info.name2fixturedefs.get(name) if info is not None else None
        if not defs or defs[-1].scope not in ("module", "class", "package"):
            continue
        where = (
            item.module.__name__
            if defs[-1].scope == "module" and hasattr(item, "module")
            else defs[-1].baseid
        )
        keys.append(f"{where}:{name}")
    mark = item.get_closest_marker("xdist_group")
    if mark is not None:  # a group named by the test itself joins the same unit
        keys.append(f"group:{mark.args[0] if mark.args else mark.kwargs.get('name', 'default')}")
    if item.get_closest_marker("serial"):
        keys.append("serial")  # back to back on one worker, which keeps the machine meanwhile
    return keys


def _units(items):
    """Tests joined (transitively) by a shared higher-scoped fixture, a group or `serial`:
    {nodeid: unit name} for the tests in a unit with others."""
    parent = {}

    def find(key):
        while parent.setdefault(key, key) != key:
            parent[key] = parent[parent[key]]
            key = parent[key]
        return key

    keys = {item: _shared_fixture_keys(item) for item in items}
    for item_keys in keys.values():
        for key in item_keys[1:]:
            parent[find(key)] = find(item_keys[0])
    return {item.nodeid: find(k[0]) for item, k in keys.items() if k}


@pytest.hookimpl(trylast=True)  # after -m/-k deselection
def pytest_collection_modifyitems(config, items):
    if not _worker(config):
        return
    units = _units(items)
    unit = {item: units.get(item.nodeid, item.nodeid) for item in items}
    # every worker sorts alike (xdist checks that the collections match): slow units first,
    # the serial unit last, each unit kept in collection order. Last, because a serial test
    # starts only when the tests beside it have ended: mid-run those are slow ones (tens of
    # seconds of idle workers while they drain); at the end only the last short ones are left
    slow = {u for item, u in unit.items() if item.get_closest_marker("slow")}
    serial = {u for item, u in unit.items() if item.get_closest_marker("serial")}
    first = {}
    for index, item in enumerate(items):
        first.setdefault(unit[item], index)
    items.sort(key=lambda item: (2 if unit[item] in serial else unit[item] not in slow, first[unit[item]]))
    # the controller schedules by unit (it sees node ids only)
    tmp = _run_file(f".units.{_worker(config)}")
    with open(tmp, "w") as f:
        json.dump(units, f)
    os.replace(tmp, _run_file(".units.json"))


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class UnitScheduling(LoadScopeScheduling):
        """xdist's scope scheduling, a scope being one of our units (or a test alone)."""

        units = None

        def _split_scope(self, nodeid):
            if self.units is None:
                try:
                    with open(_run_file(".units.json")) as f:
                        self.units = json.load(f)
                except (OSError, ValueError):
                    self.units = {}
            return self.units.get(nodeid, nodeid)

    config.option.loadscopereorder = False  # the workers' order: slow units first
    return UnitScheduling(config, log)


_held = {}  # this worker's exclusive hold, kept across back-to-back serial tests


@contextlib.contextmanager
def _alone_or_shared(alone, keep):
    """A readers-writer lock across the workers (flock): a serial test holds it alone, any
    other test shares it; a turnstile stops new sharers while a serial test waits."""
    if alone and "fd" in _held:
        fd = _held["fd"]
    else:
        turnstile = os.open(_run_file(".turnstile"), os.O_CREAT | os.O_RDWR)
        fd = os.open(_run_file(".lock"), os.O_CREAT | os.O_RDWR)
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        finally:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
            os.close(turnstile)
    try:
        yield
    finally:
        if alone and keep:
            _held["fd"] = fd
        else:
            _held.pop("fd", None)
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if not _worker(item.config):
        return (yield)
    alone = item.get_closest_marker("serial") is not None
    keep = alone and nextitem is not None and nextitem.get_closest_marker("serial") is not None
    with _alone_or_shared(alone, keep):
        return (yield)


# -- a real GPU run: the seed case recorded on an H200 (tests/data/h200-seed-b17-tensor), read by
# the report's tests (one copy per module that asks for it) --------------------------------------
H200_RUN = os.path.join(TESTS, "data", "h200-seed-b17-tensor")


@pytest.fixture(scope="module")
def h200_run(tmp_path_factory):
    if not os.path.isdir(H200_RUN):
        pytest.skip("the H200 run record is not in tests/data")
    dest = tmp_path_factory.mktemp("h200") / "run"
    shutil.copytree(H200_RUN, dest)
    from traindx.derive.run import load_run  # lazy: conftest is imported before every test module

    return load_run(dest)


# -- the seed case under --fix: FA4 4.0.0b17 with a tensor max_seqlen, recompiling every step ----
@pytest.fixture(scope="session")
def seed_fix(tmp_path_factory, fa4_b17_path):
    """`diagnose --fix` of examples/fa4_seed.py on 4.0.0b17 with a tensor max_seqlen, py-spy on:
    (root, fix folder, the kept arm's comparison, the process). Its baseline arm is also the
    plain recording test_jit.py's b17 tests judge (that was a diagnose run of its own, the same
    job): one seed run for both modules, whose tests carry xdist_group("fa4_seed_fix") so that
    one worker makes it."""
    from helpers import PY, diagnose, example  # lazy: conftest is imported before every test module

    root = tmp_path_factory.mktemp("seed-fix")
    fix_dir = root / "fix"
    env = {"PYTHONPATH": fa4_b17_path, "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR": str(root / "fa4-cache")}
    job = [example("fa4_seed.py"), "--steps", "20", "--max-seqlen-as", "tensor", "--threads", "1"]
    proc = diagnose(
        ["--fix", "--quiet", "--steps", "3", "--run-dir", str(fix_dir), "--", PY, *job],
        cwd=root,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    kept = json.loads((fix_dir / "fix.json").read_text())["best"]  # the arm --fix kept
    comparison = json.loads((fix_dir / os.path.basename(kept) / "comparison.json").read_text())
    return root, fix_dir, comparison, proc
