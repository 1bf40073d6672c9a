"""Link profiles (`--link`), the pacer on real loopback sockets, and shaped `minips local` runs
(pacer, and kernel shaping with namespaces + tc where this machine allows it)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import processes_mentioning, run_on

from minips.core.config import RunConfig
from minips.core.downlink import DRIFT
from minips.errors import ConfigError
from minips.net import channel, netshape, transport
from minips.net import transport as t
from minips.net.links import LinkProfile, Pacing, Rate, TokenBucket, parse_profile
from minips.record.metrics import HOP_COUNTERS
from minips.record.rundir import read_jsonl
from minips.run import checks
from minips.run.launch import LaunchConfig, run_local
from minips.wire import control, messages
from minips.wire.fields import Payload

TOKEN = "links-secret-0123456789abcdef"
M = 1e6

# -- profiles -----------------------------------------------------------------------------------


@pytest.mark.parametrize("text, rates, latency", [
    ("10mbit", [(10 * M, 10 * M)], 0.0),
    ("10MBit", [(10 * M, 10 * M)], 0.0),
    ("100,100,50,50,20,20,10,10mbit",
     [(r * M, r * M) for r in (100, 100, 50, 50, 20, 20, 10, 10)], 0.0),
    ("10mbit/40mbit", [(10 * M, 40 * M)], 0.0),
    ("10/40mbit, 500kbit", [(10 * M, 40 * M), (0.5 * M, 0.5 * M)], 0.0),
    ("1gbit,2000bps", [(1e9, 1e9), (2000, 2000)], 0.0),
    ("20mbit+5ms", [(20 * M, 20 * M)], 0.005),
    ("2.5mbit/.5mbit+250us", [(2.5 * M, 0.5 * M)], 0.00025),
    ("+1s", [], 1.0),
])
def test_good_profiles_parse(text: str, rates: list[tuple[float, float]], latency: float) -> None:
    prof = parse_profile(text)
    got = [bps for r in prof.rates for bps in (r.up_bps, r.down_bps)]
    assert got == pytest.approx([bps for pair in rates for bps in pair])
    assert prof.latency_s == pytest.approx(latency)


@pytest.mark.parametrize("text, says", [
    ("", "empty profile"),
    ("10", "'10' has no unit"),
    ("10mbit,", "an empty rate between commas"),
    ("10mbps", "bytes per second are not accepted"),
    ("10furlongs", "unknown unit 'furlongs'"),
    ("fast", "'fast' is not a rate"),
    ("0mbit", "out of range"),
    ("10mbit/20mbit/30mbit", "more than one '/'"),
    ("10mbit+5", "latency '5' is not a duration"),
    ("10mbit+1h", "latency '1h' is not a duration"),
    ("10mbit+11s", "above 10 s"),
    ("./no-such-profile.txt", "cannot read the profile file"),
])
def test_bad_profiles_are_refused_in_one_line(text: str, says: str) -> None:
    with pytest.raises(ConfigError, match="--link") as info:
        parse_profile(text)
    assert says in str(info.value) and "\n" not in str(info.value)


def test_a_profile_file_holds_one_rate_a_line_with_comments(tmp_path: Path) -> None:
    path = tmp_path / "links.txt"
    path.write_text("# two fast, then slow\n100mbit\n100mbit\n10mbit/20mbit  # the slow one\n"
                    "+2ms\n")
    prof = parse_profile(str(path))
    assert prof.rates == (Rate(1e8, 1e8), Rate(1e8, 1e8), Rate(1e7, 2e7))
    assert prof.latency_s == pytest.approx(0.002)
    assert prof.rate(7) == Rate(1e7, 2e7)  # the last one repeats
    assert prof.record(4, "pacer")["rates"][3] == {"worker": 3, "up_bps": 1e7, "down_bps": 2e7}


def test_a_slowed_profile_divides_every_rate_and_multiplies_the_latency() -> None:
    prof = parse_profile("100,50,5mbit,10mbit/40mbit+2ms")
    slowed = prof.slowed(2.0)
    assert slowed == "50mbit,25mbit,2.5mbit,5mbit/20mbit+4000us"
    again = parse_profile(slowed)
    assert again.rates == tuple(Rate(r.up_bps / 2, r.down_bps / 2) for r in prof.rates)
    assert again.latency_s == pytest.approx(0.004)
    assert parse_profile(parse_profile("7mbit").slowed(3)).rates[0].up_bps == round(7e6 / 3)
    with pytest.raises(ConfigError, match="factor > 0"):
        prof.slowed(0)


def test_local_flags_become_one_profile() -> None:
    assert checks.check_link(None, 0.0, 0.0, 8) == ""
    assert checks.check_link("10mbit", 0.0, 0.0, 8) == "10mbit"
    assert parse_profile(checks.check_link(None, 1e6, 0.01, 2)) == \
        LinkProfile("8000000bit+0.01s", (Rate(8e6, 8e6),), 0.01)  # the deprecated flags
    with pytest.raises(ConfigError, match="give the link once"):
        checks.check_link("10mbit", 1e6, 0.0, 2)
    with pytest.raises(ConfigError, match="3 rates for 2 workers"):
        checks.check_link("1,2,3mbit", 0.0, 0.0, 2)


def test_a_bad_link_flag_is_one_line_and_exit_2() -> None:
    out = subprocess.run([sys.executable, "-m", "minips", "local", "--link", "10mbps"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "--link" in lines[0] and "bytes per second" in lines[0]


def test_token_bucket_paces_to_its_rate_whatever_the_chunks() -> None:
    bucket = TokenBucket(rate=1000.0, burst=100.0, now=0.0)
    assert bucket.take(100, 0.0) == 0.0  # the burst passes at once
    assert bucket.take(500, 0.0) == pytest.approx(0.5)  # then 500 bytes wait 0.5 s
    assert bucket.take(1, 0.5) == pytest.approx(0.001)  # debt repaid, nothing saved up
    assert bucket.take(50, 10.0) == 0.0  # long idle: at most the burst is saved


# -- the pacer on real sockets ----------------------------------------------------------------

PAYLOAD = 400_000  # bytes of one message's buffer
RATE = 2_000_000.0  # bytes/s: the payload takes 0.2 s


async def _serve_weights(ch: channel.Channel) -> None:
    """ACK every PUSH; answer PULL with a PAYLOAD-byte WEIGHTS; until LEAVE."""
    weights = np.zeros(PAYLOAD // 4, np.float32)
    while True:
        msg = await ch.recv()
        if isinstance(msg, messages.Push):
            assert sum(len(memoryview(b).cast("B")) for b in msg.payload.buffers) == PAYLOAD
            await ch.send(messages.Ack(clock=msg.clock, version=0))
        elif isinstance(msg, messages.Pull):
            await ch.send(messages.Weights(version=1, payload=Payload("dense-f32", {}, (weights,))))
        elif isinstance(msg, control.Leave):
            return


async def _timed_transfers(pacing: Pacing | None) -> tuple[float, float]:
    """Seconds for a PAYLOAD-byte PUSH (until its ACK) and a PAYLOAD-byte WEIGHTS (from PULL)
    over loopback, the client paced by ``pacing``; heartbeats run meanwhile."""
    srv = await transport.serve("127.0.0.1", 0, token=TOKEN, handler=_serve_weights,
                        accept=lambda hello: {"worker_id": 0})
    try:
        ch = await t.connect("127.0.0.1", srv.port, token=TOKEN)
        ch.set_pacing(pacing)
        ch.start_heartbeat(0.005)  # small frames that must not land inside a paced one
        loop_time = time.perf_counter
        t0 = loop_time()
        await ch.send(messages.Push(clock=1, payload=Payload("dense-f32", {}, (bytes(PAYLOAD),))))
        assert isinstance(await ch.recv(10), messages.Ack)
        up = loop_time() - t0
        t0 = loop_time()
        await ch.send(messages.Pull(clock=1))
        weights = await ch.recv(10)
        down = loop_time() - t0
        assert isinstance(weights, messages.Weights)
        assert weights.payload.buffers[0].nbytes == PAYLOAD
        await ch.close(leave="bye")
        return up, down
    finally:
        srv.close()
        await srv.wait_closed()


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_the_pacer_moves_n_bytes_in_n_over_r_each_way(loop: str) -> None:
    """N bytes at R bytes/s take about N / R on real sockets, up (paced writes) and down
    (paced reads: the server's send is not slowed, our reading is); unpaced, far less."""
    expected = PAYLOAD / RATE
    up, down = run_on(loop, _timed_transfers(Pacing.of(RATE, RATE, time.monotonic())))
    assert 0.8 * expected <= up <= 1.5 * expected + 0.05, up
    assert 0.8 * expected <= down <= 1.5 * expected + 0.05, down
    fast_up, fast_down = run_on(loop, _timed_transfers(None))
    assert fast_up < expected / 3 and fast_down < expected / 3, (fast_up, fast_down)


def test_each_direction_has_its_own_rate() -> None:
    expected_up, expected_down = PAYLOAD / RATE, PAYLOAD / (4 * RATE)
    up, down = run_on("asyncio", _timed_transfers(Pacing.of(RATE, 4 * RATE, time.monotonic())))
    assert 0.8 * expected_up <= up <= 1.5 * expected_up + 0.05, up
    assert 0.8 * expected_down <= down <= 1.5 * expected_down + 0.05, down


# -- shaped `minips local` runs ----------------------------------------------------------------

DENSE_BYTES = 61_706 * 4  # a dense LeNet-5 weights message, what every PULL brings
STEPS = 6


def shaped_run(tmp_path: Path, link: str, shaping: str, **run: Any) -> tuple[dict[str, Any],
                                                                           Path]:
    """A tiny `minips local` run (2 workers, STEPS steps each, dense SSP on LeNet-5) over
    ``link``; returns its summary and run directory. Tests of other per-run facts (bytes of
    every hop, replica drift) can call it with their own ``run`` fields."""
    fields = {"mode": "ssp", "compressor": "none", "workers": 2, "max_steps": STEPS,
              "base_step_s": 0.0, "calib_steps": 1, "eval_every_s": 0.5, "eval_limit": 500,
              **run}
    cfg = LaunchConfig(run=RunConfig(**fields), link=link, link_shaping=shaping,
                       out_dir=str(tmp_path), name="shaped", progress=False, plot=False)
    summary = run_local(cfg)
    return summary, tmp_path / "shaped"


def _pull_seconds(run_dir: Path, worker: int) -> float:
    """Seconds worker ``worker`` spent in PULLs (receiving WEIGHTS included)."""
    return sum(r["wait_s"] for r in read_jsonl(run_dir / f"worker-{worker}.jsonl")
               if "wait_s" in r)


def _check_shaped(summary: dict[str, Any], run_dir: Path, shaping: str, down_bps: float) -> None:
    """The run finished, says how it was shaped, and its PULLs took the downlink's time."""
    assert summary["status"] == "done", summary
    assert summary["link"]["shaping"] == shaping
    assert json.loads((run_dir / "link.json").read_text()) == summary["link"]
    assert [r["down_bps"] for r in summary["link"]["rates"]] == [down_bps] * 2
    for w in (0, 1):  # each PULL brought dense weights over the downlink
        assert _pull_seconds(run_dir, w) >= 0.8 * STEPS * DENSE_BYTES * 8 / down_bps


@pytest.mark.timeout(120)
def test_a_local_run_over_the_pacer(tmp_path: Path) -> None:
    summary, run_dir = shaped_run(tmp_path, "20mbit/8mbit", "pacer")
    _check_shaped(summary, run_dir, "pacer", 8e6)
    worker = (run_dir / "logs" / "worker-0.log").read_text()
    assert "Traceback" not in worker


def _kernel_or_skip() -> None:
    why = netshape.unavailable()
    if why:
        pytest.skip(why)


@pytest.mark.timeout(120)
def test_a_local_run_over_kernel_shaped_links_leaves_no_namespace(tmp_path: Path) -> None:
    _kernel_or_skip()
    summary, run_dir = shaped_run(tmp_path, "20mbit/8mbit", "kernel")
    _check_shaped(summary, run_dir, "kernel", 8e6)
    assert netshape.leftovers(os.getpid()) == []


@pytest.mark.timeout(120)
def test_a_killed_launcher_takes_its_workers_and_the_next_run_its_namespaces(
        tmp_path: Path) -> None:
    """SIGKILL to a kernel-shaped `minips local`: its workers (inside namespaces, under
    ``ip netns exec``) still die with it (lifeline); its namespaces stay until the next
    kernel-shaped run's ``remove_stale``, which removes them."""
    _kernel_or_skip()
    cmd = [sys.executable, "-m", "minips", "local", "--mode", "asp", "--workers", "2",
           "--wall-s", "300", "--base-step", "0.05", "--link", "50mbit", "--link-shaping",
           "kernel", "--no-plot", "--no-progress", "--no-eval", "--out", str(tmp_path),
           "--name", "killed"]
    proc = subprocess.Popen(cmd, stderr=subprocess.DEVNULL)
    log = tmp_path / "killed" / "worker-1.jsonl"
    try:
        deadline = time.monotonic() + 90
        while not (log.exists() and log.stat().st_size > 0):
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.1)
        assert len([n for n in netshape.leftovers(proc.pid)
                    if n.startswith(netshape.NS_PREFIX)]) == 2
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    deadline = time.monotonic() + 15
    while processes_mentioning(str(tmp_path / "killed")) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not processes_mentioning(str(tmp_path / "killed"))
    assert netshape.leftovers(proc.pid)  # a SIGKILL runs no clean-up ...
    removed = netshape.remove_stale()  # ... the next run's does
    assert removed and netshape.leftovers(proc.pid) == []


def test_plan_falls_back_to_the_pacer_only_when_asked_to(monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]
                                                          ) -> None:
    """auto takes the pacer where kernel shaping cannot run (saying why); kernel refuses;
    pacer and a latency-only profile never touch the kernel."""
    monkeypatch.setattr(netshape, "unavailable", lambda: "kernel shaping needs root (test)")
    prof = parse_profile("10mbit")
    assert netshape.plan(prof, 2, "auto") == ("pacer", None)
    assert "needs root (test); the workers pace" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="--link-shaping kernel: kernel shaping needs root"):
        netshape.plan(prof, 2, "kernel")
    assert netshape.plan(prof, 2, "pacer") == ("pacer", None)
    assert netshape.plan(parse_profile("+5ms"), 2, "kernel") == ("none", None)
    assert netshape.plan(None, 2, "auto") == ("none", None)


def _check_hops_and_drift(summary: dict[str, Any], run_dir: Path) -> None:
    """Every hop counted (adding up to the total), the downlink compressed, and every worker's
    weights within the downlink's drift bound of its group's when it pulled them."""
    hops = [summary[k] for k in HOP_COUNTERS]
    assert summary["bytes_total"] == sum(hops) and all(h > 0 for h in hops), hops
    pulls = [r for w in (0, 1) for r in read_jsonl(run_dir / f"worker-{w}.jsonl") if "drift" in r]
    assert len(pulls) >= 2 * STEPS - 2, len(pulls)  # every step's PULL said its drift
    assert max(r["drift"] for r in pulls) <= DRIFT * (1 + 1e-5)
    # sparse updates down: well under the dense weights every PULL would bring
    assert summary["bytes_group_worker"] < 2 * STEPS * DENSE_BYTES / 5


SPARSE = {"compressor": "topk", "ratio": 0.01, "mode": "asp", "lr": 0.05}


@pytest.mark.timeout(120)
def test_a_compressed_run_over_the_pacer_counts_every_hop_and_bounds_drift(
        tmp_path: Path) -> None:
    summary, run_dir = shaped_run(tmp_path, "20mbit/8mbit", "pacer", **SPARSE)
    assert summary["status"] == "done" and summary["link"]["shaping"] == "pacer"
    _check_hops_and_drift(summary, run_dir)


@pytest.mark.timeout(120)
def test_a_compressed_run_over_kernel_shaping_counts_every_hop_and_bounds_drift(
        tmp_path: Path) -> None:
    _kernel_or_skip()
    summary, run_dir = shaped_run(tmp_path, "20mbit/8mbit", "kernel", **SPARSE)
    assert summary["status"] == "done" and summary["link"]["shaping"] == "kernel"
    _check_hops_and_drift(summary, run_dir)
