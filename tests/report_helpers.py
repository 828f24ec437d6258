"""What the report test modules share: the repository's paths, diagnose in a subprocess, a page checked in a real browser."""

import os
import shutil
import subprocess
import sys

import pytest

from traindx.derive.run import load_run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYTHON = sys.executable
ARTIFACTS = os.path.join(ROOT, "test-artifacts")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def diagnose(run_dir, *job, options=(), env=None):
    cmd = [PYTHON, "-m", "traindx", "--quiet", "--run-dir", str(run_dir), *options, "--", *job]
    proc = subprocess.run(
        cmd, cwd=ROOT, capture_output=True, text=True, timeout=240, env={**os.environ, **(env or {})}
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return load_run(run_dir), proc


def _chromium_check(path, screenshot, expect_text=(), checks=None):
    """Open the report in headless Chromium: no console errors, the page's script ran, the key
    elements are drawn; keeps a full-page screenshot under test-artifacts/."""
    if not CHROMIUM:
        pytest.skip("chromium is not installed (.ci/run installs Debian's chromium)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright (the dev extra) drives Chromium")
    os.makedirs(ARTIFACTS, exist_ok=True)
    problems = []
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM,
            args=[
                "--no-sandbox",
                "--disable-gpu",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--no-first-run",
            ],
        )
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.on(
                "console", lambda m: m.type in ("error", "warning") and problems.append(f"{m.type}: {m.text}")
            )
            page.on("pageerror", lambda e: problems.append(f"pageerror: {e}"))
            page.on("dialog", lambda d: (problems.append(f"dialog: {d.message}"), d.dismiss()))
            requests = []
            page.on("request", lambda r: r.url.startswith("file://") or requests.append(r.url))
            page.goto("file://" + os.path.abspath(path))
            page.wait_for_selector("html[data-ready='1']", timeout=10_000)
            assert page.evaluate("window.__pwned") is None
            assert page.title() != "pwned" and page.title().startswith("traindx")
            assert page.inner_text("#verdict-headline").strip()
            assert page.locator("#step-chart rect.step").count() >= 1
            body = page.inner_text("body")
            for text in expect_text:
                assert text in body
            if checks:
                checks(page)
            page.screenshot(path=os.path.join(ARTIFACTS, screenshot), full_page=True)
        finally:
            browser.close()
    assert not problems, problems
    assert not requests, f"the report reached for the network: {requests}"
