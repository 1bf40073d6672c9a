"""Tests of scripts/reproduce.py: the experiment matrix, the table arithmetic, and a tiny real run.

The end-to-end test executes the script's ``--smoke`` size (2 workers, two experiments, about
20 pushes each, real processes on loopback) so the script cannot silently rot.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from minips.ml import data, models

ROOT = Path(__file__).resolve().parent.parent
SPEC = importlib.util.spec_from_file_location("reproduce", ROOT / "scripts" / "reproduce.py")
assert SPEC is not None and SPEC.loader is not None
reproduce = importlib.util.module_from_spec(SPEC)
sys.modules["reproduce"] = reproduce  # dataclasses look their module up there
SPEC.loader.exec_module(reproduce)

OPTIMIZER_KEYS = {"lr", "momentum", "weight_decay", "batch_size", "seed", "epochs", "model"}


def test_experiments_change_only_mode_and_compression():
    for suite in reproduce.suites_for("quick"):
        labels = [e.label for e in suite.experiments]
        assert labels[:4] == ["bsp", "ssp", "asp", "gssp"]
        assert {"gssp+gdtopk-slower-more", "gssp+gdtopk-slower-less", "gssp+topk", "gssp+dgc",
                "gssp+losscomp"} <= set(labels)
        assert suite.slowdowns == [1, 1, 1.5, 1.5, 2, 2, 4, 4]
        for exp in suite.experiments:
            assert not OPTIMIZER_KEYS & set(exp.overrides), exp.label
        sparse = [e for e in suite.experiments if e.part == "compression"]
        assert {e.overrides["ratio"] for e in sparse} == {reproduce.RATIO}


def test_a_row_may_put_the_optimizer_on_the_workers_with_dgc_as_published(tmp_path):
    """Row specs are RunConfig fields: DGC's pieces validate through the launch config;
    --optimizer-at moves SGD to the workers in every row."""
    suite = reproduce.suites_for("quick")[0]
    row = reproduce.Experiment("gssp+dgc-published", {
        "mode": "gssp", "compressor": "dgc", "ratio": reproduce.RATIO, "optimizer_at": "worker",
        "momentum_masking": True, "grad_clip": 5.0,
        "compressor_opts": {"warmup_fraction": 0.05}}, part="compression")
    run = reproduce._launch_config(suite, row, 0, tmp_path).run
    assert (run.optimizer_at, run.momentum_masking, run.grad_clip) == ("worker", True, 5.0)
    args = reproduce._parser().parse_args(["--quick", "--optimizer-at", "worker"])
    reproduce._apply_overrides(suite, args)
    plain = reproduce._launch_config(suite, suite.experiments[0], 0, tmp_path).run
    assert plain.optimizer_at == "worker"


def _figures(tta80, tta85, acc):
    return {"time_to_accuracy": {"0.80": tta80, "0.85": tta85}, "final_accuracy": acc,
            "done_reason": "epochs"}


def test_aggregate_takes_medians_and_spread_over_seeds():
    row = reproduce.aggregate([_figures(10.0, None, 0.86), _figures(14.0, 30.0, 0.88),
                               _figures(12.0, 40.0, 0.87)])
    assert row["seeds"] == 3
    assert row["final_accuracy"] == pytest.approx(0.87)
    # a seed that missed 85% counts as infinitely slow: the median is the slower of the others
    assert row["time_to_accuracy"] == {"0.80": 12.0, "0.85": 40.0}
    assert row["spread"]["final_accuracy"] == pytest.approx([0.86, 0.88])
    assert row["spread"]["time_to_0.80"] == [10.0, 14.0]
    assert row["done_reason"] == "epochs"


def test_speedups_use_the_highest_target_both_reached():
    rows = {"bsp": reproduce.aggregate([_figures(40.0, None, 0.84)]),
            "ssp": reproduce.aggregate([_figures(30.0, 60.0, 0.86)]),
            "gssp": reproduce.aggregate([_figures(10.0, 20.0, 0.87)])}
    reproduce.add_speedups(rows, (0.80, 0.85))
    g = rows["gssp"]
    assert g["speedup_vs_bsp"] == pytest.approx(4.0) and g["speedup_vs_bsp_target"] == "0.80"
    assert g["speedup_vs_ssp"] == pytest.approx(3.0) and g["speedup_vs_ssp_target"] == "0.85"
    assert rows["bsp"]["speedup_vs_bsp"] == pytest.approx(1.0)


@pytest.mark.timeout(150)
def test_smoke_run_writes_table_runs_and_plots(tmp_path):
    out = tmp_path / "smoke"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "reproduce.py"), "--smoke",
                           "--out", str(out), "--json"], capture_output=True, text=True,
                          timeout=140, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = json.loads(proc.stdout)
    table = json.loads((out / "table.json").read_text())
    assert printed["suites"].keys() == table["suites"].keys() == {"smoke"}
    rows = table["suites"]["smoke"]["rows"]
    assert set(rows) == {"bsp", "gssp+topk"}
    for label, row in rows.items():
        for key in ("time_to_accuracy", "final_accuracy", "bytes_up", "speedup_vs_bsp",
                    "speedup_vs_ssp", "mean_staleness", "mean_wait_s", "samples"):
            assert key in row, (label, key)
        assert row["done_reason"] == "epochs" and row["status"] == "done"
        assert row["samples"] >= 0.02 * 60000  # the samples budget was spent
        # the table's accuracy is that of the run's final weights on the whole test set
        final = np.load(out / "runs" / f"smoke-{label}-s0" / "final_weights.npy")
        acc, _ = models.evaluate("lenet5", final, data.load_dataset("fashion-mnist", "test"))
        assert row["final_accuracy"] == pytest.approx(acc, abs=1e-12), label
    assert rows["gssp+topk"]["groups"] == 2 and rows["bsp"]["groups"] == 1
    assert rows["gssp+topk"]["bytes_up"] * 20 < rows["bsp"]["bytes_up"]  # 1% top-k vs dense
    run_dir = out / "runs" / "smoke-gssp+topk-s0"
    launch = json.loads((run_dir / "launch.json").read_text())
    assert launch["run"]["seed"] == 0 and launch["run"]["compressor"] == "topk"
    assert json.loads((run_dir / "reproduce.json").read_text())["final_full_test"]["samples"]
    assert "| gssp+topk |" in (out / "table.md").read_text()
    for row in rows.values():  # every hop counted, and adding up
        hops = [row[k] for k in ("bytes_worker_group", "bytes_group_worker",
                                 "bytes_group_global", "bytes_global_group")]
        assert row["bytes_total"] == sum(hops) and hops[0] > 0 and hops[1] > 0
    for chart in ("accuracy_vs_time", "accuracy_vs_bytes"):
        assert (out / f"smoke-{chart}.png").read_bytes()[:4] == b"\x89PNG"


def test_unknown_suite_is_refused_naming_the_suites(tmp_path, capsys):
    assert reproduce.main(["--smoke", "--suite", "nope", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "nope" in err and "smoke" in err
    assert not (tmp_path / "table.json").exists()  # nothing ran, nothing written


def test_quick_suite_decays_lr_over_its_budget():
    (suite,) = reproduce.suites_for("quick")
    assert suite.run["lr_schedule"] == "cosine" and suite.run["epochs"] > 0


def test_charts_draw_each_row_s_median_seed(tmp_path, monkeypatch):
    import repro_table  # loaded next to reproduce.py by the module above

    (suite,) = reproduce.suites_for("quick")
    suite.seeds = [0, 1, 2]
    exp = suite.experiments[0]
    last = {0: 0.8, 1: 0.5, 2: 0.9}  # seed -> last accuracy of its curve
    for seed in last:
        run_dir = tmp_path / reproduce.run_name(suite, exp, seed)
        run_dir.mkdir()
        (run_dir / "eval.jsonl").write_text("")
    monkeypatch.setattr(repro_table, "_curve",
                        lambda run_dir, x: ([1.0], [last[int(run_dir.name[-1])]]))
    assert repro_table._median_curve(suite, tmp_path, exp, "t") == ([1.0], [0.8])
    assert repro_table._median_curve(suite, tmp_path, suite.experiments[1], "t") is None


def test_table_shows_every_hop_and_a_dash_for_tables_made_before_them():
    import repro_table

    old = json.loads((ROOT / "results" / "quick" / "table.json").read_text())
    for suite in old["suites"].values():  # as a table made before the group <-> global hops
        for row in suite["rows"].values():
            for hop in repro_table.GLOBAL_HOPS:
                row.pop(hop, None)
    md = repro_table.table_markdown("quick", old)  # rows without the hop figures
    head = next(line for line in md.splitlines() if line.startswith("| experiment"))
    assert "| MB to global | MB from global | MB total |" in head
    bsp = next(line for line in md.splitlines() if line.startswith("| bsp |"))
    cells = [c.strip() for c in bsp.split("|")]
    col = [c.strip() for c in head.split("|")].index("MB total")
    assert cells[col] == cells[col - 1] == cells[col - 2] == "–"
    (suite,) = old["suites"].values()
    row = next(iter(suite["rows"].values()))
    row.update(bytes_group_global=2e6, bytes_global_group=3e6, bytes_total=9e6)
    line = repro_table.table_markdown("quick", old).splitlines()
    cells = [c.strip() for c in next(x for x in line if x.startswith("| bsp |")).split("|")]
    assert cells[col - 2:col + 1] == ["2.0", "3.0", "9.0"]
