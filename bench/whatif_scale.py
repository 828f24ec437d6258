"""Scale of the what-if replay: a synthetic op table of DP x PP x TP ranks x steps (default
16,384 ranks = DP 512 x PP 4 x TP 8, 100 steps, 4 micro-batches, one slow worker), analysed end
to end (dependency model, replay, ideal, attribution over every DP rank and stage, M_W, M_S).

    .venv/bin/python bench/whatif_scale.py [--dp 512 --pp 4 --tp 8 --steps 100 --mb 4]

Prints rows, seconds per phase and the peak resident memory. Goal: <= 300 s on 2 cores.
"""

import argparse
import resource
import sys
import time

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import whatif_synth  # noqa: E402

from traindx.analyzers.ranks.whatif import category  # noqa: E402
from traindx.derive import optable, whatif  # noqa: E402
from traindx.profiler.straggler_trace import RENAMES  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dp", type=int, default=512)
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--mb", type=int, default=4)
    a = ap.parse_args()
    t0 = time.time()
    raw = whatif_synth.make(
        dp=a.dp,
        pp=a.pp,
        mb=a.mb,
        steps=a.steps,
        tp=a.tp,
        with_tp_column=True,
        slow_worker=(1, 7, 1.5),
        noise=0.005,
    )
    t1 = time.time()
    table = optable.normalize(raw.rename(columns=RENAMES))
    del raw
    t2 = time.time()
    r = whatif.analyze(table)
    t3 = time.time()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(
        f"ranks={a.dp * a.pp * a.tp} steps={a.steps} rows={len(table):,} generate={t1 - t0:.1f}s "
        f"normalize={t2 - t1:.1f}s analyze={t3 - t2:.1f}s (normalize+analyze {t3 - t1:.1f}s) peak_rss={peak:,.0f} MiB "
        f"S={r.slowdown:.3f} M_W={r.m_w:.2f} category={category(r)}"
    )


if __name__ == "__main__":
    main()
