"""Public training scripts, each with one injected slowdown, run under `diagnose`: does traindx
name the cause at the right line with a prescription a user can apply?

    python bench/corpus.py /work/corpus [--scripts wlm,mingpt,...] [--causes ...] [--steps 24]
                           [--load 2] [--out /tmp/corpus-runs] [--json results.json]
    python bench/corpus.py /work/corpus --fix [--fix-tries 2] ...   # diagnose --fix on each

`/work/corpus` holds the fetched scripts (NOT in this repository; fetch them yourself):
    wlm_main.py wlm_model.py wlm_data.py  pytorch/examples word_language_model/{main,model,data}.py
    minGPT/                                karpathy/minGPT (the whole repository)
    pl_transformer.py                      Lightning examples/pytorch/basics/transformer.py
    fabric_lm.py                           Lightning examples/fabric/language_model/train.py
    timm_train.py                          huggingface/pytorch-image-models train.py (with --site)
    ignite_mnist.py                        pytorch/ignite examples/mnist/mnist.py
    nanogpt_{train,model,configurator}.py  karpathy/nanoGPT train.py, model.py, configurator.py
    xt_enwik8.py                           lucidrains/x-transformers train_enwik8.py
Causes inside the model's own work (hook, metric_cb, lr0, outside, badaccum): bench/corpus_model.py;
the last two scripts and their edits: bench/corpus_more.py. The machinery: corpus_scripts.py (the
scripts), corpus_inject.py (the scratch copies), corpus_run.py (the runs), corpus_judge.py (right
or wrong, the tables).
This file holds none of their code: it copies them to a scratch folder, writes tiny synthetic
data beside them, and injects each cause by inserting a line into the scratch copy at a line
found by a pattern (the training loop's optimizer step, the dataset's __getitem__), so the
injected code sits in the user's own file, as a real slowdown would. The healthy twin is the
same copy with nothing inserted. `--load N` runs N CPU burners (`python -c 'while 1: pass'`)
beside every job. Every job runs with OMP_NUM_THREADS=1 except the thread cause.

`--fix` runs `diagnose --fix` instead and judges what a user keeps: was a candidate applied, the
kept arm's mechanism, speedup (as the loop judged it) and significance, predicted vs measured
step, and whether fix.patch applies with `git apply` to a clean copy of the slowed script.
"""

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from corpus_inject import prepare  # noqa: E402
from corpus_judge import _fmt, _healthy_step, _num, _yn, fix_table, judge, live_shown, table  # noqa: E402
from corpus_run import judge_fix, rejudge, run_diagnose, run_fix  # noqa: E402
from corpus_scripts import CAUSES, SCRIPTS, guard_torchvision  # noqa: E402


def _parser():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("corpus")
    ap.add_argument("--scripts", default=",".join(SCRIPTS))
    ap.add_argument("--causes", default=",".join(CAUSES))
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--load", type=int, default=0, help="CPU burners beside each job")
    ap.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "traindx-corpus"))
    ap.add_argument("--timeout", type=int, default=300)
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument(
        "--site",
        help="a folder named site-packages holding torchvision and timm (pip install --no-deps "
        "--target DIR/site-packages torchvision==0.28.0 timm): put first on the jobs' PYTHONPATH, "
        "torchvision's compiled-op registrations guarded (FACTS §9); the timm script needs it",
    )
    ap.add_argument("--keep", action="store_true", help="keep the scratch copies")
    ap.add_argument("--fix", action="store_true", help="run diagnose --fix on each slowed copy")
    ap.add_argument("--fix-tries", type=int, default=2)
    ap.add_argument(
        "--reproduce",
        action="store_true",
        help="with --fix: run the patched clean copy too (its median step vs the kept arm's)",
    )
    ap.add_argument(
        "--rejudge",
        metavar="ROWS_JSON",
        help="no new runs: re-analyse the runs of an earlier --json with this "
        "checkout (diagnose report --reanalyze) and judge them again",
    )
    ap.add_argument(
        "--judge-only",
        action="store_true",
        help="with --rejudge: judge the findings.json already there (no reanalysis)",
    )
    return ap


def _na_row(name, cause):
    return {
        "script": name,
        "cause": cause,
        "top": "n/a (not this script's cause)" if cause != "slow_getitem" else "n/a (no DataLoader)",
        "line": "",
        "line_ok": None,
        "usable": None,
        "ok": None,
    }


def _fix_row(a, corpus, script, cause, prep, busy_s):
    d, env, injected = prep
    fix_dir, wall = run_fix(d, script, env, a.steps, a.out, a.timeout, a.fix_tries)
    row = {
        "script": script.name,
        "cause": cause,
        "injected": injected,
        "run": fix_dir,
        "wall_s": round(wall, 1),
        "busy_s": busy_s,
    }
    reproduce = (env, a.steps, a.out, a.timeout) if a.reproduce else None
    row.update(judge_fix(corpus, script, cause, fix_dir, busy_s, reproduce=reproduce))
    print(
        f"{script.name:<11} {cause:<12} kept {row['kept']} {_num(row.get('speedup'))}x "
        f"patch {_yn(row.get('patch_applies'))} ({row['wall_s']} s)",
        flush=True,
    )
    return row


def _diagnose_row(a, script, cause, prep, busy_s):
    d, env, injected = prep
    run_dir, wall = run_diagnose(d, script, env, a.steps, a.out, a.timeout)
    row = {
        "script": script.name,
        "cause": cause,
        "injected": injected,
        "run": run_dir,
        "wall_s": round(wall, 1),
        "busy_s": busy_s,
        "source_dir": d,
    }
    row.update(judge(cause, run_dir, injected))
    row["live"] = live_shown(run_dir)
    print(_fmt(row), flush=True)
    return row


def _script_rows(a, corpus, work, script):
    """The rows of one script: each cause's scratch copy run (the healthy step, run first or
    on its own, sets the size of the injected host work)."""
    rows = []
    busy_s = None
    for cause in a.causes.split(","):
        if cause != "healthy" and busy_s is None:
            prep = prepare(corpus, script, "healthy", work, 0.0)
            run_dir, _ = run_diagnose(prep[0], script, prep[1], a.steps, a.out, a.timeout)
            busy_s = 0.5 * (_healthy_step(run_dir) or 0.1)
        prep = prepare(corpus, script, cause, work, busy_s or 0.05)
        if prep is None:
            rows.append(_na_row(script.name, cause))
        elif a.fix:
            rows.append(_fix_row(a, corpus, script, cause, prep, busy_s))
        else:
            rows.append(_diagnose_row(a, script, cause, prep, busy_s))
            if cause == "healthy":
                busy_s = 0.5 * (_healthy_step(rows[-1]["run"]) or 0.1)
    return rows


def main(argv=None):
    a = _parser().parse_args(argv)
    if a.site:
        guard_torchvision(os.path.abspath(a.site))
        os.environ["PYTHONPATH"] = os.pathsep.join(
            [os.path.abspath(a.site)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
        )
    if a.rejudge:
        return rejudge(a.rejudge, a.json, os.path.abspath(a.corpus), not a.judge_only)
    corpus = os.path.abspath(a.corpus)
    os.makedirs(a.out, exist_ok=True)
    work = tempfile.mkdtemp(prefix="corpus-src-", dir=a.out)
    burners = [subprocess.Popen([sys.executable, "-c", "while 1: pass"]) for _ in range(a.load)]
    rows = []
    try:
        for name in a.scripts.split(","):
            rows.extend(_script_rows(a, corpus, work, SCRIPTS[name]))
    finally:
        for b in burners:
            os.kill(b.pid, signal.SIGTERM)
            b.wait()
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
    print()
    print(fix_table(rows) if a.fix else table(rows))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
