"""Tests of minips.record.metrics: JSON-lines writer, run directory, summarize on a hand-made
run."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from minips.record.metrics import (
    BYTE_FIGURES,
    HOP_COUNTERS,
    load_run,
    summarize,
    total_bytes_series,
)
from minips.record.rundir import JsonlWriter, RunDir, read_jsonl

CONFIG = {"mode": "gssp", "compressor": "gdtopk", "model": "lenet5", "dataset": "fashion-mnist",
          "workers": 2, "groups": 0, "seed": 0, "t0": 1000.0}


def _lines(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def _push(w, g, t, clock, staleness, wait, waited_for=()):
    return {"t": t, "worker": w, "group": g, "clock": clock, "loss": 2.0 - 0.1 * clock,
            "step_time": 0.1 * (w + 1), "wait_s": wait, "waited_for": list(waited_for),
            "staleness": staleness,
            "bytes_raw": 4000, "bytes_wire": 100, "samples": 64, "kept_fraction": 0.01}


def make_run(root: Path) -> Path:
    """A small hand-written GSSP run: 2 workers in 2 groups, 4 evals, a killed worker file."""
    (root / "config.json").write_text(json.dumps(CONFIG))
    _lines(root / "eval.jsonl", [
        {"t": 1.0, "version": 1, "samples": 128, "accuracy": 0.40, "loss": 1.9,
         "bytes_up": 200, "bytes_down": 5000},
        {"t": 3.0, "version": 5, "samples": 640, "accuracy": 0.72, "loss": 0.9,
         "bytes_up": 1000, "bytes_down": 20000},
        {"t": 5.0, "version": 9, "samples": 1152, "accuracy": 0.81, "loss": 0.6,
         "bytes_up": 1800, "bytes_down": 40000},
        {"t": 6.0, "version": 10, "samples": 1280, "accuracy": 0.79, "loss": 0.65,
         "bytes_up": 2000, "bytes_down": 44000},
    ])
    _lines(root / "worker-0.jsonl", [_push(0, 0, 0.5 * c, c, 0, 0.0, [1] * (c in (3, 7)))
                                     for c in range(1, 11)])
    _lines(root / "worker-1.jsonl", [_push(1, 1, 1.0 * c, c, 1, 0.2) for c in range(1, 6)])
    with open(root / "worker-1.jsonl", "a") as f:
        f.write('{"t": 5.5, "worker": 1, "clo')  # the process was killed mid-line
    _lines(root / "group-0.jsonl", [{"t": 2.0, "group": 0, "version": 4, "pushes": 4,
                                     "min_clock": 4, "max_clock": 4, "bytes_in": 400,
                                     "bytes_out": 9000}])
    _lines(root / "group-1.jsonl", [{"t": 2.0, "group": 1, "version": 2, "pushes": 2,
                                     "min_clock": 2, "max_clock": 2, "bytes_in": 200,
                                     "bytes_out": 7000}])
    _lines(root / "global.jsonl", [{"t": 0.5, "event": "groups", "assignment": {"0": 0, "1": 1}},
                                   {"t": 4.0, "event": "regroup"},
                                   {"t": 6.5, "event": "done"}])
    return root


def test_summarize_hand_written_run(tmp_path):
    s = summarize(make_run(tmp_path), targets=[0.5, 0.8, 0.9])
    assert (s["mode"], s["compressor"], s["workers"], s["groups"]) == ("gssp", "gdtopk", 2, 2)
    assert s["final_accuracy"] == 0.79 and s["best_accuracy"] == 0.81
    assert s["final_loss"] == 0.65
    assert s["wall_s"] == 6.5  # the "done" event
    assert (s["train_start_s"], s["train_s"]) == (0.5, 6.0)  # from the "groups" event
    assert (s["samples"], s["bytes_up"], s["bytes_down"]) == (1280, 2000, 44000)
    assert s["time_to_accuracy"] == {"0.50": 2.5, "0.80": 4.5, "0.90": None}  # from the start
    assert s["steps"] == 15  # the truncated line is skipped
    assert s["mean_staleness"] == pytest.approx(5 / 15)
    assert s["max_staleness"] == 1
    assert s["mean_wait_s"] == pytest.approx(0.2 * 5 / 15)
    # 10 steps of 0.1 s and 5 of 0.2 s, over 2 workers x 6 s of training
    assert s["compute_share"] == pytest.approx(2.0 / 12.0)
    assert s["mean_kept_fraction"] == pytest.approx(0.01)
    assert s["bytes_raw"] == 15 * 4000 and s["regroups"] == 1 and s["eval_points"] == 4
    assert s["samples_per_s"] == pytest.approx(1280 / 6.0)
    assert s["per_worker"]["1"] == {"group": 1, "steps": 5, "mean_step_s": pytest.approx(0.2),
                                    "mean_wait_s": pytest.approx(0.2), "mean_staleness": 1.0,
                                    "waited_for_by_others": 2}
    assert s["per_worker"]["0"]["waited_for_by_others"] == 0
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert on_disk == s


def test_the_compute_share_counts_each_local_step_and_is_none_without_worker_files(tmp_path):
    """A push of H local steps reports the mean step: it counts H times. Without worker files
    no share is claimed."""
    (tmp_path / "local").mkdir()
    (tmp_path / "servers").mkdir()
    run = make_run(tmp_path / "local")
    _lines(run / "worker-0.jsonl", [{**_push(0, 0, 0.5 * c, c, 0, 0.0), "local_steps": 4}
                                    for c in range(1, 11)])  # 10 pushes of 4 steps of 0.1 s
    s = summarize(run, write=False)
    assert s["compute_share"] == pytest.approx((4.0 + 1.0) / 12.0)
    run = make_run(tmp_path / "servers")
    for f in run.glob("worker-*.jsonl"):
        f.unlink()
    assert summarize(run, write=False)["compute_share"] is None


def test_a_server_without_worker_files_counts_samples_from_its_merges(tmp_path: Path) -> None:
    """Workers on other machines write their files there: the server's own summary takes the
    samples of its last merge (it said 0 before)."""
    (tmp_path / "global.jsonl").write_text("".join(json.dumps(r) + "\n" for r in (
        {"t": 1.0, "event": "merge", "group": 0, "samples": 640},
        {"t": 2.0, "event": "merge", "group": 1, "samples": 1280})))
    assert summarize(tmp_path, write=False)["samples"] == 1280


def test_summarize_tolerates_missing_files(tmp_path):
    (tmp_path / "worker-3.jsonl").write_text(json.dumps(_push(3, 0, 2.0, 1, 0, 0.5)) + "\n{bad")
    s = summarize(tmp_path)
    assert s["mode"] is None and s["final_accuracy"] is None and s["best_accuracy"] is None
    assert s["workers"] == 1 and s["groups"] == 1 and s["wall_s"] == 2.0
    assert s["train_start_s"] == 0.0 and s["samples_per_s"] == 32.0
    # Without the evaluator's totals, traffic comes from the workers' own counts.
    assert (s["samples"], s["bytes_up"], s["bytes_down"]) == (64, 100, None)
    assert all(v is None for v in s["time_to_accuracy"].values())
    (tmp_path / "empty").mkdir()
    assert summarize(tmp_path / "empty", write=False)["steps"] == 0
    assert not (tmp_path / "empty" / "summary.json").exists()
    with pytest.raises(FileNotFoundError):
        summarize(tmp_path / "nope")


def test_summarize_ignores_nan_and_targets_from_config(tmp_path):
    RunDir(tmp_path).write_config({"mode": "bsp", "targets": [0.3]})
    _lines(tmp_path / "eval.jsonl", [{"t": 1.0, "accuracy": float("nan")},
                                     {"t": 2.0, "accuracy": 0.35}])
    s = summarize(tmp_path)
    assert s["time_to_accuracy"] == {"0.30": 2.0} and s["best_accuracy"] == 0.35


def test_jsonl_writer_adds_t_flushes_each_line_and_converts_numpy(tmp_path):
    now = [1010.0]
    w = JsonlWriter(tmp_path / "sub" / "worker-1.jsonl", t0=1000.0, clock=lambda: now[0])
    w.write({"loss": np.float32(0.5), "clock": np.int64(3), "waited_for": np.array([1, 2])})
    # Visible to a reader before close: the line was flushed.
    assert read_jsonl(tmp_path / "sub" / "worker-1.jsonl") == [
        {"t": 10.0, "loss": 0.5, "clock": 3, "waited_for": [1, 2]}]
    now[0] = 1012.5
    w.write({"t": 99.0, "x": 1})  # an explicit t is kept
    w.write({"x": 2})
    w.close()
    assert [r["t"] for r in read_jsonl(w.path)] == [10.0, 99.0, 12.5]
    with pytest.raises(ValueError):
        w.write({"x": 3})
    with pytest.raises(TypeError):
        with JsonlWriter(tmp_path / "bad.jsonl") as bad:
            bad.write({"x": object()})


def test_run_dir_shares_t0_through_config(tmp_path):
    server = RunDir(tmp_path / "run", t0=1234.5)
    server.write_config({"mode": "ssp", "staleness": 3})
    assert json.loads((tmp_path / "run" / "config.json").read_text())["t0"] == 1234.5
    worker = RunDir(tmp_path / "run")  # another process opening the same directory
    assert worker.t0 == 1234.5
    with worker.writer("worker-2") as w:
        w.write({"clock": 1})
    assert worker.file("eval") == tmp_path / "run" / "eval.jsonl"
    run = load_run(tmp_path / "run")
    assert list(run.workers) == [2] and run.config["staleness"] == 3 and run.label == "ssp"


def test_summary_and_progress_line_say_whether_the_data_was_real(tmp_path, capsys):
    from minips.ml import data
    from minips.record.metrics import record
    from minips.run.launch import LaunchConfig, ProgressLine

    real = {"name": "fashion-mnist", "split": "train", "synthetic": False, "source": "/d"}
    stand_in = data.load_dataset("fashion-mnist", "test", synthetic=True).meta
    assert summarize(tmp_path, write=False)["data"] is None  # nothing loaded yet
    line = ProgressLine(tmp_path, LaunchConfig().run)
    line.draw(final=True)
    assert "data loading" in capsys.readouterr().err
    record(tmp_path, "worker-0", real)
    assert summarize(tmp_path, write=False)["data"] == "real"
    line.draw(final=True)
    assert "data real" in capsys.readouterr().err
    record(tmp_path, "evaluator", stand_in)
    summary = summarize(tmp_path)
    assert summary["data"] == "mixed" and summary["data_sources"]["evaluator"]["synthetic"]
    assert summary["data_sources"]["worker-0"]["source"] == "/d"
    assert json.loads((tmp_path / "summary.json").read_text())["data"] == "mixed"
    line.draw(final=True)
    assert "SYNTHETIC DATA" in capsys.readouterr().err
    record(tmp_path, "worker-0", stand_in)
    assert summarize(tmp_path, write=False)["data"] == "synthetic"


def _exchange(t, g, bytes_in, bytes_out, to_global, from_global):
    return {"t": t, "event": "exchange", "group": g, "bytes_in": bytes_in, "bytes_out": bytes_out,
            "bytes_to_global": to_global, "bytes_from_global": from_global}


def make_hop_run(root: Path) -> Path:
    """Two groups whose exchange events carry every hop's running totals; group 1's process
    restarted at t=3 (its counters start again from 0)."""
    make_run(root)
    _lines(root / "group-0.jsonl", [_exchange(1.0, 0, 100, 1000, 50, 400),
                                    {"t": 1.5, "event": "expired", "group": 0, "bytes_in": 150,
                                     "bytes_out": 1500},  # no group <-> global counters here
                                    _exchange(2.0, 0, 200, 2000, 100, 800)])
    _lines(root / "group-1.jsonl", [_exchange(1.0, 1, 10, 100, 5, 40),
                                    _exchange(2.0, 1, 30, 300, 15, 120),
                                    _exchange(3.0, 1, 7, 70, 3, 30),  # restarted
                                    _exchange(4.0, 1, 9, 90, 4, 35)])
    return root


def test_summarize_counts_every_hop(tmp_path):
    s = summarize(make_hop_run(tmp_path))
    assert s["bytes_worker_group"] == 200 + 30 + 9
    assert s["bytes_group_worker"] == 2000 + 300 + 90
    assert s["bytes_group_global"] == 100 + 15 + 4
    assert s["bytes_global_group"] == 800 + 120 + 35
    assert s["bytes_total"] == sum(s[k] for k in HOP_COUNTERS)
    assert (s["bytes_up"], s["bytes_down"]) == (2000, 44000)  # the evaluator's, as before
    series = total_bytes_series(load_run(tmp_path).groups)
    assert [t for t, _ in series] == sorted(t for t, _ in series)
    assert series[-1][1] == s["bytes_total"]
    assert all(b <= a for (_, b), (_, a) in zip(series, series[1:], strict=False))  # never drops


def test_hops_before_the_exchange_events_have_them_and_without_group_files(tmp_path):
    s = summarize(make_run(tmp_path), write=False)  # group files without group <-> global
    assert (s["bytes_worker_group"], s["bytes_group_worker"]) == (600, 16000)
    assert s["bytes_group_global"] == s["bytes_global_group"] == 0
    assert s["bytes_total"] == 16600
    for f in tmp_path.glob("group-*.jsonl"):
        f.unlink()
    s = summarize(tmp_path, write=False)  # no group files: the evaluator's worker <-> group
    assert (s["bytes_worker_group"], s["bytes_group_worker"], s["bytes_total"]) == (
        2000, 44000, 46000)


def test_progress_line_and_summary_show_the_ledgers_figures(tmp_path, capsys):
    """Both read the figures the global server's last line carries (its ledger), not counts of
    their own from the group files (which say otherwise here: they are not read)."""
    from minips.run.launch import LaunchConfig, ProgressLine

    line = ProgressLine(make_hop_run(tmp_path), LaunchConfig().run)
    line.draw(final=True)
    err = capsys.readouterr().err
    for label in ("up 0.0", "down 0.0", "to-global 0.0", "from-global 0.0", "total 0.0"):
        assert label in err, err
    figures = {"bytes_worker_group": 2_000_000, "bytes_group_worker": 3_000_000,
               "bytes_group_global": 400_000, "bytes_global_group": 500_000,
               "bytes_total": 5_900_000}
    _lines(tmp_path / "global.jsonl", [{"t": 9.0, "event": "merge", "group": 0, "version": 3,
                                        "samples": 10, **figures}])
    line.draw(final=True)
    assert "MB up 2.0 down 3.0 to-global 0.4 from-global 0.5 total 5.9" in capsys.readouterr().err
    s = summarize(tmp_path, write=False)
    assert {k: s[k] for k in BYTE_FIGURES} == figures
    assert (s["bytes_up"], s["bytes_down"]) == (2_000_000, 3_000_000)


def test_a_server_whose_workers_write_elsewhere_summarizes_what_it_saw(tmp_path):
    """No worker or group files (they ran on other machines): steps, per-worker figures and
    bytes per hop from the global server's merge lines, and each worker's data from the
    ``data`` events its first STATS made."""
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    merge = {"event": "merge", "bytes_in": 0, "bytes_out": 0}
    _lines(tmp_path / "global.jsonl", [
        {"t": 0.5, "event": "data", "worker": 0, "dataset": "fashion-mnist", "synthetic": False},
        {"t": 0.6, "event": "data", "worker": 1, "dataset": "fashion-mnist", "synthetic": True,
         "reason": "no files"},
        {"t": 1.0, "event": "groups", "assignment": {"0": 0, "1": 1}},
        {**merge, "t": 2.0, "group": 0, "pushes": 3, "samples": 192, "bytes_in": 300,
         "bytes_out": 3000, "bytes_to_global": 50, "bytes_from_global": 60,
         "pull_workers": [0, 0, 0], "pull_leads": [0, 1, 2], "pull_waits_us": [0, 0, 3000]},
        {**merge, "t": 3.0, "group": 1, "pushes": 1, "samples": 256, "bytes_in": 100,
         "bytes_out": 1000, "bytes_to_global": 20, "bytes_from_global": 30,
         "pull_workers": [1], "pull_leads": [0], "pull_waits_us": [1000]},
        {**merge, "t": 4.0, "group": 0, "pushes": 2, "samples": 384, "bytes_in": 500,
         "bytes_out": 5000, "bytes_to_global": 100, "bytes_from_global": 120,
         "pull_workers": [0, 0], "pull_leads": [0, 0], "pull_waits_us": [0, 0]},
    ])
    s = summarize(tmp_path, write=False)
    assert s["steps"] == 6 and s["samples"] == 384
    assert (s["bytes_worker_group"], s["bytes_group_worker"]) == (600, 6000)
    assert (s["bytes_group_global"], s["bytes_global_group"]) == (120, 150)
    assert s["bytes_total"] == 600 + 6000 + 120 + 150
    w0, w1 = s["per_worker"]["0"], s["per_worker"]["1"]
    assert (w0["group"], w0["steps"], w1["group"], w1["steps"]) == (0, 5, 1, 1)
    assert w0["mean_staleness"] == pytest.approx(0.6) and w0["mean_wait_s"] == pytest.approx(6e-4)
    assert w0["from"] == "servers"
    assert s["data"] == "mixed" and s["data_sources"]["worker-1"]["reason"] == "no files"
    assert s["data_sources"]["worker-0"]["reported"] is True
    (tmp_path / "data-worker-0.json").write_text(json.dumps(
        {"role": "worker-0", "dataset": "fashion-mnist", "synthetic": False, "source": "/d"}))
    assert summarize(tmp_path, write=False)["data_sources"]["worker-0"]["source"] == "/d"


def test_the_summary_says_how_stale_between_groups_each_groups_exchanges_were(tmp_path):
    """From the global server's merge lines: per group, the mean and the most of the other
    groups' merges its exchanges missed and of the age of the weights they rebased on; a line
    without them (older records, a group resumed before its first answer) counts in neither."""
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    merge = {"event": "merge", "pull_workers": [], "pull_leads": [], "pull_waits_us": []}
    _lines(tmp_path / "global.jsonl", [
        {"t": 1.0, "event": "groups", "assignment": {"0": 0, "1": 1}},
        {**merge, "t": 2.0, "group": 0, "missed": None, "base_age_s": None},
        {**merge, "t": 2.5, "group": 0, "missed": 0, "base_age_s": 0.5},
        {**merge, "t": 3.0, "group": 1, "missed": 2, "base_age_s": 2.0},
        {**merge, "t": 3.5, "group": 0, "missed": 1, "base_age_s": 1.0},
        {**merge, "t": 6.0, "group": 1, "missed": 4, "base_age_s": 3.0},
        {**merge, "t": 7.0, "group": 2},
    ])
    s = summarize(tmp_path, write=False)
    assert s["between_groups"] == {
        "0": {"mean_missed": 0.5, "max_missed": 1, "mean_base_age_s": 0.75, "max_base_age_s": 1},
        "1": {"mean_missed": 3, "max_missed": 4, "mean_base_age_s": 2.5, "max_base_age_s": 3},
        "2": {"mean_missed": None, "max_missed": None, "mean_base_age_s": None,
              "max_base_age_s": None}}
