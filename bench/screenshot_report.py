"""Render a run's report and take a screenshot of it in headless Chromium (docs/ figures).

usage: python bench/screenshot_report.py RUN_DIR OUT.png [--height 1600]
"""

import argparse
import shutil
import sys

from playwright.sync_api import sync_playwright

from traindx.derive.run import load_run
from traindx.report.outputs import analyze_and_write


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("run")
    p.add_argument("out")
    p.add_argument("--height", type=int, default=1600)
    a = p.parse_args(argv)
    _, report = analyze_and_write(load_run(a.run))
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    with sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=chromium,
            args=[
                "--no-sandbox",
                "--disable-gpu",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--no-first-run",
            ],
        )
        page = browser.new_page(viewport={"width": 1280, "height": a.height})
        page.goto("file://" + report)
        page.wait_for_timeout(500)
        page.screenshot(path=a.out, full_page=False)
        browser.close()
    print(a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
