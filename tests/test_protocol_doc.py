"""docs/protocol.md's smaller statements, each checked against the code that keeps it.

The INIT_WEIGHTS message gets no reply; a PULL's clock must be the worker's own; over-long
varints are accepted up to 5 bytes; NaN and inf are refused in dense gradients too; a small
frame's buffer table is checked once the frame is whole, a large one's before its body; a
handshake that runs out of time is closed without ERROR; ``read_timeout`` counts silence, not
slowness; HEARTBEAT's ``seq`` and an evaluator's ``address`` are not checked.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import numpy as np
import pytest
from conftest import recv_as, until
from test_server import TOKEN, join, make_server, push

from minips.errors import RemoteProtocolError
from minips.net import channel, transport
from minips.net.endpoints import parse_address
from minips.server import InProcGroup
from minips.sparse import SparseVector, decode_vector, encode_vector
from minips.wire import frames, messages


async def group_session(ctl: channel.Channel) -> tuple[channel.Channel, int]:
    """Worker 0 on its group server, after ASSIGN: the channel and its starting clock."""
    assign = await recv_as(ctl, messages.Assign, 5)
    host, port = parse_address(assign.address)
    ch = await transport.connect(host, port, role="worker", worker_id=0, group=assign.group,
                                 token=TOKEN)
    return ch, (await recv_as(ch, messages.Ack, 5)).clock


async def test_init_weights_gets_no_reply(tmp_path: Path) -> None:
    srv = make_server(tmp_path, None, workers=1, mode="asp")
    port = await srv.start()
    ctl = await transport.connect("127.0.0.1", port, role="worker", worker_id=-1, token=TOKEN)
    try:
        encoding, codec, buffers = encode_vector(np.ones(4, np.float32))
        await ctl.send(messages.InitWeights(size=4, encoding=encoding, codec=codec,
                                     buffers=tuple(buffers)))
        await ctl.send(messages.Stats(clock=0, step_time=0.01, loss=1.0))
        await recv_as(ctl, messages.Assign, 5)  # the next message is ASSIGN, no ACK before it
    finally:
        await ctl.close()
        await srv.close()


async def test_a_pull_at_another_clock_makes_the_push_after_it_fail(tmp_path: Path) -> None:
    srv = make_server(tmp_path, np.zeros(3, np.float32), workers=1, mode="asp")
    port = await srv.start()
    ctl = await join(port, 0, 0.01)
    ch, clock = await group_session(ctl)
    try:
        await ch.send(messages.Pull(clock=clock + 5))  # not the worker's own clock
        await recv_as(ch, messages.Weights, 5)  # answered for the worker's real clock ...
        await ch.send(push(clock + 6, np.ones(3, np.float32)))
        error = await recv_as(ch, messages.Error, 5)  # ... so its PUSH carries the wrong one
        assert error.code == "clock" and f"expected {clock + 1}" in error.reason
    finally:
        await ch.close()
        await ctl.close()
        await srv.close()


@pytest.mark.parametrize("bad", [np.nan, np.inf])
async def test_nan_or_inf_in_a_dense_gradient_is_refused(tmp_path: Path, bad: float) -> None:
    srv = make_server(tmp_path, np.zeros(3, np.float32), workers=1, mode="asp")
    port = await srv.start()
    ctl = await join(port, 0, 0.01)
    ch, clock = await group_session(ctl)
    try:
        await ch.send(messages.Pull(clock=clock))
        await recv_as(ch, messages.Weights, 5)
        await ch.send(push(clock + 1, np.array([1.0, bad, 0.0], np.float32)))
        error = await recv_as(ch, messages.Error, 5)
        assert error.code == "invalid" and "NaN or inf" in error.reason
        assert isinstance(peer := srv.core.groups[0].peer, InProcGroup)
        assert peer.server.core.weights.tolist() == [0.0] * 3  # nothing applied
    finally:
        await ch.close()
        await ctl.close()
        await srv.close()


def sparse_v1_codec(k: int) -> dict[str, object]:
    return {"k": k, "index": "varint", "value": "f32"}


def test_over_long_varints_are_accepted_up_to_five_bytes() -> None:
    values = np.ones(2, np.float32).tobytes()
    # gaps 3 (as 83 80 00: three bytes for a one-byte number) and 0 (as 80 80 80 80 00)
    index = bytes([0x83, 0x80, 0x00, 0x80, 0x80, 0x80, 0x80, 0x00])
    g = decode_vector("sparse-v1", sparse_v1_codec(2), [index, values], 10)
    assert isinstance(g, SparseVector) and g.indices.tolist() == [3, 4]
    with pytest.raises(RemoteProtocolError, match="larger than 32 bits"):  # six bytes
        decode_vector("sparse-v1", sparse_v1_codec(1),
                               [bytes([0x80] * 5 + [0x00]), values[:4]], 10)


def test_small_frame_table_is_checked_once_whole_large_one_before_its_body() -> None:
    def head(body_len: int, wire: int) -> bytes:  # one raw buffer whose table says ``wire``
        meta = b"\x80"  # an empty msgpack map: the table is what is wrong here
        return (frames.PREFIX.pack(frames.MAGIC, messages.PROTOCOL_VERSION, messages.Kind.PUSH,
                                     1, 0, len(meta), body_len)
                + frames.TABLE_ENTRY.pack(0, wire, wire) + meta)

    small = frames.FrameDecoder()
    assert small.feed(head(100, 99)) == []  # the table does not add up: not looked at yet
    with pytest.raises(RemoteProtocolError, match="does not add up"):
        small.feed(bytes(100))  # the frame is whole: now it is
    large = frames.FrameDecoder()
    with pytest.raises(RemoteProtocolError, match="does not add up"):
        large.feed(head(1 << 20, (1 << 20) - 1))  # refused before any of the body


async def test_handshake_timeout_closes_without_error() -> None:
    async def never(ch: channel.Channel) -> None:
        raise AssertionError("no handshake, no handler")

    options = channel.Options(handshake_timeout=0.3)
    async with await transport.serve("127.0.0.1", 0, accept=lambda h: {}, handler=never,
                                     token=TOKEN, options=options) as srv:
        reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)
        assert await asyncio.wait_for(reader.read(), 5) == b""  # closed, not a byte sent
        assert srv.stats["handshake_timeouts"] == 1
        writer.close()


async def test_read_timeout_counts_silence_not_slowness() -> None:
    """A frame that trickles in a byte every 0.05 s (over 1.5 s in all, 15 times read_timeout)
    is not cut off: only silence is."""
    got: list[messages.Message] = []

    async def keep(ch: channel.Channel) -> None:
        got.append(await ch.recv())

    options = channel.Options(read_timeout=0.1)
    async with await transport.serve("127.0.0.1", 0, accept=lambda h: {}, handler=keep,
                                     token=TOKEN, options=options) as srv:
        ch = await transport.connect("127.0.0.1", srv.port, token=TOKEN)
        frame = b"".join(bytes(b) for b in frames.encode(messages.Pull(clock=7)))
        for byte in range(len(frame)):  # a byte at a time, on the channel's own socket
            ch._transport.write(frame[byte:byte + 1])
            await asyncio.sleep(0.05)
        await until(lambda: bool(got), 5)
        assert got == [messages.Pull(clock=7)] and srv.stats["read_timeouts"] == 0
        await ch.close()


async def test_heartbeat_seq_and_evaluator_address_are_not_checked(tmp_path: Path) -> None:
    srv = make_server(tmp_path, np.zeros(3, np.float32), workers=1, mode="asp")
    port = await srv.start()
    ev = await transport.connect("127.0.0.1", port, role="evaluator", address="anything:1",
                                 token=TOKEN)
    try:
        for seq in (5, 5, 0):  # repeated and going back
            await ev.send(messages.Heartbeat(seq=seq))
        await ev.send(messages.Pull(clock=0))
        assert (await recv_as(ev, messages.GlobalWeights, 5)).info["size"] == 3
        assert not srv.rejected and srv.server is not None
        assert srv.server.stats["protocol_errors"] == 0
    finally:
        await ev.close()
        await srv.close()


def test_section_3_lists_every_kind_with_every_key_of_its_map() -> None:
    """Each row of section 3's table names its kind's number and name and every key of its map
    (``messages.meta_keys``), so a client written from the page sends and checks whole maps."""
    doc = (Path(__file__).parent.parent / "docs" / "protocol.md").read_text()
    rows = {int(m[1]): (m[2], m[3]) for m in
            re.finditer(r"^\| *(\d+) *\| *([A-Z_]+) *\|[^|]*\|([^\n]*)$", doc, re.M)}
    assert set(rows) == {int(k) for k in messages.Kind}
    for kind in messages.Kind:
        name, text = rows[int(kind)]
        assert name == kind.name
        keys = set(re.findall(r"`([a-z_]+)`", text))
        missing = set(messages.meta_keys(kind)) - keys
        assert not missing, f"{kind.name}: {sorted(missing)} not in docs/protocol.md section 3"
