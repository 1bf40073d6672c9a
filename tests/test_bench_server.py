"""scripts/bench_server.py measures every point of a grid in one run (issue 41 item 5,
issue 42 item 16): each point starts its server in a fresh run directory, so the second point
is not refused as "an earlier run", and every row carries its figures and the servers' CPU per
message kind."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "scripts" / "bench_server.py"


def run_bench(*argv: str) -> dict:
    out = subprocess.run([sys.executable, str(BENCH), "--json", "--models", "lenet5",
                          "--ratios", "0.01", "--window-s", "1.5", "--step-s", "0.05",
                          "--clients", "1", "--groups", "2", *argv],
                         capture_output=True, text=True, timeout=180, check=True)
    return json.loads(out.stdout)


@pytest.mark.parametrize("extra", [[], ["--group-processes"]],
                         ids=["in-process-groups", "group-processes"])
def test_two_points_in_one_run_each_with_its_figures(extra: list[str]) -> None:
    doc = run_bench("--workers", "2,3", "--optimizer-at", "worker", "--checkpoint-every", "0.4",
                    *extra)
    points = doc["points"]
    assert [(p["workers"], p["optimizer_at"]) for p in points] == [(2, "worker"), (3, "worker")]
    for p in points:
        assert "error" not in p, p
        for key in ("pushes_s", "push_bytes_s", "pull_bytes_s", "push_ack_p50_ms",
                    "push_ack_p99_ms", "pull_p50_ms", "pull_p99_ms", "server_rss_mb"):
            assert p[key] > 0, (key, p)
        cpu = p["cpu_per_message"]
        for kind in ("push", "pull", "exchange"):
            assert cpu[kind]["count"] > 0 and cpu[kind]["cpu_us"] > 0, (kind, cpu)
        # checkpoints every 0.4 s over a 1.5 s window, each a fork of the server
        assert cpu["checkpoint"]["count"] > 0 and cpu["checkpoint"]["cpu_us"] > 0, cpu


def test_the_optimizer_place_is_an_axis_of_the_grid() -> None:
    doc = run_bench("--workers", "2", "--optimizer-at", "server,worker", "--window-s", "1")
    assert [p["optimizer_at"] for p in doc["points"]] == ["server", "worker"]
    assert all("error" not in p and p["pushes_s"] > 0 for p in doc["points"])
    assert all(p["cpu_per_message"]["checkpoint"]["count"] == 0 for p in doc["points"])


def test_the_exact_downlink_is_measured_when_asked() -> None:
    doc = run_bench("--workers", "2", "--optimizer-at", "worker", "--window-s", "1",
                    "--exact-down")
    assert doc["exact_down"] is True
    (p,) = doc["points"]
    assert "error" not in p and p["pushes_s"] > 0 and p["pull_bytes_s"] > 0, p
