"""summarize reads a run's records once, one line at a time: the summary it gives is the one the
whole run read into memory gives (every file sorted by t, as load_run reads it), also for a file
out of time order or a server whose workers wrote elsewhere, and its memory stays the same
however many records the run wrote (issue 55: a soak's 42 MB of records took the server's
summary from 13 to 258 MB)."""

from __future__ import annotations

import json
import shutil
import tracemalloc
from pathlib import Path

import pytest

from minips.core.config import RunConfig
from minips.record import rundir
from minips.record.metrics import summarize
from minips.sim.simulate import SimConfig, simulate


def _whole(run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> dict:
    """The summary of the run read whole: every file sorted in memory (load_run's lists)."""
    with monkeypatch.context() as m:
        m.setattr(rundir, "in_time_order", lambda path: False)
        return summarize(run_dir, write=False)


def _same(a: dict, b: dict) -> None:
    assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)  # floats to the bit


@pytest.fixture(scope="module")
def sim_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A GSSP run of 8 workers in groups, with an evaluator, as the simulator records it."""
    out = tmp_path_factory.mktemp("sim")
    run = RunConfig(workers=8, mode="gssp", compressor="topk", ratio=0.02, lr=0.02,
                    lr_warmup=0, dataset="synthetic", epochs=100, base_step_s=0.04)
    simulate(SimConfig(run=run, slowdowns=[1, 1, 1.5, 1.5, 2, 2, 4, 4], jitter=0.1,
                       dim=200, max_pushes=600, eval_every_s=0.5, out_dir=str(out), name="run"))
    return out / "run"


def test_the_streamed_summary_is_the_whole_readings(sim_run: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    s = summarize(sim_run, write=False)
    assert s["steps"] >= 600 and s["eval_points"] > 3 and len(s["per_worker"]) == 8
    assert s["mean_wait_s"] is not None and s["between_groups"]
    assert all(rundir.in_time_order(f) for f in sim_run.glob("*.jsonl"))  # streamed, all
    _same(s, _whole(sim_run, monkeypatch))


def test_a_file_out_of_time_order_is_read_in_time_order(sim_run: Path, tmp_path: Path) -> None:
    copy = Path(shutil.copytree(sim_run, tmp_path / "run"))
    for name in ("eval.jsonl", "worker-3.jsonl", "global.jsonl"):
        lines = (copy / name).read_text().splitlines(keepends=True)
        (copy / name).write_text("".join(reversed(lines)))  # every t differs in these files
    assert not rundir.in_time_order(copy / "eval.jsonl")
    _same(summarize(copy, write=False), summarize(sim_run, write=False))


def test_what_the_servers_saw_streams_too(sim_run: Path, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """No worker or group files (they ran on other machines): per-worker figures from the
    merge lines, group after group."""
    copy = Path(shutil.copytree(sim_run, tmp_path / "run"))
    for f in [*copy.glob("worker-*.jsonl"), *copy.glob("group-*.jsonl")]:
        f.unlink()
    s = summarize(copy, write=False)
    assert {v["from"] for v in s["per_worker"].values()} == {"servers"}
    _same(s, _whole(copy, monkeypatch))


def _big_run(root: Path, workers: int = 4, pushes: int = 4000) -> int:
    """A run of ``workers`` x ``pushes`` pushes, a merge line and an eval point every 8: bytes."""
    root.mkdir()
    (root / "config.json").write_text(json.dumps({"mode": "gssp", "workers": workers, "t0": 0}))
    for w in range(workers):
        with open(root / f"worker-{w}.jsonl", "w") as f:
            for c in range(pushes):
                f.write(json.dumps({"t": c * 0.01 + w * 1e-4, "worker": w, "group": w % 2,
                                    "clock": c, "staleness": c % 3, "wait_s": 0.001 * (c % 7),
                                    "waited_for": [(w + 1) % workers] * (c % 5 == 0),
                                    "step_time": 0.05, "loss": 2.0 / (c + 1), "samples": 64,
                                    "kept_fraction": 0.01, "bytes_raw": 246824,
                                    "bytes_wire": 7845, "pad": "x" * 200},
                                   separators=(",", ":")) + "\n")
    with open(root / "global.jsonl", "w") as f, open(root / "eval.jsonl", "w") as e:
        for i in range(pushes * workers // 8):
            f.write(json.dumps({"t": i * 0.02, "event": "merge", "group": i % 2, "pushes": 8,
                                "missed": i % 3, "base_age_s": 0.01 * (i % 4),
                                "bytes_total": 1000 * i}) + "\n")
            e.write(json.dumps({"t": i * 0.02, "accuracy": min(0.9, i / 2000), "loss": 1.0,
                                "samples": 512 * i}) + "\n")
    return sum(f.stat().st_size for f in root.glob("*.jsonl"))


def _peak(fn) -> int:  # type: ignore[no-untyped-def]
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_the_summarys_memory_does_not_grow_with_the_records(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    size = _big_run(tmp_path / "big")
    assert size > 5e6
    streamed = _peak(lambda: summarize(tmp_path / "big", write=False))
    whole = _peak(lambda: _whole(tmp_path / "big", monkeypatch))
    assert streamed < 1e6, f"{streamed / 1e6:.2f} MB for {size / 1e6:.1f} MB of records"
    assert whole > size  # what reading it whole takes: the check would see a regression
