#!/usr/bin/env python3
"""Load /admin/ui of a live server in headless Chromium (Debian's `chromium`): no console errors,
and a screenshot. Run by hand (CI has no browser):

    python tests/tools/check_dashboard.py --url http://127.0.0.1:8080 --out /tmp/dashboard.png

It sends a few chat requests first (so the charts have data), lets the page poll for a while
(`--virtual-time-budget`: 60 s of page time), and reads Chromium's console log (`--enable-logging=stderr`): any
console error or uncaught exception fails the check (exit 1)."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import threading

import httpx


def traffic(url: str, n: int) -> None:
    for i in range(n):
        httpx.post(url + "/v1/chat/completions", timeout=120, headers={"X-Session-Id": f"ui-{i % 3}"},
                   json={"messages": [{"role": "user", "content": f"Count to {i + 3}."}], "max_tokens": 24})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8080")
    ap.add_argument("--out", default="/tmp/dashboard.png")
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--token", default=None, help="the admin token, if the server has one")
    args = ap.parse_args(argv)
    traffic(args.url, args.requests // 2)
    background = threading.Thread(target=traffic, args=(args.url, args.requests - args.requests // 2), daemon=True)
    background.start()
    page = args.url + "/admin/ui" + (f"#token={args.token}" if args.token else "")
    with tempfile.TemporaryDirectory() as profile:
        run = subprocess.run(["chromium", "--headless=new", "--no-sandbox", "--disable-gpu", f"--user-data-dir={profile}",
                              "--enable-logging=stderr", "--v=0", "--window-size=1400,1000",
                              "--virtual-time-budget=60000", f"--screenshot={args.out}", page],
                             capture_output=True, text=True, timeout=180)
    background.join(timeout=300)
    console = [line for line in run.stderr.splitlines() if "CONSOLE" in line or "Uncaught" in line]
    errors = [line for line in console if re.search(r"ERROR|Uncaught|error", line)]
    print(f"chromium exit {run.returncode}; console lines: {len(console)}; errors: {len(errors)}")
    for line in console:
        print("  ", line)
    print(f"screenshot: {args.out}")
    return 1 if errors or run.returncode else 0


if __name__ == "__main__":
    sys.exit(main())
