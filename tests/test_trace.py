"""The frame trace (--trace, record/trace.py) and `minips trace` (run/trace_cmd.py): what a
student reading a run's conversation sees.

Real sockets on loopback for the hook; a capture made here with dpkt for the pcap reader
(TCP segments split, out of order, retransmitted). The whole path through `minips local`,
tcpdump and tshark is tests/test_dissector.py.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import until

from minips.net import channel
from minips.net import transport as t
from minips.record import trace
from minips.run import trace_cmd
from minips.sparse import SparseVector, encode_vector
from minips.wire import control, frames, messages
from minips.wire.messages import Kind

TOKEN = "trace-token"


@pytest.fixture
def tracer(tmp_path: Path) -> Any:
    tr = trace.open_tracer(tmp_path / "worker-0.trace.jsonl", "ignored")
    yield tr
    trace.close_tracer()


def lines_of(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines()]


async def step_server(ch: channel.Channel) -> None:
    """PULL -> WEIGHTS (dense), PUSH -> ACK, until LEAVE."""
    weights = np.arange(300, dtype=np.float32)
    while True:
        msg = await ch.recv()
        if isinstance(msg, messages.Pull):
            await ch.send(messages.Weights(version=3, payload=encode_vector(weights)))
        elif isinstance(msg, messages.Push):
            await ch.send(messages.Ack(clock=msg.clock, version=4))
        elif isinstance(msg, control.Leave):
            return


async def one_step(path: Path) -> None:
    srv = await t.serve("127.0.0.1", 0, accept=lambda h: {"worker_id": 0}, handler=step_server,
                        token=TOKEN)
    async with srv:
        assert trace.TRACER is not None
        trace.TRACER.name_port(srv.port, "group-0")
        ch = await t.connect("127.0.0.1", srv.port, token=TOKEN, worker_id=0)
        await ch.send(messages.Pull(clock=0))
        assert isinstance(await ch.recv(), messages.Weights)
        grad = SparseVector(np.array([2, 40, 41], np.uint32),
                            np.array([0.5, -1.0, 2.0], np.float32), 300)
        await ch.send(messages.Push(clock=1, payload=encode_vector(grad, index="u32")))
        assert await ch.recv() == messages.Ack(clock=1, version=4)
        await ch.close(leave="done")
        await until(lambda: not srv.channels)


def test_every_frame_is_a_line_on_both_ends_with_its_bytes_map_and_payload(tracer: Any,
                                                                          tmp_path: Path):
    asyncio.run(one_step(tmp_path / "worker-0.trace.jsonl"))
    trace.close_tracer()
    got = lines_of(tmp_path / "worker-0.trace.jsonl")
    assert got[0]["event"] == "open" and got[0]["role"] == "worker-0"  # the file's name says
    frames_ = got[1:]
    kinds = [(x["role"], x["dir"], x["kind"]) for x in frames_]
    for kind in ("HELLO", "AUTH", "PULL", "PUSH", "LEAVE"):  # the client sends, the server gets
        assert ("worker-0", "send", kind) in kinds and ("group-0", "recv", kind) in kinds
    for kind in ("CHALLENGE", "WELCOME", "WEIGHTS", "ACK"):
        assert ("group-0", "send", kind) in kinds and ("worker-0", "recv", kind) in kinds
    sends = {(x["local"], x["peer"], x["seq"]): x for x in frames_ if x["dir"] == "send"}
    for x in (x for x in frames_ if x["dir"] == "recv"):  # each receive has its send
        sent = sends[(x["peer"], x["local"], x["seq"])]
        assert (sent["kind"], sent["bytes"], sent["meta"]) == (x["kind"], x["bytes"], x["meta"])
    push = next(x for x in frames_ if x["kind"] == "PUSH" and x["dir"] == "send")
    assert push["meta"]["clock"] == 1
    assert push["payload"] == {"encoding": "sparse-v1", "n": None, "k": 3, "value": "f32",
                               "index": "u32", "buffers": [12, 12]}
    wire = frames.wire_size(messages.Push(clock=1, payload=encode_vector(
        SparseVector(np.array([2, 40, 41], np.uint32), np.zeros(3, np.float32), 300),
        index="u32")))
    assert push["bytes"] == wire
    weights = next(x for x in frames_ if x["kind"] == "WEIGHTS" and x["dir"] == "recv")
    assert weights["payload"]["n"] == 300 and weights["bytes"] > 1200
    hello = next(x for x in frames_ if x["kind"] == "HELLO")
    assert hello["meta"]["nonce"].endswith("bytes>")  # bytes fields are never written out


def test_off_by_default_and_when_closed_nothing_is_written(tmp_path: Path):
    assert trace.TRACER is None  # no --trace: the hook is one `is None` check
    tr = trace.open_tracer(tmp_path / "x.trace.jsonl", "server")
    trace.close_tracer()
    assert trace.TRACER is None and not (tmp_path / "x.trace.jsonl").exists()  # no frame: no file
    tr.inproc("group-0", "server", "send", messages.Pull(clock=1), 31)  # after close: dropped
    assert not (tmp_path / "x.trace.jsonl").exists()


def test_past_the_cap_only_every_nth_frame_then_nothing_and_the_file_says_so(tmp_path: Path):
    path = tmp_path / "server.trace.jsonl"
    tr = trace.Tracer(path, "server", cap_bytes=3000, every=4)
    for i in range(400):
        tr.inproc("group-0", "server", "send", messages.Pull(clock=i), 31)
    tr.close()
    got = lines_of(path)
    events = [x for x in got if "event" in x]
    assert [e["event"] for e in events] == ["open", "sampling", "stopped"]
    at = got.index(events[1])
    clocks = [x["meta"]["clock"] for x in got[at + 1:] if "kind" in x]
    assert clocks and all(c % 4 == 3 for c in clocks)  # frames counted from 1: every 4th
    assert np.all(np.diff(clocks) == 4)
    assert path.stat().st_size < 2 * 3000 + 1000  # twice the cap, and the last event line
    assert max(x["meta"]["clock"] for x in got if "kind" in x) < 399  # stopped before the end


def test_the_conversation_pairs_ends_names_roles_and_shows_clocks(tmp_path: Path):
    """Two files of one connection and an in-process exchange: each frame once, named by role,
    with its receive time."""
    a = {"local": "127.0.0.1:5000", "peer": "127.0.0.1:7071"}
    b = {"local": "127.0.0.1:7071", "peer": "127.0.0.1:5000"}
    worker = [{"t": 10.0, "role": "worker-0", "dir": "send", "kind": "PUSH", "bytes": 900,
               "seq": 0, **a, "meta": {"clock": 1},
               "payload": trace.summarise_payload("sparse-v1", {"k": 5, "index": "u32",
                                                                "value": "f16"}, [20, 10])},
              {"t": 10.004, "role": "worker-0", "dir": "recv", "kind": "ACK", "bytes": 33,
               "seq": 0, **a, "meta": {"clock": 1, "version": 7}}]
    group = [{"t": 10.001, "role": "group-0", "dir": "recv", "kind": "PUSH", "bytes": 900,
              "seq": 0, **b, "meta": {"clock": 1}},
             {"t": 10.003, "role": "group-0", "dir": "send", "kind": "ACK", "bytes": 33,
              "seq": 0, **b, "meta": {"clock": 1, "version": 7}},
             {"t": 10.002, "role": "group-0", "dir": "send", "kind": "EXCHANGE", "bytes": 5000,
              "seq": 0, "local": "inproc:group-0", "peer": "inproc:server",
              "peer_role": "server", "meta": {"version": 7}}]
    for name, rows in (("worker-0", worker), ("server", group)):
        (tmp_path / f"{name}.trace.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in rows) + '{"t": 1, "role"')  # half a line
    got, notes = trace_cmd.load_frames(trace_cmd.trace_files(tmp_path))
    assert [(f.src, f.dst, f.kind) for f in got] == [
        ("worker-0", "group-0", "PUSH"), ("group-0", "server", "EXCHANGE"),
        ("group-0", "worker-0", "ACK")]
    assert got[0].t_recv == pytest.approx(10.001) and got[2].t_recv == pytest.approx(10.004)
    assert any("unreadable" in n for n in notes)
    text = list(trace_cmd.render_text(got, got[0].t))
    assert "PUSH" in text[0] and "clock=1" in text[0] and "900 B" in text[0]
    assert "sparse-v1 k=5 f16 u32" in text[0] and "(+1.00 ms)" in text[0]
    assert "version=7" in text[2] and "in-process" in text[1]


def test_the_chart_has_a_lifeline_per_role_and_labelled_arrows(tmp_path: Path):
    pytest.importorskip("matplotlib")
    got = [trace_cmd.Frame(1.0 + i / 100, src, dst, kind, n, meta)
           for i, (src, dst, kind, n, meta) in enumerate([
               ("worker-0", "group-0", "PULL", 31, {"clock": 0}),
               ("group-0", "worker-0", "WEIGHTS", 247024, {"version": 0}),
               ("worker-0", "group-0", "PUSH", 246928, {"clock": 1}),
               ("group-0", "worker-0", "ACK", 33, {"clock": 1, "version": 1}),
               ("group-0", "server", "EXCHANGE", 247122, {"version": 2}),
               ("server", "group-0", "EXCHANGE_REPLY", 246927, {"version": 1})])]
    chosen, lo, hi = trace_cmd.chart_window(got, 1.0, None, None)
    assert [f.kind for f in chosen][0] == "PULL" and chosen[-1].kind == "EXCHANGE_REPLY"
    out = trace_cmd.draw_chart(chosen, 1.0, (lo, hi), tmp_path / "chart")
    assert [p.suffix for p in out] == [".png", ".svg"] and all(p.stat().st_size for p in out)
    svg = out[1].read_text()
    for text in ("server", "group-0", "worker-0", "PUSH clock=1 · 246.9 kB",
                 "EXCHANGE_REPLY version=1", "ACK clock=1 version=1 · 33 B"):
        assert text in svg, text
    assert trace_cmd.chart_window(got, 1.0, 0.015, 0.035)[0] == got[2:4]  # --from / --to


def test_minips_trace_says_in_one_line_what_is_missing(tmp_path: Path):
    cmd = [sys.executable, "-m", "minips", "trace"]
    for args, says in (([str(tmp_path / "nope")], "no such file or directory"),
                       ([str(tmp_path)], "no *.trace.jsonl files"),
                       (["--pcap", str(tmp_path / "x.pcap")], "no such file")):
        proc = subprocess.run(cmd + args, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and says in proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1


# -- a capture made here: the pcap reader's TCP reassembly -----------------------------------

def _capture(path: Path, segments: list[tuple[float, tuple[str, int], tuple[str, int], int,
                                                int, bytes]]) -> None:
    dpkt = pytest.importorskip("dpkt")
    import socket

    with open(path, "wb") as f:
        w = dpkt.pcap.Writer(f, linktype=dpkt.pcap.DLT_EN10MB)
        for ts, (sh, sp), (dh, dp), seq, flags, data in segments:
            tcp = dpkt.tcp.TCP(sport=sp, dport=dp, seq=seq, flags=flags, data=data)
            ip = dpkt.ip.IP(src=socket.inet_aton(sh), dst=socket.inet_aton(dh),
                            p=dpkt.ip.IP_PROTO_TCP, data=tcp)
            ip.len = len(bytes(ip))
            w.writepkt(bytes(dpkt.ethernet.Ethernet(type=dpkt.ethernet.ETH_TYPE_IP, data=ip)),
                       ts=ts)


def test_a_capture_becomes_the_same_conversation_segments_out_of_order_and_repeated(
        tmp_path: Path):
    worker, group = ("127.0.0.1", 50000), ("127.0.0.1", 7071)
    up = [control.Hello(role="worker", worker_id=3, nonce=b"n" * 32, group=0),
          messages.Pull(clock=0),
          messages.Push(clock=1, payload=encode_vector(np.ones(5000, np.float32)))]
    down = [messages.Weights(version=0, payload=encode_vector(np.zeros(5000, np.float32))),
            messages.Ack(clock=1, version=1)]
    wire_up = b"".join(bytes(memoryview(p)) for m in up for p in frames.encode(m))
    wire_down = b"".join(bytes(memoryview(p)) for m in down for p in frames.encode(m))
    cuts = [0, 7, 150, 170, 5000, 12000, len(wire_up)]  # a prefix split, a body in pieces
    segs = [(1.0, worker, group, 999, 0x02, b"")]  # SYN: isn 999
    for i in range(len(cuts) - 1):
        segs.append((1.1 + i / 10, worker, group, 1000 + cuts[i], 0x18,
                     wire_up[cuts[i]:cuts[i + 1]]))
    segs[3], segs[4] = segs[4], segs[3]  # out of order
    segs.insert(5, segs[2])  # a retransmission
    segs.append((2.0, group, worker, 5000, 0x18, wire_down))  # no SYN seen: starts here
    _capture(tmp_path / "cap.pcap", segs)
    got = trace_cmd.read_pcap(tmp_path / "cap.pcap")
    assert [(f.src, f.dst, f.kind, f.nbytes) for f in got] == [
        ("worker-3", "group-0", "HELLO", frames.wire_size(up[0])),
        ("worker-3", "group-0", "PULL", frames.wire_size(up[1])),
        ("worker-3", "group-0", "PUSH", frames.wire_size(up[2])),
        ("group-0", "worker-3", "WEIGHTS", frames.wire_size(down[0])),
        ("group-0", "worker-3", "ACK", frames.wire_size(down[1]))]
    push = got[2]
    assert push.meta == {"clock": 1, "step_time": 0.0, "loss": 0.0, "samples": 0}
    assert push.payload is not None and push.payload["n"] == 5000
    assert push.t_recv is not None and push.t_recv > push.t  # its body came in later segments
    assert Kind[got[4].kind] == Kind.ACK and got[4].meta["version"] == 1


def test_bytes_the_capture_never_saw_are_passed_over_and_what_came_after_still_shows(
        tmp_path: Path):
    """A capture drops packets under load: a segment lost inside a body keeps the frames in
    step, one lost in a head loses that frame only; a retransmission that covers a held
    segment's start releases it (each once lost every frame after it in that direction)."""
    worker, group = ("127.0.0.1", 50001), ("127.0.0.1", 7071)
    msgs = [messages.Pull(clock=0),
            messages.Push(clock=1, payload=encode_vector(np.ones(5000, np.float32))),
            messages.Pull(clock=1),
            messages.Pull(clock=2),
            messages.Push(clock=3, payload=encode_vector(np.ones(3000, np.float32))),
            messages.Pull(clock=4)]
    wires = [b"".join(bytes(memoryview(p)) for p in frames.encode(m)) for m in msgs]
    at = [0]
    for w in wires:
        at.append(at[-1] + len(w))
    wire = b"".join(wires)

    def seg(ts: float, lo: int, hi: int) -> tuple[Any, ...]:
        return (ts, worker, group, 1000 + lo, 0x18, wire[lo:hi])

    push1, pull3 = at[1], at[3]
    segs = [(1.0, worker, group, 999, 0x02, b""),
            seg(1.1, 0, push1 + 200),  # PULL, the head of the PUSH and some of its body
            # push1+200 .. push1+4000: body bytes the capture dropped
            seg(1.3, push1 + 4000, pull3 + 5),  # the rest of the body, a PULL, a head's start
            # pull3+5 .. at[4]: the rest of that PULL's head, dropped: the frame is lost
            seg(1.5, at[4] + 100, at[6]),  # held: the bytes before it come below
            seg(1.6, at[4], at[4] + 300)]  # a retransmission covering the held one's start
    _capture(tmp_path / "cap.pcap", segs)
    got = [(f.kind, f.meta["clock"]) for f in trace_cmd.read_pcap(tmp_path / "cap.pcap")]
    # (in time order the last PULL comes first: its bytes were seen before the PUSH's)
    assert sorted(got, key=lambda k: k[1]) == [("PULL", 0), ("PUSH", 1), ("PULL", 1),
                                               ("PUSH", 3), ("PULL", 4)]
