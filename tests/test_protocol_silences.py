"""What docs/protocol.md says on the points a second implementer found it silent on (issue 43),
each rule or number read from the page and checked against a real server on loopback.

The narrowed ``max_frame_bytes``; a str32 / bin32 length over its limit past ``meta_len``; how
deep a map field nests; a group HELLO address with no host; EXCHANGE's ``pull_*`` lists (their
length, their values, the latest 4096); a group's traffic counters across its group-process
sessions; WEIGHTS' ``progress`` under ``--max-steps`` and what the samples budget is; the ids
in WELCOME (a worker's ``info``, an evaluator that sends 7); STATS ``data`` (its keys answered
``invalid``, a later one); ``saved_exchanges`` before any checkpoint; EXCHANGE_REPLY's
``done``. Hostile-looking peers connect from addresses of their own (127.0.0.x,
tests/loopback_source.py): a server backs off an address whose sessions it cuts.
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
from conftest import recv_as
from loopback_source import connect_from
from raw_group import Cluster
from test_server import TOKEN, make_server, push

from minips.core import config, exchange
from minips.core.roster import GroupHandle
from minips.errors import AuthError
from minips.net import transport
from minips.net.channel import Channel
from minips.net.endpoints import parse_address
from minips.serve.peers import NoGroup
from minips.wire import checks, control, messages

PAGE = (Path(__file__).parent.parent / "docs" / "protocol.md").read_text()


def said(pattern: str) -> re.Match[str]:
    """The page's sentence matching ``pattern`` (whitespace in it matches any line break)."""
    found = re.search(pattern.replace(" ", r"\s+"), PAGE)
    assert found, f"docs/protocol.md does not say {pattern!r}"
    return found


def number(text: str) -> int:
    """A number as the page writes it: 4096, 1,189,856, 2^63-1, 64 KiB, 1 MiB."""
    text = text.replace(",", "").strip()
    if m := re.fullmatch(r"2\^(\d+)-1", text):
        return (1 << int(m[1])) - 1
    if m := re.fullmatch(r"(\d+) (KiB|MiB)", text):
        return int(m[1]) << (10 if m[2] == "KiB" else 20)
    return int(text)


def raw_frame(kind: messages.Kind, meta: bytes) -> bytes:
    """A frame of ``kind`` with no buffers whose map is the bytes ``meta``, as a peer may write."""
    return checks.PREFIX.pack(checks.MAGIC, messages.PROTOCOL_VERSION, kind, 0, 0, len(meta),
                              0) + meta


async def answer_to(port: int, source: str, frame: bytes) -> messages.Message:
    """What the server answers a worker's control channel (from ``source``) that sends
    ``frame`` right after the handshake."""
    ch = await connect_from(source, "127.0.0.1", port, token=TOKEN)
    try:
        ch._transport.write(frame)
        return await asyncio.wait_for(ch.recv(), 10)
    finally:
        await ch.close()


# -- STATS data: its keys are the server's to check (ERROR invalid); a later one -------------------

async def test_stats_data_with_another_key_or_type_is_answered_invalid(tmp_path: Path) -> None:
    """Issue 43, departure 1: the page says ``invalid``, the server said ``protocol_error``."""
    m = said(r"a map of at most `(\w+)`, `(\w+)`, `(\w+)`, `(\w+)` \(strings of <= (\d+) "
             r"chars\) and `(\w+)` \(bool\); any other key or type is answered ERROR `(\w+)`")
    strings, longest, flag, code = list(m.groups()[:4]), int(m[5]), m[6], m[7]
    assert set(strings) | {flag} == set(control.DATA_KEYS)
    bad = [{"host": "lab-pc-3"}, {flag: "yes"}, {flag: 1}, {strings[0]: 3},
           {strings[1]: None}, {strings[2]: ["a"]}, {strings[3]: "x" * (longest + 1)}]
    srv = make_server(tmp_path, np.zeros(3, np.float32), workers=2, mode="asp")
    port = await srv.start()
    try:
        for i, data in enumerate(bad):
            meta = msgpack.packb({"clock": 0, "step_time": 0.01, "loss": 1.0, "samples": 0,
                                  "data": data})
            reply = await answer_to(port, f"127.0.0.{20 + i}", raw_frame(messages.Kind.STATS,
                                                                         meta))
            assert isinstance(reply, control.Error) and reply.code == code, (data, reply)
            assert "STATS data" in reply.reason
        assert srv.rejected[code] == len(bad)
        good = {s: "x" * longest for s in strings} | {flag: True}
        ch = await transport.connect("127.0.0.1", port, worker_id=0, token=TOKEN)
        await ch.send(control.Stats(clock=0, step_time=0.01, loss=1.0, data=good))
        await ch.send(control.Stats(clock=1, step_time=0.01, loss=1.0, data=good))
        ok = await transport.connect("127.0.0.1", port, worker_id=1, token=TOKEN)
        await ok.send(control.Stats(clock=0, step_time=0.01, loss=1.0))
        await recv_as(ch, control.Assign, 10)  # both taken: the grouping came
        assert srv.rejected[code] == len(bad)
        await ch.close()
        await ok.close()
    finally:
        await srv.close()
    said(r"A later STATS may carry `data` too: it is checked the same way and logged again")
    records = [json.loads(line) for line in (tmp_path / "global.jsonl").read_text().splitlines()]
    records = [r for r in records if r["event"] == "data"]
    assert len(records) == 2  # the first STATS' data and the later one's


# -- frames and maps -------------------------------------------------------------------------

async def test_the_narrowed_frame_limit_is_the_page_s_sum(tmp_path: Path) -> None:
    m = said(r"`max_frame_bytes` = (\d+) \+ (\d+) × (\d+) \+ (\d+ MiB) \+ 2 × \(5n \+ (\d+ KiB)\)")
    prefix, entry, nbuf, meta, slack = (number(g) for g in m.groups())
    example = said(r"a frame of n = ([\d,]+) may claim ([\d,]+) bytes in all")
    n, claimed = number(example[1]), number(example[2])
    assert prefix + entry * nbuf + meta + 2 * (5 * n + slack) == claimed
    assert checks.DEFAULT_LIMITS.sized_for(n).max_frame_bytes == claimed
    srv = make_server(tmp_path, np.zeros(n, np.float32), workers=1, mode="asp")
    port = await srv.start()
    try:
        body = claimed + 1 - checks.PREFIX.size  # one byte over, in the body: no table needed
        prefix_only = checks.PREFIX.pack(checks.MAGIC, messages.PROTOCOL_VERSION,
                                         messages.Kind.STATS, 0, 0, 0, body)
        reply = await answer_to(port, "127.0.0.40", prefix_only)
        assert isinstance(reply, control.Error) and reply.code == "limit_exceeded", reply
    finally:
        await srv.close()


async def test_a_length_over_its_limit_is_limit_exceeded_even_past_the_map(
        tmp_path: Path) -> None:
    said(r"a str32 or bin32 header claiming 70,000 bytes in a map of 20 is `limit_exceeded`, "
         r"as an array32 or map32 header claiming too many items is; a length within its limit "
         r"that runs past `meta_len` is truncated msgpack, `protocol_error`")
    limits = checks.Limits()

    def claiming(tag: int, size: int, n: int) -> bytes:  # {"a": <header claiming n>} + 2 bytes
        return b"\x81\xa1a" + bytes([tag]) + n.to_bytes(size, "big") + b"xx"

    cases = {"str32": (claiming(0xdb, 4, 70_000), "limit_exceeded"),
             "bin32": (claiming(0xc6, 4, 70_000), "limit_exceeded"),
             "array32": (claiming(0xdd, 4, limits.max_array_len + 1), "limit_exceeded"),
             "map32": (claiming(0xdf, 4, limits.max_map_len + 1), "limit_exceeded"),
             "str32 within": (claiming(0xdb, 4, 100), "protocol_error"),
             "bin32 within": (claiming(0xc6, 4, limits.max_bin_len), "protocol_error")}
    assert all(len(meta) < 20 for meta, _ in cases.values())
    srv = make_server(tmp_path, np.zeros(3, np.float32), workers=1, mode="asp")
    port = await srv.start()
    try:
        for i, (name, (meta, code)) in enumerate(cases.items()):
            reply = await answer_to(port, f"127.0.0.{50 + i}", raw_frame(messages.Kind.STATS,
                                                                         meta))
            assert isinstance(reply, control.Error) and reply.code == code, (name, reply)
    finally:
        await srv.close()


def nested(levels: int) -> dict[str, Any]:
    """A map ``levels`` deep: {"a": {"a": ... {"a": 1}}}."""
    tree: dict[str, Any] = {"a": 1}
    for _ in range(levels - 1):
        tree = {"a": tree}
    return tree


async def test_a_map_field_nests_as_deep_as_the_page_says_counting_its_own_map(
        tmp_path: Path) -> None:
    m = said(r'at most (\d+) deep \(`MAX_DEPTH`\), the field\'s own map counting as the first '
             r'level \(`\{"a": \{"b": 1\}\}` is 2 deep; a ninth level is `protocol_error`\)')
    deepest = int(m[1])
    srv = make_server(tmp_path, np.zeros(3, np.float32), workers=1, mode="asp")
    port = await srv.start()
    try:
        answers = []
        for i, levels in enumerate((deepest, deepest + 1)):
            meta = msgpack.packb({"clock": 0, "step_time": 0.01, "loss": 1.0, "samples": 0,
                                  "data": nested(levels)})
            reply = await answer_to(port, f"127.0.0.{60 + i}", raw_frame(messages.Kind.STATS,
                                                                         meta))
            assert isinstance(reply, control.Error)
            answers.append(reply.code)
        # 8 deep passes the decoder (the server then finds no data key it knows: invalid);
        # 9 deep does not
        assert answers == ["invalid", "protocol_error"]
    finally:
        await srv.close()


# -- group processes: their address, their lists, their counters ---------------------------------

async def test_a_group_hello_address_with_no_host_is_refused(tmp_path: Path) -> None:
    m = said(r"and so is one with no host \(`(:\d+)`\)")
    srv = make_server(tmp_path, np.zeros(3, np.float32), workers=1, mode="ssp",
                      external_groups=1)
    port = await srv.start()
    try:
        with pytest.raises(AuthError, match="address"):
            await transport.connect("127.0.0.1", port, role="group", address=m[1], token=TOKEN,
                                    timeout=5, retries=0)
        ch = await transport.connect("127.0.0.1", port, role="group", address="0.0.0.0:7101",
                                     token=TOKEN, timeout=5)  # a wildcard host is one
        await ch.close()
    finally:
        await srv.close()


def pulls(n: int, value: int = 1) -> dict[str, Any]:
    return {"pull_workers": [0] * n, "pull_leads": [value] * n, "pull_waits_us": [7] * n}


async def test_exchange_pull_lists_hold_the_latest_4096_any_int_each(tmp_path: Path) -> None:
    m = said(r"each value in 0..(2\^63-1) and each list at most (\d+) entries long")
    top, longest = number(m[1]), int(m[2])
    latest = int(said(r"since its last exchange, the latest (\d+) at most")[1])
    assert longest == latest == exchange.MAX_PULLS == checks.Limits().max_array_len
    cluster = await Cluster(tmp_path, groups=1).start()
    try:
        ch = cluster.groups[0]
        await cluster.pull(ch)
        reply = await cluster.exchange(ch, session=1, seq=1, **pulls(longest, top))
        assert isinstance(reply, messages.ExchangeReply)
        reply = await cluster.exchange(ch, session=1, seq=2, **pulls(longest + 1))
        assert isinstance(reply, control.Error) and reply.code == "limit_exceeded", reply
    finally:
        await cluster.close()


async def test_a_group_s_traffic_counters_never_fall_when_another_process_takes_it_over(
        tmp_path: Path) -> None:
    said(r"the worker traffic this group process counted since it started, from 0 in each "
         r"`session`; the global server adds what the group's earlier sessions counted, so the "
         r"run's `bytes_up` and `bytes_down` never fall")
    cluster = await Cluster(tmp_path, groups=1).start()
    try:
        first = cluster.groups[0]
        await cluster.pull(first)
        await cluster.exchange(first, session=11, seq=1, bytes_in=1 << 40, bytes_out=1 << 41)
        await cluster.exchange(first, session=11, seq=2, bytes_in=(1 << 40) + 5,
                               bytes_out=1 << 41)
        await first.send(control.Leave(reason="restarting"))
        second = await cluster.connect_group(7301)  # adopts the group; counts from 0
        await recv_as(second, control.Assign, 10)
        await cluster.pull(second)
        await cluster.exchange(second, session=22, seq=1, bytes_in=1 << 20, bytes_out=3)
        counters = (await cluster.evaluate()).info
        assert counters["bytes_up"] == (1 << 40) + 5 + (1 << 20)
        assert counters["bytes_down"] == (1 << 41) + 3
    finally:
        await cluster.close()


def test_traffic_across_sessions_never_falls_nor_counts_a_session_twice() -> None:
    """``GroupHandle.across_sessions``: a new session counts on top of the earlier ones; the
    session a resumed server's restored counts came from (its ``last_exchange``) is not added
    to them a second time."""
    h, peer = GroupHandle(0, "127.0.0.1:7300"), NoGroup()  # the shell keeps the traffic

    def report(session: int, up: int) -> int:
        info = h.across_sessions({"session": session, "bytes_in": up, "bytes_out": 0},
                                 peer.traffic())
        peer.reported(info)
        h.last_exchange = (session, 1)
        return int(info["bytes_in"])

    assert [report(1, 100), report(1, 150)] == [100, 150]
    assert [report(2, 10), report(2, 30)] == [160, 180]  # another process: on top of 150
    h, peer = GroupHandle(0, "127.0.0.1:7300"), NoGroup({"bytes_in": 170, "bytes_out": 0})
    h.last_exchange = (2, 1)  # the resumed checkpoint held 150 + 20 of session 2
    assert report(2, 40) == 170 and report(2, 50) == 180  # never below 170, never 170 + 40
    assert report(3, 5) == 185


async def test_saved_exchanges_before_any_checkpoint(tmp_path: Path) -> None:
    m = said(r"`(\[\[-1, -1\], \[-1, -1\]\])` before the server's first checkpoint")
    cluster = await Cluster(tmp_path, groups=1).start()
    try:
        ch = cluster.groups[0]
        await cluster.pull(ch)
        reply = await cluster.exchange(ch, session=1, seq=1)
        assert isinstance(reply, messages.ExchangeReply)
        assert reply.saved_exchanges == eval(m[1])  # a literal list of the page's
    finally:
        await cluster.close()


async def test_exchange_reply_done_says_the_run_is_over(tmp_path: Path) -> None:
    said(r"`done` \(bool: true once the run is over, its budget spent or the run failed, as "
         r"LEAVE `done` says")
    cluster = await Cluster(tmp_path, groups=1).start()
    try:
        ch = cluster.groups[0]
        await cluster.pull(ch)
        reply = await cluster.exchange(ch, session=1, seq=1)
        assert isinstance(reply, messages.ExchangeReply) and not reply.done
        cluster.srv.perform(cluster.srv.core.finish("wall time"))  # the budget is spent
        leave = await recv_as(ch, control.Leave, 10)
        assert leave.reason == "done"
        reply = await cluster.exchange(ch, session=1, seq=2, final=True)
        assert isinstance(reply, messages.ExchangeReply) and reply.done
    finally:
        await cluster.close()


# -- run progress --------------------------------------------------------------------------

async def test_progress_under_max_steps_counts_against_the_page_s_budget(tmp_path: Path) -> None:
    said(r"with `max_steps` N > 0, N × `workers` × `batch_size` × H \(H: `local_steps`, or "
         r"`local_steps_max` when `local_steps` is 0, auto\)")
    steps, batch = 4, 16
    run = config.RunConfig(max_steps=steps, workers=1, batch_size=batch, local_steps=1)
    assert run.budget_samples() == steps * 1 * batch * 1
    srv = make_server(tmp_path, np.zeros(3, np.float32), workers=1, mode="asp",
                      max_steps=steps, batch_size=batch, local_steps=1)
    port = await srv.start()
    ctl = await transport.connect("127.0.0.1", port, worker_id=0, token=TOKEN)
    await ctl.send(control.Stats(clock=0, step_time=0.01, loss=1.0))
    assign = await recv_as(ctl, control.Assign, 10)
    host, gport = parse_address(assign.address)
    ch = await transport.connect(host or "127.0.0.1", gport, worker_id=0, group=assign.group,
                                 token=TOKEN)
    try:
        clock = (await recv_as(ch, messages.Ack, 10)).clock
        seen = []
        for _ in range(2):
            await ch.send(messages.Pull(clock=clock))
            seen.append((await recv_as(ch, messages.Weights, 10)).progress)
            await ch.send(push(clock + 1, np.ones(3, np.float32), samples=batch))
            clock = (await recv_as(ch, messages.Ack, 10)).clock
        await ch.send(messages.Pull(clock=clock))
        seen.append((await recv_as(ch, messages.Weights, 10)).progress)
        assert seen == pytest.approx([0.0, 1 / steps, 2 / steps], abs=1e-9)
    finally:
        await ch.close()
        await ctl.close()
        await srv.close()


# -- ids in WELCOME ------------------------------------------------------------------------

async def test_welcome_ids_of_a_worker_and_of_an_evaluator_that_sends_one(tmp_path: Path) -> None:
    said(r"`need_init` \(bool\), `worker_id`, the same id as WELCOME's own field, and "
         r"`link_probe` \(bool, step 3\) \(a worker's `info` holds these keys; an evaluator's "
         r"and a group process's hold none\)")
    m = said(r"an evaluator that sends `worker_id` (\d+) gets (\d+) back")
    sent, back = int(m[1]), int(m[2])
    srv = make_server(tmp_path, np.zeros(3, np.float32), workers=2, mode="asp")
    port = await srv.start()
    chans: list[Channel] = []
    try:
        worker = await transport.connect("127.0.0.1", port, worker_id=-1, token=TOKEN)
        chans.append(worker)
        assert worker.welcome_info["worker_id"] == worker.worker_id == 0
        assert worker.welcome_info["need_init"] is False
        assert worker.welcome_info["link_probe"] is True
        ev = await transport.connect("127.0.0.1", port, role="evaluator", worker_id=sent,
                                     token=TOKEN)
        chans.append(ev)
        assert ev.worker_id == back
        assert not {"worker_id", "need_init", "link_probe"} & set(ev.welcome_info)
        await ev.send(messages.Pull(clock=0))  # served as an evaluator all the same
        assert (await recv_as(ev, messages.GlobalWeights, 10)).size == 3
    finally:
        for ch in chans:
            await ch.close()
        await srv.close()
