"""What redaction costs: loading traindx/common/redact.py into a job's process the way the shim does
(once per process, at its start) and passing one log line through a Redactor (the launcher's
pump thread, once per line the job prints; never the job's own thread).

    OMP_NUM_THREADS=1 .venv/bin/python bench/redact_cost.py
"""

import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHIM = os.path.join(ROOT, "profiler", "shim")
LINES = [
    " [2026-12-01 10:34:58] iteration        7/       8 | consumed samples:           56 | elapsed "
    "time per iteration (ms): 8.7 | learning rate: 3.000000E-03 | global batch size:     8 | "
    "tokens per step: 256 | lm loss: 5.711099E+00 |",
    "step 3 loss 0.6711",
    "{'loss': 2.31, 'grad_norm': 1.2, 'learning_rate': 5e-05, 'epoch': 0.1}",
    "args: ['train.py', '--wandb_key', '0123456789abcdef0123456789abcdef01234567', '--lr', '0.1']",
]
LOAD = f"""
import os, sys, time
sys.path.insert(0, {SHIM!r})
from _traindx_shim.writer import load_redactor
t = time.perf_counter()
r = load_redactor(os.environ, sys.argv)
print((time.perf_counter() - t) * 1e3)
"""


def main():
    loads = [
        float(
            subprocess.run(
                [sys.executable, "-c", LOAD, "--hf_token=hf_x"], text=True, capture_output=True, check=True
            ).stdout
        )
        for _ in range(5)
    ]
    sys.path.insert(0, ROOT)
    from traindx.common.redact import Redactor

    r = Redactor.for_job(
        dict(os.environ, WANDB_API_KEY="f" * 40),
        ["train.py", "--wandb_key", "0123456789abcdef0123456789abcdef01234567"],
    )
    per_line = {}
    for line in LINES:
        n = 20000
        t = time.perf_counter()
        for _ in range(n):
            r.line(line)
        per_line[line[:40]] = round((time.perf_counter() - t) / n * 1e6, 2)
    print(
        json.dumps(
            {
                "load_ms_median_of_5": round(statistics.median(loads), 1),
                "load_ms_all": [round(x, 1) for x in loads],
                "us_per_line": per_line,
                "loadavg": os.getloadavg()[0],
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
