"""Held-out traces made from the published ones: a different worker, stage or op type at fault.

Reads a published trace (trace-X.parquet + meta-X.yaml), replaces its recorded work by
  - worker=STAGE,DP,F   the old fault removed (every compute op at its type's typical work),
                        then that worker's compute x F
  - stage=STAGE,F       the same, then that stage's compute x F
  - optype=TYPE,P,F     the same, then a random P of that type's instances x F
replays it over the dependency model (new start times that respect every wait) and writes
trace-NAME.parquet and meta-NAME.yaml in the published format, for `diagnose analyze` and for
the paper's own simulator (its analyzer/wia.py, compute_ms.py, compute_mw.py) to compare.

    .venv/bin/python bench/whatif_perturb.py data/trace-AR.parquet --worker 2,3,1.8 --name ARw --out DIR
"""

import argparse
import os

import numpy as np
import pandas as pd
import yaml

from traindx.derive import optable, replay, whatif
from traindx.derive.optable import OpType
from traindx.profiler import straggler_trace


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--name", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--worker")
    ap.add_argument("--stage")
    ap.add_argument("--optype")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    tf = straggler_trace.read(a.trace)
    table = optable.normalize(tf.table)
    meta = tf.meta
    r = whatif.analyze(
        table, vpp=meta.get("vpp_size"), dp_sync=meta.get("dp_size", 1) * meta.get("dsp_size", 1) > 1
    )
    model, cube = r.sim["model"], r.sim["cube"]
    nodes = model.nodes
    optype = nodes["optype"].astype(str).to_numpy()
    stage = nodes["pp"].to_numpy()
    work = cube.work.copy()
    compute = np.isin(optype, OpType.COMPUTE)
    for o in OpType.COMPUTE:  # the stage split made even too: only the new fault stands
        sel = optype == o
        work[sel] = cube.work[sel].mean()
    rng = np.random.default_rng(a.seed)
    if a.worker:
        s, d, f = a.worker.split(",")
        work[(stage == int(s)) & compute, :, int(d)] *= float(f)
    if a.stage:
        s, f = a.stage.split(",")
        work[(stage == int(s)) & compute] *= float(f)
    if a.optype:
        o, p, f = a.optype.split(",")
        sel = optype == o
        hit = rng.random(work[sel].shape) < float(p)
        work[sel] = np.where(hit, work[sel] * float(f), work[sel])
    rep = replay.replay(model, work[:, None], keep=True)
    start, end = rep.start[:, 0], rep.end[:, 0]
    n, s_n, p_n = work.shape
    ranks = table.groupby(["dp", "pp"])["rank"].first()
    mb = table[table["dp"] == 0].groupby(["pp", "optype", "seq"], observed=True)["mb"].first()
    ii, ss, dd = np.meshgrid(np.arange(n), np.arange(s_n), np.arange(p_n), indexing="ij")
    ii, ss, dd = ii.ravel(), ss.ravel(), dd.ravel()
    out = pd.DataFrame(
        {
            "dp_rank": dd.astype(np.int8),
            "stage": stage[ii].astype(np.int8),
            "rank": ranks.reindex(pd.MultiIndex.from_arrays([dd, stage[ii]])).to_numpy().astype(np.int16),
            "step": cube.steps[ss].astype(np.int64),
            "optype": pd.Categorical(optype[ii]),
            "start_ts": start.ravel().astype(np.float32),
            "duration": (end - start).ravel().astype(np.float32),
            "seq_id": nodes["seq"].to_numpy()[ii].astype(np.int32),
            "mc": nodes["chunk"].to_numpy()[ii].astype(np.int8),
            "mb_id": mb.reindex(
                pd.MultiIndex.from_arrays([stage[ii], optype[ii], nodes["seq"].to_numpy()[ii]])
            )
            .fillna(-1)
            .to_numpy()
            .astype(np.int8),
            "gmc": nodes["gchunk"].to_numpy()[ii].astype(np.int16),
        }
    )
    os.makedirs(a.out, exist_ok=True)
    out.to_parquet(os.path.join(a.out, f"trace-{a.name}.parquet"))
    with open(os.path.join(a.out, f"meta-{a.name}.yaml"), "w") as f:
        yaml.safe_dump({**meta, "trial_name": a.name}, f)
    print(f"wrote {a.out}/trace-{a.name}.parquet ({len(out)} ops)")


if __name__ == "__main__":
    main()
