"""What-if predictions vs a balanced twin's measured speed-up, on pipeline jobs under torchrun
(gloo): one stage carries more layers than the others (bench/jobs/whatif_pipeline.py, a GPipe
schedule with blocking send/recv; `--device cuda` puts every stage on cuda:0; `--job pipelining`:
bench/jobs/whatif_pipelining.py, torch.distributed.pipelining's PipelineStage with its
Schedule1F1B or ScheduleGPipe, isend/irecv under the hood).

Each case runs its faulty arm and its balanced twin (the same layers in all, split evenly) side by
side (the same load on a shared machine), both under `diagnose` (the automatic what-if of a run of
several ranks writes its finding into findings.json), then `diagnose analyze RUN --what-if --json`
on each. Predicted speed-up: `balance_stages_speedup` (each compute op at its mean over the
stages); measured: the faulty arm's median step over the twin's (the longest rank's span, from
the spans).

    .venv/bin/python bench/whatif_pipeline.py [--repeat 1] [--out /tmp/whatif-pipe] [--device cpu]
    .venv/bin/python bench/whatif_pipeline.py --job pipelining [--schedule 1f1b|gpipe] --cases pp2-first-heavy
"""

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)
JOBS = {  # --job: the hand-written GPipe (blocking send/recv) or torch.distributed.pipelining
    "blocking": os.path.join(ROOT, "bench", "jobs", "whatif_pipeline.py"),
    "pipelining": os.path.join(ROOT, "bench", "jobs", "whatif_pipelining.py"),
}
CASES = {  # name: (faulty split, balanced split)
    "pp2-first-heavy": ("6,2", "4,4"),
    "pp2-last-heavy": ("2,6", "4,4"),
    "pp4-one-heavy": ("2,6,2,2", "3,3,3,3"),
}


def launch(run_dir, split, a, log):
    cmd = [os.path.join(BIN, "diagnose"), "--run-dir", run_dir, "--quiet"]
    cmd += ["--no-pyspy"] if not os.environ.get("TRAINDX_PYSPY") else []
    cmd += [
        "--",
        os.path.join(BIN, "torchrun"),
        "--nproc-per-node",
        str(len(split.split(","))),
        JOBS[a.job],
        "--split",
        split,
        "--steps",
        str(a.steps),
        "--micro-batches",
        str(a.micro_batches),
        "--rows",
        str(a.rows),
        "--width",
        str(a.width),
        "--layer-ms",
        str(a.layer_ms),
    ]
    cmd += ["--device", a.device] if a.job == "blocking" else ["--schedule", a.schedule]
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)


def whatif(run_dir):
    out = subprocess.run(
        [os.path.join(BIN, "diagnose"), "analyze", run_dir, "--what-if", "--json"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return json.loads(out)[0]


def auto_finding(run_dir):
    """The what-if finding `diagnose -- cmd` wrote itself (none: '-')."""
    with open(os.path.join(run_dir, "findings.json")) as fh:
        found = [f for f in json.load(fh) if f["id"].startswith("whatif.")]
    return f"{found[0]['id']} {found[0]['severity']}" if found else "-"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--layer-ms", type=float, default=2.0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--job", default="blocking", choices=list(JOBS))
    ap.add_argument("--schedule", default="1f1b", choices=("gpipe", "1f1b"), help="--job pipelining's")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--out", default="/tmp/whatif-pipe")
    ap.add_argument("--cases", nargs="*", default=list(CASES))
    ap.add_argument("--one-at-a-time", action="store_true", help="the twin after the faulty arm, not beside")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    print(f"load average at start: {os.getloadavg()[0]:.1f}")
    print(
        "| case | run | faulty step s | twin step s | measured speed-up | predicted | error | "
        "what-if (faulty / twin) | automatic in the run (faulty / twin) | stages found |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    ok = True
    for name in a.cases:
        bad, even = CASES[name]
        for k in range(a.repeat):
            faulty, twin = (os.path.join(a.out, f"{name}-{k}-{arm}") for arm in ("faulty", "twin"))
            with open(faulty + ".log", "w") as lf, open(twin + ".log", "w") as lt:
                p1 = launch(faulty, bad, a, lf)
                if a.one_at_a_time:
                    p1.wait()
                p2 = launch(twin, even, a, lt)
                failed = p1.wait() != 0 or p2.wait() != 0
            if failed:
                print(f"| {name} | {k} | failed (logs: {faulty}.log, {twin}.log) | | | | | | | |")
                ok = False
                continue
            f, t = whatif(faulty), whatif(twin)
            t_f = f["evidence"]["step_time_recorded_median_s"]
            t_t = t["evidence"]["step_time_recorded_median_s"]
            measured, predicted = t_f / t_t, f["evidence"]["balance_stages_speedup"]
            print(
                f"| {name} ({bad} vs {even}) | {k} | {t_f:.4f} | {t_t:.4f} | {measured:.2f} | "
                f"{predicted:.2f} | {(predicted - measured) / measured * 100:+.0f} % | "
                f"{f['id']} {f['severity']} / {t['id']} {t['severity']} | "
                f"{auto_finding(faulty)} / {auto_finding(twin)} | PP {f['evidence']['layout']['pp']} |",
                flush=True,
            )
    print(f"load average at end: {os.getloadavg()[0]:.1f}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
