"""The dashboard's credential is its own, never the cluster's secret: a real `minips server`
with ``--dashboard`` on a non-loopback address prints a URL whose token opens the page (read
only) and is not MINIPS_TOKEN; MINIPS_TOKEN opens nothing there, and no file of the run directory
nor anything the server printed holds it. A dashboard token that equals the cluster's secret is
refused at start.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from conftest import interrupt, wait_for

from minips.net import lifeline

pytest.importorskip("aiohttp", reason="the dashboard extra is not installed")

SECRET = "the-cluster-secret-0123456789abcdef"  # MINIPS_TOKEN of the run


def server(run_dir: Path, *flags: str, **env: str) -> subprocess.Popen[str]:
    """`minips server --dashboard 0.0.0.0:0` with the cluster's secret (and ``env``)."""
    return subprocess.Popen(
        [sys.executable, "-m", "minips", "server", "--port", "0", "--run-dir", str(run_dir),
         "--dashboard", "0.0.0.0:0", "--calib-timeout", "600", *flags],
        env=lifeline.child_env({**os.environ, "MINIPS_TOKEN": SECRET, **env}),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return int(r.status)
    except urllib.error.HTTPError as exc:
        return exc.code


def test_the_dashboard_link_and_the_run_directory_never_hold_the_cluster_secret(
        tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = server(run_dir)
    try:
        assert proc.stdout is not None
        readline = proc.stdout.readline
        line = wait_for("the dashboard's line", lambda: next(
            (ln for ln in iter(readline, "") if "dashboard at" in ln), ""), 60,
            (proc,))
        url = re.search(r"dashboard at (\S+)", line).group(1)  # type: ignore[union-attr]
        port = url.split("//", 1)[1].split("/", 1)[0].rsplit(":", 1)[1]
        query = url.split("?", 1)[1] if "?" in url else ""
        assert SECRET not in url
        assert query.startswith("token=") and len(query) > len("token=") + 16, url
        base = f"http://127.0.0.1:{port}"
        wait_for("dashboard.url", lambda: (run_dir / "dashboard.url").exists(), 30, (proc,))
        assert status(f"{base}/state?{query}") == 200  # its own token opens the page
        assert status(f"{base}/state?token={SECRET}") == 401  # the cluster's opens nothing
        assert status(f"{base}/state") == 401
    finally:
        out, err = interrupt(proc, 60)
    assert SECRET not in out + err
    files = [p for p in run_dir.rglob("*") if p.is_file()]
    assert any(p.name == "dashboard.url" for p in files) and len(files) >= 3, files
    for p in files:
        assert SECRET.encode() not in p.read_bytes(), p
        assert query.encode() not in p.read_bytes(), p  # nor the dashboard's own token


def test_a_dashboard_token_that_is_the_cluster_secret_is_refused(tmp_path: Path) -> None:
    proc = server(tmp_path / "run", MINIPS_DASHBOARD_TOKEN=SECRET)
    try:
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 2, err
    assert "MINIPS_DASHBOARD_TOKEN" in err and SECRET not in out + err


def test_a_dashboard_token_given_is_the_one_asked_for(tmp_path: Path) -> None:
    own = "a-dashboard-token-of-its-own-42"
    run_dir = tmp_path / "run"
    proc = server(run_dir, MINIPS_DASHBOARD_TOKEN=own)
    try:
        url_file = run_dir / "dashboard.url"
        wait_for("dashboard.url", lambda: url_file.exists() and url_file.read_text(), 60, (proc,))
        port = url_file.read_text().strip().rstrip("/").rsplit(":", 1)[1]
        assert status(f"http://127.0.0.1:{port}/state?token={own}") == 200
        assert status(f"http://127.0.0.1:{port}/state?token={SECRET}") == 401
    finally:
        out, err = interrupt(proc, 60)
    assert own not in out + err + url_file.read_text()  # the operator has it; nobody else
