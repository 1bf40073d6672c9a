"""Tests for the receive queue of minips.net.transport on real loopback sockets: reading pauses when
the buffers waiting for recv() reach ``Options.max_queued_bytes`` and resumes as they drain,
with nothing lost or reordered; recv() wakes as soon as a message is queued."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

import numpy as np
import pytest
from conftest import run_on, until

from minips.net import channel, transport
from minips.net import transport as t
from minips.wire import control, messages
from minips.wire.fields import Payload

TOKEN = "queue-token"
LOOPS = pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
MiB = 1 << 20


def run(loop: str, coro: Coroutine[Any, Any, Any]) -> Any:
    return run_on(loop, coro, 30)


@LOOPS
@pytest.mark.timeout(60)
def test_reading_pauses_at_the_byte_bound_and_resumes_without_loss(loop: str) -> None:
    bound, pushes = 2 * MiB, 8
    server_side: list[channel.Channel] = []
    go = asyncio.Event()  # binds to the loop on first use (Python >= 3.10)

    async def hold_then_drain(ch: channel.Channel) -> None:
        server_side.append(ch)
        await go.wait()
        clocks = []
        for _ in range(pushes):
            msg = await ch.recv()
            assert isinstance(msg, messages.Push) and msg.payload.buffers[0][0] == msg.clock
            clocks.append(msg.clock)
        assert clocks == list(range(pushes))
        await ch.send(messages.Ack(clock=pushes, version=pushes))
        await ch.recv()  # LEAVE

    async def scenario() -> None:
        options = channel.Options(max_queued_bytes=bound)
        async with await transport.serve("127.0.0.1", 0, accept=lambda h: {},
                                         handler=hold_then_drain,
                                 token=TOKEN, options=options) as srv:
            ch = await t.connect("127.0.0.1", srv.port, token=TOKEN)
            for clock in range(pushes):  # 8 MiB in all: the kernel buffers take what we don't
                payload = np.full(MiB, clock, dtype=np.uint8)
                await ch.send(messages.Push(clock=clock, payload=Payload("raw", {}, (payload,))))
            await until(lambda: bool(server_side) and server_side[0]._proto.paused)
            proto = server_side[0]._proto
            assert bound <= proto.queued_bytes <= bound + MiB  # the bound plus one frame
            assert len(proto.queue) < pushes
            go.set()
            ack = await ch.recv()
            assert ack == messages.Ack(clock=pushes, version=pushes)
            assert not proto.paused and proto.queued_bytes == 0
            await ch.close(leave="bye")

    run(loop, scenario())


@LOOPS
def test_messages_already_queued_are_returned_in_order_without_waiting(loop: str) -> None:
    async def burst(ch: channel.Channel) -> None:
        await ch.recv()
        for seq in range(50):  # one write each; the client reads them in whatever chunks
            await ch.send(messages.Ack(clock=seq, version=0))
        await ch.recv()

    async def scenario() -> None:
        async with await transport.serve("127.0.0.1", 0, accept=lambda h: {}, handler=burst,
                                 token=TOKEN) as srv:
            ch = await t.connect("127.0.0.1", srv.port, token=TOKEN)
            await ch.send(messages.Pull(clock=0))
            got = [await ch.recv(timeout=5) for _ in range(50)]
            assert [m.clock for m in got] == list(range(50))  # type: ignore[attr-defined]
            assert ch._proto.queued_bytes == 0
            await ch.close(leave="bye")

    run(loop, scenario())


@LOOPS
def test_recv_timeout_counts_from_the_call_even_through_heartbeats(loop: str) -> None:
    async def beat_only(ch: channel.Channel) -> None:
        for seq in range(1000):  # heartbeats wake recv() but are not messages
            await ch.send(control.Heartbeat(seq=seq))
            await asyncio.sleep(0.02)

    async def scenario() -> None:
        async with await transport.serve("127.0.0.1", 0, accept=lambda h: {}, handler=beat_only,
                                 token=TOKEN) as srv:
            ch = await t.connect("127.0.0.1", srv.port, token=TOKEN)
            began = asyncio.get_running_loop().time()
            with pytest.raises(asyncio.TimeoutError):
                await ch.recv(timeout=0.3)
            waited = asyncio.get_running_loop().time() - began
            assert 0.29 <= waited < 3.0 and ch.heartbeats_received > 0
            await ch.close()

    run(loop, scenario())
