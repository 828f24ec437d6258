"""The table of bench/gpu_mechanism_cases.sh: for each case's cause and twin run folder, the top
places (gpu.places' evidence), the findings (id, severity, saving), the job's measured step median
(its own `ms` lines, steps 10 on); per case, whether the mechanism was named, at which module,
its predicted saving against the twin's measured difference, and whether the twin stayed quiet.

usage: python bench/gpu_mechanism_table.py RUNS_DIR [CASE ...]
"""

import json
import os
import re
import statistics
import sys

# the mechanism each case's cause should be found by (the generic place finding also counts)
EXPECTED = {"checkpoint": "gpu.recompute", "nchw": "gpu.layout_nchw", "cast": "gpu.cast_in_autocast"}
MECHANISMS = ("gpu.recompute", "gpu.layout_nchw", "gpu.cast_in_autocast", "gpu.place_slow")
_STEP = re.compile(r"^step (\d+) .* ms ([0-9.]+)")


def step_median_ms(out_path):
    steps = {}
    try:
        with open(out_path, encoding="utf-8", errors="replace") as f:
            for line in f:
                m = _STEP.match(line)
                if m:
                    steps[int(m.group(1))] = float(m.group(2))
    except OSError:
        return None
    # steps 10 on (warm-up and the profiler window left out); a short CPU check: its second half
    first = min(10, max(steps, default=0) // 2)
    values = [ms for step, ms in steps.items() if step >= first]
    return statistics.median(values) if values else None


def findings(run_dir):
    try:
        with open(os.path.join(run_dir, "findings.json"), encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return []


def show_run(name, run_dir, out_path):
    found = findings(run_dir)
    median = step_median_ms(out_path)
    print(f"\n### {name}: step median {median:.2f} ms" if median else f"\n### {name}: no step times")
    note = next((f for f in found if f.get("id") == "gpu.places"), None)
    for r in (note or {}).get("evidence", {}).get("places", [])[:6]:
        need = f" needs {r['need_s'] * 1e3:.2f} ms" if r.get("need_s") else ""
        share = f" ({r['share']:.0%})" if r.get("share") is not None else ""
        print(
            f"  place {r['module']} {r['phase']}: GPU {r['gpu_s'] * 1e3:.2f} ms{share}, "
            f"host {r['host_s'] * 1e3:.2f} ms{need} · {r.get('line') or '-'} · {r.get('top_kernel') or '-'}"
        )
    if note is None:
        print("  (no places: no profiler window with GPU work)")
    for f in found:
        if f.get("id") in ("gpu.places",):
            continue
        saving = f.get("seconds_lost_per_step")
        saving_text = f"{saving * 1e3:.2f} ms" if isinstance(saving, (int, float)) else "-"
        print(
            f"  finding {f.get('id')} [{f.get('severity')}] saving {saving_text}: {str(f.get('title'))[:150]}"
        )
    return found, median


def main(argv):
    runs, cases = argv[0], argv[1:] or list(EXPECTED)
    rows = []
    for case in cases:
        bad, bad_ms = show_run(
            f"{case} (cause)", os.path.join(runs, f"{case}-bad"), os.path.join(runs, f"{case}-bad.out")
        )
        good, good_ms = show_run(
            f"{case} (twin)", os.path.join(runs, f"{case}-fixed"), os.path.join(runs, f"{case}-fixed.out")
        )
        hits = [f for f in bad if f.get("id") in MECHANISMS]
        named = next((f for f in hits if f.get("id") == EXPECTED.get(case)), None)
        pick = named or max(hits, key=lambda f: f.get("seconds_lost_per_step") or 0.0, default=None)
        predicted = (pick or {}).get("seconds_lost_per_step")
        measured = (bad_ms - good_ms) / 1e3 if bad_ms and good_ms else None
        within = (
            abs(predicted - measured) <= 0.3 * abs(measured) if predicted is not None and measured else None
        )
        ev = (pick or {}).get("evidence", {})
        where = ev.get("module") or ", ".join(ev.get("modules") or []) or "-"
        loud = [f.get("id") for f in good if f.get("id") in MECHANISMS]
        rows.append(
            (case, pick.get("id") if pick else "none", bool(named), where, predicted, measured, within, loud)
        )
    print(
        "\n| case | finding | mechanism named | where | predicted ms | measured ms (cause - twin) | within ±30 % | twin's mechanism findings |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for case, fid, named, where, predicted, measured, within, loud in rows:
        p = f"{predicted * 1e3:.2f}" if predicted is not None else "-"
        m = f"{measured * 1e3:.2f}" if measured is not None else "-"
        print(
            f"| {case} | {fid} | {'yes' if named else 'no'} | {where[:60]} | {p} | {m} | {within} | {', '.join(loud) or 'quiet'} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
