"""The dashboard's parts on their own: RunState's rules, tailing and replaying run files,
TensorBoard event files read back by TensorBoard, the page's token rule, the missing extra."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import textwrap
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from conftest import interrupt, recv_as, until, wait_for

from minips.dashboard.state import Histogram, Replay, RunFollower, RunState, Tail
from minips.dashboard.tboard import EventWriter, TensorBoardSink, crc32c
from minips.errors import ConfigError
from minips.wire.fields import Payload

CONFIG = {"mode": "gssp", "staleness": 2, "lease_s": 10.0, "t0": 1000.0}


def push(w: int, t: float, clock: int, group: int = 0, **kw: Any) -> dict[str, Any]:
    return {"t": t, "worker": w, "group": group, "clock": clock, "step_time": 0.1,
            "wait_s": 0.05, "staleness": 0, "bytes_wire": 100, "bytes_raw": 400, **kw}


def merge(g: int, t: float, **kw: Any) -> dict[str, Any]:
    """A global.jsonl merge line of group ``g``, with the counters its EXCHANGE carried."""
    return {"t": t, "event": "merge", "group": g, "pushes": 0, "min_clock": 0, "max_clock": 0,
            "pull_workers": [], "pull_leads": [], "pull_waits_us": [], **kw}


# -- RunState ----------------------------------------------------------------------------------


def test_worker_states_follow_the_ssp_rule_pull_time_lease_and_events() -> None:
    s = RunState(CONFIG)
    s.add("worker", push(0, 1.0, 5))
    s.add("worker", push(1, 1.0, 2))
    s.add("worker", push(2, 1.0, 4, group=1))
    states = {w["id"]: w["state"] for w in s.update(1.2)["workers"]}
    assert states[0] == "waiting"  # 5 - 2 > staleness 2: the SSP bound holds it
    assert states[1] == "computing"  # 0.2 s after its push, its pull took 0.05 s
    assert s.state_of(s.workers[1], 1.01) == "pulling"
    assert s.state_of(s.workers[2], 11.5) == "dead"  # silent for more than lease_s
    s.add("group", {"t": 2.0, "event": "expired", "group": 0, "workers": [1]})
    assert s.state_of(s.workers[1], 2.0) == "dead"
    assert s.state_of(s.workers[0], 2.0) == "computing"  # the expired worker holds no one
    s.add("global", {"t": 2.5, "event": "rehomed", "group": 0, "moved": {"0": 1}})
    assert s.workers[0].group == 1 and s.events[-1]["event"] == "rehomed"
    s.add("global", {"t": 3.0, "event": "done", "reason": "epochs"})
    assert s.state_of(s.workers[0], 3.0) == "done"


def test_a_remote_groups_bytes_per_push_spans_32_pushes_and_a_half_read_push_moves_it_little(
        ) -> None:
    """Exchanges of 4 dense 1,000-byte pushes whose ``bytes_in`` was read with a push half
    received at every other cut: over one exchange that reads 1.125 or 0.875 a push, over 32
    pushes within 1/64; a new group process counting from 0 starts the window again."""
    from minips.dashboard.state import PUSH_BYTES_OVER
    s = RunState(CONFIG)
    for i in range(1, 13):
        s.add("global", merge(0, float(i), pushes=4, bytes_in=4000 * i + 500 * (i % 2)))
        if i == 2:
            assert s.push_bytes[0] == 3500 / 4  # one exchange: the half push read at the cut
    assert PUSH_BYTES_OVER == 32 and abs(s.push_bytes[0] / 1000 - 1) <= 1 / 64
    s.add("global", merge(0, 13.0, pushes=4, bytes_in=4000))  # a new process: from 0 again
    assert abs(s.push_bytes[0] / 1000 - 1) <= 1 / 64  # nothing to measure it against yet
    s.add("global", merge(0, 14.0, pushes=4, bytes_in=8000))
    assert s.push_bytes[0] == 1000


def test_a_slowdown_or_link_change_is_an_event_on_the_page() -> None:
    s = RunState(CONFIG)
    s.add("worker", push(3, 1.0, 5))
    s.add("worker", {"t": 2.0, "worker": 3, "event": "slowdown", "clock": 6, "factor": 1.0,
                     "was": 4.0})
    assert s.events[-1]["event"] == "slowdown"
    assert s.events[-1]["text"] == "worker 3: emulated slowdown 4x -> 1x"
    s.add("links", {"t": 3.0, "event": "link", "worker": 3, "at_s": 2.0, "up_bps": 5e6,
                    "down_bps": 5e6})
    assert s.events[-1]["text"] == "worker 3: link now 5 mbit up, 5 mbit down"


def test_the_probe_says_who_waits_and_keeps_a_slow_worker_alive() -> None:
    s = RunState({**CONFIG, "mode": "asp"})
    s.add("worker", push(0, 1.0, 3))
    s.add("probe", {"t": 30.0, "worker": 0, "group": 0, "clock": 7, "alive": True,
                    "waiting": True, "step_time": 0.5})
    v = s.workers[0]
    assert (v.clock, v.step_time, s.state_of(v, 30.0)) == (7, 0.1, "waiting")
    s.add("probe", {"t": 31.0, "worker": 0, "group": 0, "clock": 7, "alive": False})
    assert s.state_of(v, 31.0) == "dead"


def test_per_push_fields_upload_ratio_and_histograms() -> None:
    s = RunState(CONFIG)
    for i in range(3):
        s.add("worker", push(0, 1.0 + i, i + 1, staleness=i))
    row = s.update(4.0)["workers"][0]
    assert row["upload_ratio"] == 0.25 and row["bytes_per_push"] == 100 and row["staleness"] == 2
    assert s.staleness_hist.n == 0 and s.totals["pushes"] == 0  # counted from the merges only
    s.add("global", merge(0, 4.0, pushes=3, pull_workers=[0, 0, 1], pull_leads=[0, 1, 3],
                          pull_waits_us=[2000, 30000, 700000]))
    assert s.totals["pushes"] == 3
    assert dict(s.staleness_hist.cumulative())["1.0"] == 2
    assert s.staleness_hist.cumulative()[-1] == ("+Inf", 3)
    assert dict(s.wait_hist.cumulative())["0.025"] == 1 and s.wait_hist.total == pytest.approx(
        0.732)
    assert (s.workers[0].pulls, s.workers[1].pulls) == (2, 1)
    assert s.workers[0].held_s == pytest.approx(0.032)
    assert s.update(4.0)["held"] == [{"t": 4.0, "tt": 0.0, "group": 0,
                                      "held": {"0": 0.032, "1": 0.7}}]
    h = Histogram((1.0, 2.0))
    h.observe(1.0)  # on a bound: counted in that bucket (le)
    h.observe(5.0)
    assert h.cumulative() == [("1.0", 1), ("2.0", 1), ("+Inf", 2)]


def test_update_sends_only_what_the_series_gained_since_the_cursor() -> None:
    s = RunState(CONFIG)
    s.add("eval", {"t": 1.0, "accuracy": 0.5, "loss": 1.2, "bytes_up": 10, "bytes_down": 30})
    s.add("global", {"t": 1.0, "event": "groups", "assignment": {"0": 0, "1": 1}})
    first = s.update(1.0)
    assert len(first["eval"]) == 1 and first["eval"][0]["bytes"] == 40
    assert [e["event"] for e in first["events"]] == ["groups"]
    assert {w["id"]: w["group"] for w in first["workers"]} == {0: 0, 1: 1}
    s.add("eval", {"t": 2.0, "accuracy": 0.6, "loss": 1.0})
    second = s.update(2.0, first["cursor"])
    assert [e["accuracy"] for e in second["eval"]] == [0.6] and second["events"] == []


def test_merges_give_group_clocks_bytes_and_keep_the_last_known_clocks() -> None:
    s = RunState(CONFIG)
    for t, lo in [(1.0, 1), (1.2, 2), (1.6, 3)]:  # the 1.2 point is within CLOCK_POINT_S
        s.add("global", {"t": t, "event": "merge", "group": 0, "min_clock": lo,
                         "max_clock": lo + 1, "bytes_in": 10 * lo, "bytes_out": 20 * lo})
    s.add("global", {"t": 2.0, "event": "merge", "group": 0, "min_clock": None,
                     "max_clock": None, "final": True})  # the workers already left
    assert [c["min_clock"] for c in s.clocks] == [1, 3]
    assert s.groups[0]["min_clock"] == 3 and s.merges[0] == 4 and s.totals["merges"] == 4
    s.add("global", {"t": 3.0, "event": "checkpoint", "bytes": 5})
    assert s.checkpoint_t == 3.0


def test_prometheus_collector_exposes_the_state_in_the_text_format() -> None:
    pytest.importorskip("prometheus_client")
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from minips.dashboard.web import RunCollector

    s = RunState({**CONFIG, "compressor": "topk", "model": "lenet5", "workers": 2})
    s.add("worker", push(0, 1.0, 1, wait_s=0.02))
    s.add("worker", push(1, 1.0, 1, group=1))
    s.add("global", merge(1, 2.0, pushes=1, bytes_in=500, bytes_out=900, bytes_to_global=70,
                          bytes_from_global=80, pull_workers=[1], pull_leads=[2],
                          pull_waits_us=[20000]))
    s.add("global", {"t": 3.0, "event": "checkpoint", "bytes_up": 500, "bytes_down": 900})
    s.add("eval", {"t": 4.0, "accuracy": 0.75, "loss": 0.6})
    # the global server's view: worker 1's iteration (its link makes it 0.8 s) beside its compute
    s.add("probe", {"t": 4.5, "worker": 1, "group": 1, "clock": 1, "step_time": 0.1,
                    "iteration_s": 0.8, "alive": True})
    registry = CollectorRegistry()
    registry.register(RunCollector(s, lambda: 10.0))
    fams = {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}
    value = {(s.name, tuple(sorted(s.labels.items()))): s.value
             for f in fams.values() for s in f.samples}
    assert value[("minips_last_checkpoint_timestamp_seconds", ())] == 1003.0  # t0 + t
    assert value[("minips_pushes_total", (("group", "1"),))] == 1
    assert ("minips_pushes_total", (("group", "0"),)) not in value  # no merge of group 0 yet
    hop = {k: value[("minips_bytes_total", (("group", "1"), ("hop", k)))] for k in (
        "worker_to_group", "group_to_worker", "group_to_global", "global_to_group")}
    assert hop == {"worker_to_group": 500, "group_to_worker": 900, "group_to_global": 70,
                   "global_to_group": 80}
    assert "minips_group_bytes" not in fams  # the hops per group say it once
    assert fams["minips_staleness_steps"].type == fams["minips_ssp_wait_seconds"].type \
        == "histogram"
    assert value[("minips_ssp_wait_seconds_bucket", (("le", "0.025"),))] == 1
    assert value[("minips_ssp_wait_seconds_sum", ())] == pytest.approx(0.02)
    assert value[("minips_staleness_steps_bucket", (("le", "2.0"),))] == 1
    assert value[("minips_workers_alive", (("group", "0"),))] == 1
    assert value[("minips_accuracy_ratio", ())] == 0.75 and "minips_accuracy" not in fams
    worker1 = (("group", "1"), ("worker", "1"))
    assert value[("minips_worker_up", worker1)] == value[("minips_worker_clock", worker1)] == 1
    assert value[("minips_worker_pulls_total", worker1)] == 1
    assert value[("minips_worker_ssp_wait_seconds_total", worker1)] == pytest.approx(0.02)
    assert value[("minips_worker_step_seconds", worker1)] == 0.1
    assert value[("minips_worker_iteration_seconds", worker1)] == 0.8
    row = next(r for r in s.update(10.0)["workers"] if r["id"] == 1)
    assert (row["step_time"], row["iteration_s"]) == (0.1, 0.8)
    info = [k for k in value if k[0] == "minips_run_info"]
    assert len(info) == 1 and dict(info[0][1])["compressor"] == "topk" and value[info[0]] == 1


def test_the_staleness_between_groups_reaches_the_cards_a_chart_and_the_metrics() -> None:
    pytest.importorskip("prometheus_client")
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from minips.dashboard.web import RunCollector

    s = RunState(CONFIG)
    s.add("global", {"t": 1.0, "event": "groups", "assignment": {"0": 0, "1": 1}})
    s.add("global", merge(0, 1.5, missed=None, base_age_s=None))  # resumed: not known
    s.add("global", merge(0, 2.0, missed=0, base_age_s=0.5))
    s.add("global", merge(1, 2.0, missed=3, base_age_s=1.0))
    s.add("global", merge(1, 2.2, missed=5, base_age_s=0.2))  # within CLOCK_POINT_S: held back
    s.add("global", merge(1, 2.6, missed=1, base_age_s=0.4))  # ... and given with the next
    s.add("global", merge(0, 3.0))  # a record written before the figures existed
    msg = s.update(3.0)
    assert [(p["group"], p["missed"], p["base_age_s"], p["tt"]) for p in msg["between"]] == [
        (0, 0, 0.5, 1.0), (1, 3, 1.0, 1.0), (1, 5, 0.4, 1.6)]  # the most since the last point
    g0, g1 = msg["groups"]["0"], msg["groups"]["1"]
    assert (g1["missed"], g1["base_age_s"]) == (1, 0.4)  # the last merge's, on the card
    assert (g1["missed_max"], g1["base_age_max_s"]) == (5, 1.0)
    assert g1["missed_mean"] == 3 and g1["base_age_mean_s"] == pytest.approx(1.6 / 3)
    assert (g0["missed"], g0["missed_max"], g0["missed_mean"]) == (0, 0, 0)
    assert s.missed_hist[1].cumulative()[:4] == [("0.0", 0), ("1.0", 1), ("2.0", 1), ("3.0", 2)]

    registry = CollectorRegistry()
    registry.register(RunCollector(s, lambda: 3.0))
    fams = {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}
    value = {(x.name, tuple(sorted(x.labels.items()))): x.value
             for f in fams.values() for x in f.samples}
    assert fams["minips_exchange_missed_merges"].type == "histogram"
    assert fams["minips_exchange_base_age_seconds"].type == "histogram"
    assert "other groups" in fams["minips_exchange_missed_merges"].documentation
    one = (("group", "1"),)
    assert value[("minips_exchange_missed_merges_count", one)] == 3
    assert value[("minips_exchange_missed_merges_sum", one)] == 9
    assert value[("minips_exchange_missed_merges_bucket", (("group", "1"), ("le", "4.0")))] == 2
    assert value[("minips_exchange_base_age_seconds_sum", one)] == pytest.approx(1.6)
    assert value[("minips_exchange_base_age_seconds_count", (("group", "0"),))] == 1
    for stat, missed, age in (("last", 1, 0.4), ("max", 5, 1.0)):
        key = (("group", "1"), ("stat", stat))
        assert value[("minips_group_missed_merges", key)] == missed
        assert value[("minips_group_base_age_seconds", key)] == pytest.approx(age)


# -- following and replaying files ---------------------------------------------------------------


def test_tail_hands_over_whole_lines_once_and_rereads_a_truncated_file(tmp_path: Path) -> None:
    f = tmp_path / "worker-0.jsonl"
    f.write_bytes(b'{"t": 1}\n{"t": 2')
    tail = Tail(f)
    assert tail.read() == [{"t": 1}]
    with open(f, "ab") as out:
        out.write(b'}\nnot json\n{"t": 3}\n')
    assert tail.read() == [{"t": 2}, {"t": 3}]
    assert tail.read() == []
    f.write_bytes(b'{"t": 9}\n')  # a new, shorter file
    assert tail.read() == [{"t": 9}]


def test_follower_picks_up_files_that_appear_later(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    (tmp_path / "global.jsonl").write_text(json.dumps({"t": 0.5, "event": "joined",
                                                       "worker": 0}) + "\n")
    f = RunFollower(tmp_path)
    assert [src for src, _ in f.poll()] == ["global"]
    (tmp_path / "worker-0.jsonl").write_text(json.dumps(push(0, 1.0, 1)) + "\n")
    (tmp_path / "notes.jsonl").write_text('{"t": 1}\n')  # not a metrics file
    assert [src for src, _ in f.poll()] == ["worker"]
    assert f.state.workers[0].clock == 1 and f.state.staleness == 2


def test_replay_releases_records_in_run_time_order_at_its_speed(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    (tmp_path / "worker-0.jsonl").write_text(
        "".join(json.dumps(push(0, t, i + 1)) + "\n" for i, t in enumerate([10.0, 20.0, 30.0])))
    (tmp_path / "eval.jsonl").write_text(json.dumps({"t": 15.0, "accuracy": 0.4}) + "\n")
    r = Replay(tmp_path, speed=10.0)
    assert r.horizon(0.0) == 10.0  # starts at the first record, not at t0
    assert [rec["t"] for _, rec in r.poll(0.6)] == [10.0, 15.0]
    assert r.state.update(r.horizon(0.6))["kind"] == "replay"
    assert [rec["t"] for _, rec in r.poll(5.0)] == [20.0, 30.0] and r.horizon(5.0) == 30.0
    assert Replay(tmp_path, speed=0).horizon(0.0) == 30.0
    with pytest.raises(FileNotFoundError):
        Replay(tmp_path / "missing")


# -- TensorBoard ---------------------------------------------------------------------------------


def test_crc32c_check_value() -> None:
    assert crc32c(b"123456789") == 0xE3069283  # the CRC-32C catalogue's check value
    assert crc32c(b"") == 0


def test_tensorboard_reads_back_the_scalars_written_by_hand(tmp_path: Path) -> None:
    ea = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    w = EventWriter(tmp_path)
    w.scalar("a/b", 0.25, 3, 1000.5)
    w.scalar("a/b", -1e9, 1 << 40, 1001.0)
    w.close()
    sink = TensorBoardSink(tmp_path / "sink", t0=2000.0)
    sink.add("eval", {"t": 5.0, "accuracy": 0.8, "loss": 0.5, "samples": 640,
                      "bytes_up": 100, "bytes_down": 300})
    sink.add("worker", push(4, 6.0, 9, staleness=2))
    sink.add("global", {"t": 7.0, "event": "merge", "group": 1, "min_clock": 4, "max_clock": 6})
    sink.close()
    acc = ea.EventAccumulator(str(tmp_path))
    acc.Reload()
    got = [(e.wall_time, e.step, e.value) for e in acc.Scalars("a/b")]
    assert got == [(1000.5, 3, 0.25), (1001.0, 1 << 40, -1e9)]
    acc = ea.EventAccumulator(str(tmp_path / "sink"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("eval_by_bytes/loss")] == [(400, 0.5)]
    assert [(e.wall_time, e.step) for e in acc.Scalars("eval/accuracy")] == [(2005.0, 640)]
    assert [(e.step, e.value) for e in acc.Scalars("worker/4/staleness")] == [(9, 2.0)]
    assert [(e.step, e.value) for e in acc.Scalars("group/1/max_clock")] == [(1, 6.0)]


# -- the web side --------------------------------------------------------------------------------


async def test_token_is_asked_for_when_set_and_a_wide_address_gets_one(tmp_path: Path) -> None:
    aiohttp = pytest.importorskip("aiohttp")
    from minips.dashboard.monitor import Monitor, MonitorConfig
    from minips.dashboard.web import Ticker, make_app, start_site

    app = make_app(RunState(CONFIG), lambda: 0.0, Ticker(), token="s3cret")
    runner, port = await start_site(app, "127.0.0.1", 0)
    base = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as http:
            for path, headers, status in [("/metrics", {}, 401), ("/?token=nope", {}, 401),
                                          ("/?token=s3cret", {}, 200),
                                          ("/metrics", {"Authorization": "Bearer s3cret"}, 200),
                                          ("/state?token=s3cret", {}, 200)]:
                async with http.get(base + path, headers=headers) as resp:
                    assert resp.status == status, path
    finally:
        await runner.cleanup()
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    wide = Monitor(MonitorConfig(run_dir=str(tmp_path), dashboard="0.0.0.0:0"))
    url = await wide.start()  # no token given: one is made, and only the URL returned has it
    try:
        assert len(url.split("?token=")[1]) >= 16
    finally:
        await wide.stop()
    short = Monitor(MonitorConfig(run_dir=str(tmp_path), dashboard="0.0.0.0:0", token="short"))
    with pytest.raises(ConfigError, match="MINIPS_DASHBOARD_TOKEN"):
        await short.start()


async def test_event_stream_sends_the_state_then_each_tick(tmp_path: Path) -> None:
    aiohttp = pytest.importorskip("aiohttp")
    from minips.dashboard.web import Ticker, make_app, start_site

    state, ticker = RunState(CONFIG), Ticker()
    runner, port = await start_site(make_app(state, lambda: 1.0, ticker), "127.0.0.1", 0)
    try:
        async with aiohttp.ClientSession() as http, \
                http.get(f"http://127.0.0.1:{port}/events") as resp:
            assert resp.headers["Content-Type"].startswith("text/event-stream")
            first = json.loads((await resp.content.readline()).removeprefix(b"data: "))
            assert first["eval"] == [] and first["workers"] == []
            await resp.content.readline()  # the blank line that ends an event
            state.add("eval", {"t": 1.0, "accuracy": 0.7})
            ticker.tick()
            line = await asyncio.wait_for(resp.content.readline(), 10)
            assert [e["accuracy"] for e in json.loads(line.removeprefix(b"data: "))["eval"]] \
                == [0.7]
    finally:
        ticker.closed = True
        ticker.tick()
        await runner.cleanup()


def test_server_without_the_extra_says_how_to_get_it(tmp_path: Path) -> None:
    block = textwrap.dedent("""
        import importlib.abc, sys
        class NoAiohttp(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] == "aiohttp":
                    raise ImportError("blocked", name="aiohttp")
        sys.meta_path.insert(0, NoAiohttp())
        from minips.run.cli import main
        sys.exit(main())
    """)
    proc = subprocess.run([sys.executable, "-c", block, "server", "--port", "0", "--quiet",
                           "--run-dir", str(tmp_path), "--dashboard", "127.0.0.1:0"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "pip install 'minips[dashboard]'" in proc.stderr and "aiohttp" in proc.stderr
    assert not (tmp_path / "config.json").exists()  # refused before anything started


def test_a_taken_dashboard_port_ends_the_server_with_a_clear_error(tmp_path: Path) -> None:
    pytest.importorskip("aiohttp")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "minips", "server", "--port", "0",
                               "--quiet", "--run-dir", str(tmp_path), "--dashboard",
                               f"127.0.0.1:{port}"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]  # after the note of the default budget
    assert last.startswith("minips server: error:") and str(port) in last


def test_minips_dashboard_follow_shows_records_as_they_are_appended(tmp_path: Path) -> None:
    pytest.importorskip("aiohttp")
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    proc = subprocess.Popen([sys.executable, "-m", "minips", "dashboard", str(tmp_path),
                             "--listen", "127.0.0.1:0", "--follow"],
                            stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        assert "following" in line, line
        url = line.split(" on ")[1].split()[0] + "state"

        def evals() -> list[Any]:
            with urllib.request.urlopen(url, timeout=10) as r:
                return list(json.loads(r.read())["eval"])

        assert evals() == []
        with open(tmp_path / "eval.jsonl", "a") as f:
            f.write(json.dumps({"t": 1.0, "accuracy": 0.5}) + "\n")
        got = wait_for("the appended record", evals, 30, (proc,))
        assert [e["accuracy"] for e in got] == [0.5]
    finally:
        interrupt(proc, 30)
    assert proc.returncode == 0 and not (tmp_path / "dashboard.url").exists()


async def test_probe_reads_clocks_the_ssp_bound_and_connections_from_a_live_server(
        tmp_path: Path) -> None:
    import numpy as np

    from minips import sparse
    from minips.core.config import RunConfig
    from minips.dashboard.monitor import probe
    from minips.net import transport
    from minips.net.endpoints import parse_address
    from minips.server import GlobalServer, ServerConfig
    from minips.wire import control, messages

    cfg = ServerConfig(run=RunConfig(workers=2, mode="bsp", lr_warmup=0.0), port=0,
                       token="t", run_dir=str(tmp_path), calib_timeout_s=10.0, linger_s=1.0)
    srv = GlobalServer(cfg, np.zeros(4, np.float32))
    port = await srv.start()
    ctl, grp = [], []
    try:
        for w in (0, 1):
            ch = await transport.connect("127.0.0.1", port, role="worker", worker_id=w, token="t")
            await ch.send(control.Stats(clock=0, step_time=0.01, loss=2.0))
            ctl.append(ch)
        for w, ch in enumerate(ctl):
            host, gport = parse_address((await recv_as(ch, control.Assign)).address)
            grp.append(await transport.connect(host, gport, role="worker", worker_id=w,
                                               token="t"))
            await asyncio.wait_for(grp[-1].recv(), 10)  # ACK: its start clock
        await grp[0].send(messages.Pull(clock=0))
        assert isinstance(await asyncio.wait_for(grp[0].recv(), 10), messages.Weights)
        encoding, codec, buffers = sparse.encode_vector(np.ones(4, np.float32))
        await grp[0].send(messages.Push(clock=1, samples=1, payload=Payload(encoding, codec,
                                        tuple(buffers))))
        await asyncio.wait_for(grp[0].recv(), 10)
        seen = {r["worker"]: r for r in probe(srv, 5.0)}
        assert (seen[0]["clock"], seen[0]["waiting"]) == (1, True)  # BSP: held for worker 1
        assert (seen[1]["clock"], seen[1]["waiting"], seen[1]["alive"]) == (0, False, True)
        assert seen[0]["group"] == seen[1]["group"] == 0 and seen[0]["t"] == 5.0
        await ctl[1].close()
        await until(lambda: not {r["worker"]: r for r in probe(srv, 6.0)}[1]["alive"])
    finally:
        for ch in ctl + grp:
            await ch.close()
        await srv.close()


def test_a_failing_tick_is_printed_once_and_the_monitor_goes_on(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    from minips.dashboard.monitor import Monitor, MonitorConfig

    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    (tmp_path / "eval.jsonl").write_text(json.dumps({"t": 1.0, "accuracy": 0.5}) + "\n")
    monitor = Monitor(MonitorConfig(run_dir=str(tmp_path)))

    def broken(source: str, rec: dict[str, Any]) -> None:
        raise RuntimeError("a bug in the dashboard")

    monkeypatch.setattr(monitor.state, "add", broken)
    monitor.tick()
    with open(tmp_path / "eval.jsonl", "a") as f:
        f.write(json.dumps({"t": 2.0, "accuracy": 0.6}) + "\n")
    monitor.tick()
    assert capsys.readouterr().err.count("RuntimeError: a bug in the dashboard") == 1


def test_totals_add_the_group_global_hop_from_the_groups_exchange_events() -> None:
    s = RunState(CONFIG)
    assert (s.totals["bytes_group_global"], s.totals["bytes_global_group"]) == (0, 0)
    for g, t, to, back in [(0, 1.0, 100, 400), (1, 1.5, 10, 40), (0, 2.0, 300, 900)]:
        s.add("group", {"t": t, "event": "exchange", "group": g, "bytes_to_global": to,
                        "bytes_from_global": back})
    s.add("group", {"t": 2.5, "event": "expired", "group": 1, "workers": [3]})  # no counters
    assert (s.totals["bytes_group_global"], s.totals["bytes_global_group"]) == (310, 940)


def test_a_slow_worker_is_marked_against_the_whole_cluster_not_its_own_group() -> None:
    """Under GSSP a group holds workers of one speed: the slow group's workers are marked
    against the median of all live workers."""
    s = RunState(CONFIG)
    for w, g, step in [(0, 0, 0.1), (1, 0, 0.1), (2, 0, 0.11), (3, 1, 0.4), (4, 1, 0.4)]:
        s.add("worker", push(w, 1.0, 1, group=g, step_time=step))
    slow = {r["id"] for r in s.update(1.5)["workers"] if r["slow"]}
    assert slow == {3, 4}


def test_a_group_a_regroup_emptied_leaves_the_cards_and_the_per_group_gauges() -> None:
    s = RunState(CONFIG)
    s.add("global", {"t": 1.0, "event": "groups", "assignment": {"0": 0, "1": 0, "2": 1}})
    for g in (0, 1):
        s.add("global", merge(g, 1.5, min_clock=3, max_clock=4))
    assert set(s.update(1.6)["groups"]) == {"0", "1"}
    s.add("global", {"t": 2.0, "event": "regroup", "moved": {"2": 0}})
    s.add("global", merge(1, 2.5, min_clock=-1, max_clock=-1, final=True))  # its last flush
    msg = s.update(3.0)
    assert set(msg["groups"]) == {"0"} and set(s.alive_per_group(3.0)) == {0}
    assert s.groups[1]["min_clock"] == 3  # -1 (no live worker) is not a clock
    assert msg["events"][-1]["text"] == "regrouped: worker 2 to group 0"


def test_events_read_as_sentences_and_checkpoints_fold_into_one_count() -> None:
    s = RunState(CONFIG)
    s.add("global", {"t": 1.0, "event": "groups", "assignment": {"0": 0, "1": 1, "2": 0}})
    s.add("global", {"t": 1.1, "event": "joined", "worker": 3, "version": 5, "samples": 64})
    for t in (2.0, 3.0, 4.0):
        s.add("global", {"t": t, "event": "checkpoint", "bytes": 1000, "write_s": 0.01})
    s.add("global", {"t": 4.5, "event": "left", "worker": 3, "reason": "connection lost"})
    s.add("global", {"t": 4.6, "event": "group_lost", "group": 1})
    s.add("global", {"t": 5.0, "event": "done", "reason": "epochs"})
    msg = s.update(5.0)
    assert [e["text"] for e in msg["events"]] == [
        "groups formed: group 0: workers 0, 2; group 1: workers 1", "worker 3 joined",
        "worker 3 left: connection lost", "group 1: its group server is gone",
        "run over: epochs"]
    assert msg["checkpoints"] == {"n": 3, "t": 4.0, "tt": 3.0, "bytes": 1000}


def test_bytes_per_hop_are_a_series_over_time_from_the_merges() -> None:
    s = RunState(CONFIG)
    for t, g, k in [(1.0, 0, 1), (1.2, 1, 1), (2.0, 0, 2)]:  # 1.2: within CLOCK_POINT_S
        s.add("global", merge(g, t, bytes_in=100 * k, bytes_out=200 * k,
                              bytes_to_global=10 * k, bytes_from_global=20 * k))
    s.add("group", {"t": 2.1, "event": "exchange", "group": 0, "bytes_to_global": 999,
                    "bytes_from_global": 999})  # the merges carry it: the group file is not read
    first = s.update(2.5)
    assert [p["t"] for p in first["bytes"]] == [1.0, 2.0]
    assert first["bytes"][-1] == {"t": 2.0, "tt": 0.0, "worker_to_group": 300,
                                  "group_to_worker": 600, "group_to_global": 30,
                                  "global_to_group": 60}
    assert s.update(2.5, first["cursor"])["bytes"] == []
    assert s.update(2.5)["evaluator"] is None
    s.add("server", {"t": 3.0, "evaluator": False})
    assert s.update(3.0)["evaluator"] is False


def test_each_groups_local_steps_reach_the_cards_and_a_gauge() -> None:
    """Local steps: a group's H from its workers' pushes, or what the global server set
    (``--local-steps auto``, a ``local_steps`` line), on the group's card and in /metrics."""
    pytest.importorskip("prometheus_client")
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from minips.dashboard.web import RunCollector

    s = RunState(CONFIG)
    s.add("worker", push(0, 1.0, 1, local_steps=8))
    s.add("worker", push(1, 1.0, 1, group=1, local_steps=4))
    s.add("global", merge(0, 1.5))
    s.add("global", merge(1, 1.5))
    assert {g: c.get("local_steps") for g, c in s.update(2.0)["groups"].items()} == \
        {"0": 8, "1": 4}
    s.add("global", {"t": 2.0, "event": "local_steps", "local_steps": {"0": 8, "1": 2}})
    assert s.update(2.5)["groups"]["1"]["local_steps"] == 2
    registry = CollectorRegistry()
    registry.register(RunCollector(s, lambda: 3.0))
    samples = {(x.name, x.labels.get("group")): x.value for f in
               text_string_to_metric_families(generate_latest(registry).decode())
               for x in f.samples}
    assert samples[("minips_group_local_steps", "0")] == 8
    assert samples[("minips_group_local_steps", "1")] == 2


def test_a_remote_workers_row_is_filled_from_what_the_servers_saw() -> None:
    """Workers whose files are on other machines: the merges' answered PULLs give each one's
    lead, SSP wait and a clock; its group's bytes over the pushes of an exchange its KB per
    push and, with the model's size, its upload; its STATS (the probe) its step time."""
    s = RunState(CONFIG)
    s.add("server", {"t": 0.0, "size": 1000})
    s.add("global", merge(0, 1.0, pushes=2, bytes_in=500, pull_workers=[0, 1],
                          pull_leads=[0, 1], pull_waits_us=[0, 0]))
    s.add("global", merge(0, 2.0, pushes=4, bytes_in=2100, step_time=0.05,
                          pull_workers=[0, 1, 0, 1, 0],
                          pull_leads=[0, 1, 1, 0, 2], pull_waits_us=[0, 0, 1500, 0, 3000]))
    s.add("global", merge(0, 2.2, pushes=0, step_time=0.0))  # a final exchange: no steps
    s.add("probe", {"t": 2.0, "worker": 1, "group": 0, "clock": 0, "step_time": 0.2})
    s.add("probe", {"t": 2.5, "worker": 1, "group": 0, "clock": 0, "step_time": 0.3})
    rows = {r["id"]: r for r in s.update(2.5)["workers"]}
    w0, w1 = rows[0], rows[1]
    assert (w0["clock"], w0["staleness"], w0["wait_s"]) == (3, 2, pytest.approx(0.003))
    assert (w1["clock"], w1["staleness"], w1["wait_s"]) == (2, 0, 0.0)
    assert w0["bytes_per_push"] == w1["bytes_per_push"] == pytest.approx(400.0)  # 1600 / 4
    assert w0["upload_ratio"] == pytest.approx(0.1)  # of 4 x 1000 bytes, dense float32
    assert w1["step_time"] == 0.3  # its last STATS
    assert w0["step_time"] == 0.05  # no STATS: its group's mean, at the last exchange
    assert w0["seen"] == "servers"
    assert set(w0["approx"]) == {"step_time", "bytes_per_push", "upload_ratio"}
    s.add("worker", push(1, 3.0, clock=4))  # a file of its own after all: its own figures
    mine = {r["id"]: r for r in s.update(3.0)["workers"]}[1]
    assert mine["seen"] == "own" and mine["bytes_per_push"] == 100 and mine["approx"] == []


def test_after_the_run_every_row_keeps_its_last_clock() -> None:
    s = RunState(CONFIG)
    s.add("probe", {"t": 1.0, "worker": 0, "group": 0, "clock": 41, "alive": True})
    s.add("global", merge(0, 1.5, pushes=3, pull_workers=[1] * 8, pull_leads=[0] * 8,
                          pull_waits_us=[0] * 8))
    s.add("global", {"t": 2.0, "event": "done", "reason": "epochs"})
    s.add("probe", {"t": 2.5, "worker": 0, "group": 0, "clock": 0, "alive": False})
    rows = {r["id"]: r for r in s.update(3.0)["workers"]}
    assert (rows[0]["clock"], rows[1]["clock"]) == (41, 7)
    assert {r["state"] for r in rows.values()} == {"done"}


def test_a_run_without_an_evaluator_says_so_live_over_and_in_a_replay(tmp_path: Path) -> None:
    """"no evaluator" (the page's hint), never "waiting for data", once nothing can come."""
    s = RunState(CONFIG)
    assert s.update(1.0)["evaluator"] is None  # nobody said yet
    s.add("global", {"t": 2.0, "event": "done", "reason": "epochs"})
    assert s.update(2.0)["evaluator"] is False  # over, and not a single evaluation
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps(CONFIG))
    (run / "global.jsonl").write_text(json.dumps(merge(0, 1.0)) + "\n")
    replay = Replay(run, speed=1.0)
    assert replay.state.update(replay.horizon(0.0))["evaluator"] is False  # before its end
    (run / "eval.jsonl").write_text(json.dumps({"t": 0.5, "accuracy": 0.1}) + "\n")
    assert Replay(run, speed=1.0).state.update(0.0)["evaluator"] is None


def test_byte_counters_that_start_again_after_a_resume_never_go_back() -> None:
    """A resumed server's groups count their hop bytes from 0 again: the page adds the
    segments up, so the bytes chart and the totals do not drop (accuracy vs bytes does not
    double back)."""
    s = RunState(CONFIG)
    for t, b in ((1.0, 100), (2.0, 300), (5.0, 50), (6.0, 120)):  # resumed between 2 and 5 s
        s.add("global", merge(0, t, bytes_in=b, bytes_out=10 * b, bytes_to_global=b,
                              bytes_from_global=2 * b))
    assert s.hops() == {"worker_to_group": 420, "group_to_worker": 4200,
                        "group_to_global": 420, "global_to_group": 840}
    series = [p["worker_to_group"] for p in s.bytes]
    assert series == sorted(series) and series[-1] == 420
    for t, b in ((1.5, 1000), (2.5, 3000), (5.5, 400)):  # the evaluator's view, likewise
        s.add("eval", {"t": t, "accuracy": 0.5, "bytes_up": b, "bytes_down": 0})
    assert [e["bytes"] for e in s.eval] == [1000, 3000, 3400]


def test_the_pages_times_are_the_servers_training_clock_across_a_resume() -> None:
    """Every point carries its training time: from the groups event, the checkpoint's
    training time after a resume (the downtime left out), the done event's at the end;
    events before training read as start-up."""
    s = RunState(CONFIG)
    s.add("global", {"t": 1.0, "event": "joined", "worker": 0})
    s.add("global", {"t": 3.0, "event": "groups", "assignment": {"0": 0}})
    s.add("global", merge(0, 6.0, bytes_in=10))
    s.add("global", {"t": 20.0, "event": "resumed", "train_s": 2.5})
    s.add("global", merge(0, 22.0, bytes_in=20))
    s.add("eval", {"t": 23.0, "accuracy": 0.5})
    s.add("global", {"t": 30.0, "event": "done", "reason": "epochs", "train_s": 12.0})
    msg = s.update(31.0)
    assert [p["tt"] for p in msg["bytes"]] == [3.0, 4.5] and msg["eval"][0]["tt"] == 5.5
    assert msg["train_t"] == 12.0
    assert [e["tt"] for e in msg["events"]] == [None, 0.0, 2.5, 12.0]
    assert RunState(CONFIG).update(0.5)["train_t"] is None  # start-up
