"""The benches that had no test of their own, each run small so it cannot silently break:
bench_wire, bench_rtt, bench_simulate, bench_worker and bench_device_compress print one JSON
document measured in that run (their figures are for the docs; here only that they are there)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def run(script: str, *argv: str, timeout: float = 240) -> dict:
    out = subprocess.run([sys.executable, str(SCRIPTS / script), *argv], capture_output=True,
                         text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


@pytest.mark.timeout(300)
def test_bench_wire_measures_minips_against_gloo_and_a_bare_socket() -> None:
    doc = run("bench_wire.py", "--json", "--iters", "2", "--rtt-iters", "50")
    for key in ("dense_gbps", "gloo_gbps", "raw_gbps", "rtt_us_p50", "echo_rtt_us_p50"):
        assert doc[key] > 0, key
    assert doc["iters"] == 2 and doc["rtt_iters"] == 50


@pytest.mark.timeout(300)
def test_bench_rtt_measures_a_push_and_its_ack_against_a_bare_echo() -> None:
    doc = run("bench_rtt.py", "--json", "--rtt-iters", "50")
    assert doc["rtt_us_p50"] > 0 and doc["echo_rtt_us_p50"] > 0 and doc["rtt_ratio"] > 0


@pytest.mark.timeout(300)
def test_bench_simulate_runs_a_small_cluster() -> None:
    doc = run("bench_simulate.py", "--json", "--workers", "16", "--pushes", "500",
              "--dim", "100")
    assert doc["workers"] == 16 and doc["pushes"] >= 500 and doc["pushes_per_real_s"] > 0
    assert doc["groups"] >= 1 and doc["bytes_total"] > 0


@pytest.mark.timeout(300)
def test_bench_worker_times_a_real_workers_phases() -> None:
    doc = run("bench_worker.py", "--models", "lenet5", "--steps", "4", "--skip", "1")
    fig = doc["lenet5"]
    assert fig["steps_timed"] == 3 and fig["compute_s"] > 0 and fig["rss_mb"] > 0


@pytest.mark.timeout(300)
def test_bench_device_compress_selects_on_the_cpu() -> None:
    doc = run("bench_device_compress.py", "--device", "cpu", "--reps", "1")
    rows = [v for k, v in doc.items() if isinstance(v, dict)]
    assert rows and all(r["select_ms"] > 0 and r["host_bytes"] < r["dense_bytes"] for r in rows)
