"""docs/playground.png: the playground after its needle-in-a-haystack demo, run for real.

    .venv/bin/python scripts/screenshot_playground.py [--length 10240] [--out docs/playground.png]

Starts the server on the default model, opens the page in Debian's Chromium (Playwright's
library, no browser download), makes the demo's haystack with its needle farther back than the
training length, runs plain RoPE and ReRoPE side by side, waits for both answers and saves the page as a PNG.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

from rope_plugins.testing.launcher import running_server  # noqa: E402

CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=int, default=16384, help="the haystack's tokens")
    parser.add_argument("--depth", type=int, default=20, help="the needle's depth, percent")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "playground.png")
    args = parser.parse_args()
    chromium = shutil.which("chromium")
    if chromium is None:
        sys.exit("no chromium here: scripts/install_browser.sh installs it")
    from playwright.sync_api import sync_playwright

    log = Path(tempfile.mkdtemp()) / "server.log"
    print(f"starting the server (log: {log})", flush=True)
    with running_server([], log) as server, sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.goto(server.base + "/")
        page.wait_for_selector("body[data-ready=true]")
        page.click("#demo summary")
        page.fill("#demo-length", str(args.length))
        page.fill("#demo-depth", str(args.depth))
        page.click("#demo-make")
        page.wait_for_function("Number(document.querySelector('#doc-count').dataset.tokens) > 0")
        print(page.text_content("#doc-count"), flush=True)
        page.click("#run")
        print("running plain RoPE and ReRoPE side by side…", flush=True)
        page.wait_for_function("[...document.querySelectorAll('.column')].every(c => c.dataset.state === 'done')",
                               timeout=900_000)
        for column in page.locator(".column").all():
            print(column.locator("[name=method]").input_value(), repr(column.locator(".output").text_content()),
                  column.locator(".stats").text_content(), flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(args.out), full_page=True)
        browser.close()
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
