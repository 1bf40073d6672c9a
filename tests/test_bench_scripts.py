"""The benches that had no test of their own, each run small so it cannot silently break:
bench_wire, bench_rtt, bench_simulate, bench_worker, bench_device_compress and bench_dashboard
print one JSON document measured in that run (their figures are for the docs; here only that
they are there), and bench_server's client process speaks its line protocol."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
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
def test_rtt_breakdown_times_the_round_trip_with_and_without_the_codec_and_checks() -> None:
    """The three variants run (each patch reaches the decoder the channel uses: a round trip
    without field checks must still decode the PUSH's payload) and the parts are reported."""
    doc = run("rtt_breakdown.py", "--json", "--rtt-iters", "50")
    for key in ("minips_us", "free_codec_us", "no_checks_us", "echo_us", "floor_us"):
        assert doc[key] > 0, key
    assert doc["rtt_iters"] == 50
    assert doc["codec_us"] == pytest.approx(doc["minips_us"] - doc["free_codec_us"], abs=0.11)


@pytest.mark.timeout(300)
def test_gssp_causes_runs_its_rows_in_the_simulator() -> None:
    """Two rows, one seed, a sliver of an epoch: each row ran with its own flags (the link
    stretches simulated time, one group has no between-group misses) and the gaps are per seed."""
    doc = run("gssp_causes.py", "--rows", "unlinked,link20,link20-1group", "--seeds", "0",
              "--epochs", "0.05")
    rows = doc["rows"]
    assert rows["link20"]["sim_s"] > 2 * rows["unlinked"]["sim_s"]
    assert rows["unlinked"]["groups"] == 4 and rows["link20-1group"]["groups"] == 1
    assert rows["unlinked"]["gap_vs_unlinked"] == [0.0]
    assert 0.0 <= rows["link20"]["final"][0] <= 1.0
    assert set(rows["unlinked"]["missed_seed0"]) == {"0", "1", "2", "3"}


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


@pytest.mark.timeout(300)
def test_bench_dashboard_compares_a_small_run_with_and_without_the_dashboard(
        tmp_path: Path) -> None:
    doc = run("bench_dashboard.py", "--repeats", "1", "--tensorboard", "--out", str(tmp_path),
              "--run-flags", "--workers 2 --max-steps 20")
    off, on = doc["runs"]
    assert (off["dashboard"], on["dashboard"], on["tensorboard"]) == (False, True, True)
    assert on["events"] > 0 and off["train_s"] > 0 and on["train_s"] > 0
    (cpu,) = doc["monitor_cpu"]
    assert cpu["records"] > 0 and cpu["monitor_cpu_s"] > 0 and cpu["tensorboard_cpu_s"] > 0


@pytest.mark.timeout(120)
def test_bench_server_clients_push_and_pull_against_a_real_server(tmp_path: Path) -> None:
    """The client process of bench_server.py on its own line protocol: `ready` once its workers
    are in their loops, then one JSON line for the window it is given."""
    env = {**os.environ, "MINIPS_TOKEN": "bench-clients-test"}
    init, ready = tmp_path / "init.npy", tmp_path / "ready"
    np.save(init, np.zeros(61_706, np.float32))
    server = subprocess.Popen(
        [sys.executable, "-m", "minips", "server", "--port", "0", "--quiet", "--ready-file",
         str(ready), "--init", str(init), "--run-dir", str(tmp_path / "run"), "--workers", "2",
         "--mode", "gssp", "--groups", "1", "--staleness", "1000000", "--epochs", "0",
         "--compressor", "topk", "--checkpoint-every", "0"], env=env,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    clients = None
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():  # the server writes it once it listens
            assert server.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        address = ":".join(ready.read_text().split())
        clients = subprocess.Popen(
            [sys.executable, str(SCRIPTS / "bench_server_clients.py"), "--connect", address,
             "--size", "61706", "--ratio", "0.01", "--step-s", "0.05", "--ids", "0,1",
             "--active", "0"], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True)
        assert clients.stdout is not None and clients.stdin is not None
        assert clients.stdout.readline().strip() == "ready"
        t0 = time.monotonic()
        time.sleep(1.0)  # the measured window itself, as bench_server.py holds it
        clients.stdin.write(f"{t0} {time.monotonic()}\n")
        clients.stdin.flush()
        window = json.loads(clients.stdout.readline())
        assert window["push_ms"] and window["pull_ms"]  # the active worker stepped
        assert all(ms > 0 for ms in window["push_ms"] + window["pull_ms"])
        assert window["push_bytes"] > 0 and window["pull_bytes"] > 0
    finally:
        for proc in (clients, server):
            if proc is not None:
                proc.kill()
                proc.wait()
