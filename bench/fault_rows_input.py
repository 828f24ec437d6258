"""Fault pass four, classes "files" (never harm the user's files, B rows), "input" (bad input to
every command, C rows) and "own" (traindx's own failures, D rows) of docs/faults.md."""

from __future__ import annotations

import json
import os
import stat
import tarfile
import time

from fault_rows import OURS, ROOT, SYSTEM_PY, Ctx, row, tree

CARD_RUN = os.path.join(ROOT, "tests", "data", "cpu-gc-hook", "run")  # a run with steps (read only)
JOB = "import sys\nprint('ran')\nsys.exit(3)\n"


def _job(ctx: Ctx) -> None:
    ctx.write("job.py", JOB)


# -- the user's files -------------------------------------------------------------------------
@row(
    "B01",
    "files",
    "diagnose --run-dir proj -- job (proj: the user's non-empty folder, not a run)",
    "refused in one line, proj unchanged",
)
def b01(ctx: Ctx):
    _job(ctx)
    ctx.write("proj/train.py", "x = 1\n")
    ctx.write("proj/data/a.csv", "1,2\n")
    before = tree(ctx.path("proj"))
    held, said = ctx.one_line("$DX --quiet --run-dir proj -- $PY job.py")
    after = tree(ctx.path("proj"))
    return held and before == after, said + ("" if before == after else f"; proj changed: {after}")


@row("B02", "files", "cd proj && diagnose --run-dir . -- job", "refused in one line, proj unchanged")
def b02(ctx: Ctx):
    ctx.write("proj/job.py", JOB)
    before = tree(ctx.path("proj"))
    held, said = ctx.one_line("cd proj && $DX --quiet --run-dir . -- $PY job.py")
    after = tree(ctx.path("proj"))
    return held and before == after, said + ("" if before == after else f"; proj changed: {after}")


@row(
    "B03",
    "files",
    "diagnose --out notes.txt -- job (a regular file)",
    "one line, exit 2, notes.txt unchanged",
)
def b03(ctx: Ctx):
    _job(ctx)
    ctx.write("notes.txt", "mine\n")
    held, said = ctx.one_line("$DX --quiet --out notes.txt -- $PY job.py")
    same = open(ctx.path("notes.txt")).read() == "mine\n"
    return held and same, said


@row(
    "B04",
    "files",
    "diagnose --out link -- job (link -> the user's folder elsewhere)",
    "the run made in the link's folder, the link kept, the job's exit",
)
def b04(ctx: Ctx):
    _job(ctx)
    os.mkdir(ctx.path("real"))
    os.symlink(ctx.path("real"), ctx.path("link"))
    p = ctx.sh("$DX --quiet --no-pyspy --out link -- $PY job.py")
    made = os.listdir(ctx.path("real"))
    ok = (
        p.returncode == 3
        and os.path.islink(ctx.path("link"))
        and len(made) == 1
        and not OURS.search(p.stderr)
    )
    return ok, f"exit {p.returncode}, runs in target {len(made)}, {p.stderr.decode()[-200:]!r}"


@row(
    "B05",
    "files",
    "diagnose --out dangling -- job (a link to nothing)",
    "one line or a run in its target, no traceback",
)
def b05(ctx: Ctx):
    _job(ctx)
    os.symlink(ctx.path("nowhere"), ctx.path("dangling"))
    p = ctx.sh("$DX --quiet --no-pyspy --out dangling -- $PY job.py")
    lines = [x for x in p.stderr.decode().splitlines() if x.strip()]
    ok = not OURS.search(p.stderr) and (p.returncode == 3 or (p.returncode == 2 and len(lines) == 1))
    return ok, f"exit {p.returncode}: {' | '.join(lines)[-200:]}"


def _outputs(ctx: Ctx, run: str, target: str) -> list[tuple[str, str]]:
    """Every option of a subcommand that writes a file the user names, aimed at target."""
    return [
        ("card", f"$DX card {CARD_RUN} --active-params 1e6 --tokens-per-step 64 -o {target}"),
        ("analyze -o", f"$DX analyze {run} -o {target}"),
        ("compare --json", f"$DX compare {run} {run}2 --json {target}"),
        ("report -o", f"$DX report {run} --quiet -o {target}"),
    ]


@row(
    "B06",
    "files",
    "card/analyze/compare/report -o NULL (a null char device, as /dev/null)",
    "written into the device; it stays a character device",
)
def b06(ctx: Ctx):
    run = ctx.run_dir()
    ctx.run_dir("done2")
    os.mknod(ctx.path("null"), 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    bad = []
    for what, cmd in _outputs(ctx, run, "null"):
        p = ctx.sh(cmd)
        if not stat.S_ISCHR(os.lstat(ctx.path("null")).st_mode) or p.returncode != 0:
            bad.append(
                f"{what}: exit {p.returncode}, null is {'a device' if stat.S_ISCHR(os.lstat(ctx.path('null')).st_mode) else 'now a regular file'}"
            )
            os.remove(ctx.path("null"))
            os.mknod(ctx.path("null"), 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    return not bad, "; ".join(bad) or "every output written into the device, still a device"


@row(
    "B07",
    "files",
    "card/analyze/compare/report -o out (out -> /proc/self/fd/1, as /dev/stdout)",
    "the output on stdout; the link stays a link",
)
def b07(ctx: Ctx):
    run = ctx.run_dir()
    ctx.run_dir("done2")
    bad = []
    for what, cmd in _outputs(ctx, run, "out"):
        if os.path.lexists(ctx.path("out")):
            os.remove(ctx.path("out"))
        os.symlink("/proc/self/fd/1", ctx.path("out"))
        p = ctx.sh(cmd + " > got")
        got = os.path.getsize(ctx.path("got"))
        if not os.path.islink(ctx.path("out")) or p.returncode != 0 or got < 20:
            bad.append(
                f"{what}: exit {p.returncode}, {got} bytes on stdout, link {'kept' if os.path.islink(ctx.path('out')) else 'replaced by a file'}"
            )
    return not bad, "; ".join(bad) or "every output on stdout, the link kept"


@row(
    "B08",
    "files",
    "report -o shared.html where shared.html is a hard link of the user's file",
    "either written through (both names) or refused; never a silent split",
)
def b08(ctx: Ctx):
    run = ctx.run_dir()
    ctx.write("mine.html", "old\n")
    os.link(ctx.path("mine.html"), ctx.path("shared.html"))
    p = ctx.sh(f"$DX report {run} --quiet -o shared.html")
    mine = open(ctx.path("mine.html")).read()
    shared = open(ctx.path("shared.html")).read()
    ok = p.returncode == 0 and mine == shared or (p.returncode != 0 and mine == "old\n")
    return (
        ok,
        f"exit {p.returncode}, the other name {'updated too' if mine == shared else 'left at the old text'}",
    )


@row(
    "B12",
    "files",
    "report -o private.html where private.html exists with mode 0600",
    "the report written, mode 0600 kept",
)
def b12(ctx: Ctx):
    run = ctx.run_dir()
    ctx.write("private.html", "old\n", 0o600)
    p = ctx.sh(f"$DX report {run} --quiet -o private.html")
    mode = oct(stat.S_IMODE(os.stat(ctx.path("private.html")).st_mode))
    ok = p.returncode == 0 and mode == "0o600" and os.path.getsize(ctx.path("private.html")) > 100
    return ok, f"exit {p.returncode}, mode {mode}"


def _ro(ctx: Ctx, folder: str, script: str) -> str:
    """script in a private mount namespace where folder is read-only (root bypasses modes)."""
    q = ctx.path(folder)
    return f"unshare -rm bash -c 'mount --bind {q} {q} && mount -o remount,bind,ro {q} && {script}'"


@row(
    "B09",
    "files",
    "cd ro && diagnose -- job (a read-only working folder, default ./runs)",
    "one line, non-zero, or the job run with the run elsewhere; no traceback",
)
def b09(ctx: Ctx):
    ctx.write("ro/job.py", JOB)
    p = ctx.sh(_ro(ctx, "ro", "cd ro && $DX --quiet --no-pyspy -- $PY job.py"))
    lines = [x for x in p.stderr.decode().splitlines() if x.strip()]
    ok = not OURS.search(p.stderr) and ((p.returncode == 2 and len(lines) == 1) or p.returncode == 3)
    return ok, f"exit {p.returncode}: {' | '.join(lines)[-240:]}"


@row(
    "B10",
    "files",
    "diagnose report RUN on a read-only run folder",
    "the report written or one line per file; nothing lost",
)
def b10(ctx: Ctx):
    run = ctx.run_dir()
    os.remove(os.path.join(run, "report.html"))
    before = tree(run)
    p = ctx.sh(_ro(ctx, "done", f"$DX report {run} --reanalyze --quiet"))
    ok = not OURS.search(p.stderr) and tree(run) == before
    return ok, f"exit {p.returncode}: {p.stderr.decode()[-240:]!r}"


@row(
    "B11",
    "files",
    "diagnose --fix -- sh job.sh (appends a line to ./log each run)",
    "./log holds at most one run's line; exit as bare",
)
def b11(ctx: Ctx):
    ctx.write("job.sh", "echo run >> log\nexit 0\n")
    p = ctx.sh("$DX --quiet --fix --run-dir fixrun -- sh job.sh", timeout=300)
    lines = open(ctx.path("log")).read().count("run") if os.path.exists(ctx.path("log")) else 0
    ok = lines <= 1 and p.returncode == 0 and not OURS.search(p.stderr)
    return ok, f"exit {p.returncode}, ./log has {lines} line(s): {p.stderr.decode()[-200:]!r}"


# -- bad input to every command ---------------------------------------------------------------
def _bad(
    rid: str, command: str, script: str, expected: str = "one line, non-zero exit", needs_run: bool = False
):
    @row(rid, "input", command, expected)
    def check(ctx: Ctx):
        if needs_run:
            ctx.run_dir()
        ctx.write("notes.txt", "text\n")
        os.mkdir(ctx.path("empty"))
        return ctx.one_line(script)

    return check


_bad("C01", "diagnose report (no RUN)", "$DX report")
_bad("C02", "diagnose report /etc (a folder that is no run)", "$DX report /etc")
_bad("C03", "diagnose report notes.txt (a file)", "$DX report notes.txt")
_bad("C04", "diagnose analyze empty/ (an empty folder)", "$DX analyze empty")
_bad("C05", "diagnose analyze list.json ([] as JSON)", "echo '[]' > list.json; $DX analyze list.json")
_bad(
    "C06",
    "diagnose analyze bad.speedscope.json (a speedscope file with wrong types)",
    'echo \'{"$schema": "https://www.speedscope.app/file-format-schema.json", "shared": {"frames": 5}, '
    '"profiles": "x"}\' > bad.speedscope.json; $DX analyze bad.speedscope.json',
)
_bad("C07", "diagnose compare RUN /etc", "$DX compare done /etc", needs_run=True)
_bad("C08", "diagnose merge RUN (a single-node run)", "$DX merge done", needs_run=True)
_bad("C09", "diagnose merge empty/", "$DX merge empty")
_bad("C10", "diagnose watch nowhere/ (no such folder)", "$DX watch nowhere")
_bad("C11", "diagnose watch notes.txt (a file)", "$DX watch notes.txt")
_bad(
    "C12",
    "diagnose attach --pid <a sleep, not Python> --duration 1",
    "sleep 20 & $DX attach --pid $! --duration 1 --out empty; s=$?; kill %1; exit $s",
)
_bad("C13", "diagnose attach --pid 4000000 (no such process)", "$DX attach --pid 4000000 --duration 1")
_bad("C14", "diagnose --log-regex '(' -- job (not a regex)", "$DX --log-regex '(' -- true")
_bad("C15", "diagnose --log-regex 'x' -- job (no named group)", "$DX --log-regex 'x' -- true")
_bad("C16", "diagnose -- '' (an empty command)", "$DX -- ''")
_bad("C17", "kernel-cache (no subcommand)", "$PY -m traindx.kernel_cache.cli.main")
_bad(
    "C18",
    "kernel-cache unpack notes.txt (not an archive)",
    "$PY -m traindx.kernel_cache.cli.main unpack --cache-dir empty notes.txt",
)
_bad(
    "C19",
    "kernel-cache pack empty/ (a folder as the pack file)",
    "$PY -m traindx.kernel_cache.cli.main pack --cache-dir empty empty",
)
_bad("C20", "diagnose card RUN (no --active-params, no model)", f"$DX card {CARD_RUN} -o c.yaml")


@row("C21", "input", "diagnose watch RUN (a finished run)", "exits at once, exit 0, no traceback")
def c21(ctx: Ctx):
    run = ctx.run_dir()
    started = time.monotonic()
    p = ctx.sh(f"$DX watch {run}", timeout=60)
    took = time.monotonic() - started
    ok = p.returncode == 0 and took < 30 and not OURS.search(p.stderr)
    return ok, f"exit {p.returncode} after {took:.0f} s"


@row(
    "C22",
    "input",
    "diagnose --step-marker nosuchmodule:f -- job",
    "the job's exit and bytes, one line said of the marker",
)
def c22(ctx: Ctx):
    _job(ctx)
    return ctx.same("$PY job.py", flags="--quiet --step-marker nosuchmodule:f")


@row(
    "C23",
    "input",
    "kernel-cache unpack evil.tar (a member ../escape)",
    "refused in one line, nothing outside written",
)
def c23(ctx: Ctx):
    with open(ctx.path("payload"), "w") as f:
        f.write("x")
    with tarfile.open(ctx.path("evil.tar"), "w") as t:
        t.add(ctx.path("payload"), arcname="../escape")
    os.mkdir(ctx.path("cache"))
    held, said = ctx.one_line("$PY -m traindx.kernel_cache.cli.main unpack --cache-dir cache/sub evil.tar")
    escaped = os.path.exists(ctx.path("cache", "escape")) or os.path.exists(ctx.path("escape"))
    return held and not escaped, said + ("; ../escape written" if escaped else "")


@row("C24", "input", "diagnose card RUN -o full/c.yaml on a full disk", "one line, non-zero, no .tmp left")
def c24(ctx: Ctx):
    script = (
        f"unshare -rm bash -c 'mount -t tmpfs -o size=4k none {ctx.path('empty')} && "
        f"head -c 3000 /dev/zero > {ctx.path('empty', 'fill')}; "
        f"$DX card {CARD_RUN} --active-params 1e6 --tokens-per-step 64 -o {ctx.path('empty', 'c.yaml')}; s=$?; "
        f"ls -a {ctx.path('empty')} 1>&2; exit $s'"
    )
    os.makedirs(ctx.path("empty"), exist_ok=True)
    p = ctx.sh(script)
    lines = [x for x in p.stderr.decode().splitlines() if x.strip() and x not in (".", "..", "fill")]
    ok = p.returncode != 0 and len(lines) == 1 and not OURS.search(p.stderr)
    return ok, f"exit {p.returncode}: {' | '.join(lines)[-240:]}"


# -- traindx's own failures -------------------------------------------------------------------
def _fake_pyspy(ctx: Ctx, body: str) -> dict[str, str]:
    ctx.write("fake-py-spy", "#!/bin/sh\n" + body, 0o755)
    return {"TRAINDX_PYSPY": ctx.path("fake-py-spy")}


@row(
    "D01",
    "own",
    "TRAINDX_PYSPY=/nonexistent diagnose -- job",
    "the job's exit and bytes; py-spy named as not collected",
)
def d01(ctx: Ctx):
    ctx.write("job.py", "import time, sys\ntime.sleep(0.5)\nprint('ran')\nsys.exit(3)\n")
    return ctx.same("$PY job.py", env={"TRAINDX_PYSPY": "/nonexistent/py-spy"})


@row("D02", "own", "a py-spy that exits 1 at once with garbage on stderr", "the job's exit and bytes")
def d02(ctx: Ctx):
    ctx.write("job.py", "import time, sys\ntime.sleep(0.5)\nprint('ran')\nsys.exit(3)\n")
    return ctx.same("$PY job.py", env=_fake_pyspy(ctx, "printf '\\033[2J\\377garbage\\n' >&2\nexit 1\n"))


@row(
    "D03",
    "own",
    "a py-spy that ignores SIGTERM and never exits",
    "diagnose ends soon after the job, its exit",
)
def d03(ctx: Ctx):
    ctx.write("job.py", "import time, sys\ntime.sleep(0.5)\nprint('ran')\nsys.exit(3)\n")
    started = time.monotonic()
    held, said = ctx.same("$PY job.py", env=_fake_pyspy(ctx, "trap '' TERM INT\nwhile :; do sleep 1; done\n"))
    took = time.monotonic() - started
    return held and took < 90, f"{said}; both arms took {took:.0f} s"


@row(
    "D04",
    "own",
    "a py-spy that writes garbage where its recording goes",
    "the job's exit; the report made, one warning line",
)
def d04(ctx: Ctx):
    ctx.write("job.py", "import time, sys\ntime.sleep(0.5)\nprint('ran')\nsys.exit(3)\n")
    body = 'for a in "$@"; do case "$prev" in -o|--output) head -c 3000 /dev/urandom > "$a";; esac; prev="$a"; done\nexit 0\n'
    held, said = ctx.same("$PY job.py", env=_fake_pyspy(ctx, body))
    report = os.path.exists(ctx.path("run", "report.html"))
    return held and report, said + ("" if report else "; no report")


@row(
    "D05",
    "own",
    f"diagnose -- {SYSTEM_PY} job.py (the shim under another interpreter)",
    "the job's exit and bytes",
)
def d05(ctx: Ctx):
    _job(ctx)
    return ctx.same(f"{SYSTEM_PY} job.py")


@row(
    "D06",
    "own",
    "LD_LIBRARY_PATH holds a garbage libnvidia-ml.so.1",
    "the job's exit and bytes; NVML not collected",
)
def d06(ctx: Ctx):
    _job(ctx)
    os.mkdir(ctx.path("lib"))
    with open(ctx.path("lib", "libnvidia-ml.so.1"), "wb") as f:
        f.write(b"\x7fELF garbage" * 50)
    return ctx.same("$PY job.py", env={"LD_LIBRARY_PATH": ctx.path("lib")})


@row(
    "D07",
    "own",
    "the job's folder holds a torch.py that raises ImportError",
    "the job's own traceback and exit 1, as bare",
)
def d07(ctx: Ctx):
    ctx.write("torch.py", "raise ImportError('broken torch')\n")
    ctx.write("job.py", "import torch\n")
    return ctx.same("$PY job.py")


@row(
    "D08",
    "own",
    "the job's folder holds a fake torch.py (no nn, no optim)",
    "the job's bytes and exit, as bare",
)
def d08(ctx: Ctx):
    ctx.write("torch.py", "__version__ = 'fake'\ndef randn(*a):\n    return 0\n")
    ctx.write("job.py", "import torch\nprint(torch.__version__, torch.randn(2))\n")
    return ctx.same("$PY job.py")


@row(
    "D09",
    "own",
    "a run whose manifest.json is valid JSON of another shape ([])",
    "report: one warning at most, a report",
)
def d09(ctx: Ctx):
    run = ctx.run_dir()
    with open(os.path.join(run, "manifest.json"), "w") as f:
        json.dump([], f)
    p = ctx.sh(f"$DX report {run} --reanalyze --quiet")
    ok = p.returncode == 0 and not OURS.search(p.stderr)
    return ok, f"exit {p.returncode}: {p.stderr.decode()[-240:]!r}"
