"""Tests for the fast paths: the zero-copy receiver's (whole frames decoded in one step, frames
split across reads) and the messages' (the checks of a map a peer sent, the inline number checks
of the constructor).
"""

from __future__ import annotations

import math
import struct

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minips.errors import LocalProtocolError, RemoteProtocolError
from minips.wire import checks, control, frames, messages, receive
from minips.wire.fields import Payload


def frame(msg: messages.Message, **kw: object) -> bytes:
    return b"".join(bytes(b) for b in frames.encode(msg, **kw))  # type: ignore[arg-type]


def raw(kind: int, meta: object, version: int = messages.PROTOCOL_VERSION) -> bytes:
    """A frame without buffers around any msgpack value (for maps a peer could send)."""
    packed = msgpack.packb(meta, use_bin_type=True)
    return checks.PREFIX.pack(checks.MAGIC, version, kind, 0, 0, len(packed), 0) + packed


SPARSE = messages.Push(clock=3, step_time=0.5, loss=1.25, samples=64, payload=Payload(
    "sparse-v1", {"k": 2, "index": "u32", "value": "f32"},
    (np.array([3, 17], np.uint32), np.array([0.5, -1.25], np.float32))))
STREAM = [messages.Ack(clock=1, version=2), SPARSE, control.Heartbeat(seq=9), SPARSE,
          messages.Pull(clock=4)]
STREAM_BYTES = b"".join(frame(m) for m in STREAM)


@settings(max_examples=100, deadline=None)
@given(cuts=st.lists(st.integers(0, len(STREAM_BYTES)), max_size=8))
def test_small_frames_split_anywhere_decode_the_same(cuts: list[int]) -> None:
    dec, got, at = receive.FrameReceiver(), [], 0
    for cut in sorted(cuts) + [len(STREAM_BYTES)]:
        got += dec.feed(STREAM_BYTES[at:cut])
        at = cut
    assert got == STREAM and not dec.in_frame


def test_half_a_small_frame_waits_without_a_partial_state() -> None:
    dec = receive.FrameReceiver()
    data = frame(SPARSE)
    assert dec.feed(data[:20]) == [] and dec.in_frame
    assert dec.feed(data[20:]) == [SPARSE] and not dec.in_frame


@pytest.mark.parametrize("custom_alloc", [False, True])
def test_frame_over_64k_already_whole_in_scratch(custom_alloc: bool) -> None:
    payload = np.arange(30_000, dtype=np.float32)  # 120 KB, under the 256 KiB scratch
    dest = np.zeros_like(payload)

    def alloc(kind: messages.Kind, index: int, nbytes: int) -> memoryview:
        assert (kind, index, nbytes) == (messages.Kind.WEIGHTS, 0, payload.nbytes)
        return dest.data.cast("B")

    dec = receive.FrameReceiver(alloc=alloc if custom_alloc else None)
    weights = messages.Weights(version=1, payload=Payload("dense-f32", {}, (payload,)))
    [msg] = dec.feed(frame(weights))
    got = np.frombuffer(msg.payload.buffers[0], dtype=np.float32)  # type: ignore[attr-defined]
    assert np.array_equal(got, payload)
    assert np.shares_memory(got, dest) == custom_alloc


def test_lz4_buffer_of_a_whole_small_frame() -> None:
    msg = messages.Push(clock=0, payload=Payload("dense-f32", {}, (bytes(20_000), b"tail")))
    data = frame(msg, compress=True)
    assert len(data) < 1000  # the zeros were compressed
    assert receive.FrameReceiver().feed(data) == [msg]


def test_decoded_buffers_are_writable_and_survive_later_frames() -> None:
    dec = receive.FrameReceiver()
    [first] = dec.feed(frame(SPARSE))
    other = messages.Push(clock=4, payload=Payload("sparse-v1", {}, (bytes(8), bytes(8))))
    dec.feed(frame(other) * 3)
    assert first == SPARSE
    view = first.payload.buffers[0]  # type: ignore[attr-defined]
    assert not view.readonly and view.format == "B" and view.ndim == 1
    view[0] = 0xFF


ACK = {"clock": 1, "version": 2}


@pytest.mark.parametrize("kind, meta, field", [
    (messages.Kind.ACK, {**ACK, "clock": True}, "clock"),  # bool is not an int on the wire
    (messages.Kind.ACK, {**ACK, "clock": -1}, "clock"),
    (messages.Kind.ACK, {**ACK, "version": 2**64 - 1}, "version"),
    (messages.Kind.ACK, {**ACK, "clock": 1.0}, "clock"),
    (messages.Kind.STATS, {"clock": 0, "step_time": math.nan, "loss": 0.0, "samples": 0},
     "step_time"),
    (messages.Kind.STATS, {"clock": 0, "step_time": 1.0, "loss": math.inf, "samples": 0}, "loss"),
    (messages.Kind.STATS, {"clock": 0, "step_time": -1.0, "loss": 0.0, "samples": 0}, "step_time"),
    (messages.Kind.ASSIGN, {"group": 0, "address": "", "ratio": 1.5, "staleness": 0,
                             "local_steps": 0}, "ratio"),
    (messages.Kind.ERROR, {"code": "x" * 65, "reason": ""}, "code"),
    (messages.Kind.WELCOME, {"worker_id": 0, "mac": b"", "info": {"a": [[[[[[[[[1]]]]]]]]]}},
     "info"),
    (messages.Kind.LEAVE, {"reason": b"bytes"}, "reason"),
])
def test_a_bad_field_from_the_peer_is_a_remote_error_naming_it(
        kind: messages.Kind, meta: dict[str, object], field: str) -> None:
    with pytest.raises(RemoteProtocolError, match=field) as info:
        frames.FrameDecoder().feed(raw(kind, meta))
    assert info.value.got == meta[field] or info.value.got != info.value.got  # nan != nan


def test_an_int_is_accepted_where_a_float_is_expected() -> None:
    [stats] = frames.FrameDecoder().feed(raw(messages.Kind.STATS, {"clock": 0, "step_time": 2,
                                                                   "loss": -3,
                                                        "samples": 5}))
    assert type(stats.step_time) is float and stats.step_time == 2.0  # type: ignore[attr-defined]
    assert type(stats.loss) is float  # type: ignore[attr-defined]


def test_keys_in_another_order_decode_and_encode_canonically() -> None:
    meta = {"version": 2, "clock": 1}  # a peer may order the map as it likes
    [ack] = frames.FrameDecoder().feed(raw(messages.Kind.ACK, meta))
    assert ack == messages.Ack(clock=1, version=2)
    assert frame(ack) == frame(messages.Ack(clock=1, version=2))


def test_hello_version_comes_from_the_prefix() -> None:
    hello = control.Hello(version=5, nonce=bytes(32))
    data = frame(hello)
    assert struct.unpack_from("<B", data, 4) == (5,)
    assert frames.FrameDecoder().feed(data)[0].version == 5  # type: ignore[attr-defined]


@pytest.mark.parametrize("make", [
    lambda: messages.Ack(clock=True),
    lambda: messages.Ack(clock=2**63),
    lambda: control.Stats(clock=0, step_time=math.inf, loss=0.0),
    lambda: control.Stats(clock=0, step_time=0.0, loss=math.nan),
    lambda: control.Stats(clock=0, step_time=0.0, loss=np.float64(1.0)),  # a float subclass
    lambda: control.Assign(group=0, address="", ratio=-0.1, staleness=0),
])
def test_constructor_number_checks_refuse_what_the_wire_would(make: object) -> None:
    with pytest.raises(LocalProtocolError):
        make()  # type: ignore[operator]


def test_constructor_normalises_ints_to_floats() -> None:
    stats = control.Stats(clock=0, step_time=1, loss=2)
    assert type(stats.step_time) is float and type(stats.loss) is float
