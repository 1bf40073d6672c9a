"""The plain decoder a student reads (``frames.FrameDecoder``) and the zero-copy receiver the
asyncio shell uses (``receive.FrameReceiver``) decode alike: fed the same bytes, whole, one byte
at a time, in random pieces, with trailing garbage, mangled, or over any limit, they give the
same messages, or the same messages and then the same error class, and they wait alike for the
rest of a frame (``in_frame``): both check a frame over 64 KiB as soon as its head is in, a
smaller one once it is whole (docs/protocol.md, section 1.1).
"""

from __future__ import annotations

import gc
from collections.abc import Iterable
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minips.errors import LimitExceeded, LocalProtocolError, ProtocolError
from minips.wire import checks, control, frames, handshake, messages, receive
from minips.wire.fields import Payload

DECODERS = (frames.FrameDecoder, receive.FrameReceiver)


def frame(msg: messages.Message, compress: bool = False) -> bytes:
    return b"".join(bytes(memoryview(b).cast("B")) for b in frames.encode(msg, compress=compress))


def raw_frame(kind: int, meta: bytes, *, version: int = messages.PROTOCOL_VERSION,
              entries: tuple[tuple[int, int, int], ...] = (), body: bytes = b"",
              flags: int = 0) -> bytes:
    """A frame put together by hand: ``entries`` (codec, wire_len, raw_len) per buffer."""
    table = b"".join(checks.TABLE_ENTRY.pack(*e) for e in entries)
    prefix = checks.PREFIX.pack(checks.MAGIC, version, kind, len(entries), flags, len(meta),
                                len(body))
    return prefix + table + meta + body


# -- what a decoder made of some bytes, and the rule that two outcomes agree ----------------------

Outcome = tuple[list[messages.Message], type | None, bool]  # messages, error class, in_frame


def outcome(decoder: type[frames.FrameDecoder], chunks: Iterable[bytes],
            **kw: Any) -> Outcome:
    """Feed ``chunks`` one by one until the decoder refuses; what it gave and how it ended."""
    dec = decoder(**kw)
    got: list[messages.Message] = []
    for chunk in chunks:
        try:
            got += dec.feed(chunk)
        except ProtocolError as e:
            return got, type(e), dec.in_frame
    return got, type(dec.error) if dec.error is not None else None, dec.in_frame


def assert_alike(chunks: list[bytes], **kw: Any) -> Outcome:
    """Both decoders on ``chunks``: the same messages and the same end."""
    plain = outcome(frames.FrameDecoder, chunks, **kw)
    zero_copy = outcome(receive.FrameReceiver, chunks, **kw)
    assert plain[:2] == zero_copy[:2]
    if plain[1] is None:
        assert plain[2] == zero_copy[2]  # both done, or both waiting for the rest of a frame
    return plain


def pieces(data: bytes, cuts: Iterable[int]) -> list[bytes]:
    at, out = 0, []
    for cut in sorted(set(cuts)) + [len(data)]:
        out.append(data[at:cut])
        at = cut
    return out


# -- streams of valid frames -----------------------------------------------------------------------

WEIGHTS = np.arange(300_000, dtype=np.float32)  # 1.2 MB: read stage by stage by the receiver
SMALL = [
    control.Hello(nonce=bytes(range(32)), capabilities=("lz4",), address="h:1"),
    control.Challenge(nonce=bytes(32)),
    control.Auth(mac=bytes(32)),
    control.Welcome(worker_id=3, mac=b"", info={"model": "lenet5", "sizes": [1, 2, 3]}),
    control.Assign(group=1, address="", ratio=0.01, staleness=3),
    messages.Pull(clock=4, since=2),
    messages.Weights(version=5, since=2, payload=Payload(
        "sparse-v1", {"k": 2, "index": "u32", "value": "f32"},
        (np.array([3, 17], np.uint32), np.array([0.5, -1.0], np.float32))),
                     waited_for=[1, 2], ratio=0.5),
    messages.Push(clock=5, step_time=0.25, loss=1.5, samples=64, payload=Payload("dense-f32", {},
                  (np.ones(5000, np.float32),))),  # 20 KB of ones: lz4 takes it
    messages.Ack(clock=5, version=6),
    control.Stats(clock=5, step_time=0.25, loss=1.5, data={"dataset": "mnist"}),
    control.Heartbeat(seq=7),
    control.Leave(reason="done"),
]
BIG = [
    messages.Weights(version=1, payload=Payload("dense-f32", {}, (WEIGHTS,))),
    messages.Push(clock=1, payload=Payload("dense-f32", {}, (np.zeros(100_000, np.float32),
                                                          WEIGHTS[:20_000]))),
    messages.InitWeights(size=300_000, payload=Payload("dense-f32", {}, (WEIGHTS,))),
]
SMALL_BYTES = b"".join(frame(m, compress=i % 2 == 1) for i, m in enumerate(SMALL))
ALL_BYTES = b"".join(frame(m, compress=c) for m in SMALL + BIG for c in (False, True))


def test_whole_streams_decode_alike() -> None:
    for data in (SMALL_BYTES, ALL_BYTES):
        got, err, waiting = assert_alike([data])
        assert err is None and not waiting and len(got) in (len(SMALL), 2 * len(SMALL + BIG))


def test_one_byte_at_a_time_decodes_alike() -> None:
    got, err, waiting = assert_alike([SMALL_BYTES[i:i + 1] for i in range(len(SMALL_BYTES))])
    assert got == SMALL and err is None and not waiting


@settings(max_examples=40, deadline=None)
@given(cuts=st.lists(st.integers(0, len(ALL_BYTES)), max_size=12))
def test_any_pieces_decode_alike(cuts: list[int]) -> None:
    got, err, _ = assert_alike(pieces(ALL_BYTES, cuts))
    assert err is None and len(got) == 2 * len(SMALL + BIG)


@settings(max_examples=200, deadline=None)
@given(tail=st.binary(min_size=1, max_size=64), cut=st.integers(0, len(SMALL_BYTES)))
def test_trailing_garbage_gives_the_same_messages_then_the_same_error(tail: bytes,
                                                                      cut: int) -> None:
    got, _, _ = assert_alike(pieces(SMALL_BYTES + tail, [cut]))
    assert got == SMALL


@settings(max_examples=100, deadline=None)
@given(cut=st.integers(0, len(ALL_BYTES) - 1))
def test_a_stream_cut_short_waits_alike(cut: int) -> None:
    assert_alike([ALL_BYTES[:cut]])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_mangled_streams_decode_alike(data: st.DataObject) -> None:
    """Bytes overwritten anywhere in a stream (prefix, table, map, body): the same messages
    before the damage, then the same error class, or the same messages if it did no harm."""
    stream = bytearray(data.draw(st.sampled_from([SMALL_BYTES, ALL_BYTES[:400_000]])))
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(stream) - 1))
        stream[at] = data.draw(st.integers(0, 255))
    cuts = data.draw(st.lists(st.integers(0, len(stream)), max_size=4))
    assert_alike(pieces(bytes(stream), cuts))


# -- malformed frames and every limit -------------------------------------------------------------

ACK = frames.encode(messages.Ack(clock=1, version=2))[0][checks.PREFIX.size:]  # its packed map
PUSH = frame(messages.Push(clock=0, payload=Payload("d", {}, (b"abc",))))
PUSH_META = PUSH[checks.PREFIX.size + checks.TABLE_ENTRY.size:-3]
K = messages.Kind
MALFORMED = [
    b"XXXX" + PUSH[4:],  # bad magic
    raw_frame(99, ACK),  # unknown kind
    raw_frame(K.ACK, ACK, version=3),  # another version
    raw_frame(K.REFUSE, frames.encode(control.Refuse(code="v", reason="r"))[0][16:], version=9),
    raw_frame(K.ACK, ACK, flags=1),
    raw_frame(K.ACK, b"\x92\x01\x02"),  # a list, not a map
    raw_frame(K.ACK, b"\x81\xa5clock\x01"),  # a key missing
    raw_frame(K.ACK, b"\x82\xa5clock\xc3\xa7version\x02"),  # a bool for an int
    raw_frame(K.ACK, ACK[:-1] + b"\xc1"),  # not msgpack
    raw_frame(K.ACK, ACK, entries=((0, 3, 3),), body=b"abc"),  # buffers on a kind without
    raw_frame(K.PUSH, PUSH_META, entries=((2, 3, 3),), body=b"abc"),  # unknown codec
    raw_frame(K.PUSH, PUSH_META, entries=((0, 3, 4),), body=b"abc"),  # raw with raw_len != wire
    raw_frame(K.PUSH, PUSH_META, entries=((0, 3, 3),), body=b"abcd"),  # table != body_len
    raw_frame(K.PUSH, PUSH_META, entries=((1, 3, 100),), body=b"abc"),  # corrupt lz4
    raw_frame(K.PUSH, PUSH_META, entries=((1, 1, 5),), body=b"\x00"),  # lz4 short of raw_len
    raw_frame(K.PUSH, PUSH_META, entries=((1, 0, 0),)),  # an empty lz4 block
    raw_frame(K.PUSH, PUSH_META, body=b"abc"),  # a body and no table
    PUSH[:-3] + b"ab",  # a frame shorter than it says, then nothing: waits
]


@pytest.mark.parametrize("data", MALFORMED)
def test_malformed_frames_are_refused_alike(data: bytes) -> None:
    good = frame(control.Heartbeat(seq=1))
    for chunks in ([good + data], [good + data[:9], data[9:]],
                   [bytes([b]) for b in good + data]):
        assert_alike(chunks)


TWO = messages.Push(clock=0, payload=Payload("d", {}, (bytes(5000), bytes(5000))))
LIMITED = [
    (checks.Limits(max_frame_bytes=9000), frame(TWO)),
    (checks.Limits(max_buffers=1), frame(TWO)),
    (checks.Limits(max_meta_bytes=10), frame(TWO)),
    (checks.Limits(max_raw_bytes=9000), frame(TWO, compress=True)),
    (checks.Limits(max_buffer_bytes=4999), frame(TWO, compress=True)),
    (checks.Limits(max_str_len=10), frame(control.Leave(reason="x" * 11))),
    (checks.Limits(max_bin_len=16), frame(control.Challenge(nonce=bytes(32)))),
    (checks.Limits(max_array_len=2), frame(control.Welcome(worker_id=0, mac=b"",
                                                            info={"a": [1, 2, 3]}))),
    (checks.Limits(max_map_len=2), frame(control.Welcome(worker_id=0, mac=b"", info={}))),
    (handshake.HANDSHAKE_LIMITS, frame(TWO)),
    (checks.DEFAULT_LIMITS.sized_for(1000), frame(messages.Push(
        clock=0, payload=Payload("dense-f32", {}, (bytes(80 << 10),))), compress=True)),
    (checks.DEFAULT_LIMITS.sized_for(1000), frame(BIG[0])),
]


@pytest.mark.parametrize("limits, data", LIMITED)
def test_every_limit_is_refused_alike(limits: checks.Limits, data: bytes) -> None:
    for chunks in ([data], [data[:20], data[20:]], pieces(data, range(0, len(data), 4096))):
        got, err, _ = assert_alike(chunks, limits=limits)
        assert got == [] and err is LimitExceeded


@pytest.mark.parametrize("limits, data", LIMITED)
def test_under_every_limit_the_same_frames_decode_alike(limits: checks.Limits,
                                                        data: bytes) -> None:
    got, err, _ = assert_alike([data])
    assert len(got) == 1 and err is None


def test_the_inflate_budget_refuses_a_frame_alike() -> None:
    over = frame(messages.Push(clock=0, payload=Payload("d", {}, (bytes(40_000), bytes(40_000)))),
                 compress=True)
    for cap, refused in ((64 << 10, True), (80_000, False)):
        for chunks in ([over], [over[:30], over[30:]]):
            budget = checks.InflateBudget(cap)
            got, err, _ = assert_alike(chunks, budget=budget)
            assert (err is LimitExceeded) == refused and len(got) == (not refused)
            del got
            gc.collect()  # a refused frame's first buffer dies with the error's traceback
            assert budget.used == 0  # the plain decoder's charge returned, the receiver's freed


def test_an_alloc_of_the_callers_gets_the_same_buffers() -> None:
    for data in (frame(BIG[0]), frame(BIG[0], compress=True), frame(SMALL[6])):
        targets: dict[type, list[np.ndarray]] = {d: [] for d in DECODERS}
        for decoder in DECODERS:
            def alloc(kind: messages.Kind, index: int, nbytes: int,
                      into: list[np.ndarray] = targets[decoder]) -> memoryview:
                into.append(np.empty(nbytes + 8, np.uint8))
                return into[-1].data
            (got,) = decoder(alloc=alloc).feed(data)
            assert all(np.shares_memory(np.frombuffer(b, np.uint8), t)
                       for b, t in zip(got.payload.buffers, targets[decoder], strict=True))  # type: ignore[attr-defined]
        plain, zero_copy = targets.values()
        assert [t.size for t in plain] == [t.size for t in zero_copy]
        assert all(np.array_equal(a[:-8], b[:-8]) for a, b in zip(plain, zero_copy, strict=True))


@pytest.mark.parametrize("decoder", DECODERS)
def test_a_short_alloc_is_our_error_in_both(decoder: type[frames.FrameDecoder]) -> None:
    with pytest.raises(LocalProtocolError):
        decoder(alloc=lambda kind, i, n: np.empty(n - 1, np.uint8).data).feed(frame(BIG[0]))


def test_the_receiver_takes_over_a_fresh_decoder_with_its_settings() -> None:
    conn = handshake.Connection(handshake.Side.SERVER)
    taken = receive.FrameReceiver.taking_over(conn.decoder)
    assert taken.limits is handshake.HANDSHAKE_LIMITS and taken.scratch == conn.decoder.scratch
    assert (taken.alloc, taken.budget) == (conn.decoder.alloc, conn.decoder.budget)
    conn.decoder.feed(frame(control.Heartbeat(seq=1))[:5])
    with pytest.raises(LocalProtocolError):
        receive.FrameReceiver.taking_over(conn.decoder)
