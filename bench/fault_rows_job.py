"""Fault pass four, class "job": never harm the job (rows A01-A39 of docs/faults.md)."""

from __future__ import annotations

import os

from fault_rows import OURS, ROOT, SYSTEM_PY, Ctx, row

J = "$PY job.py"


def job(ctx: Ctx, text: str, name: str = "job.py") -> None:
    ctx.write(name, text)


@row("A01", "job", "diagnose -- ./train.sh (a shell script running Python, exit 3)", "exit 3, bytes as bare")
def a01(ctx: Ctx):
    ctx.write(
        "train.sh",
        '#!/bin/sh\necho start\n"$PY" -c \'import sys; print("py"); sys.exit(3)\'\nexit $?\n',
        0o755,
    )
    return ctx.same("./train.sh")


@row("A02", "job", "diagnose -- sh -c 'printf \"a\\0b\"; echo e >&2; exit 9'", "exit 9, NUL byte kept")
def a02(ctx: Ctx):
    return ctx.same("sh -c 'printf \"a\\0b\"; echo e >&2; exit 9'")


@row("A03", "job", "a job that SIGKILLs itself", "diagnose ends by SIGKILL, as the job bare (not exit 137)")
def a03(ctx: Ctx):
    job(ctx, "import os, signal\nprint('x', flush=True)\nos.kill(os.getpid(), signal.SIGKILL)\n")
    return ctx.same(J)


@row(
    "A04",
    "job",
    "a job that segfaults (ctypes.string_at(0))",
    "ends by SIGSEGV and the job's stderr, as bare",
)
def a04(ctx: Ctx):
    job(ctx, "import ctypes\nprint('before', flush=True)\nctypes.string_at(0)\n")
    return ctx.same(J)


@row(
    "A05",
    "job",
    "a job that raises KeyboardInterrupt itself",
    "ends by SIGINT (a shell loop stops) and its traceback, as bare",
)
def a05(ctx: Ctx):
    job(ctx, "raise KeyboardInterrupt\n")
    return ctx.same(J)


@row("A06", "job", "sys.exit(256), sys.exit(-1), sys.exit('msg')", "0, 255, 1 + msg, as bare")
def a06(ctx: Ctx):
    results = []
    for code in ("256", "-1", "'msg'"):
        job(ctx, f"import sys\nsys.exit({code})\n")
        results.append(ctx.same(J))
    return all(h for h, _ in results), "; ".join(s for _, s in results)


@row("A07", "job", "os._exit(4) from a thread while main sleeps", "exit 4 at once")
def a07(ctx: Ctx):
    job(
        ctx,
        "import os, threading, time\nthreading.Thread(target=lambda: os._exit(4)).start()\ntime.sleep(30)\n",
    )
    return ctx.same(J)


@row("A08", "job", "a non-daemon thread printing after main returns", "its lines, exit 0")
def a08(ctx: Ctx):
    job(
        ctx,
        "import threading, time\ndef late():\n    time.sleep(0.3)\n    print('late', flush=True)\n"
        "threading.Thread(target=late).start()\nprint('main done')\n",
    )
    return ctx.same(J)


@row("A09", "job", "a daemon thread printing while the interpreter exits", "exit 0, no line of ours")
def a09(ctx: Ctx):
    job(
        ctx,
        "import sys, threading, time\ndef spam():\n    while True:\n        sys.stderr.write('')\n        time.sleep(0.001)\n"
        "threading.Thread(target=spam, daemon=True).start()\ntime.sleep(0.2)\nprint('bye')\n",
    )
    return ctx.same(J)


@row("A10", "job", "a job that chdirs to sub/ and writes out.txt there", "sub/out.txt as bare")
def a10(ctx: Ctx):
    os.mkdir(ctx.path("sub"))
    job(ctx, "import os\nos.chdir('sub')\nopen('out.txt', 'a').write(os.getcwd() + '\\n')\n")

    def lines() -> str:  # read, then removed: each arm starts from none
        with open(ctx.path("sub", "out.txt")) as f:
            text = f.read()
        os.remove(ctx.path("sub", "out.txt"))
        return text

    return ctx.same(J, check=lines)


@row("A11", "job", "umask 077; diagnose -- job writing a file", "the job's umask and file mode as bare")
def a11(ctx: Ctx):
    job(
        ctx,
        "import os\nm = os.umask(0); os.umask(m)\nopen('f', 'w').close()\nprint(oct(m), oct(os.stat('f').st_mode))\nos.remove('f')\n",
    )
    return ctx.same(J, pre="umask 077; ")


@row(
    "A12",
    "job",
    f"a job that runs {SYSTEM_PY} (no traindx there)",
    "the child's output as bare, no line of ours",
)
def a12(ctx: Ctx):
    job(ctx, f"import subprocess\nsubprocess.run(['{SYSTEM_PY}', '-c', 'print(\"child ok\")'], check=True)\n")
    return ctx.same(J)


@row("A13", "job", "ulimit -n 512 -c 0 -s 4096; job prints its rlimits", "the same limits as bare")
def a13(ctx: Ctx):
    job(
        ctx,
        "import resource as r\nprint([r.getrlimit(getattr(r, n)) for n in ('RLIMIT_NOFILE', 'RLIMIT_CORE', 'RLIMIT_STACK', 'RLIMIT_NPROC', 'RLIMIT_AS')])\n",
    )
    return ctx.same(J, pre="ulimit -n 512; ulimit -c 0; ulimit -s 4096; ")


@row("A14", "job", "multiprocessing spawn Pool(2).map", "results and exit as bare")
def a14(ctx: Ctx):
    job(
        ctx,
        "import multiprocessing as mp\ndef sq(x):\n    return x * x\nif __name__ == '__main__':\n"
        "    with mp.get_context('spawn').Pool(2) as p:\n        print(p.map(sq, range(8)))\n",
    )
    return ctx.same(J)


@row("A15", "job", "multiprocessing forkserver child exiting 3", "exitcode 3 printed, as bare")
def a15(ctx: Ctx):
    job(
        ctx,
        "import multiprocessing as mp, sys\ndef f():\n    sys.exit(3)\nif __name__ == '__main__':\n"
        "    p = mp.get_context('forkserver').Process(target=f); p.start(); p.join(); print(p.exitcode)\n",
    )
    return ctx.same(J)


@row("A16", "job", "30 os.fork children, each os._exit(i % 3)", "statuses as bare, no hang")
def a16(ctx: Ctx):
    job(
        ctx,
        "import os\nst = []\nfor i in range(30):\n    pid = os.fork()\n    if pid == 0:\n        os._exit(i % 3)\n"
        "    st.append(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))\nprint(st)\n",
    )
    return ctx.same(J)


@row("A17", "job", "diagnose -- python - < job.py (the script on stdin)", "the script runs, as bare")
def a17(ctx: Ctx):
    job(ctx, "import sys\nprint('from stdin', sys.argv)\nsys.exit(2)\n")
    return ctx.same("$PY - a b < job.py")


@row("A18", "job", "argv '', 'a\\nb', '--', '-x', 'é', '\\xff', '*'", "sys.argv as bare")
def a18(ctx: Ctx):
    job(ctx, "import sys, os\nprint(ascii(sys.argv), ascii(os.fsencode(sys.argv[-2])))\n")
    return ctx.same("$PY job.py '' $'a\\nb' -- -x é $'\\xff' '*'")


@row("A19", "job", "diagnose -- python -m pkg (a local package)", "argv[0], __spec__ and exit as bare")
def a19(ctx: Ctx):
    ctx.write("pkg/__init__.py", "")
    ctx.write(
        "pkg/__main__.py",
        "import sys\nprint(sys.argv[0].endswith('__main__.py'), __spec__.name)\nsys.exit(6)\n",
    )
    return ctx.same("$PY -m pkg")


@row(
    "A20",
    "job",
    "the job's folder holds numbers.py, random.py, token.py, copy.py, json.py; the job imports them",
    "the job gets its own modules, as bare",
)
def a20(ctx: Ctx):
    for name in ("numbers", "random", "token", "copy", "json"):
        ctx.write(f"{name}.py", f"MINE = {name!r}\n")
    job(
        ctx,
        "import numbers, random, token, copy, json\nprint([getattr(m, 'MINE', 'stdlib') for m in (numbers, random, token, copy, json)])\n",
    )
    return ctx.same(J)


@row(
    "A21",
    "job",
    "echo old > f; diagnose -- job >> f (stdout a regular file)",
    "f keeps 'old', the job's stdout is a regular file, as bare",
)
def a21(ctx: Ctx):
    job(ctx, "import os, stat\nprint('isreg', stat.S_ISREG(os.fstat(1).st_mode))\n")
    return ctx.same(f"{J} >> f", pre="echo old > f; ", out_file="f")


@row("A22", "job", "diagnose -- job > /dev/full", "the job's write error (ENOSPC) and exit 1, as bare")
def a22(ctx: Ctx):
    job(ctx, "print('x' * 10)\n")
    return ctx.same(f"{J} > /dev/full")


@row(
    "A23",
    "job",
    "a job that closes fds 0-2 itself, then opens files (at 0, 1, 2)",
    "its files hold only its bytes, as bare",
)
def a23(ctx: Ctx):
    job(
        ctx,
        "import os, time\nfor fd in (0, 1, 2):\n    os.close(fd)\nfs = [open(f'f{i}', 'w') for i in range(3)]\n"
        "for f in fs:\n    f.write(f'{f.fileno()}\\n'); f.flush()\nx = [bytearray(10**6) for _ in range(50)]\ntime.sleep(1)\nimport gc; gc.collect()\n",
    )
    return ctx.same(J, check=lambda: "|".join(open(ctx.path(f"f{i}")).read() for i in range(3)))


@row("A24", "job", "diagnose -- python -W error job.py", "as bare (no warning of ours raised)")
def a24(ctx: Ctx):
    job(ctx, "import json, threading\nprint('ok')\n")
    return ctx.same("$PY -W error job.py")


@row("A25", "job", "diagnose -- python -X dev job.py", "stderr as bare (no ResourceWarning of ours)")
def a25(ctx: Ctx):
    job(ctx, "import time\nfor i in range(5):\n    time.sleep(0.1)\nprint('ok')\n")
    return ctx.same("$PY -X dev job.py")


@row("A26", "job", "diagnose -- python -S job.py (no site: no shim)", "exit and bytes as bare, no traceback")
def a26(ctx: Ctx):
    job(ctx, "import sys\nprint('nosite')\nsys.exit(4)\n")
    return ctx.same("$PY -S job.py")


@row("A27", "job", "a job with its own sys.setprofile counting calls", "the same count as bare")
def a27(ctx: Ctx):
    job(
        ctx,
        "import sys\nn = [0]\ndef prof(frame, event, arg):\n    if event == 'call' and frame.f_code.co_name == 'f':\n        n[0] += 1\n"
        "def f():\n    pass\nsys.setprofile(prof)\nfor _ in range(1000):\n    f()\nsys.setprofile(None)\nprint(n[0], sys.getprofile())\n",
    )
    return ctx.same(J)


@row("A28", "job", "a job with its own sys.excepthook and atexit", "its hook's line, atexit line, exit 1")
def a28(ctx: Ctx):
    job(
        ctx,
        "import atexit, sys\natexit.register(lambda: print('atexit ran'))\nsys.excepthook = lambda t, v, tb: print('my hook', t.__name__, file=sys.stderr)\nraise ValueError\n",
    )
    return ctx.same(J)


@row("A29", "job", "one 120 KB argument and a 100 KB environment variable", "lengths as bare")
def a29(ctx: Ctx):
    job(ctx, "import os, sys\nprint(len(sys.argv[1]), len(os.environ['BIG']))\n")
    ctx.write("arg", "a" * 120_000)  # one argument is at most 128 KiB (MAX_ARG_STRLEN)
    return ctx.same(f'{J} "$(cat arg)"', env={"BIG": "b" * 100_000})


@row(
    "A30",
    "job",
    "the job itself runs diagnose on a child (nested)",
    "the outer job's exit 6 and its child's bytes",
)
def a30(ctx: Ctx):
    job(
        ctx,
        "import subprocess, sys\nr = subprocess.run([sys.executable, '-m', 'traindx', '--quiet', '--no-pyspy', '--out', 'inner',"
        " '--', sys.executable, '-c', 'print(\"inner\"); raise SystemExit(6)'], stderr=subprocess.DEVNULL)\nsys.exit(r.returncode)\n",
    )
    return ctx.same(J)


@row("A31", "job", "a job with 300 threads", "exit 0 and bytes as bare")
def a31(ctx: Ctx):
    job(
        ctx,
        "import threading\nout = []\nts = [threading.Thread(target=out.append, args=(i,)) for i in range(300)]\n"
        "[t.start() for t in ts]; [t.join() for t in ts]\nprint(sum(out))\n",
    )
    return ctx.same(J)


@row("A32", "job", "sys.setrecursionlimit(80), then recursion 60 deep", "as bare (no RecursionError of ours)")
def a32(ctx: Ctx):
    job(
        ctx,
        "import sys\nsys.setrecursionlimit(80)\ndef r(n):\n    return 0 if n == 0 else 1 + r(n - 1)\nprint(r(60))\n",
    )
    return ctx.same(J)


@row(
    "A33",
    "job",
    "examples/train_tiny.py --steps 4 (torch, real steps)",
    "exit 0 and stdout as bare, but its printed times",
)
def a33(ctx: Ctx):
    cmd = f"$PY {ROOT}/examples/train_tiny.py --steps 4 --seq-len 32 --d-model 32"
    return ctx.same(cmd, digits=False)  # its lines hold times and dates: compared without digits


@row(
    "A34",
    "job",
    "TMPDIR=/nonexistent diagnose -- job",
    "the job runs as bare (its own tempfile error is its)",
)
def a34(ctx: Ctx):
    job(ctx, "print('ran')\n")
    return ctx.same(J, env={"TMPDIR": "/nonexistent/tmp"})


@row("A35", "job", "env -u HOME diagnose -- job", "as bare")
def a35(ctx: Ctx):
    job(ctx, "import os\nprint('HOME' in os.environ)\n")
    return ctx.same(f"env -u HOME {J}", pre="")


@row("A36", "job", "a job in a folder named 'd é x' run by a relative path", "argv[0], cwd and exit as bare")
def a36(ctx: Ctx):
    ctx.write("d é x/job.py", "import os, sys\nprint(ascii(sys.argv[0]), ascii(os.getcwd()))\nsys.exit(5)\n")
    return ctx.same("$PY job.py", pre="cd 'd é x' && ")


@row("A37", "job", "signal.signal(SIGCHLD, SIG_IGN) then subprocess.run", "as bare")
def a37(ctx: Ctx):
    job(
        ctx,
        "import signal, subprocess\nsignal.signal(signal.SIGCHLD, signal.SIG_IGN)\n"
        "try:\n    print(subprocess.run(['true']).returncode)\nexcept ChildProcessError as e:\n    print('ECHILD')\n",
    )
    return ctx.same(J)


@row(
    "A38",
    "job",
    "two diagnose runs at once in one folder, default ./runs",
    "two run folders, both exit codes",
)
def a38(ctx: Ctx):
    job(ctx, "import sys, time\ntime.sleep(0.5)\nsys.exit(int(sys.argv[1]))\n")
    p = ctx.sh(
        "$DX --quiet --no-pyspy -- $PY job.py 3 & p1=$!; $DX --quiet --no-pyspy -- $PY job.py 4 & p2=$!; "
        "wait $p1; a=$?; wait $p2; echo $a $?"
    )
    runs = sorted(os.listdir(ctx.path("runs"))) if os.path.isdir(ctx.path("runs")) else []
    ok = p.stdout.split()[-2:] == [b"3", b"4"] and len(runs) == 2 and not OURS.search(p.stderr)
    return ok, f"exits {p.stdout.split()[-2:]}, run folders {len(runs)}"


@row("A39", "job", "diagnose -- job > /dev/full (200 prints)", "the job's write fails, exit 1, as bare")
def a39(ctx: Ctx):
    job(
        ctx,
        "import time\nfor i in range(200):\n    print('x' * 100)\n    time.sleep(0.01)\nprint('done-all', file=__import__('sys').stderr)\n",
    )
    bare = ctx.sh(f"{J} > /dev/full")
    dx = ctx.sh(f"$DX --quiet --run-dir run -- {J} > /dev/full")
    ran_on = b"done-all" in dx.stderr
    ok = dx.returncode == bare.returncode == 1 and not ran_on
    return ok, f"exit {dx.returncode}, bare {bare.returncode}{'; the job ran to its end' if ran_on else ''}"
