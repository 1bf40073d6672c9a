"""Tests of scripts/reproduce.py: the experiment matrix, the table arithmetic, and a tiny real run.

The end-to-end test executes the script's ``--smoke`` size (2 workers, two experiments, about
20 pushes each, real processes on loopback) so the script cannot silently rot.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from dataclasses import replace
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
                "gssp+losscomp", "ddp", "ddp-fp16", "ddp-powersgd", "lbbsp",
                "lbbsp+topk"} <= set(labels)
        hooks = {e.label: e.ddp_hook for e in suite.experiments if e.ddp_hook}
        assert hooks == {"ddp": "none", "ddp-fp16": "fp16", "ddp-powersgd": "powersgd"}
        assert suite.slowdowns == [1, 1, 1.5, 1.5, 2, 2, 4, 4]
        for exp in suite.experiments:
            assert not OPTIMIZER_KEYS & set(exp.overrides), exp.label
        sparse = [e for e in suite.experiments if e.part == "compression"]
        assert {e.overrides["ratio"] for e in sparse} == {reproduce.RATIO}
        # the presets' best 1% setting: the optimizer on the workers, as `make demo`
        gdtopk = [e for e in suite.experiments if e.label.startswith("gssp+gdtopk")]
        for exp in sparse + gdtopk:
            assert exp.overrides["optimizer_at"] == "worker", exp.label
            assert exp.overrides["down_drift"] == reproduce.SPARSE_DEFAULTS["down_drift"]


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


def test_sync_every_overrides_the_exchange_cadence_of_every_row(tmp_path):
    """--sync-every 16 and --group-momentum cluster reach each row's launch config (rows of
    gssp_causes.py, run for real)."""
    (suite,) = reproduce.suites_for("link")
    args = reproduce._parser().parse_args(["--link-suite", "--sync-every", "16"])
    reproduce._apply_overrides(suite, args)
    for exp in suite.experiments[:3]:
        assert reproduce._launch_config(suite, exp, 0, tmp_path).run.sync_every == 16
    args = reproduce._parser().parse_args(["--link-suite", "--group-momentum", "cluster"])
    reproduce._apply_overrides(suite, args)
    for exp in suite.experiments[:3]:
        assert reproduce._launch_config(suite, exp, 0, tmp_path).run.group_momentum == "cluster"


def test_a_longer_budget_makes_the_wall_cap_as_many_times_longer(tmp_path):
    """--epochs 20 on the link suite (5 epochs, a 240 s cap) gives a 960 s cap, so the
    20-epoch runs are not cut at the 5-epoch run's cap; a shorter budget keeps the cap."""
    for epochs, wall in (("20", 960.0), ("1", 240.0)):
        (suite,) = reproduce.suites_for("link")
        reproduce._apply_overrides(suite, reproduce._parser().parse_args(
            ["--link-suite", "--epochs", epochs]))
        assert (suite.run["epochs"], suite.run["wall_s"]) == (float(epochs), wall)
        run = reproduce._launch_config(suite, suite.experiments[0], 0, tmp_path).run
        assert run.epochs == float(epochs)


def test_the_link_suites_hold_local_steps_rows_that_validate(tmp_path):
    """--link-suite and --link-suite-5mbit: dense vs compressed vs local steps (row specs);
    every row's launch config validates (the optimizer on the workers where H > 1)."""
    for size, link in (("link", "20mbit"), ("link5", "5mbit")):
        (suite,) = reproduce.suites_for(size)
        assert suite.link == link
        rows = {e.label: e for e in suite.experiments}
        assert {"gssp+local8", "gssp+local8+nesterov", "gssp+localauto",
                "gssp+local8+topk"} <= set(rows)
        for exp in suite.experiments:
            assert not OPTIMIZER_KEYS & set(exp.overrides), exp.label
            run = reproduce._launch_config(suite, exp, 0, tmp_path).run
            if exp.label.startswith("gssp+local"):
                assert run.optimizer_at == "worker" and run.local_steps in (0, 4, 8)
        assert rows["gssp+local8+topk"].overrides["ratio"] == 8 * reproduce.RATIO  # per step
    assert reproduce._parser().parse_args(["--link-suite-5mbit"]).link_suite_5mbit


def test_the_mixed_link_suite_puts_each_worker_behind_a_link_that_follows_its_speed(tmp_path):
    from minips.net.links import parse_profile

    (suite,) = reproduce.suites_for("linkmixed")
    rates = [parse_profile(suite.link).rate(i).up_bps for i in range(len(suite.slowdowns))]
    assert rates == sorted(rates, reverse=True) and rates[0] == 20 * rates[-1]  # 100 .. 5 mbit
    assert [e.label for e in suite.experiments] == [
        "bsp", "gssp", "gssp+gdtopk-slower-less", "gssp-unlinked", "gssp+local8",
        "gssp+local8+topk", "ddp-fp16"]
    for exp in suite.experiments:
        if not exp.ddp_hook:
            reproduce._launch_config(suite, exp, 0, tmp_path)  # every row validates
    argv = reproduce.ddp_argv(suite, next(e for e in suite.experiments if e.ddp_hook), 0)
    assert argv[argv.index("--link") + 1] == suite.link  # DDP's ranks behind the same links
    assert reproduce._parser().parse_args(["--link-suite-mixed"]).link_suite_mixed


def test_time_scale_stretches_steps_links_caps_and_evaluations_alike(tmp_path):
    """--time-scale 2: base step, wall cap, evaluation interval x 2 and every link / 2 (the
    suite's and a row's own), so compute and communication keep their proportions; the
    run directories go to results/<size>-x2, never among the unstretched runs."""
    from minips.net.links import parse_profile

    (plain,) = reproduce.suites_for("linkmixed")
    (suite,) = reproduce.suites_for("linkmixed")
    reproduce.stretch_time(suite, 2.0)
    for key in ("base_step_s", "wall_s", "eval_every_s"):
        assert suite.run[key] == 2 * plain.run[key]
    n = len(suite.slowdowns)
    assert [parse_profile(suite.link).rate(i).up_bps for i in range(n)] == [
        parse_profile(plain.link).rate(i).up_bps / 2 for i in range(n)]
    assert next(e for e in suite.experiments if e.label == "gssp-unlinked").link == ""
    assert "Time stretched 2x" in suite.description
    exp = next(e for e in suite.experiments if e.label == "gssp+local8+topk")
    cfg = reproduce._launch_config(suite, exp, 0, tmp_path)
    assert cfg.run.base_step_s == pytest.approx(2 * plain.run["base_step_s"])
    argv = reproduce.ddp_argv(suite, next(e for e in suite.experiments if e.ddp_hook), 0)
    assert argv[argv.index("--link") + 1] == suite.link
    assert float(argv[argv.index("--base-step") + 1]) == suite.run["base_step_s"]
    with pytest.raises(SystemExit, match="factor > 0"):
        reproduce.stretch_time(suite, -1.0)


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


def test_an_unknown_row_is_refused_in_one_line_before_anything_runs(tmp_path, capsys):
    """--only with a label the suite does not have (e.g. LABEL+exact of a row that is exact
    already) is one clear line, not a row skipped without a word."""
    argv = ["--link-suite", "--down-mode", "both", "--out", str(tmp_path), "--only"]
    assert reproduce.main([*argv, "gssp+gdtopk-slower-less+exact,ddp-fp16"]) == 2
    err = capsys.readouterr().err
    assert "gssp+gdtopk-slower-less+exact" in err and "+compressed" in err
    assert err.count("\n") == 1 and "ddp-fp16'" not in err
    assert not (tmp_path / "table.json").exists() and not any((tmp_path / "runs").iterdir())


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
    lines = md.splitlines()  # the median table's bsp row (a carried row reads "bsp †")
    bsp = next(line for line in lines[lines.index(head):] if line.startswith("| bsp "))
    cells = [c.strip() for c in bsp.split("|")]
    col = [c.strip() for c in head.split("|")].index("MB total")
    assert cells[col] == cells[col - 1] == cells[col - 2] == "–"
    (suite,) = old["suites"].values()
    row = suite["rows"]["bsp"]
    row.update(bytes_group_global=2e6, bytes_global_group=3e6, bytes_total=9e6)
    line = repro_table.table_markdown("quick", old).splitlines()
    cells = [c.strip() for c in next(x for x in line[line.index(head):]
                                     if x.startswith("| bsp ")).split("|")]
    assert cells[col - 2:col + 1] == ["2.0", "3.0", "9.0"]


def test_the_ceiling_is_sum_of_rates_over_bsp_s_rate_and_follows_a_schedule():
    from minips.core.slowdown import Schedule, Slowdown, parse_schedule

    (suite,) = reproduce.suites_for("quick")
    flat = reproduce.suite_slowdowns(suite)
    assert reproduce.profile_ceiling(flat) == pytest.approx((2 + 2 / 1.5 + 1 + 0.5) / (8 / 4))
    assert reproduce.profile_ceiling(flat) == pytest.approx(2.4167, abs=1e-4)
    assert reproduce.profile_ceiling([Slowdown(Schedule.flat(2.0))] * 4) == pytest.approx(1.0)
    # one of two workers is 4x for the first 10 s, then 1x: ceiling 2.5/2 then 1, over 20 s
    changing = [Slowdown(Schedule.flat(1.0)), Slowdown(parse_schedule("4@0,1@10s"))]
    assert reproduce.profile_ceiling(changing, horizon_s=20.0) == pytest.approx(
        (10 * 1.25 + 10 * 2) / (10 * 0.5 + 10 * 2))
    rows = {"bsp": {"speedup_vs_bsp": 1.0}, "gssp": {"speedup_vs_bsp": 2.3},
            "x": {"speedup_vs_bsp": None}}
    import repro_table

    repro_table.add_ceiling_shares(rows, 2.4167)
    assert rows["gssp"]["ceiling_share"] == pytest.approx(0.9517, abs=1e-4)
    assert rows["x"]["ceiling_share"] is None


def test_the_changing_suite_s_rows_resolve_to_valid_configs():
    from minips.core.slowdown import parse_schedules

    (suite,) = reproduce.suites_for("changing")
    labels = [e.label for e in suite.experiments]
    assert labels == ["ddp", "bsp", "lbbsp", "ssp", "gssp", "gssp-fixed-groups",
                      "gssp+gdtopk-slower-less", "lbbsp+topk"]
    schedules = parse_schedules(suite.profile)
    assert len(schedules) == len(suite.slowdowns) == 8
    assert [s.first for s in schedules] == [1, 1, 1.5, 1.5, 2, 2, 4, 4]
    assert sum(s.changes for s in schedules) == 3 and suite.throttle
    for exp in suite.experiments:
        assert not OPTIMIZER_KEYS & set(exp.overrides), exp.label
        cfg = reproduce._launch_config(suite, exp, 0, Path("/nonexistent"))
        assert cfg.run.workers == 8 and cfg.schedules == schedules
        assert cfg.throttle == suite.throttle
    fixed = next(e for e in suite.experiments if e.label == "gssp-fixed-groups")
    assert reproduce._launch_config(suite, fixed, 0, Path("/x")).run.regroup is False
    ddp = reproduce.ddp_argv(suite, suite.experiments[0], 0)
    assert ddp[ddp.index("--profile") + 1] == suite.profile and "--hook" in ddp
    bench = subprocess.run([sys.executable, ddp[1], "--help"], capture_output=True, text=True,
                           timeout=60)
    assert bench.returncode == 0
    assert all(flag in bench.stdout for flag in ddp[2::2] if flag.startswith("--"))


def test_a_ddp_row_is_read_from_its_ddp_json(tmp_path):
    import repro_table

    curve = [{"t": 5.0, "samples": 5120, "accuracy": 0.72}, {"t": 9.0, "samples": 10240,
                                                             "accuracy": 0.81}]
    (tmp_path / "ddp.json").write_text(json.dumps({
        "bench": "ddp", "curve": curve, "final_accuracy": 0.81, "final_full_test": 0.805,
        "train_s": 10.0, "steps": 20, "total_steps": 20, "overrun_max": 1.02}))
    figures = repro_table.run_figures(tmp_path, (0.70, 0.80, 0.85))
    assert set(repro_table.FIGURES) <= set(figures)
    assert figures["time_to_accuracy"] == {"0.70": 5.0, "0.80": 9.0, "0.85": None}
    assert (figures["final_accuracy"], figures["step_overrun"]) == (0.805, 1.02)
    assert figures["samples_per_s"] == pytest.approx(1024.0)
    assert figures["done_reason"] == "epochs" and figures["mean_staleness"] == 0


def test_the_table_shows_every_seed_flags_an_overrun_and_compares_gssp_seed_by_seed():
    import repro_table

    def figures(t85, overrun):
        return {"time_to_accuracy": {"0.85": t85}, "final_accuracy": 0.86,
                "bytes_total": 5e6, "step_overrun": overrun}

    rows = {"gssp": {"per_seed": {"0": figures(20.0, 1.01), "1": figures(25.0, 1.02)}},
            "ddp": {"per_seed": {"0": figures(60.0, 1.00), "1": figures(None, 1.08)}}}
    suite = {"config": {"seeds": [0, 1]}, "rows": rows}
    assert repro_table.against(suite, "gssp", "0.85") == {"ddp": {"0": 3.0, "1": None}}
    assert repro_table.overrun_flags({"suites": {"s": suite}}) == [
        "s/ddp seed 1: overrun 1.080"]
    assert repro_table.overrun_cell(1.08).endswith("⚠ CPU")
    assert "⚠" not in repro_table.overrun_cell(1.05)
    lines = repro_table._per_seed_markdown(suite, ["0.85"])
    assert "| ddp | 1 | – | 86.00 | 5.0 | 1.08 ⚠ CPU | 1 | – |" in lines
    lines = repro_table._against_markdown(suite, "gssp", "0.85")
    assert "| ddp | 3.00× | – |" in lines


def test_rows_without_runs_here_are_carried_from_the_earlier_table_and_marked():
    import repro_table

    new = {"suites": {"s": {"config": {"seeds": [0]}, "rows": {"ddp": {"x": 1}},
                            "missing": ["s-bsp-s0", "s-gssp-s0"]}}}
    earlier = {"created": "2026-12-01 03:44:08",
               "suites": {"s": {"rows": {"ddp": {"x": 0}, "bsp": {"x": 2}}}}}
    repro_table.carry_rows(new, earlier)
    rows = new["suites"]["s"]["rows"]
    assert rows["ddp"] == {"x": 1}  # rerun here: the new row
    assert rows["bsp"] == {"x": 2, "carried_from": "2026-12-01 03:44:08"}
    assert new["suites"]["s"]["missing"] == ["s-gssp-s0"]  # carried rows are not missing
    old = json.loads((ROOT / "results" / "quick" / "table.json").read_text())
    fresh = {"suites": {name: {**suite, "rows": {}, "missing": []}
                        for name, suite in old["suites"].items()}}
    repro_table.carry_rows(fresh, old)
    md = repro_table.table_markdown("quick", fresh)
    kept = next(line for line in md.splitlines() if "kept from the table of" in line)
    assert "| bsp † |" in md and old["created"] in kept  # and the dates of rows it carried


def test_the_ablation_separates_each_hop_and_each_of_dgcs_pieces(tmp_path):
    """--ablation-suite: dense, then DGC on the upload, + the downlink, + the exchange, on the
    servers' and the workers' optimizer, then masking, clipping and warm-up one by one; every
    sparse row at the same 1% a push; each row builds its compressor."""
    (suite,) = reproduce.suites_for("ablation")
    runs = {e.label: reproduce._launch_config(suite, e, 0, tmp_path).run
            for e in suite.experiments}
    assert runs["up"].downlink_ratio() == 1.0 and runs["up"].xchg_ratio == 1.0
    assert runs["up+down"].downlink_ratio() == reproduce.RATIO
    assert runs["up+down"].xchg_ratio == 1.0 and runs["all"].xchg_ratio is None
    for label in ("up", "up+down", "all"):
        assert runs[label].optimizer_at == "server"
        assert runs[f"{label}@worker"].optimizer_at == "worker"
    steps = [runs[k] for k in ("all@worker", "all@worker+mask", "all@worker+mask+clip",
                               "all@worker+mask+clip+warmup")]
    assert [r.momentum_masking for r in steps] == [False, True, True, True]
    assert [r.grad_clip > 0 for r in steps] == [False, False, True, True]
    assert [r.compressor_opts.get("warmup_fraction", 0) > 0 for r in steps] == [
        False, False, False, True]
    assert {r.ratio for r in runs.values() if r.compressor != "none"} == {reproduce.RATIO}
    for run in runs.values():
        run.worker_compressor(models.param_count("lenet5"), 0)
    for exp in suite.experiments:  # a label is one path component of its run directory
        assert "/" not in reproduce.run_name(suite, exp, 0)


def test_the_losscomp_sweep_tunes_on_a_validation_split_never_the_test_set(tmp_path):
    (suite,) = reproduce.suites_for("losscomp-sweep")
    assert suite.final_test is False and suite.run["val_size"] == reproduce.VAL_SIZE
    runs = {e.label: reproduce._launch_config(suite, e, 0, tmp_path).run
            for e in suite.experiments}
    assert len(runs) == 1 + len(reproduce.VOTE_WEIGHTS) * len(reproduce.VOTE_WINDOWS)
    assert runs["losscomp-w0"].compressor_opts.get("vote_weight", 0) == 0
    for run in runs.values():
        assert run.compressor == "losscomp" and run.val_size == reproduce.VAL_SIZE
        assert run.ratio == reproduce.RATIO and run.epoch_samples() == 60_000 - run.val_size
        run.worker_compressor(models.param_count("lenet5"), 0)
    weights = {r.compressor_opts.get("vote_weight") for r in runs.values()} - {None}
    assert weights == set(reproduce.VOTE_WEIGHTS)


def test_the_overrun_of_a_local_steps_push_is_per_step_not_per_push():
    import types

    import repro_table

    # two workers at F = 1 and 2, base 40 ms, batch 64: worker 0 pushes 8 local steps of
    # 40 ms each (samples 512, step_time the mean of the 8), worker 1 one step of 88 ms
    run = types.SimpleNamespace(workers={
        0: [{"step_time": 0.040, "samples": 512, "local_steps": 8, "slowdown": 1.0}] * 3,
        1: [{"step_time": 0.088, "samples": 64, "slowdown": 2.0}] * 3})
    assert repro_table._overrun(run, [1.0, 2.0], 0.04, 64) == pytest.approx(1.1)
    run.workers[1] = [{"step_time": 0.080, "samples": 64, "local_steps": 1}]
    assert repro_table._overrun(run, [1.0, 2.0], 0.04, 64) == pytest.approx(1.0)


def test_down_mode_both_puts_each_minips_row_beside_its_twin(tmp_path):
    """--down-mode both: LABEL and its twin with the other downlink side by side (LABEL+exact
    for a compressed row, LABEL+compressed for the sparse rows, exact by default; DDP rows
    have no downlink); --down-mode exact / auto: every minips run answers PULLs that way."""
    (suite,) = reproduce.suites_for("link")
    labels = [e.label for e in suite.experiments]
    mode = {e.label: reproduce._launch_config(suite, e, 0, tmp_path).run.down_mode
            for e in suite.experiments if not e.ddp_hook}
    assert mode["gssp+gdtopk-slower-less"] == mode["lbbsp+topk"] == "exact"  # SPARSE_DEFAULTS
    assert mode["gssp+local8+topk"] == mode["gssp"] == "auto"
    reproduce.with_downlink(suite, "both")
    rows = {e.label: e for e in suite.experiments}
    order = [e.label for e in suite.experiments]
    for label, twin, other in (("gssp+local8+topk", "gssp+local8+topk+exact", "exact"),
                               ("gssp+gdtopk-slower-less", "gssp+gdtopk-slower-less+compressed",
                                "auto")):
        assert order.index(twin) == order.index(label) + 1
        assert reproduce._launch_config(suite, rows[twin], 0, tmp_path).run.down_mode == other
        assert reproduce._launch_config(suite, rows[label], 0,
                                        tmp_path).run.down_mode == mode[label]
    assert "ddp+exact" not in rows and len(rows) == 2 * len(labels) - sum(
        1 for e in suite.experiments if e.ddp_hook)
    for down in ("exact", "auto"):
        (quick,) = reproduce.suites_for("quick")
        reproduce.with_downlink(quick, down)
        assert {reproduce._launch_config(quick, e, 0, tmp_path).run.down_mode
                for e in quick.experiments if not e.ddp_hook} == {down}
    args = reproduce._parser().parse_args(["--down-mode", "both"])
    assert args.down_mode == "both"


def test_the_link_suites_sparse_rows_send_float16_downlink_values_and_f32down_is_the_control(
        tmp_path):
    """Sparse rows take ``make demo``'s exact downlink with float16 values; the best row's
    ``+f32down`` twin differs from it only in those values."""
    for name in ("link", "link5"):
        (suite,) = reproduce.suites_for(name)
        rows = {e.label: e for e in suite.experiments}
        best = rows["gssp+gdtopk-slower-less"]
        twin = rows["gssp+gdtopk-slower-less" + reproduce.F32_DOWN]
        half = reproduce._launch_config(suite, best, 0, tmp_path).run
        full = reproduce._launch_config(suite, twin, 0, tmp_path).run
        assert (half.down_mode, half.down_values) == ("exact", "f16")
        assert (full.down_mode, full.down_values) == ("exact", "f32")
        assert replace(full, down_values="f16") == half
        lbbsp = reproduce._launch_config(suite, rows["lbbsp+topk"], 0, tmp_path).run
        assert (lbbsp.down_mode, lbbsp.down_values) == ("exact", "f16")


def test_the_exchange_and_alpha_rows_differ_from_the_best_row_in_that_one_setting(tmp_path):
    """``+xchg2%`` / ``+xchg4%`` change only the group <-> global exchange's kept fraction (the
    best row's is its upload ratio, 1%), ``+alpha0.5`` / ``+alpha2`` only GDTopK's spread."""
    (suite,) = reproduce.suites_for("link")
    rows = {e.label: e for e in suite.experiments}
    best = reproduce._launch_config(suite, rows["gssp+gdtopk-slower-less"], 0, tmp_path).run
    assert best.xchg_ratio is None and best.gdtopk_alpha == 1.0
    for suffix, field, value in (("+xchg2%", "xchg_ratio", 0.02), ("+xchg4%", "xchg_ratio", 0.04),
                                 ("+alpha0.5", "gdtopk_alpha", 0.5),
                                 ("+alpha2", "gdtopk_alpha", 2.0)):
        run = reproduce._launch_config(
            suite, rows["gssp+gdtopk-slower-less" + suffix], 0, tmp_path).run
        assert getattr(run, field) == value
        assert replace(run, **{field: getattr(best, field)}) == best


def test_down_values_f32_gives_every_sparse_row_the_float32_downlink_of_the_earlier_runs(
        tmp_path):
    """--down-values f32 reruns a sparse row as the runs before the float16 default sent it;
    dense rows and DDP are untouched."""
    (suite,) = reproduce.suites_for("link")
    before = {e.label: e for e in suite.experiments}
    reproduce._apply_overrides(suite, reproduce._parser().parse_args(
        ["--link-suite", "--down-values", "f32"]))
    for exp in suite.experiments:
        run = None if exp.ddp_hook else reproduce._launch_config(suite, exp, 0, tmp_path).run
        if "down_values" in before[exp.label].overrides:
            assert run.down_values == "f32", exp.label
        else:
            assert exp == before[exp.label], exp.label
    assert "gssp+gdtopk-slower-less" in before and "lbbsp+topk" in before


def test_the_link_only_profile_has_equal_compute_and_only_two_slow_links(tmp_path):
    """--link-suite-links: every worker computes alike, six sit behind 100 mbit and two behind
    5 mbit; its rows are BSP, LB-BSP, dense GSSP, GSSP + GDTopK, DDP + fp16 and GSSP without
    links, every minips row's launch config validates, and DDP's ranks get the same links."""
    from minips.net.links import parse_profile

    (suite,) = reproduce.suites_for("linkonly")
    assert suite.name == "linkonly" and suite.link == "100,100,100,100,100,100,5,5mbit"
    assert suite.slowdowns == [1.0] * 8  # equal compute: only a link makes a worker slow
    rates = [parse_profile(suite.link).rate(i).up_bps for i in range(8)]
    assert rates[:6] == [rates[0]] * 6 and rates[6:] == [rates[0] / 20] * 2
    assert [e.label for e in suite.experiments] == [
        "bsp", "gssp", "gssp+gdtopk-slower-less", "gssp-unlinked", "ddp-fp16", "lbbsp"]
    assert set(suite.leads) == {"gssp", "gssp+gdtopk-slower-less"}
    for exp in suite.experiments:
        if not exp.ddp_hook:
            cfg = reproduce._launch_config(suite, exp, 0, tmp_path)  # validates
            assert cfg.slowdowns == [1.0] * 8 and cfg.run.workers == 8
            assert cfg.link == ("" if exp.label == "gssp-unlinked" else suite.link)
    argv = reproduce.ddp_argv(suite, next(e for e in suite.experiments if e.ddp_hook), 0)
    assert argv[argv.index("--link") + 1] == suite.link
    assert argv[argv.index("--profile") + 1] == ",".join(["1"] * 8)
    # the cluster asks the CPUs for as many steps a second as the link suite's profile
    (link,) = reproduce.suites_for("link")
    asked = sum(1 / f for f in link.slowdowns) / link.run["base_step_s"]
    assert 8 / suite.run["base_step_s"] == pytest.approx(asked, rel=0.01)
    assert reproduce._parser().parse_args(["--link-suite-links"]).link_suite_links


def _ddp_run(run_dir: Path, final: float, t50: float | None) -> None:
    """A finished DDP-format run directory (ddp.json + summary.json): the table reads it."""
    run_dir.mkdir(parents=True)
    curve = [{"t": 10.0, "samples": 1000, "accuracy": 0.40},  # the smoke suite's 30% and 50%
             {"t": t50 or 50.0, "samples": 2000, "accuracy": 0.60 if t50 else 0.45}]
    (run_dir / "ddp.json").write_text(json.dumps({
        "curve": curve, "final_accuracy": final, "final_full_test": final,
        "final_full_test_samples": 10000, "train_s": 60.0, "steps": 5, "total_steps": 5}))
    (run_dir / "summary.json").write_text(json.dumps({"status": "done"}))


def test_repeat_makes_each_seeds_figure_the_median_of_its_runs_and_shows_k_and_spread(
        tmp_path, capsys):
    """--repeat 3: three runs of each seed (``-s0``, ``-s0-r1``, ``-s0-r2``); the seed's
    figures are their medians (a time never reached counts as infinitely slow), with the
    number of runs and their spread in table.json and table.md; the row's figure is the median
    over seeds of those medians."""
    (suite,) = reproduce.suites_for("smoke")
    exp = suite.experiments[0]
    assert reproduce.run_name(suite, exp, 0) == "smoke-bsp-s0"  # the first run's name is kept
    assert reproduce.run_name(suite, exp, 0, 2) == "smoke-bsp-s0-r2"
    runs = tmp_path / "runs"
    for k, (final, t50) in enumerate([(0.861, 30.0), (0.866, None), (0.858, 34.0)]):
        _ddp_run(runs / reproduce.run_name(suite, exp, 0, k), final, t50)
    _ddp_run(runs / reproduce.run_name(suite, suite.experiments[1], 0, 0), 0.85, 20.0)
    argv = ["--smoke", "--table-only", "--no-plot", "--fresh-table", "--out", str(tmp_path)]
    assert reproduce.main([*argv, "--repeat", "3"]) == 0
    table = json.loads((tmp_path / "table.json").read_text())["suites"]["smoke"]
    bsp = table["rows"]["bsp"]
    seed = bsp["per_seed"]["0"]
    assert seed["runs"] == 3 and table["config"]["repeats"] == 3
    assert seed["final_accuracy"] == pytest.approx(0.861)  # the median, not the first run
    assert seed["time_to_accuracy"]["0.50"] == 34.0  # 30, 34 and never: never is slowest
    assert seed["runs_spread"]["final_accuracy"] == pytest.approx([0.858, 0.866])
    assert bsp["final_accuracy"] == pytest.approx(0.861)
    # the other row ran once of three: its seed is the one run, the two absent are missing
    assert table["rows"]["gssp+topk"]["per_seed"]["0"]["runs"] == 1
    assert set(table["missing"]) == {"smoke-gssp+topk-s0-r1", "smoke-gssp+topk-s0-r2"}
    md = (tmp_path / "table.md").read_text()
    assert "3 runs a seed (its figures the median)" in md
    assert "| bsp | 0 | 10 | 34 | 86.10 | – | – | 3 | 85.80–86.60 % / 30 s–never |" in md
    assert "| gssp+topk | 0 | 10 | 20 | 85.00 | – | – | 1 | – |" in md
    assert "all 10,000 test samples" in md  # which samples the final accuracy is taken on
    # with one run a seed (the default), only -s0 counts and the header says so
    assert reproduce.main([*argv]) == 0
    table = json.loads((tmp_path / "table.json").read_text())["suites"]["smoke"]
    assert table["rows"]["bsp"]["per_seed"]["0"]["final_accuracy"] == pytest.approx(0.861)
    assert table["rows"]["bsp"]["per_seed"]["0"]["runs"] == 1
    capsys.readouterr()
    with pytest.raises(SystemExit):
        reproduce.main([*argv, "--repeat", "0"])
    err = capsys.readouterr().err
    assert "--repeat" in err and "1 or more" in err


def test_a_seed_of_three_runs_takes_the_median_time_and_a_missed_target_as_infinite():
    import repro_table

    figs = [{"time_to_accuracy": {"0.85": t}, "final_accuracy": a}
            for t, a in ((60.0, 0.86), (None, 0.85), (64.0, 0.87))]
    seed = repro_table.seed_figures(figs)
    assert seed["time_to_accuracy"]["0.85"] == 64.0 and seed["runs"] == 3
    assert seed["runs_spread"]["time_to_0.85"] == [60.0, None]  # one run never got there
    assert repro_table.runs_spread_cell(seed, "0.85") == "85.00–87.00 % / 60 s–never"
    both = repro_table.seed_figures([figs[0], figs[2]])
    assert repro_table.runs_spread_cell(both, "0.85") == "86.00–87.00 % / 60 s–64 s"
    one = repro_table.seed_figures(figs[:1])
    assert one["runs_spread"] == {} and repro_table.runs_spread_cell(one, "0.85") == "–"


def test_the_final_accuracy_note_names_a_row_scored_on_fewer_test_samples():
    """Every row's final accuracy is on the same test samples; a row that was not (no final
    weights kept: the evaluator's last point on eval_limit samples) is named under the table."""
    import repro_table

    suite = {"config": {"epochs": 5.0, "eval_limit": 5000},
             "rows": {"gssp": {"final_samples": 10000}, "ddp-fp16": {"final_samples": 10000},
                      "old": {"final_samples": 5000}}}
    note = repro_table.final_note(suite)
    assert "all 10,000 test samples" in note and "first 5000" in note
    assert note.endswith("the evaluator's last point): old.")
    del suite["rows"]["old"]
    assert "fewer" not in repro_table.final_note(suite)


def test_a_ddp_row_trains_the_clusters_samples_budget_with_minips_warm_up(tmp_path):
    """bench_ddp.py's budget is minips': epochs x the training set, all ranks together, to the
    first round that reaches it (586 rounds of 8 x 64 for 5 epochs of 60,000, as minips BSP;
    not 5 x 117 batches of each rank's shard, 585), and its lr warms up as minips' rows do."""
    spec = importlib.util.spec_from_file_location("bench_ddp", ROOT / "scripts" / "bench_ddp.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.budget_steps(5.0, 60000, 8, 64) == 586
    assert bench.budget_steps(1.0, 1024, 2, 64) == 8  # a budget of whole rounds: no extra one
    (suite,) = reproduce.suites_for("link")
    argv = reproduce.ddp_argv(suite, next(e for e in suite.experiments if e.ddp_hook), 0)
    from minips.core.config import RunConfig

    assert float(argv[argv.index("--lr-warmup") + 1]) == RunConfig().lr_warmup > 0
    assert bench._parser().parse_args(["--lr-warmup", "0"]).lr_warmup == 0


@pytest.mark.timeout(120)
def test_the_reference_script_trains_a_suites_schedule_and_scores_the_first_samples_too():
    """scripts/train_reference.py with a suite's workers, cosine schedule and warm-up is the
    reference loop with them (synchronous SGD as minips BSP and DDP train it); it scores the
    final weights on the whole test set and, with --eval-limit, on its first N samples."""
    from minips.ml import reference

    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "train_reference.py"), "--synthetic",
         "--steps", "4", "--batch-size", "16", "--workers", "2", "--lr", "0.05",
         "--lr-schedule", "cosine", "--lr-warmup", "0.01", "--eval-limit", "100", "--json"],
        capture_output=True, text=True, timeout=100, check=True)
    result = json.loads(out.stdout)
    assert (result["lr_schedule"], result["lr_warmup"], result["eval_limit"]) == (
        "cosine", 0.01, 100)
    train = data.load_dataset("fashion-mnist", "train", synthetic=True)
    test = data.load_dataset("fashion-mnist", "test", synthetic=True)
    flat, _ = reference.train("lenet5", train, lr=0.05, seed=0, steps=4, batch_size=16,
                              workers=2, lr_schedule="cosine", lr_warmup=0.01)
    assert result["test_samples"] == len(test)
    assert result["test_accuracy"] == pytest.approx(models.evaluate("lenet5", flat, test)[0],
                                                    abs=1e-12)
    head = test.subset(np.arange(100))
    assert result["test_accuracy_first"] == pytest.approx(
        models.evaluate("lenet5", flat, head)[0], abs=1e-12)
    flat0, _ = reference.train("lenet5", train, lr=0.05, seed=0, steps=4, batch_size=16,
                               workers=2, lr_schedule="cosine")
    assert not np.allclose(flat0, flat)  # the warm-up did change the updates


def test_xchg_mode_both_puts_each_minips_row_beside_its_exact_exchange_twin(tmp_path):
    """--xchg-mode both: each minips row, then LABEL+xexact with the exact group <-> global
    exchange (core/exchange.py), the rest unchanged; exact / topk set it for every row."""
    (suite,) = reproduce.suites_for("link")
    plain = {e.label: reproduce._launch_config(suite, e, 0, tmp_path).run
             for e in suite.experiments if not e.ddp_hook}
    reproduce.with_exchange(suite, "both")
    order = [e.label for e in suite.experiments]
    rows = {e.label: e for e in suite.experiments}
    for label, run in plain.items():
        twin = label + reproduce.XEXACT
        assert order.index(twin) == order.index(label) + 1
        got = reproduce._launch_config(suite, rows[twin], 0, tmp_path).run
        assert got.xchg_mode == "exact" and replace(got, xchg_mode=run.xchg_mode) == run
    for mode in ("exact", "topk"):
        (quick,) = reproduce.suites_for("quick")
        reproduce.with_exchange(quick, mode)
        assert {reproduce._launch_config(quick, e, 0, tmp_path).run.xchg_mode
                for e in quick.experiments if not e.ddp_hook} == {mode}
    assert reproduce._parser().parse_args(["--xchg-mode", "both"]).xchg_mode == "both"
