"""README's test command runs the suite on xdist workers (tests/conftest.py): a module-scoped
fixture is made once for all the tests that share it, a `serial` test has the machine to itself,
slow tests start first, the serial ones last. Checked on an inner pytest session of tests
written for the purpose."""

import os

import pytest

pytest.importorskip("xdist")
pytest_plugins = ["pytester"]

CONFTEST = os.path.join(os.path.dirname(os.path.abspath(__file__)), "conftest.py")

SHARED = """
import os, time, pytest

def log(what):
    with open(os.environ["SUITE_LOG"], "a") as f:
        f.write(f"{what} {os.getpid()} {time.monotonic()}\\n")

@pytest.fixture(scope="module")
def made_once():
    log("setup")
    return os.getpid()

@pytest.fixture(scope="module")
def other(made_once):
    return made_once

def test_a(made_once):
    time.sleep(0.3)
    assert made_once == os.getpid()

def test_b(other):
    time.sleep(0.3)
    assert other == os.getpid()

@pytest.mark.slow
def test_c(made_once):
    assert made_once == os.getpid()
"""

SERIAL = """
import os, time, pytest

def span(name, seconds):
    start = time.monotonic()
    time.sleep(seconds)
    with open(os.environ["SUITE_LOG"], "a") as f:
        f.write(f"span {name} {start} {time.monotonic()} {os.getpid()}\\n")

@pytest.mark.serial
def test_burner_one():
    span("serial", 1.0)

@pytest.mark.serial
def test_burner_two():
    span("serial", 1.0)

@pytest.mark.parametrize("i", range(8))
def test_plain(i):
    span("plain", 0.4)

@pytest.mark.slow
def test_long():
    span("slow", 0.2)
"""


@pytest.mark.slow  # an inner xdist session of three workers (~10 s on 2 busy cores)
def test_shared_fixtures_serial_tests_and_slow_first_under_xdist(pytester, tmp_path, monkeypatch):
    log = tmp_path / "log.txt"
    monkeypatch.setenv("SUITE_LOG", str(log))
    for name in (
        "PYTEST_XDIST_WORKER",
        "PYTEST_XDIST_WORKER_COUNT",
        "PYTEST_XDIST_TESTRUNUID",
        "TRAINDX_TESTS_RUN",
    ):  # this test may itself run on a worker of the suite
        monkeypatch.delenv(name, raising=False)
    with open(CONFTEST, encoding="utf-8") as f:
        pytester.makeconftest(f.read())
    pytester.makeini("[pytest]\nmarkers =\n    slow: slow\n    serial: alone\n    fa4: fa4\n")
    pytester.makepyfile(test_shared=SHARED, test_serial=SERIAL)
    result = pytester.runpytest_subprocess("-n", "3", "-p", "xdist", "-v")
    result.assert_outcomes(passed=14)
    lines = [line.split() for line in log.read_text().splitlines()]
    # the module fixture was made once, for the three tests that share it (one through another
    # fixture), in the worker that ran them all
    assert [l[0] for l in lines].count("setup") == 1
    spans = [(l[1], float(l[2]), float(l[3])) for l in lines if l[0] == "span"]
    pids = {(l[1], float(l[2])): l[4] for l in lines if l[0] == "span"}
    serial = [s for s in spans if s[0] == "serial"]
    others = [s for s in spans if s[0] != "serial"]
    assert len(serial) == 2 and len(others) == 9
    # nothing ran beside a serial test
    for _, start, end in serial:
        assert all(e <= start or s >= end for _, s, e in others), (serial, others)
    # the serial unit comes last in its worker's order: nothing ran there after it
    serial_pid = {pids[s[0], s[1]] for s in serial}
    assert len(serial_pid) == 1
    assert all(s < min(st for _, st, _ in serial) for name, s, _ in others if pids[name, s] in serial_pid), (
        serial,
        others,
    )
    # the plain tests did run side by side (three workers)
    plain = sorted(s for s in others if s[0] == "plain")
    assert any(b[1] < a[2] for a, b in zip(plain, plain[1:])), plain
    # slow tests first: the slow one started before the last plain test
    slow = next(s for s in others if s[0] == "slow")
    assert slow[1] < max(s[1] for s in plain)
