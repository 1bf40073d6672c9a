"""`minips local`: a real cluster of processes on loopback; clean end, clean Ctrl-C."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import interrupt, processes_mentioning

from minips.core.config import RunConfig
from minips.ml import data, models
from minips.record.rundir import read_jsonl
from minips.run.launch import Cluster, LaunchConfig, run_local


@pytest.mark.timeout(120)
def test_local_bsp_run_writes_a_complete_run_directory(tmp_path: Path) -> None:
    run = RunConfig(mode="bsp", compressor="none", workers=2, max_steps=8, base_step_s=0.0,
                    calib_steps=1, eval_every_s=0.5, eval_limit=1000)
    summary = run_local(LaunchConfig(run=run, out_dir=str(tmp_path), name="bsp",
                                     progress=False, plot=False))
    run_dir = tmp_path / "bsp"
    assert summary["status"] == "done"
    assert summary["steps"] == 16 and summary["workers"] == 2 and summary["groups"] == 1
    for name in ("config.json", "summary.json", "global.jsonl", "group-0.jsonl", "eval.jsonl",
                 "worker-0.jsonl", "worker-1.jsonl", "init.npy", "final_weights.npy"):
        assert (run_dir / name).exists(), name
    # the summary's final accuracy is that of the final weights on every test sample (the
    # periodic points use the first eval_limit), as the tables score every row
    written = json.loads((run_dir / "summary.json").read_text())
    test = data.load_dataset("fashion-mnist", "test")
    acc, _ = models.evaluate("lenet5", np.load(run_dir / "final_weights.npy"), test)
    assert written["final_accuracy"] == pytest.approx(acc, abs=1e-12)
    assert written["final_test_samples"] == len(test)
    assert all(r["test_samples"] == 1000 for r in read_jsonl(run_dir / "eval.jsonl")[:-1])
    assert read_jsonl(run_dir / "eval.jsonl")[-1]["final"] is True
    # ... and it says which data that was: each process's record, and one word for the run
    kind = "synthetic" if test.meta["synthetic"] else "real"
    assert written["data"] == kind
    assert set(written["data_sources"]) == {"worker-0", "worker-1", "evaluator"}
    assert not processes_mentioning(str(run_dir))


@pytest.mark.timeout(120)
def test_ctrl_c_stops_every_child_and_still_writes_the_summary(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "minips", "local", "--mode", "asp", "--workers", "2",
           "--wall-s", "300", "--base-step", "0.05", "--no-plot", "--no-progress",
           "--out", str(tmp_path), "--name", "cc"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    worker_log = tmp_path / "cc" / "worker-1.jsonl"
    deadline = time.monotonic() + 90
    while not (worker_log.exists() and worker_log.stat().st_size > 0):
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.1)
    _, err = interrupt(proc, 60)
    summary = json.loads((tmp_path / "cc" / "summary.json").read_text())
    assert summary["status"] == "interrupted"
    assert "run directory" in err
    deadline = time.monotonic() + 10
    while processes_mentioning(str(tmp_path / "cc")) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not processes_mentioning(str(tmp_path / "cc"))


def test_children_that_exit_with_an_error_are_named(tmp_path: Path) -> None:
    cluster = Cluster(LaunchConfig(out_dir=str(tmp_path)), tmp_path, "token")
    cluster._spawn("worker-0", ["worker", "--help"])  # exits 0
    cluster._spawn("worker-1", ["worker", "--connect", "127.0.0.1:0"])  # bad flag: exits 2
    assert cluster.collect(timeout_s=60) == ["worker-1"]
    assert "error" in (tmp_path / "logs" / "worker-1.log").read_text()


def _alive(pid: int) -> bool:
    """``pid`` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _start_local(tmp_path: Path, name: str) -> tuple[subprocess.Popen[str], list[int]]:
    """`minips local` training (2 ASP workers, evaluator); its children's pids once a worker
    has stepped (each child's command line holds the run directory)."""
    cmd = [sys.executable, "-m", "minips", "local", "--mode", "asp", "--workers", "2",
           "--wall-s", "300", "--base-step", "0.05", "--no-plot", "--no-progress",
           "--out", str(tmp_path), "--name", name]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    worker_log = tmp_path / name / "worker-1.jsonl"
    deadline = time.monotonic() + 90
    while not (worker_log.exists() and worker_log.stat().st_size > 0):
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.1)
    children = [p for p in processes_mentioning(str(tmp_path / name)) if p != proc.pid]
    assert len(children) >= 4, children  # server, 2 workers, evaluator
    return proc, children


def _survivors(pids: list[int], within_s: float) -> list[int]:
    """The pids still running ``within_s`` seconds from now (polled, returns early when none)."""
    deadline = time.monotonic() + within_s
    while (alive := [p for p in pids if _alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive


@pytest.mark.timeout(150)
def test_no_child_survives_its_launcher_killed(tmp_path: Path) -> None:
    proc, children = _start_local(tmp_path, "kill9")
    proc.kill()
    proc.wait()
    left = _survivors(children, 5.0)
    for p in left:  # do not leave them running when the test fails
        os.kill(p, signal.SIGKILL)
    assert not left, f"children alive 5 s after the launcher's SIGKILL: {left}"


@pytest.mark.timeout(150)
def test_sigterm_stops_the_cluster_promptly_and_writes_the_summary(tmp_path: Path) -> None:
    proc, children = _start_local(tmp_path, "term")
    t = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    took = time.monotonic() - t
    left = _survivors(children, 5.0)
    for p in left:
        os.kill(p, signal.SIGKILL)
    assert not left, f"children alive 5 s after the launcher's SIGTERM: {left}"
    assert proc.returncode == 143, err
    assert json.loads((tmp_path / "term" / "summary.json").read_text())["status"] == "terminated"
    assert took < 10, f"SIGTERM took {took:.1f} s"


@pytest.mark.timeout(60)
def test_every_worker_failing_ends_a_local_run_at_once(tmp_path: Path) -> None:
    """The server would wait --rejoin-wait for workers that will never come back: the launcher
    sees that every worker exited with an error and stops the run now."""
    import numpy as np

    from minips.core.config import PARAM_COUNTS
    from minips.run.launch import WorkersFailed

    cluster = Cluster(LaunchConfig(run=RunConfig(workers=2), out_dir=str(tmp_path)), tmp_path,
                      "token")
    try:
        np.save(tmp_path / "init.npy", np.zeros(PARAM_COUNTS["lenet5"], np.float32))
        cluster.start_server(tmp_path / "init.npy")  # then it waits for its workers
        for i in range(2):
            cluster._spawn(f"worker-{i}", ["worker", "--connect", "127.0.0.1:0"])  # exits 2
        t = time.monotonic()
        with pytest.raises(WorkersFailed, match="worker-0, worker-1 exited with an error"):
            cluster.wait(timeout_s=40, progress=False)
        assert time.monotonic() - t < 30
    finally:
        cluster.stop()


@pytest.mark.parametrize(("model", "mode", "groups", "in_process", "expected"), [
    ("lenet5", "gssp", 2, False, 0),       # small: in the server's process
    ("resnet18", "gssp", 2, False, 2),     # large: a process per fixed group
    ("resnet18", "gssp", 0, False, 4),     # automatic count: max_groups (4) processes
    ("vgg19", "bsp", 0, False, 1),         # a single-group mode: one
    ("resnet18", "gssp", 2, True, 0),      # --groups-in-process keeps them in
])
def test_a_large_model_gets_a_group_process_per_group_unless_told(
        tmp_path: Path, model: str, mode: str, groups: int, in_process: bool,
        expected: int) -> None:
    cfg = LaunchConfig(run=RunConfig(model=model, mode=mode, groups=groups, workers=8),
                       groups_in_process=in_process)
    assert cfg.group_processes() == expected
    cluster = Cluster(cfg, tmp_path, "t")
    assert cluster._external_args() == (["--external-groups", str(expected)] if expected else [])


def test_the_automatic_group_count_is_at_most_one_group_per_worker() -> None:
    cfg = LaunchConfig(run=RunConfig(model="resnet18", mode="gssp", groups=0, workers=2))
    assert cfg.group_processes() == 2
