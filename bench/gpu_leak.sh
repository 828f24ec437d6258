#!/usr/bin/env bash
# Issue 36 item 4 on a GPU: tests/jobs/keep_loss.py on CUDA, the losses kept in a list with
# their graph, summed as tensors, and as numbers (the twin), under diagnose; then --fix on the
# summed one. traindx installed --no-deps into the machine's torch. Results in $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PY=${PY:-python3}
$PY -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 || tail -5 "$OUT/install.log"
R=/tmp/gpu_leak; rm -rf $R; mkdir -p $R; cp tests/jobs/keep_loss.py $R/
cd $R
for c in twin keep-graph sum-graph; do
  a=$([ $c = twin ] && echo "" || echo "--$c")
  timeout -k 5 120 $PY -m traindx --quiet --no-pyspy --steps 40 --run-dir $R/$c -- $PY keep_loss.py 50 --cuda $a > $R/$c.out 2>&1
  echo "== $c rc $?"
  $PY - "$R/$c" <<'PY'
import json, sys
for f in json.load(open(sys.argv[1] + "/findings.json")):
    if f["severity"] != "info" or f["id"] == "memory.growth":
        ev = f.get("evidence", {})
        print(f["id"], f["severity"], f["title"][:160], ev.get("memory"), ev.get("rate_mb_per_step"))
        for p in f["prescriptions"][:1]:
            print("   ", p["summary"][-120:], p.get("automatic"), (p.get("change") or {}).get("code", {}).get("after"))
PY
done
timeout -k 5 200 $PY -m traindx --fix --quiet --no-pyspy --steps 40 --run-dir $R/fix -- $PY keep_loss.py 50 --cuda --sum-graph > $R/fix.out 2>&1
echo "== fix rc $?"; grep -E "kept|tried|decided" $R/fix.out | head
cat $R/fix/fix.patch 2>/dev/null
(cd /tmp && tar czf "$OUT/gpu_leak.tgz" --exclude="*.speedscope.json" --exclude="*.pt.trace.json*" gpu_leak)
