"""The HTML report: one self-contained file (inline CSS, JS and SVG; no network), rendered with
Jinja2 from report.data. Autoescape is on for every value; a Content-Security-Policy lets only
the report's own script run, so even an escaping bug could not run a job's string as code."""

from __future__ import annotations

import base64
import hashlib
import os
from collections.abc import Mapping
from functools import lru_cache
from importlib.metadata import version
from typing import TYPE_CHECKING, Any

from jinja2 import Environment, FileSystemLoader, StrictUndefined, select_autoescape
from markupsafe import Markup

from traindx.common.atomic import write_text
from traindx.report import charts, svg
from traindx.report.data import build_report_data
from traindx.report.step_chart import step_chart

if TYPE_CHECKING:
    from traindx.derive.run import RunRecord
    from traindx.judgement import Judgement

TEMPLATES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "templates")


@lru_cache(maxsize=1)
def _environment() -> Environment:
    env = Environment(
        loader=FileSystemLoader(TEMPLATES),
        autoescape=select_autoescape(default=True, default_for_string=True),
        undefined=StrictUndefined,
        trim_blocks=False,
        lstrip_blocks=False,
    )
    env.filters["fmt_s"] = svg.fmt_s
    return env


def _asset(name: str) -> str:
    with open(os.path.join(TEMPLATES, name), encoding="utf-8") as f:
        return f.read()


def _version() -> str:
    try:
        return version("traindx")
    except Exception:
        return "?"


def render_html(data: Mapping[str, Any]) -> str:
    """The report page for report data (from build_report_data)."""
    js = _asset("report.js")
    script_hash = "sha256-" + base64.b64encode(hashlib.sha256(js.encode("utf-8")).digest()).decode()
    drawn = {
        "steps": step_chart(data["timeline"], data["compiles"], data["stats"], data["causes"]),
        "steps_by_step": step_chart(
            data["timeline"], data["compiles"], data["stats"], data["causes"], by="step"
        ),
        "icicles": [charts.icicle(g["tree"]) for g in data["gil"]],
        "lanes": charts.thread_lanes(data["lanes"]),
        "gpu": charts.gpu_charts(data["gpu"], data["timeline"]),
        "heatmap": charts.rank_heatmap(data["timeline"]),
        "ledger": charts.ledger_chart(data.get("ledger")),
    }
    template = _environment().get_template("report.html.j2")
    # CSS and JS are ours, not the job's: inserted verbatim (Markup), so the hash stays exact
    return template.render(
        data=data,
        charts=drawn,
        css=Markup(_asset("report.css")),
        js=Markup(js),
        script_hash=script_hash,
        colours=svg.CAUSE_COLOURS,
        frame_colours=svg.FRAME_COLOURS,
        state_colours=svg.STATE_COLOURS,
        ledger_colours=svg.LEDGER_COLOURS,
        version=_version(),
    )


def write_report(
    run: RunRecord,
    judgement: Judgement,
    path: str | None = None,
    comparison: Mapping[str, Any] | None = None,
) -> str:
    """Render a judged run's runs/<id>/report.html (or `path`); returns the path written.

    comparison: an optional mapping from the --fix loop (arms side by side, speedup, parity…);
    whatever keys it has are shown in a 'Before and after' section."""
    data = build_report_data(run, judgement, comparison=comparison)
    html = render_html(data)
    write_text(path or os.path.join(run.path, "report.html"), html, user_path=path is not None)
    path = path or os.path.join(run.path, "report.html")
    return path
