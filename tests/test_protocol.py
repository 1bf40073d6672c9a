"""Tests for minips.wire.messages: round trips of every message, decoding in pieces, limits, state
machine and handshake, all without sockets."""

from __future__ import annotations

import struct

import lz4.block
import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minips.errors import AuthError, LimitExceeded, LocalProtocolError, RemoteProtocolError
from minips.wire import checks, control, fields, frames, handshake, kinds, messages, receive
from minips.wire.fields import Payload

# ---------------------------------------------------------------------------------------------
# Strategies: one per message class, drawing every field from its valid range.

ids = st.integers(-1, 2**63 - 1)
uints = st.integers(0, 2**63 - 1)
finite = st.floats(allow_nan=False, allow_infinity=False)
names = st.text(max_size=fields.MAX_NAME)
texts = st.text(max_size=200)
nonces = st.binary(min_size=control.NONCE_BYTES, max_size=control.NONCE_BYTES)
macs = st.one_of(st.just(b""), st.binary(min_size=control.MAC_BYTES, max_size=control.MAC_BYTES))
prims = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), finite, texts,
                  st.binary(max_size=64))
trees = st.recursive(prims, lambda c: st.one_of(st.lists(c, max_size=4),
                                                st.dictionaries(texts, c, max_size=4)),
                     max_leaves=12)
maps = st.dictionaries(names, trees, max_size=6)
buffers = st.lists(st.binary(max_size=300), max_size=4).map(tuple)
codecs = st.fixed_dictionaries({}, optional={
    "k": uints, "index": st.sampled_from(["varint", "u32"]),
    "value": st.sampled_from(["f32", "f16"])})
int_lists = st.lists(st.integers(0, 2**63 - 1), max_size=8)
seqs = st.integers(0, 2**53 - 1)
counts = st.integers(0, 2**62)
seconds = st.floats(0, 1e9)

payloads = st.builds(Payload, names, codecs, buffers)
STRATEGIES = {
    control.Hello: st.builds(control.Hello, version=st.integers(0, 255),
                              role=st.sampled_from(control.ROLES),
                       worker_id=ids, nonce=nonces, capabilities=st.lists(names, max_size=5),
                       address=texts, group=ids),
    control.Challenge: st.builds(control.Challenge, nonce=nonces),
    control.Auth: st.builds(control.Auth, mac=macs),
    control.Welcome: st.builds(control.Welcome, worker_id=ids, mac=macs, info=maps),
    control.Refuse: st.builds(control.Refuse, code=names, reason=texts),
    control.Assign: st.builds(control.Assign, group=uints, address=texts, ratio=st.floats(0, 1),
                        staleness=ids),
    control.Stats: st.builds(control.Stats, clock=uints, step_time=st.floats(0, 1e9), loss=finite,
                       samples=uints),
    messages.Push: st.builds(messages.Push, clock=uints, step_time=st.floats(0, 1e9), loss=finite,
                      samples=uints, payload=payloads),
    messages.Ack: st.builds(messages.Ack, clock=uints, version=uints),
    messages.Pull: st.builds(messages.Pull, clock=uints, since=ids),
    messages.Weights: st.builds(messages.Weights, version=uints, since=ids, payload=payloads,
                         done=st.booleans(), group=ids, waited_for=int_lists,
                         ratio=st.floats(0, 1), lead=st.integers(-(2**63) + 1, 2**63 - 1),
                         min_clock=ids, drift=st.floats(-1, 1e9)),
    messages.Exchange: st.builds(messages.Exchange, session=seqs, seq=seqs, version=uints,
                                 final=st.booleans(),
                          pushes=counts, samples=counts, step_time=seconds,
                          loss=st.floats(-1e30, 1e30), iter_time=seconds, bytes_in=counts,
                          bytes_out=counts, min_clock=ids, max_clock=ids, payload=payloads),
    messages.ExchangeReply: st.builds(messages.ExchangeReply, version=uints, done=st.booleans(),
                                      samples=counts,
                               saved_exchanges=st.lists(st.lists(st.integers(-1, 2**62),
                                                                 min_size=2, max_size=2),
                                                        max_size=3),
                               payload=payloads),
    messages.GlobalWeights: st.builds(messages.GlobalWeights, version=uints, done=st.booleans(),
                               size=st.integers(0, 2**31), samples=counts, t=finite,
                               train_s=seconds, done_reason=names, bytes_up=counts,
                               bytes_down=counts, members=int_lists,
                               last_exchange=st.one_of(st.just([]), st.lists(
                                   st.integers(-1, 2**62), min_size=2, max_size=2)),
                               payload=payloads),
    messages.InitWeights: st.builds(messages.InitWeights, size=st.integers(1, 2**31),
                                    payload=payloads),
    control.Heartbeat: st.builds(control.Heartbeat, seq=uints),
    control.Leave: st.builds(control.Leave, reason=texts),
    control.Score: st.builds(control.Score, version=uints, accuracy=st.floats(0, 1),
                             loss=finite, tested=uints, final=st.booleans()),
    control.Error: st.builds(control.Error, code=names, reason=texts),
}
any_message = st.one_of(*STRATEGIES.values())


def frame(msg: messages.Message, **kw: object) -> bytes:
    return b"".join(bytes(b) for b in frames.encode(msg, **kw))  # type: ignore[arg-type]


def test_every_kind_has_a_strategy() -> None:
    assert set(STRATEGIES) == set(kinds.MESSAGE_TYPES.values())


@settings(max_examples=300, deadline=None)
@given(msg=any_message, compress=st.booleans())
def test_round_trip_every_kind(msg: messages.Message, compress: bool) -> None:
    assert frames.FrameDecoder().feed(frame(msg, compress=compress)) == [msg]


@settings(max_examples=60, deadline=None)
@given(msgs=st.lists(any_message, min_size=1, max_size=5))
def test_decode_whole_bytewise_and_with_trailing_bytes(msgs: list[messages.Message]) -> None:
    data = b"".join(frame(m) for m in msgs)
    assert frames.FrameDecoder().feed(data) == msgs
    dec = frames.FrameDecoder()
    got = [m for i in range(len(data)) for m in dec.feed(data[i:i + 1])]
    assert got == msgs and not dec.in_frame
    dec = frames.FrameDecoder()
    assert dec.feed(data + data[:7]) == msgs  # the start of a next frame waits for more
    assert dec.in_frame
    assert dec.feed(data[7:]) == msgs


def test_large_buffers_round_trip_and_compress() -> None:
    weights = np.arange(300_000, dtype=np.float32)  # 1.2 MB, over the direct-receive size
    zeros = np.zeros(100_000, dtype=np.float32)  # compresses to almost nothing
    msg = messages.Weights(version=3, payload=Payload("dense", {}, (weights, zeros)))
    plain, packed = frame(msg), frame(msg, compress=True)
    assert len(packed) < len(plain) - 390_000
    for data in (plain, packed):
        (got,) = frames.FrameDecoder().feed(data)
        assert isinstance(got, messages.Weights)
        assert np.array_equal(np.frombuffer(got.payload.buffers[0], np.float32), weights)
        assert not np.frombuffer(got.payload.buffers[1], np.float32).any()


def test_custom_alloc_receives_into_preallocated_array() -> None:
    weights = np.linspace(0, 1, 50_000, dtype=np.float32)
    target = np.empty_like(weights)
    calls = []

    def alloc(kind: messages.Kind, index: int, nbytes: int) -> memoryview:
        calls.append((kind, index, nbytes))
        return target.data.cast("B")

    dec = receive.FrameReceiver(alloc=alloc)
    data = frame(messages.Weights(version=1, payload=Payload("dense", {}, (weights,))))
    for i in range(0, len(data), 70_001):  # the zero-copy pair, in uneven chunks
        chunk = data[i:i + 70_001]
        got: list[messages.Message] = []
        while chunk:
            room = dec.get_buffer()
            n = min(len(room), len(chunk))
            room[:n], chunk = chunk[:n], chunk[n:]
            got += dec.buffer_updated(n)
    assert calls == [(messages.Kind.WEIGHTS, 0, weights.nbytes)] and isinstance(got[0],
                                                                                messages.Weights)
    assert np.array_equal(target, weights)
    assert np.shares_memory(np.frombuffer(got[0].payload.buffers[0], np.uint8), target)


def test_a_big_payload_is_read_into_its_destination_a_few_kib_at_a_time() -> None:
    weights = np.arange(1_000_000, dtype=np.float32)  # 4 MB
    target = np.empty_like(weights)
    dec = receive.FrameReceiver(alloc=lambda kind, index, nbytes: target.data.cast("B"))
    data = memoryview(frame(messages.Weights(version=1, payload=Payload("dense", {}, (weights,)))))
    target_bytes = np.frombuffer(target, np.uint8)
    direct, got = [], []
    while data:  # a socket with everything waiting: each read fills the room it is given
        room = dec.get_buffer()
        n = min(len(room), len(data))
        room[:n], data = data[:n], data[n:]
        if np.shares_memory(np.frombuffer(room, np.uint8), target_bytes):
            direct.append(n)
        got += dec.buffer_updated(n)
    assert isinstance(got[0], messages.Weights) and np.array_equal(target, weights)
    assert max(direct) == receive.DIRECT_READ_BYTES
    # the rest came through the scratch buffer: with the head, and a last piece under 64 KiB
    assert sum(direct) >= weights.nbytes - frames.SCRATCH_BYTES - receive.DIRECT_MIN_BYTES


@pytest.mark.parametrize("decoder", [frames.FrameDecoder, receive.FrameReceiver])
def test_alloc_must_return_a_big_enough_writable_buffer(decoder: type[frames.FrameDecoder]) -> None:
    dec = decoder(alloc=lambda kind, i, n: b"x" * n)
    with pytest.raises(LocalProtocolError):
        dec.feed(frame(messages.Push(clock=0, payload=Payload("d", {}, (b"abc",)))))


# ---------------------------------------------------------------------------------------------
# Field validation


@pytest.mark.parametrize("make", [
    lambda: messages.Ack(clock=-1),
    lambda: messages.Ack(clock=True),
    lambda: messages.Ack(clock=2**63),
    lambda: control.Stats(clock=0, step_time=float("nan"), loss=0.0),
    lambda: control.Stats(clock=0, step_time=-1.0, loss=0.0),
    lambda: control.Assign(group=0, address="", ratio=1.5, staleness=0),
    lambda: control.Hello(role="boss", nonce=bytes(32)),
    lambda: control.Hello(nonce=bytes(31)),
    lambda: control.Leave(reason="x" * (fields.MAX_TEXT + 1)),
    lambda: control.Welcome(worker_id=0, mac=b"", info={1: 2}),  # type: ignore[dict-item]
    lambda: control.Welcome(worker_id=0, mac=b"", info={"a": object()}),
    lambda: messages.Push(clock=0, payload=Payload("d", {}, (np.zeros((4, 4))[:, 0],))),
    lambda: messages.Push(clock=0, payload=Payload("d", {}, (b"",) * (fields.MAX_BUFFERS + 1))),
    lambda: messages.Weights(version=0, payload=Payload("d", {}, ()), done=1),  # type: ignore[arg-type]
])
def test_invalid_fields_are_local_errors(make: object) -> None:
    with pytest.raises(LocalProtocolError) as info:
        make()  # type: ignore[operator]
    assert info.value.expected is not None


def test_buffers_are_flat_views_without_copy() -> None:
    arr = np.ones((3, 4), dtype=np.float32)
    msg = messages.Push(clock=0, payload=Payload("dense", {}, (arr,)))
    assert msg.payload.buffers[0].nbytes == 48 and msg.payload.buffers[0].format == "B"
    assert np.shares_memory(np.frombuffer(msg.payload.buffers[0], np.uint8), arr)


# ---------------------------------------------------------------------------------------------
# Malformed frames and limits


def raw_frame(kind: int, meta: object, *, version: int = messages.PROTOCOL_VERSION,
              magic: bytes = checks.MAGIC,
              entries: tuple[tuple[int, int, int], ...] = (), body: bytes = b"", flags: int = 0,
              body_len: int | None = None) -> bytes:
    packed = msgpack.packb(meta, use_bin_type=True)
    table = b"".join(checks.TABLE_ENTRY.pack(*e) for e in entries)
    blen = len(body) if body_len is None else body_len
    return checks.PREFIX.pack(magic, version, kind, len(entries), flags, len(packed),
                              blen) + table \
        + packed + body


ACK = {"clock": 1, "version": 2}
PUSH = {"clock": 1, "step_time": 0.0, "loss": 0.0, "samples": 0, "encoding": "d", "codec": {}}


def test_raw_frame_helper_matches_encoder() -> None:
    assert raw_frame(messages.Kind.ACK, ACK) == frame(messages.Ack(clock=1, version=2))


@pytest.mark.parametrize("data, what", [
    (raw_frame(messages.Kind.ACK, ACK, magic=b"HTTP"), "magic"),
    (raw_frame(99, ACK), "kind"),
    (raw_frame(messages.Kind.ACK, ACK, version=messages.PROTOCOL_VERSION + 1), "version"),
    (raw_frame(messages.Kind.ACK, ACK, flags=1), "flags"),
    (raw_frame(messages.Kind.ACK, {"clock": 1}), "keys"),
    (raw_frame(messages.Kind.ACK, {**ACK, "extra": 0}), "keys"),
    (raw_frame(messages.Kind.ACK, {"clock": "1", "version": 2}), "ACK"),
    (raw_frame(messages.Kind.ACK, [1, 2]), "not a map"),
    (raw_frame(messages.Kind.ACK, ACK, entries=((0, 3, 3),), body=b"abc"), "no buffers"),
    (raw_frame(messages.Kind.PUSH, PUSH, entries=((2, 3, 3),), body=b"abc"), "codec"),
    (raw_frame(messages.Kind.PUSH, PUSH, entries=((0, 3, 4),), body=b"abc"), "raw"),
    (raw_frame(messages.Kind.PUSH, PUSH, entries=((0, 3, 3),), body=b"abcd"), "add up"),
    (raw_frame(messages.Kind.PUSH, PUSH, entries=((1, 3, 100),), body=b"abc"), "lz4"),
    (raw_frame(messages.Kind.HEARTBEAT, {"seq": 0}) [:-1] + b"\xc1", "msgpack"),
])
def test_malformed_frames_are_remote_errors(data: bytes, what: str) -> None:
    with pytest.raises(RemoteProtocolError, match=what):
        frames.FrameDecoder().feed(data)


def test_lz4_output_must_match_announced_size() -> None:
    packed = lz4.block.compress(bytes(10_000), store_size=False)
    data = raw_frame(messages.Kind.PUSH, PUSH, entries=((1, len(packed), 5_000),), body=packed)
    with pytest.raises(RemoteProtocolError, match="lz4"):
        frames.FrameDecoder().feed(data)


def test_hello_refuse_error_decode_in_any_version() -> None:
    hello = control.Hello(version=7, nonce=bytes(32))
    assert frames.FrameDecoder().feed(frame(hello)) == [hello]
    refuse = raw_frame(messages.Kind.REFUSE, {"code": "version", "reason": "no"}, version=9)
    assert frames.FrameDecoder().feed(refuse) == [control.Refuse(code="version", reason="no")]


def test_decoder_stays_failed_and_returns_messages_before_the_error() -> None:
    dec = frames.FrameDecoder()
    good = frame(control.Heartbeat(seq=1))
    assert dec.feed(good + b"GARBAGE-GARBAGE-") == [control.Heartbeat(seq=1)]
    assert isinstance(dec.error, RemoteProtocolError)
    with pytest.raises(RemoteProtocolError):
        dec.feed(good)


def never_alloc(kind: messages.Kind, index: int, nbytes: int) -> memoryview:
    raise AssertionError("allocated before the limit check")


BIG = messages.Push(clock=0, payload=Payload("d", {}, (bytes(5000), bytes(5000))))


@pytest.mark.parametrize("limits, data", [
    (checks.Limits(max_frame_bytes=9000), frame(BIG)),
    (checks.Limits(max_buffers=1), frame(BIG)),
    (checks.Limits(max_meta_bytes=10), frame(BIG)),
    (checks.Limits(max_raw_bytes=9000), frame(BIG, compress=True)),
    (checks.Limits(max_str_len=10), frame(control.Leave(reason="x" * 11))),
    (checks.Limits(max_bin_len=16), frame(control.Challenge(nonce=bytes(32)))),
    (checks.Limits(max_array_len=2), frame(control.Welcome(worker_id=0, mac=b"", info={"a": [1, 2,
                                                                                              3]}))),
    (checks.Limits(max_map_len=2), frame(control.Welcome(worker_id=0, mac=b"", info={}))),
])
def test_every_limit_is_checked_before_allocation(limits: checks.Limits, data: bytes) -> None:
    dec = frames.FrameDecoder(limits=limits, alloc=never_alloc)
    with pytest.raises(RemoteProtocolError):
        dec.feed(data)


def test_limit_errors_carry_limit_and_value() -> None:
    dec = frames.FrameDecoder(limits=checks.Limits(max_frame_bytes=9000))
    with pytest.raises(LimitExceeded) as info:
        dec.feed(frame(BIG)[:checks.PREFIX.size])  # the prefix alone is enough to refuse
    assert info.value.expected == 9000 and info.value.got > 9000


@pytest.mark.parametrize("value, what, got, limit", [
    ("x" * 70_000, "max_str_len", 70_000, 1 << 16),
    (b"x" * 70_000, "max_bin_len", 70_000, 1 << 16),
    (list(range(5000)), "max_array_len", 5000, 4096),
    ({str(i): 0 for i in range(2000)}, "max_map_len", 2000, 1024),
])
def test_msgpack_lengths_over_their_limits_are_limit_exceeded(value: object, what: str, got: int,
                                                              limit: int) -> None:
    """docs/protocol.md section 6: the msgpack limits are limits like the others."""
    with pytest.raises(LimitExceeded) as info:
        frames.FrameDecoder().feed(raw_frame(messages.Kind.LEAVE, {"reason": value}))
    assert (info.value.expected, info.value.got) == (limit, got) and what in str(info.value)


def test_bad_msgpack_is_a_protocol_error_not_a_limit() -> None:
    packed = msgpack.packb({"reason": "x"})[:-1]  # the map cut short
    data = checks.PREFIX.pack(checks.MAGIC, messages.PROTOCOL_VERSION, messages.Kind.LEAVE, 0, 0,
                              len(packed), 0) + packed
    with pytest.raises(RemoteProtocolError) as info:
        frames.FrameDecoder().feed(data)
    assert not isinstance(info.value, LimitExceeded)


def test_huge_lengths_in_prefix_are_refused_at_once() -> None:
    prefix = struct.pack("<4sBBBBII", checks.MAGIC, messages.PROTOCOL_VERSION, messages.Kind.PUSH,
                         1, 0, 10, 2**32 - 1)
    with pytest.raises(LimitExceeded):
        frames.FrameDecoder(alloc=never_alloc).feed(prefix)


def test_encoder_refuses_frames_over_its_limits() -> None:
    with pytest.raises(LocalProtocolError):
        frames.encode(BIG, limits=checks.Limits(max_frame_bytes=9000))


# ---------------------------------------------------------------------------------------------
# Connection state machine


def handshake_pair(token: str | None = "secret") -> tuple[handshake.Connection,
                                                          handshake.Connection]:
    client = handshake.Connection(handshake.Side.CLIENT)
    server = handshake.Connection(handshake.Side.SERVER)
    ch, sh = handshake.ClientHandshake(token, role="worker"), handshake.ServerHandshake(token)

    def deliver(src: handshake.Connection, dst: handshake.Connection,
                msg: messages.Message) -> messages.Message:
        (got,) = dst.receive(b"".join(bytes(b) for b in src.send(msg)))
        return got

    hello = deliver(client, server, ch.hello)
    challenge = sh.on_hello(hello)  # type: ignore[arg-type]
    auth = ch.on_challenge(deliver(server, client, challenge))  # type: ignore[arg-type]
    assert sh.on_auth(deliver(client, server, auth)) is None  # type: ignore[arg-type]
    welcome = deliver(server, client, sh.welcome(3, {"mode": "bsp"}))
    assert ch.on_reply(welcome).info == {"mode": "bsp"}
    return client, server


def test_states_walk_through_the_handshake_to_open() -> None:
    client, server = handshake_pair()
    assert client.state == server.state == handshake.State.OPEN
    assert server.receive(frame(messages.Pull(clock=0))) == [messages.Pull(clock=0)]


def test_nothing_but_hello_before_the_handshake() -> None:
    with pytest.raises(LocalProtocolError) as info:
        handshake.Connection(handshake.Side.CLIENT).send(messages.Pull(clock=0))
    assert info.value.expected == ["ERROR", "HELLO"]
    with pytest.raises(RemoteProtocolError):
        handshake.Connection(handshake.Side.SERVER).receive(frame(messages.Push(
            clock=0, payload=Payload("d", {}, ()))))


def test_no_hello_after_the_handshake_and_directions_are_enforced() -> None:
    client, server = handshake_pair()
    with pytest.raises(RemoteProtocolError):
        server.receive(frame(control.Hello(nonce=bytes(32))))
    with pytest.raises(LocalProtocolError):
        client.send(messages.Ack(clock=0))  # ACK goes server -> client only


def test_error_closes_the_connection() -> None:
    client, server = handshake_pair()
    server.receive(b"".join(bytes(b) for b in client.send(control.Error(code="x", reason="bye"))))
    assert client.state == server.state == handshake.State.CLOSED
    with pytest.raises(LocalProtocolError):
        client.send(control.Heartbeat())


# ---------------------------------------------------------------------------------------------
# Handshake MACs


def test_server_without_token_accepts_client_without_token() -> None:
    client, server = handshake_pair(token=None)
    assert client.state == handshake.State.OPEN


def test_wrong_and_missing_tokens_are_refused_with_reasons() -> None:
    for client_token, reason in (("guess", "wrong token"), (None, "missing token")):
        ch, sh = handshake.ClientHandshake(client_token), handshake.ServerHandshake("secret")
        ch.on_challenge(sh.on_hello(ch.hello))  # type: ignore[arg-type]
        refuse = sh.on_auth(ch.on_challenge(control.Challenge(nonce=sh.nonce)))
        assert refuse is not None and reason in refuse.reason
        with pytest.raises(AuthError, match=reason):
            ch.on_reply(refuse)


def test_version_mismatch_is_refused_with_reason() -> None:
    ch = handshake.ClientHandshake("s", version=messages.PROTOCOL_VERSION + 1)
    sh = handshake.ServerHandshake("s")
    refuse = sh.on_hello(ch.hello)
    v = messages.PROTOCOL_VERSION
    assert isinstance(refuse, control.Refuse)
    assert f"server speaks {v}, client sent {v + 1}" in refuse.reason


def test_replayed_auth_fails_against_a_fresh_server_nonce() -> None:
    ch, first = handshake.ClientHandshake("secret"), handshake.ServerHandshake("secret")
    first.on_hello(ch.hello)
    recorded = ch.on_challenge(control.Challenge(nonce=first.nonce))
    assert first.on_auth(recorded) is None
    second = handshake.ServerHandshake("secret")  # an eavesdropper replays HELLO then AUTH
    second.on_hello(ch.hello)
    refuse = second.on_auth(recorded)
    assert refuse is not None and "wrong token" in refuse.reason


def test_client_checks_the_server_proof() -> None:
    ch, impostor = handshake.ClientHandshake("secret"), handshake.ServerHandshake("other")
    ch.on_challenge(impostor.on_hello(ch.hello))  # type: ignore[arg-type]
    with pytest.raises(AuthError, match="prove"):
        ch.on_reply(impostor.welcome(0, {}))


def test_mac_is_hmac_sha256_of_the_documented_transcript() -> None:
    import hashlib
    import hmac

    hello = control.Hello(role="worker", worker_id=5, nonce=bytes(range(32)))
    server_nonce = bytes(range(32, 64))
    transcript = (b"minips-client-v1\x00" + bytes([messages.PROTOCOL_VERSION, 6]) + b"worker"
                  + struct.pack("<q", 5) + hello.nonce + server_nonce)
    want = hmac.new(b"k", transcript, hashlib.sha256).digest()
    assert handshake.make_mac("k", handshake.CLIENT_LABEL, hello, server_nonce) == want


def test_worked_example_in_docs_matches_the_encoder() -> None:
    import re
    from pathlib import Path

    doc = (Path(__file__).parent.parent / "docs" / "protocol.md").read_text()
    blocks = re.findall(r"```hex\n(.*?)```", doc, re.S)
    dumps = [bytes.fromhex(" ".join(line[6:] for line in b.splitlines())) for b in blocks]
    push = messages.Push(clock=7, step_time=0.25, loss=1.5, samples=64, payload=Payload(
        "sparse-v1", {"k": 2, "index": "u32", "value": "f32"},
        (np.array([3, 17], np.uint32), np.array([0.5, -1.25], np.float32))))
    assert dumps == [frame(push), frame(messages.Ack(clock=7, version=8))]
