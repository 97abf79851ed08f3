"""Screenshot of TensorBoard showing a run's curves, for the docs (headless Chromium).

Starts `tensorboard --logdir LOGDIR` on a free loopback port, opens its scalars dashboard in
Debian's chromium through Playwright with the tags filtered to TAGS, and writes a PNG.

    reservoir runs track reverse-grpo /tmp/tb --to tensorboard
    python -m tools.tensorboard_shot /tmp/tb docs/tensorboard.png
"""

from __future__ import annotations

import argparse
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

TAGS = r"^(reward_mean|eval/accuracy)$"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_until_up(url: str, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(url, timeout=2)
            return
        except OSError:
            time.sleep(0.5)
    raise SystemExit(f"tensorboard did not answer at {url} within {seconds:g} s")


def shoot(logdir: Path, out: Path, tags: str) -> None:
    from playwright.sync_api import sync_playwright

    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir),
                               "--host", "127.0.0.1", "--port", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        base = f"http://127.0.0.1:{port}/"
        wait_until_up(base)
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True,
                                                 args=["--no-sandbox", "--disable-gpu"])
            page = browser.new_page(viewport={"width": 1400, "height": 760})
            page.goto(f"{base}?darkMode=false#scalars&tagFilter="
                      f"{urllib.parse.quote(tags, safe='')}")
            page.wait_for_load_state("networkidle", timeout=60_000)
            page.wait_for_timeout(6000)  # the charts draw after their data arrives
            page.screenshot(path=str(out))
            browser.close()
    finally:
        server.terminate()
        server.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("logdir", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--tags", default=TAGS, help="a regular expression of the tags shown")
    args = parser.parse_args()
    shoot(args.logdir, args.out, args.tags)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
