"""Judging bench/corpus.py's runs: the top root finding, its lines against the injected ones, its
prescription against what fits the cause; the tables."""

import json
import os
import re
import sys

from corpus_model import TWIN_CAUSES, USABLE_MODEL

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _num(v, digits=2):
    return "-" if v is None else f"{v:.{digits}f}"


def fix_table(rows):
    out = [
        "| script | cause | arms tried (mechanism:finding=speedup) | kept | speedup | significant "
        "| predicted vs measured step | error | fix.patch applies | patched copy vs kept arm, median step |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        err = "-" if r.get("error") is None else f"{r['error']:+.0%}"
        again = (
            f"{_num(r.get('patched_median_s'), 3)} vs {_num(r.get('kept_median_s'), 3)} s"
            if r.get("patched_median_s")
            else ("; ".join(r.get("apply") or [])[-60:] or "-")
        )
        out.append(
            f"| {r['script']} | {r['cause']} | {', '.join(r.get('arms') or []) or '-'} | "
            f"{r.get('kept')} | {_num(r.get('speedup'))}x | {_yn(r.get('significant'))} | "
            f"{_num(r.get('predicted_s'), 3)} vs {_num(r.get('measured_s'), 3)} s | {err} | "
            f"{_yn(r.get('patch_applies'))} | {again} |"
        )
    out.append(
        f"\n{sum(1 for r in rows if r.get('ok'))} of {len(rows)} right: a significant change "
        ">= 1.5x kept with parity, its patch (if any) applying to a clean copy; a healthy twin: no arm"
    )
    return "\n".join(out)


def _root_findings(run_dir):
    try:
        with open(os.path.join(run_dir, "findings.json")) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    items = data.get("findings", data) if isinstance(data, dict) else data
    return [
        f
        for f in items
        if isinstance(f, dict)
        and not f.get("cause")
        and not str(f.get("id", "")).startswith(("verdict.", "traindx.", "analysis."))
    ]


def _top(findings):
    above = [f for f in findings if f.get("severity") != "info"]
    return above[0] if above else None


def _lines_of(finding):
    text = (
        f"{finding.get('title')} {finding.get('summary')} "
        + json.dumps(finding.get("evidence") or {})
        + " "
        + json.dumps([p.get("change") for p in finding.get("prescriptions") or []])
    )
    return set(re.findall(r"([\w./-]+\.py)[\"']?[:, ]+(?:\"line\": )?(\d+)", text))


# what a usable prescription says for each cause
USABLE = {
    "read150": r"DataLoader|worker|async|cache|less often|prefetch",
    "odd_host": r"DataLoader|worker|async|cache|less often|GPU",
    "threads16": r"OMP_NUM_THREADS|set_num_threads",
    "save": r"less often|async|interval|every",
    "slow_getitem": r"num_workers",
    "anomaly": r"set_detect_anomaly\(False\)|switch_off:anomaly",
    "float64": r"set_default_dtype|switch_off:default_dtype",
    "gc_collect": r"gc\.collect|gc\.freeze|remove",
    "item": r"item",
    "keep_loss": r"\.item\(\)|\.detach\(\)",
    "running_sum": r"\.item\(\)|\.detach\(\)",
    "grid2": r"less often|async|every|thread",
    "recovery2": r"--recovery-interval",
    "eval_grad": r"no_grad|inference_mode",
    **USABLE_MODEL,
}


def judge(cause, run_dir, injected):
    """(top finding id, its line, right line?, usable prescription?) for one run."""
    found = _root_findings(run_dir)
    if found is None:
        return {"top": "(no findings.json)", "line": "", "line_ok": False, "usable": False, "ok": False}
    top = _top(found)
    if top is None:
        # .item() costs nothing on a CPU tensor; a save below 3 % of the step is worth no finding
        ok = cause in ("healthy", "item", *TWIN_CAUSES) or (cause == "save" and _io_share(run_dir) < 0.03)
        return {"top": "-", "line": "", "line_ok": ok, "usable": ok, "ok": ok}
    lines = _lines_of(top)
    line = ""
    line_ok = False
    if injected:
        f, span = injected.rsplit(":", 1)
        first, _, last = span.partition("-")
        base = os.path.basename(f)
        hits = [(p, ln) for p, ln in lines if os.path.basename(p) == base]
        line_ok = any(int(first) - 1 <= int(ln) <= int(last or first) + 1 for _, ln in hits)
        line = ", ".join(f"{os.path.basename(p)}:{ln}" for p, ln in sorted(hits)[:2])
    elif lines:
        p, ln = sorted(lines)[0]
        line = f"{os.path.basename(p)}:{ln}"
    pres = " ".join(
        f"{p.get('summary', '')} {p.get('command') or ''} {json.dumps(p.get('change'))}"
        for p in top.get("prescriptions") or []
    )
    gains = [p.get("expected_gain_s_per_step") for p in top.get("prescriptions") or []]
    positive = all(g is None or g > 0 for g in gains)
    usable = bool(cause in USABLE and re.search(USABLE[cause], pres)) and positive
    if cause == "recovery2":  # a setting: the job's flag, never a file under site-packages
        pres_text = json.dumps([p.get("change") for p in top.get("prescriptions") or []][:1])
        line_ok = "--recovery-interval" in pres_text and "site-packages" not in str(
            (top.get("prescriptions") or [{}])[0].get("summary")
        )
    if cause in ("threads16", "slow_getitem", "save") and not injected:
        line_ok = True  # a setting, not a line: the prescription says which
    if cause == "slow_getitem" and not line_ok:
        # the DataLoader's construction line is the place of the fix: the train loader's
        befores = [
            ((p.get("change") or {}).get("code") or {}).get("before") or ""
            for p in top.get("prescriptions") or []
        ]
        line_ok = any("DataLoader(" in b and not re.search(r"\b(val|test|eval)", b) for b in befores)
    if cause == "healthy" or cause in TWIN_CAUSES:
        usable = line_ok = False
    ok = line_ok and usable
    return {
        "top": top.get("id"),
        "line": line,
        "line_ok": line_ok,
        "usable": usable,
        "ok": ok,
        "severity": top.get("severity"),
        "seconds": top.get("seconds_lost_per_step"),
    }


def live_shown(run_dir):
    """What the live judgement printed while the job ran: {finding id: step on screen}, and
    the passes that ran (trigger, step), from live.json."""
    try:
        with open(os.path.join(run_dir, "live.json")) as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return None
    return {
        "shown": {k: v.get("step") for k, v in (doc.get("findings") or {}).items()},
        "passes": [(p.get("trigger"), p.get("step")) for p in doc.get("passes") or []],
        "cpu_s": doc.get("analysis_cpu_s"),
    }


def _live_text(r):
    live = r.get("live")
    if not live:
        return ""
    shown = live["shown"]
    return ", ".join(f"{k} at step {v}" for k, v in shown.items()) or "nothing"


def _io_share(run_dir):
    try:
        import traindx
        from traindx.derive import ledger

        led = ledger.steady_rows(traindx.load_run(run_dir))
        return float(led["io_s"].sum() / led["wall_s"].sum()) if len(led) else 1.0
    except Exception:
        return 1.0


def _healthy_step(run_dir):
    try:
        sys.path.insert(0, REPO)
        import traindx

        run = traindx.load_run(run_dir)
        led = run.ledger
        return float(led["wall_s"].median()) if len(led) else None
    except Exception:
        return None


def _yn(v):
    return "-" if v is None else ("yes" if v else "no")


def _fmt(r):
    return (
        f"{r['script']:<11} {r['cause']:<12} {str(r['top']):<34} {r.get('line') or '':<22} "
        f"{_yn(r.get('line_ok')):<5} {_yn(r.get('usable')):<5}"
    )


def table(rows):
    head = (
        "| script | cause | top finding | its line | right line | usable prescription | "
        "printed while it ran |"
    )
    out = [head, "|---|---|---|---|---|---|---|"]
    out.extend(
        f"| {r['script']} | {r['cause']} | {r['top']} | {r.get('line') or ''} | "
        f"{_yn(r.get('line_ok'))} | {_yn(r.get('usable'))} | {_live_text(r)} |"
        for r in rows
    )
    ok = [r for r in rows if r.get("ok") is not None]
    out.append(
        f"\n{sum(1 for r in ok if r['ok'])} of {len(ok)} right (cause named at its line or "
        "setting, with a usable prescription; healthy twins and .item() on CPU: silent)"
    )
    return "\n".join(out)
