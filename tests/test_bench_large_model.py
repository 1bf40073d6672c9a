"""scripts/bench_large_model.py runs a real `minips local` and reads its figures (run small:
LeNet-5, 2 workers, 5 pushes each), so the script cannot silently break."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "scripts" / "bench_large_model.py"


def test_a_small_run_reports_steps_acks_and_the_servers_cpu(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, str(BENCH), "--model", "lenet5", "--workers", "2",
                          "--max-steps", "5", "--eval-every", "5", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=240, check=True)
    doc = json.loads(out.stdout)
    assert doc["model"] == "lenet5" and doc["pushes"] == 10
    assert 0 < doc["push_ack_ms"]["p50"] <= doc["push_ack_ms"]["p99"]
    assert 0 < doc["worker_step_s"]["p50"] <= doc["worker_step_s"]["p99"]
    assert doc["server_cpu"]["total"] > 0 and doc["server_cpu"]["server"] > 0
    assert doc["workers_cpu"] > 0 and doc["server_share_of_step"] > 0
