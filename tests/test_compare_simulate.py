"""scripts/compare_simulate.py's calibration from a real run's records: behind a link and
with local steps (the records are made here, the arithmetic is the script's)."""

from __future__ import annotations

import importlib.util
import json
import sys
import types
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
SPEC = importlib.util.spec_from_file_location("compare_simulate",
                                              ROOT / "scripts" / "compare_simulate.py")
assert SPEC is not None and SPEC.loader is not None
compare_simulate = importlib.util.module_from_spec(SPEC)
sys.modules["compare_simulate"] = compare_simulate
SPEC.loader.exec_module(compare_simulate)


def test_the_link_rate_is_read_from_link_json_in_bytes_per_second(tmp_path: Path) -> None:
    assert compare_simulate.link_rate(tmp_path) == 0.0
    rates = [{"worker": 0, "up_bps": 20e6, "down_bps": 20e6},
             {"worker": 1, "up_bps": 5e6, "down_bps": 8e6}]
    (tmp_path / "link.json").write_text(json.dumps({"rates": rates}))
    assert compare_simulate.link_rate(tmp_path) == pytest.approx(5e6 / 8)


def test_a_local_steps_push_behind_a_link_calibrates_h_steps_of_its_compute() -> None:
    rate = 1e6  # bytes/s
    # pushes at t = 1.0 and 2.0 after the start at 0: each moved 10 kB up and 40 kB down
    # (the channel's counts so far), its PUSH round trip 0.012 s of which 0.01 s on the link
    recs: list[dict[str, Any]] = [
        {"t": 1.0 * k, "clock": k, "group": 0, "waited_for": [], "wait_s": 0.05,
         "push_s": 0.012, "bytes_wire": 10_000, "link_bytes_up": 10_000 * k,
         "link_bytes_down": 40_000 * k, "local_steps": 4} for k in (1, 2)]
    run = types.SimpleNamespace(start_t=0.0, workers={0: recs})
    cal = compare_simulate.calibration(run, 1, rate)
    assert cal["latency_s"] == pytest.approx(0.001)
    # 1.0 s less four latencies and the 50 ms the push and its answer spent on the link
    step = (1.0 - 4 * 0.001 - 0.05) / 4
    assert cal["traces"] == [[pytest.approx(step)] * 8]
    assert cal["medians"] == [pytest.approx(step)]
    # without a link and local steps: the whole interval less four latencies of 6 ms
    plain = [{**r, "local_steps": 1} for r in recs]
    cal = compare_simulate.calibration(types.SimpleNamespace(start_t=0.0, workers={0: plain}),
                                       1)
    assert cal["traces"] == [[pytest.approx(1.0 - 4 * 0.006)] * 2]
