"""The table of bench/gpu_unnamed_cases.sh: for each case's cause and twin run folder, the top
places, the findings (id, severity, saving) and the job's step median (as
bench/gpu_mechanism_table.py prints them); per case, which finding points at the cause's place
(its module path or its line, as the case's docstring names it), by which mechanism (the generic
place finding or a named one), its predicted saving against the twin's measured difference
(±30 %), and whether the twin stayed quiet (no root finding above low: a symptom shows under
its root).

usage: python bench/gpu_unnamed_table.py RUNS_DIR [CASE ...]
"""

import json
import os
import sys

from gpu_mechanism_table import show_run

# where each cause is, as a user would look for it: a module path part or a function of the job
WHERE = {
    "ema_loop": "update_loop",
    "clip_loop": "clip_by_loop",
    "attn_manual": "Attention",
    "mha_weights": "MultiheadAttention",
    "rmsnorm": "RMSNorm",
    "embed_dense": "Embedding",
    "sample_loss": "per_sample_loss",
    "cat_loop": "Stepper",
}
PLACES = ("gpu.recompute", "gpu.layout_nchw", "gpu.cast_in_autocast", "gpu.place_slow")
QUIET = ("info", "low", "note", None)
SKIP = ("gpu.places", "traindx.cost")


def _points_at(finding, marker):
    ev = finding.get("evidence") or {}
    text = json.dumps({k: ev.get(k) for k in ("module", "modules", "line", "lines", "site", "frames")})
    return marker in text or marker in str(finding.get("title"))


def judge(case, bad, bad_ms, good, good_ms):
    marker = WHERE.get(case, case)
    causes = [f for f in bad if f.get("id") not in SKIP and not str(f.get("id")).startswith("verdict.")]
    hits = [f for f in causes if _points_at(f, marker)]
    pick = max(hits, key=lambda f: f.get("seconds_lost_per_step") or 0.0, default=None)
    predicted = (pick or {}).get("seconds_lost_per_step")
    measured = (bad_ms - good_ms) / 1e3 if bad_ms and good_ms else None
    within = abs(predicted - measured) <= 0.3 * abs(measured) if predicted is not None and measured else None
    ev = (pick or {}).get("evidence", {})
    where = ev.get("line") or ev.get("module") or ", ".join(ev.get("modules") or []) or "-"
    headline = next((f.get("id") for f in causes if f.get("severity") not in QUIET), "-")
    loud = [
        f"{f.get('id')} [{f.get('severity')}]"
        for f in good
        if f.get("id") not in SKIP
        and f.get("severity") not in QUIET
        # a symptom shows under its root (analyzers/core/chains.py): not a finding of its own
        and not f.get("cause")
        and not str(f.get("id")).startswith("verdict.")
    ]
    kind = "-" if pick is None else ("place" if pick.get("id") in PLACES else "other analyzer")
    return (
        case,
        pick.get("id") if pick else "none",
        kind,
        str(where),
        headline,
        predicted,
        measured,
        within,
        loud,
    )


def main(argv):
    runs, cases = argv[0], argv[1:] or list(WHERE)
    rows = []
    for case in cases:
        bad, bad_ms = show_run(
            f"{case} (cause)", os.path.join(runs, f"{case}-bad"), os.path.join(runs, f"{case}-bad.out")
        )
        good, good_ms = show_run(
            f"{case} (twin)", os.path.join(runs, f"{case}-fixed"), os.path.join(runs, f"{case}-fixed.out")
        )
        rows.append(judge(case, bad, bad_ms, good, good_ms))
    print(
        "\n| case | finding at the cause | found by | where | headline | predicted ms | measured ms (cause - twin) "
        "| within ±30 % | twin above low |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for case, fid, kind, where, headline, predicted, measured, within, loud in rows:
        p = f"{predicted * 1e3:.2f}" if predicted is not None else "-"
        m = f"{measured * 1e3:.2f}" if measured is not None else "-"
        print(
            f"| {case} | {fid} | {kind} | {where[:60]} | {headline} | {p} | {m} | {within} | {', '.join(loud) or 'quiet'} |"
        )
    found = sum(1 for r in rows if r[1] != "none")
    by_place = sum(1 for r in rows if r[2] == "place")
    print(f"\nfound at their place: {found} of {len(rows)} ({by_place} by the places mechanism)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
