"""Speeds that change and LB-BSP, on real processes (`minips local`, loopback, Fashion-MNIST):
a scheduled slowdown change is an event in the worker's file and moves the worker to the other
group within the documented delay (a 4x change: ``roster.REGROUP_FAST_S``); in ``--mode lbbsp``
the batch sizes follow the workers' speeds, with the same total per round. Links that change
(``--link-change``): parsed, and a kernel-shaped link's tbf changed live (root only)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import interrupt, records, steps, wait_for

from minips.core.roster import REGROUP_DELAY_S, REGROUP_FAST_S
from minips.errors import ConfigError
from minips.net import netshape
from minips.net.links import LinkChange, Rate, parse_link_changes


def _local(tmp_path: Path, name: str, *flags: str) -> list[str]:
    return [sys.executable, "-m", "minips", "local", "--no-progress", "--no-eval", "--no-plot",
            "--out", str(tmp_path), "--name", name, "--device", "cpu", *flags]


@pytest.mark.timeout(120)
def test_a_scheduled_speed_up_regroups_the_worker_within_the_documented_delay(
        tmp_path: Path) -> None:
    # worker 3 runs 4x like worker 2 until 3 s into training, then 1x like workers 0 and 1
    cmd = _local(tmp_path, "sched", "--mode", "gssp", "--groups", "2", "--workers", "4",
                 "--slowdown", "1,1,4,4@0,1@3s", "--base-step", "0.08", "--wall-s", "90")
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    run_dir = tmp_path / "sched"
    try:
        grouped = wait_for("the first groups", lambda: records(run_dir / "global.jsonl",
                                                               event="groups"), 60, (proc,))
        first = grouped[0]["assignment"]
        assert first["3"] == first["2"] != first["0"] == first["1"]  # 4x with 4x at first
        change = wait_for("worker 3's slowdown change", lambda: records(
            run_dir / "worker-3.jsonl", event="slowdown"), 30, (proc,))[0]
        assert (change["factor"], change["was"]) == (1.0, 4.0)
        moved = wait_for("the regroup", lambda: [
            r for r in records(run_dir / "global.jsonl", event="regroup")
            if "3" in r["moved"]], REGROUP_DELAY_S + 10, (proc,))[0]
        wait_for("a step of worker 3 in its new group", lambda: [
            r for r in steps(run_dir / "worker-3.jsonl")
            if r["group"] == moved["moved"]["3"]], 20, (proc,))
    finally:
        interrupt(proc, 60)
    assert moved["moved"]["3"] == first["0"]  # into the fast group
    # a 4x change skips the patience (grouping.Regrouper's change-point test)
    assert moved["t"] - change["t"] <= REGROUP_FAST_S, moved["t"] - change["t"]


@pytest.mark.timeout(120)
def test_lbbsp_batches_follow_the_speeds_in_a_real_run(tmp_path: Path) -> None:
    proc = subprocess.run(_local(tmp_path, "lb", "--mode", "lbbsp", "--workers", "3",
                                 "--slowdown", "1,1,3", "--base-step", "0.05",
                                 "--max-steps", "12", "--balance-every", "2"),
                          capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = tmp_path / "lb"
    balance = records(run_dir / "group-0.jsonl", event="balance")
    assert balance, "no re-balancing was logged"
    batches = balance[-1]["batches"]
    assert sum(batches.values()) == 3 * 64
    assert batches["0"] > 2 * batches["2"] and batches["1"] > 2 * batches["2"]  # 3x slower
    by_clock: dict[int, int] = {}
    for w in range(3):
        for r in steps(run_dir / f"worker-{w}.jsonl"):
            by_clock[r["clock"]] = by_clock.get(r["clock"], 0) + r["samples"]
    assert set(by_clock.values()) == {3 * 64}  # every round: the same total samples
    slow = [r["step_time"] for r in steps(run_dir / "worker-2.jsonl")][-3:]
    fast = [r["step_time"] for r in steps(run_dir / "worker-0.jsonl")][-3:]
    assert max(slow) < 2 * min(fast)  # balanced: about the same time per round (3x in BSP)


def test_link_changes_parse_in_time_order_and_refuse_bad_items() -> None:
    got = parse_link_changes("3:50mbit@120s,3:5mbit@60,*:10mbit/20mbit@30")
    assert got == [LinkChange(-1, Rate(10e6, 20e6), 30.0), LinkChange(3, Rate(5e6, 5e6), 60.0),
                   LinkChange(3, Rate(50e6, 50e6), 120.0)]
    assert got[0].applies_to(7) and not got[1].applies_to(2)
    for bad in ("3:5mbit", "x:5mbit@1", "3:5mbit@-1", "3:5@1", "3:1/2/3mbit@1"):
        with pytest.raises(ConfigError):
            parse_link_changes(bad)


@pytest.mark.timeout(60)
def test_a_kernel_shaped_link_changes_its_rate_live() -> None:
    why = netshape.unavailable()
    if why:
        pytest.skip(why)
    spaces = netshape.create([Rate(20e6, 20e6)])
    try:
        spaces.set_rate(0, Rate(5e6, 40e6))
        host, inside = spaces.veths(0)
        up = subprocess.run(["tc", "-n", spaces.names[0], "qdisc", "show", "dev", inside],
                            capture_output=True, text=True, timeout=10, check=True).stdout
        down = subprocess.run(["tc", "qdisc", "show", "dev", host], capture_output=True,
                              text=True, timeout=10, check=True).stdout
        assert "rate 5Mbit" in up and "rate 40Mbit" in down, (up, down)
    finally:
        spaces.remove()
    assert netshape.leftovers(os.getpid()) == []


@pytest.mark.timeout(120)
def test_a_local_run_changes_its_workers_links_on_schedule(tmp_path: Path) -> None:
    why = netshape.unavailable()
    if why:
        pytest.skip(why)
    proc = subprocess.run(_local(tmp_path, "lc", "--mode", "ssp", "--workers", "2",
                                 "--link", "20mbit", "--link-shaping", "kernel",
                                 "--link-change", "*:5mbit@1s,1:50mbit/10mbit@2s",
                                 "--wall-s", "6"),
                          capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stderr[-3000:]
    changes = records(tmp_path / "lc" / "links.jsonl", event="link")
    assert [(c["worker"], c["up_bps"], c["down_bps"]) for c in changes] == [
        (0, 5e6, 5e6), (1, 5e6, 5e6), (1, 50e6, 10e6)]
