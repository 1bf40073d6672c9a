"""A screenshot of the dashboard replaying a run, as in the README (docs/img/dashboard.png).

Starts `minips dashboard RUN_DIR --speed SPEED` on a free port, opens it in headless Chromium
(Debian's chromium and chromium-driver through Selenium), waits until the replay reached AT
seconds of run time, saves the page as a PNG reduced to a 256-colour palette (Pillow) and stops
the replay.

Usage: python scripts/screenshot_dashboard.py RUN_DIR [--at 60] [--speed 10]
       [--size 1400x960] [--out docs/img/dashboard.png]
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from PIL import Image
from selenium import webdriver
from selenium.webdriver.chrome.service import Service

FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync")


def wait_run_time(url: str, at: float, timeout: float = 300.0) -> None:
    """Until the replay shows ``at`` seconds of run time (or its end)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with urllib.request.urlopen(url + "state", timeout=10) as r:
            state = json.loads(r.read())
        if state["t"] >= at or state["done"]:
            return
        time.sleep(0.2)
    raise SystemExit(f"the replay did not reach {at} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run_dir")
    ap.add_argument("--at", type=float, default=60.0, help="run time to show, s (default 60)")
    ap.add_argument("--speed", type=float, default=10.0, help="replay speed (default 10)")
    ap.add_argument("--size", default="1400x960", help="window size (default 1400x960)")
    ap.add_argument("--out", default="docs/img/dashboard.png", help="PNG to write")
    args = ap.parse_args()
    replay = subprocess.Popen([sys.executable, "-m", "minips", "dashboard", args.run_dir,
                               "--listen", "127.0.0.1:0", "--speed", str(args.speed)],
                              stdout=subprocess.PIPE, text=True)
    profile = tempfile.mkdtemp(prefix="minips-chromium-")
    opts = webdriver.ChromeOptions()
    opts.binary_location = "/usr/bin/chromium"
    size = args.size.replace("x", ",")
    for flag in (*FLAGS, f"--user-data-dir={profile}", f"--window-size={size}"):
        opts.add_argument(flag)
    driver = None
    try:
        line = replay.stdout.readline() if replay.stdout else ""
        url = line.split(" on ")[1].split()[0]
        driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=opts)
        driver.get(url)
        wait_run_time(url, args.at)
        time.sleep(1.0)  # one more tick reaches the page
        raw = Path(tempfile.mkdtemp()) / "raw.png"
        driver.save_screenshot(str(raw))
        Image.open(raw).convert("RGB").quantize(256).save(args.out, optimize=True)
        print(args.out, Path(args.out).stat().st_size, "bytes")
    finally:
        if driver is not None:
            driver.quit()
        replay.send_signal(signal.SIGINT)
        replay.communicate(timeout=30)
        shutil.rmtree(profile, ignore_errors=True)


if __name__ == "__main__":
    main()
