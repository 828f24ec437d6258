"""What the output relay (profiler/tee.py) costs a job that prints a lot: the job's own time to
print N lines, bare (stdout a pipe drained by `cat`) and under `diagnose` (the relay writes
log.txt, redacted, and forwards each line to diagnose, which prints it).

usage: python bench/output_relay.py [--lines 200000] [--reps 3]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

JOB = """
import sys, time
n = int(sys.argv[1])
line = "step {} loss 0.1234 lr 3e-4 tokens/s 12345.6 " + "." * 40
t = time.perf_counter()
for i in range(n):
    print(line.format(i))
sys.stderr.write("PRINT_S %.6f\\n" % (time.perf_counter() - t))
"""


def _print_s(stderr):
    return float(next(x for x in stderr.splitlines() if x.startswith("PRINT_S")).split()[1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lines", type=int, default=200000)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    with tempfile.TemporaryDirectory() as tmp:
        job = os.path.join(tmp, "job.py")
        with open(job, "w") as f:
            f.write(JOB)
        bare, under = [], []
        for rep in range(a.reps):
            p = subprocess.run(
                f"{sys.executable} {job} {a.lines} | cat > /dev/null",
                shell=True,
                env=env,
                capture_output=True,
                text=True,
                check=True,
            )
            bare.append(_print_s(p.stderr))
            p = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "traindx",
                    "--quiet",
                    "--no-pyspy",
                    "--no-shim",
                    "--no-nvml",
                    "--run-dir",
                    os.path.join(tmp, f"run{rep}"),
                    "--",
                    sys.executable,
                    job,
                    str(a.lines),
                ],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
            under.append(_print_s(p.stderr))
        result = {
            "lines": a.lines,
            "bare_print_s": bare,
            "diagnose_print_s": under,
            "ratio_median": statistics.median(under) / statistics.median(bare),
            "relay_lines_per_s": a.lines / statistics.median(under),
        }
        print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
