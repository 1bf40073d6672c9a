"""Tests for minips.net.transport on real loopback sockets (port 0), on both the standard asyncio
loop and uvloop: handshake outcomes, limits, read timeout, TLS, retry, heartbeats, back-pressure."""

from __future__ import annotations

import asyncio
import socket
import ssl
import time
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
from conftest import run_on, until

from minips.errors import AuthError, RemoteProtocolError
from minips.net import channel, transport
from minips.net import transport as t
from minips.net.channel import write_batches
from minips.wire import checks, control, frames, handshake, messages
from minips.wire.fields import Payload

TOKEN = "test-token"
LOOPS = pytest.mark.parametrize("loop", ["asyncio", "uvloop"])


def run(loop: str, coro: Coroutine[Any, Any, Any]) -> Any:
    return run_on(loop, coro, 20)


async def echo_handler(ch: channel.Channel) -> None:
    """Answer PUSH with ACK and PULL with WEIGHTS of a fixed array until LEAVE."""
    weights = np.arange(1000, dtype=np.float32)
    while True:
        msg = await ch.recv()
        if isinstance(msg, messages.Push):
            await ch.send(messages.Ack(clock=msg.clock, version=len(msg.payload.buffers)))
        elif isinstance(msg, messages.Pull):
            await ch.send(messages.Weights(version=msg.clock,
                                           payload=Payload("dense", {}, (weights,))))
        elif isinstance(msg, control.Leave):
            return


def accept_all(hello: control.Hello) -> dict[str, Any]:
    return {"worker_id": 7 if hello.worker_id < 0 else hello.worker_id, "mode": "ssp"}


async def start(handler: Callable[[channel.Channel], Awaitable[None]] = echo_handler,
                **kw: Any) -> transport.Server:
    kw.setdefault("token", TOKEN)
    return await transport.serve("127.0.0.1", 0, accept=kw.pop("accept", accept_all),
                                 handler=handler,
                         **kw)


# ---------------------------------------------------------------------------------------------
# Handshake


@LOOPS
def test_handshake_accepted_and_messages_flow(loop: str) -> None:
    async def scenario() -> None:
        async with await start() as srv:
            ch = await t.connect("127.0.0.1", srv.port, token=TOKEN, capabilities=("lz4",))
            assert ch.worker_id == 7 and ch.welcome_info == {"worker_id": 7, "mode": "ssp"}
            await ch.send(messages.Push(clock=1, payload=Payload("dense", {}, (b"ab", b"cd"))))
            assert await ch.recv() == messages.Ack(clock=1, version=2)
            await ch.send(messages.Pull(clock=4))
            weights = await ch.recv()
            assert isinstance(weights, messages.Weights) and weights.version == 4
            got = np.frombuffer(weights.payload.buffers[0], np.float32)
            assert np.array_equal(got, np.arange(1000))
            await ch.close(leave="bye")
            await until(lambda: not srv.channels)
            assert srv.stats["accepted"] == 1 and srv.stats["refused"] == 0
            assert ch.bytes_sent > 0 and ch.bytes_received > 4000

    run(loop, scenario())


@LOOPS
def test_accept_sees_hello_and_can_refuse(loop: str) -> None:
    def accept(hello: control.Hello) -> dict[str, Any]:
        if hello.role != "evaluator":
            raise AuthError(f"role {hello.role} not welcome")
        return {}

    async def scenario() -> None:
        async with await start(accept=accept) as srv:
            with pytest.raises(AuthError, match="role worker not welcome"):
                await t.connect("127.0.0.1", srv.port, token=TOKEN)
            ch = await t.connect("127.0.0.1", srv.port, token=TOKEN, role="evaluator")
            await ch.close()
            assert srv.stats["refused"] == 1

    run(loop, scenario())


@pytest.mark.parametrize("kw, reason", [
    ({"version": messages.PROTOCOL_VERSION + 1}, "protocol version mismatch: server speaks "
     f"{messages.PROTOCOL_VERSION}, client sent {messages.PROTOCOL_VERSION + 1}"),
    ({"token": "guess"}, "wrong token"),
    ({"token": ""}, "missing token"),
])
def test_refusals_carry_reasons_on_both_sides(kw: dict[str, Any], reason: str,
                                              caplog: pytest.LogCaptureFixture) -> None:
    async def scenario() -> None:
        async with await start() as srv:
            kw.setdefault("token", TOKEN)
            with pytest.raises(AuthError, match=reason):
                await t.connect("127.0.0.1", srv.port, **kw)
            await until(lambda: srv.stats["refused"] == 1)

    with caplog.at_level("WARNING", logger="minips.net.transport"):
        run("uvloop", scenario())
    assert reason in caplog.text


def test_token_defaults_to_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MINIPS_TOKEN", "from-env")

    async def scenario() -> None:
        async with await start(token=None) as srv:
            ch = await t.connect("127.0.0.1", srv.port)
            await ch.close()
            with pytest.raises(AuthError, match="wrong token"):
                await t.connect("127.0.0.1", srv.port, token="other")

    run("asyncio", scenario())


def test_client_refuses_a_server_without_the_secret() -> None:
    async def scenario() -> None:
        async with await start(token="") as srv:
            with pytest.raises(AuthError, match="prove"):
                await t.connect("127.0.0.1", srv.port, token=TOKEN)

    run("asyncio", scenario())


async def read_frame(reader: asyncio.StreamReader) -> messages.Message:
    dec = frames.FrameDecoder()
    while True:
        data = await reader.read(65536)
        assert data, "connection closed before a whole frame"
        msgs = dec.feed(data)
        if msgs:
            return msgs[0]


def raw(msg: messages.Message) -> bytes:
    return b"".join(bytes(b) for b in frames.encode(msg))


@LOOPS
def test_replayed_handshake_is_refused(loop: str) -> None:
    async def scenario() -> None:
        async with await start() as srv:
            hs = handshake.ClientHandshake(TOKEN)
            reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)
            writer.write(raw(hs.hello))
            challenge = await read_frame(reader)
            auth = hs.on_challenge(challenge)  # type: ignore[arg-type]
            writer.write(raw(auth))
            assert isinstance(await read_frame(reader), control.Welcome)
            writer.close()
            # An eavesdropper replays the recorded HELLO and AUTH on a new connection.
            reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)
            writer.write(raw(hs.hello))
            assert isinstance(await read_frame(reader), control.Challenge)
            writer.write(raw(auth))
            refuse = await read_frame(reader)
            assert isinstance(refuse, control.Refuse) and "wrong token" in refuse.reason
            writer.close()
            await until(lambda: srv.stats["refused"] == 1)

    run(loop, scenario())


# ---------------------------------------------------------------------------------------------
# Protocol errors, limits and timeouts


@LOOPS
def test_frame_over_limit_closes_that_connection_only(loop: str) -> None:
    options = channel.Options(limits=checks.Limits(max_frame_bytes=1 << 20))

    async def scenario() -> None:
        async with await start(options=options) as srv:
            bad = await t.connect("127.0.0.1", srv.port, token=TOKEN)
            good = await t.connect("127.0.0.1", srv.port, token=TOKEN)
            await bad.send(messages.Push(clock=0, payload=Payload("dense", {}, (bytes(2 << 20),))))
            error = await bad.recv()
            assert isinstance(error, control.Error) and error.code == "limit_exceeded"
            assert "frame size" in error.reason
            with pytest.raises(ConnectionError):
                await bad.recv()
            await good.send(messages.Push(clock=3, payload=Payload("dense", {}, ())))
            assert await good.recv() == messages.Ack(clock=3, version=0)
            await until(lambda: srv.stats["limit_exceeded"] == 1)
            await good.close()

    run(loop, scenario())


@pytest.mark.parametrize("value", ["x" * 70_000, list(range(5000))], ids=["str", "array"])
def test_msgpack_length_over_limit_is_answered_limit_exceeded(value: object) -> None:
    """A 70,000-character string or a 5,000-item array in a map: ERROR limit_exceeded, as
    docs/protocol.md section 6 and ``Limits`` say, counted as such; then the server closes.
    Sent after the handshake: before WELCOME a frame over 16 KiB is refused by its size alone."""
    packed = msgpack.packb({"reason": value})
    data = checks.PREFIX.pack(checks.MAGIC, messages.PROTOCOL_VERSION, messages.Kind.LEAVE, 0, 0,
                              len(packed), 0) + packed

    async def scenario() -> None:
        async with await start() as srv:
            hs = handshake.ClientHandshake(TOKEN)
            reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)
            writer.write(raw(hs.hello))
            writer.write(raw(hs.on_challenge(await read_frame(reader))))  # type: ignore[arg-type]
            assert isinstance(await read_frame(reader), control.Welcome)
            writer.write(data)
            error = await read_frame(reader)
            assert isinstance(error, control.Error) and error.code == "limit_exceeded", error
            assert await reader.read() == b""
            await until(lambda: srv.stats["limit_exceeded"] == 1)
            assert srv.stats["protocol_errors"] == 0
            writer.close()

    run("asyncio", scenario())


@LOOPS
def test_half_frame_then_silence_is_cut_off_by_read_timeout(loop: str) -> None:
    options = channel.Options(read_timeout=0.3)

    async def scenario() -> None:
        async with await start(options=options) as srv:
            reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)
            # a prefix cut short, then nothing
            writer.write(raw(control.Hello(nonce=bytes(32)))[:10])
            error = await read_frame(reader)
            assert isinstance(error, control.Error) and "read timeout" in error.reason
            assert await reader.read() == b""  # then the server closed
            assert srv.stats["read_timeouts"] == 1
            writer.close()

    run(loop, scenario())


def test_garbage_gets_error_then_close_and_is_counted() -> None:
    async def scenario() -> None:
        async with await start() as srv:
            reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)
            writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            error = await read_frame(reader)
            assert isinstance(error, control.Error) and "magic" in error.reason
            await until(lambda: srv.stats["protocol_errors"] == 1)
            writer.close()

    run("uvloop", scenario())


def test_out_of_order_message_from_peer_raises_remote_error_in_recv() -> None:
    async def handler(ch: channel.Channel) -> None:
        ch._transport.write(raw(control.Challenge(nonce=bytes(32))))  # bypass our own state checks
        await ch.recv()

    async def scenario() -> None:
        async with await start(handler=handler) as srv:
            ch = await t.connect("127.0.0.1", srv.port, token=TOKEN)
            with pytest.raises(RemoteProtocolError, match="may not send CHALLENGE"):
                await ch.recv()

    run("asyncio", scenario())


# ---------------------------------------------------------------------------------------------
# Retry, heartbeats, back-pressure, zero-copy receive


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@LOOPS
def test_connect_retries_until_the_server_appears(loop: str) -> None:
    async def scenario() -> None:
        port = free_port()
        attempt = asyncio.create_task(t.connect("127.0.0.1", port, token=TOKEN, retries=50))
        await asyncio.sleep(0.3)  # let a few attempts fail first
        srv = await transport.serve("127.0.0.1", port, token=TOKEN, accept=accept_all,
                            handler=echo_handler)
        ch = await attempt
        await ch.close()
        srv.close()
        await srv.wait_closed()

    run(loop, scenario())


def test_unreachable_address_gives_connection_error_within_timeout() -> None:
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        began = loop.time()
        with pytest.raises(ConnectionError, match="could not connect"):
            await t.connect("127.0.0.1", free_port(), token=TOKEN, timeout=0.5, retries=100)
        assert loop.time() - began < 1.5

    run("asyncio", scenario())


async def heartbeating_client(srv: transport.Server) -> tuple[channel.Channel, channel.Channel]:
    """A client that sends HEARTBEAT every 50 ms, and the server's side of its connection."""
    ch = await t.connect("127.0.0.1", srv.port, token=TOKEN,
                         options=channel.Options(heartbeat=0.05))
    await until(lambda: len(srv.channels) == 1)
    (server_side,) = srv.channels
    return ch, server_side


def silence_limited(errors: list[BaseException]) -> Callable[[channel.Channel], Awaitable[None]]:
    """A handler that limits its connection's silence to 0.3 s, then waits for a message;
    ``errors`` gets why the connection ended, if it did."""

    async def limited(ch: channel.Channel) -> None:
        ch.start_silence_limit(0.3)
        try:
            await ch.recv()
        except ConnectionError as e:
            errors.append(e)

    return limited


@LOOPS
def test_heartbeats_refresh_last_recv_and_stop_on_close(loop: str) -> None:
    async def quiet(ch: channel.Channel) -> None:
        await ch.recv()  # heartbeats are absorbed; this returns at LEAVE

    async def scenario() -> None:
        async with await start(handler=quiet) as srv:
            ch, server_side = await heartbeating_client(srv)
            first = server_side.last_recv
            await until(lambda: server_side.last_recv > first + 0.1)
            beat = ch._beat
            await ch.close(leave="bye")
            assert beat is not None and beat.done()

    run(loop, scenario())


@LOOPS
def test_abort_wakes_a_waiting_recv_with_the_reason_and_the_server_sees_the_close(
        loop: str) -> None:
    async def quiet(ch: channel.Channel) -> None:
        await ch.recv()  # raises when the client is gone

    async def scenario() -> None:
        async with await start(handler=quiet) as srv:
            ch = await t.connect("127.0.0.1", srv.port, token=TOKEN)
            waiting = asyncio.ensure_future(ch.recv())  # the server never answers
            await asyncio.sleep(0)
            ch.abort("group moved")
            with pytest.raises(ConnectionAbortedError, match="group moved"):
                await asyncio.wait_for(waiting, 5)
            await until(lambda: not srv.channels)
            with pytest.raises(ConnectionError):
                await ch.send(messages.Pull(clock=1))

    run(loop, scenario())


@LOOPS
def test_silence_limit_keeps_a_heartbeating_peer_and_drops_a_silent_one(loop: str) -> None:
    errors: list[BaseException] = []

    async def scenario() -> None:
        async with await start(handler=silence_limited(errors)) as srv:
            beating, kept = await heartbeating_client(srv)
            first = kept.last_recv
            await until(lambda: kept.last_recv > first + 1.0)  # more than 3 limits later
            assert not kept.closed and not errors
            silent = await t.connect("127.0.0.1", srv.port, token=TOKEN)
            await until(lambda: len(errors) == 1)
            assert isinstance(errors[0], ConnectionAbortedError)
            assert "sent nothing for" in str(errors[0]) and not kept.closed
            await beating.close(leave="bye")
            await silent.close()

    run(loop, scenario())


@LOOPS
def test_silence_limit_is_not_fooled_by_a_stall_of_our_own_loop(loop: str) -> None:
    errors: list[BaseException] = []

    async def scenario() -> None:
        async with await start(handler=silence_limited(errors)) as srv:
            beating, kept = await heartbeating_client(srv)
            time.sleep(0.8)  # the loop (server and peer alike) is held up past the limit
            first = kept.last_recv
            await until(lambda: kept.last_recv > first + 0.5)
            assert not errors and not kept.closed
            await beating.close(leave="bye")

    run(loop, scenario())


@LOOPS
def test_send_to_a_peer_that_stopped_reading_times_out(loop: str) -> None:
    outcome: asyncio.Future[BaseException] | None = None

    async def flood(ch: channel.Channel) -> None:
        assert outcome is not None
        await ch.recv()
        big = np.zeros(16 << 20, dtype=np.uint8)
        try:
            for version in range(100):
                await ch.send(messages.Weights(version=version,
                                               payload=Payload("dense", {}, (big,))))
        except ConnectionError as e:
            outcome.set_result(e)

    async def scenario() -> None:
        nonlocal outcome
        outcome = asyncio.get_running_loop().create_future()
        async with await start(handler=flood, options=channel.Options(send_timeout=0.5)) as srv:
            ch = await t.connect("127.0.0.1", srv.port, token=TOKEN)
            ch._transport.pause_reading()  # fault injection: this client stops reading
            await ch.send(messages.Pull(clock=0))
            err = await asyncio.wait_for(outcome, 10)
            assert "stopped reading" in str(err)
            await ch.close()

    run(loop, scenario())


@LOOPS
def test_large_payload_lands_in_the_preallocated_array(loop: str) -> None:
    weights = np.random.default_rng(0).standard_normal(3_000_000).astype(np.float32)
    target = np.empty_like(weights)

    async def send_weights(ch: channel.Channel) -> None:
        await ch.recv()
        await ch.send(messages.Weights(version=1, payload=Payload("dense", {}, (weights,))))
        await ch.recv()

    def alloc(kind: messages.Kind, index: int, nbytes: int) -> memoryview:
        return target.data.cast("B") if nbytes == target.nbytes else frames.default_alloc(
            kind, index, nbytes)

    async def scenario() -> None:
        async with await start(handler=send_weights) as srv:
            ch = await t.connect("127.0.0.1", srv.port, token=TOKEN,
                                 options=channel.Options(alloc=alloc))
            await ch.send(messages.Pull(clock=0))
            msg = await ch.recv()
            assert isinstance(msg, messages.Weights)
            assert np.shares_memory(np.frombuffer(msg.payload.buffers[0], np.uint8), target)
            assert np.array_equal(target, weights)
            await ch.close(leave="done")

    run(loop, scenario())


def test_a_big_frame_is_written_in_batches_of_about_the_write_size() -> None:
    big = np.arange(700_000, dtype=np.float32)  # 2.8 MB: cut into three pieces
    frame = frames.encode(messages.Push(clock=3, payload=Payload("sparse", {}, (
        np.arange(30_000, dtype=np.int32), big, np.ones(5, np.float32)))))
    size = 1 << 20
    batches = list(write_batches(frame, size))
    sizes = [sum(map(len, batch)) for batch in batches]
    pieces = [piece for batch in batches for piece in batch]
    assert b"".join(map(bytes, pieces)) == b"".join(map(bytes, frame))  # every byte, in order
    assert all(len(piece) <= size for piece in pieces)
    assert all(s >= size for s in sizes[:-1]) and all(s < 2 * size for s in sizes)
    assert len(batches) == 3
    big_bytes = np.frombuffer(big, np.uint8)
    assert sum(np.shares_memory(np.frombuffer(piece, np.uint8), big_bytes)
               for piece in pieces) == 3  # the big buffer is sent from its own memory


def test_a_frame_under_the_write_size_is_one_batch_as_it_was() -> None:
    frame = frames.encode(messages.Weights(version=1, payload=Payload("dense", {}, (np.ones(50_000,
                                                                                         np.float32),))))
    assert list(write_batches(frame, 1 << 20)) == [frame]


# ---------------------------------------------------------------------------------------------
# TLS


@LOOPS
def test_tls_with_self_signed_certificate(loop: str, tls_files: tuple[Path, Path]) -> None:
    cert, key = tls_files
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(cert, key)
    client_ctx = ssl.create_default_context(cafile=str(cert))

    async def scenario() -> None:
        async with await start(ssl=server_ctx) as srv:
            ch = await t.connect("127.0.0.1", srv.port, token=TOKEN, ssl=client_ctx,
                                 server_hostname="localhost")
            assert ch._transport.get_extra_info("ssl_object") is not None
            payload = np.arange(200_000, dtype=np.float32)
            await ch.send(messages.Push(clock=5, payload=Payload("dense", {}, (payload,))))
            assert await ch.recv() == messages.Ack(clock=5, version=1)
            await ch.close(leave="bye")
            with pytest.raises(ConnectionError):  # a plain client cannot talk to a TLS server
                await t.connect("127.0.0.1", srv.port, token=TOKEN, timeout=1.0, retries=0)

    run(loop, scenario())


@LOOPS
def test_over_tls_a_server_may_speak_first_after_the_handshake(
        loop: str, tls_files: tuple[Path, Path]) -> None:
    """A group server sends ACK right after WELCOME, before the worker says anything. Over TLS
    that ACK (and the WELCOME send) once waited until the peer sent something: a deadlock."""
    cert, key = tls_files
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(cert, key)
    client_ctx = ssl.create_default_context(cafile=str(cert))

    async def speak_first(ch: channel.Channel) -> None:
        await ch.send(messages.Ack(clock=3, version=4))
        ones = np.ones(300_000, np.float32)  # a big frame: written in batches, over TLS
        await ch.send(messages.Weights(version=4, payload=Payload("dense", {}, (ones,))))
        await ch.recv()

    async def scenario() -> None:
        async with await start(handler=speak_first, ssl=server_ctx) as srv:
            ch = await t.connect("127.0.0.1", srv.port, token=TOKEN, ssl=client_ctx,
                                 server_hostname="localhost")
            assert await asyncio.wait_for(ch.recv(), 5) == messages.Ack(clock=3, version=4)
            weights = await asyncio.wait_for(ch.recv(), 5)
            assert isinstance(weights, messages.Weights)
            got = np.frombuffer(weights.payload.buffers[0], np.float32)
            assert np.array_equal(got, np.ones(300_000))
            await ch.close(leave="bye")

    run(loop, scenario())


def test_a_failing_handler_sends_error_and_the_server_keeps_serving() -> None:
    async def buggy(ch: channel.Channel) -> None:
        msg = await ch.recv()
        if isinstance(msg, messages.Pull):
            raise ValueError("boom")
        await ch.send(messages.Ack(clock=1, version=0))

    async def scenario() -> None:
        async with await start(handler=buggy) as srv:
            ch = await t.connect("127.0.0.1", srv.port, token=TOKEN)
            await ch.send(messages.Pull(clock=0))
            error = await ch.recv()
            assert isinstance(error, control.Error) and error.code == "internal"
            assert "ValueError: boom" in error.reason
            other = await t.connect("127.0.0.1", srv.port, token=TOKEN)
            await other.send(messages.Push(clock=1, payload=Payload("d", {}, ())))
            assert await other.recv() == messages.Ack(clock=1, version=0)
            await other.close()
            assert srv.stats["handler_errors"] == 1

    run("uvloop", scenario())


def test_a_send_after_error_is_a_closed_connection_not_our_protocol_error() -> None:
    """A session replaced while its PULL waits (the server sent ERROR ``replaced`` on it) that
    then answers: the send raises ConnectionResetError, which ends the session quietly, instead
    of LocalProtocolError ("server may not send WEIGHTS in state CLOSED"), which the server
    logged as a failed handler (found by scripts/fuzz_grammar.py)."""
    seen: list[BaseException] = []

    async def handler(ch: channel.Channel) -> None:
        await ch.recv()
        await ch.send_error("replaced", "another connection took this session over")
        try:
            await ch.send(messages.Ack(clock=1, version=1))
        except BaseException as e:
            seen.append(e)
            raise

    async def scenario() -> None:
        async with await start(handler) as srv:
            ch = await t.connect("127.0.0.1", srv.port, token=TOKEN)
            await ch.send(messages.Pull(clock=0))
            got = await ch.recv()
            assert isinstance(got, control.Error) and got.code == "replaced"
            await until(lambda: bool(seen))
            await until(lambda: not srv.channels)
            assert isinstance(seen[0], ConnectionResetError), seen
            assert srv.stats["handler_errors"] == 0

    run("asyncio", scenario())
