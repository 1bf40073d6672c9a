"""scripts/bench_server.py measures every point of a grid in one run (issue 41 item 5,
issue 42 item 16): each point starts its server in a fresh run directory, so the second point
is not refused as "an earlier run", and every row carries its figures and the servers' CPU per
message kind. With ``--baseline-ref`` it measures a git ref's tree side by side (issue 56 item
6), so the guard against regressions cannot silently break."""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

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
        stages = p["setup_stages_s"]  # the slowest worker's set-up, stage by stage
        assert list(stages) == ["control", "assign", "group", "start"], stages
        assert 0 < stages["control"] <= stages["assign"] <= stages["group"] <= stages["start"]
        assert stages["start"] <= p["setup_s"] + 0.1, (stages, p["setup_s"])
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


def test_the_exact_exchange_is_measured_when_asked() -> None:
    doc = run_bench("--workers", "2", "--optimizer-at", "worker", "--window-s", "1",
                    "--exact-down", "--exact-xchg")
    assert doc["exact_xchg"] is True
    (p,) = doc["points"]
    assert "error" not in p and p["pushes_s"] > 0, p
    assert p["cpu_per_message"]["exchange"]["count"] > 0, p


def bench_module() -> Any:
    spec = importlib.util.spec_from_file_location("bench_server", BENCH)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_ref_is_measured_side_by_side_with_the_ratio_per_point() -> None:
    """--baseline-ref HEAD: HEAD's tree in a worktree (removed after), each point measured with
    both trees alternately, each run's figures and the ratio of the medians per point."""
    head = subprocess.run(["git", "-C", str(BENCH.parents[1]), "rev-parse", "HEAD"],
                          capture_output=True, text=True, check=True).stdout.strip()
    before = worktrees()
    doc = run_bench("--workers", "2", "--optimizer-at", "worker", "--window-s", "0.7",
                    "--runs", "2", "--baseline-ref", head)  # HEAD, as it was (others commit)
    assert worktrees() == before, "the ref's worktree is removed"
    base = doc["baseline"]
    assert base["commit"] == head and base["dropped_flags"] == [] and "own" in base["driver"]
    assert len(doc["points"]) == len(base["points"]) == 2
    assert all("error" not in p and p["pushes_s"] > 0 for p in doc["points"] + base["points"])
    (row,) = doc["side_by_side"]
    assert (row["model"], row["workers"], row["ref_optimizer_at"]) == ("lenet5", 2, "worker")
    for key in bench_module().COMPARED:
        this, ref = row["this"][key], row["ref"][key]
        assert len(this) == len(ref) == 2 and all(v is not None for v in this + ref), key
        want = statistics.median(this) / statistics.median(ref)
        assert row["this_over_ref"][key] == pytest.approx(want, abs=1e-3), key


def test_a_ref_whose_bench_lacks_a_flag_runs_without_it_and_says_so() -> None:
    """A ref from before ``--optimizer-at`` (0162ffa) measures its one place: the flag is left
    out of its argv and named, and its default is not passed either."""
    mod = bench_module()
    args = argparse.Namespace(max_active_text="lenet5=8", step_s=0.1, window_s=1.0, clients=1,
                              groups=2, group_processes=False, dense_down=False,
                              exact_down=True, exact_xchg=True, checkpoint_every=0.0)
    spec = {"model": "lenet5", "optimizer_at": "worker", "ratio": 0.01, "workers": 4}
    known = {"--json", "--models", "--ratios", "--workers", "--max-active", "--step-s",
             "--window-s", "--clients", "--groups"}
    argv, dropped = mod.ref_argv(spec, args, known)
    assert dropped == ["--optimizer-at", "--exact-down", "--exact-xchg"]
    assert "--optimizer-at" not in argv and argv[argv.index("--workers") + 1] == "4"


def worktrees() -> set[str]:
    """The paths of the repository's worktrees (their commits move as others commit)."""
    out = subprocess.run(["git", "-C", str(BENCH.parents[1]), "worktree", "list", "--porcelain"],
                         capture_output=True, text=True, check=True).stdout
    return {line.split(" ", 1)[1] for line in out.splitlines() if line.startswith("worktree ")}


def test_py_spy_is_found_beside_the_python_or_named_missing_in_one_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--profile ran "py-spy" from PATH only: from an unactivated venv it failed with a
    FileNotFoundError traceback after the servers had started."""
    bench = bench_module()
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing on PATH
    spy = tmp_path / "bin" / "py-spy"
    spy.parent.mkdir()
    spy.write_text("#!/bin/sh\n")
    monkeypatch.setattr(bench.sys, "executable", str(tmp_path / "bin" / "python"))
    assert bench.py_spy() == str(spy)
    spy.unlink()
    with pytest.raises(SystemExit, match=r"--profile needs py-spy \(pip install py-spy\)"):
        bench.py_spy()
