"""Many peers behind one address (a lab behind one NAT, a bench's workers on 127.0.0.1) against a
live server on loopback: the per-source handshake limits are for unauthenticated peers, so a burst
of good clients from one address is admitted in turn, none turned away and none retried, while a
flood from one address (wrong secrets, or connections that never speak) is still cut and costs the
other addresses nothing (minips/net/guard.py, ``transport.Server``)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from typing import Any

import pytest
from conftest import until
from loopback_source import connect_from

from minips.errors import AuthError
from minips.net import channel, guard, transport

TOKEN = "one-address-secret-0123456789"
BURST = 256  # good workers connecting together from 127.0.0.1
SLOTS = 8  # handshakes at once per address in these tests: a burst of 256 must wait in line


async def idle(ch: channel.Channel) -> None:
    """A handler that holds the session until the peer goes."""
    with contextlib.suppress(ConnectionError):
        await ch.recv()


@contextlib.asynccontextmanager
async def server(**limits: Any) -> AsyncIterator[transport.Server]:
    opts = channel.Options(guard=guard.GuardLimits(max_pending_per_source=SLOTS, **limits))
    srv = await transport.serve("127.0.0.1", 0, accept=lambda hello: {}, handler=idle,
                                token=TOKEN, options=opts)
    try:
        yield srv
    finally:
        srv.close()
        await asyncio.wait_for(srv.wait_closed(), 20)


async def burst(srv: transport.Server, n: int) -> list[channel.Channel]:
    """``n`` clients from 127.0.0.1 at once, each with one attempt only (no retry, so a
    connection turned away fails the test instead of coming back after a back-off)."""
    return list(await asyncio.gather(*(
        transport.connect("127.0.0.1", srv.port, token=TOKEN, worker_id=w, timeout=30,
                          retries=0) for w in range(n))))


async def close_all(chans: list[channel.Channel]) -> None:
    await asyncio.gather(*(ch.close() for ch in chans))


@pytest.mark.timeout(60)
async def test_a_burst_of_workers_behind_one_address_is_admitted_without_back_off() -> None:
    async with server() as srv:
        t0 = asyncio.get_running_loop().time()
        chans = await burst(srv, BURST)
        took = asyncio.get_running_loop().time() - t0
        try:
            assert len({ch.worker_id for ch in chans}) == BURST
            assert srv.stats["accepted"] == BURST and srv.stats["turned_away"] == 0
            assert srv.stats["waited"] > 0, "the burst should have outrun the address's slots"
            assert took < 15.0, took  # one attempt each; before, most were closed unread
            # authenticated sessions hold no slot of their address
            assert srv.guard.pending["127.0.0.1"] == 0 and srv.guard.total_waiting == 0
        finally:
            await close_all(chans)


@pytest.mark.timeout(60)
async def test_a_flood_of_wrong_secrets_from_one_address_is_still_cut() -> None:
    """200 handshakes with a wrong secret at once from 127.0.0.2: a few reach the HMAC check,
    the rest are closed unread by the back-off, even those that waited in line; meanwhile a
    burst of good workers from 127.0.0.1 is admitted in full."""
    async with server() as srv:
        async def guess() -> str:
            try:
                await connect_from("127.0.0.2", "127.0.0.1", srv.port, token="wrong-" + TOKEN)
            except AuthError:
                return "refused"
            except (ConnectionError, asyncio.TimeoutError):
                return "closed"
            return "admitted"

        guesses = asyncio.gather(*(guess() for _ in range(200)))
        chans = await burst(srv, 64)
        outcomes = await guesses
        try:
            assert "admitted" not in outcomes
            # the free failures, then whatever had passed the back-off check before it began
            assert outcomes.count("refused") <= guard.GuardLimits().free_failures + SLOTS, outcomes
            assert srv.stats["refused"] == outcomes.count("refused")
            assert srv.stats["turned_away"] >= 200 - guard.GuardLimits().free_failures - SLOTS
            assert srv.guard.backoff_left("127.0.0.2", asyncio.get_running_loop().time()) > 0
            assert len(chans) == 64 and srv.guard.backoff_left("127.0.0.1", 0.0) == 0
        finally:
            await close_all(chans)


@pytest.mark.timeout(60)
async def test_silent_connections_from_one_address_are_bounded_by_its_line() -> None:
    """40 connections from 127.0.0.3 that never send a byte: SLOTS sit in the handshake, 8 wait
    in line, the rest are closed at once; another address is served meanwhile. Those in line are
    closed after ``max_wait_s``, long before the silent ones' handshake timeout (10 s)."""
    async with server(max_waiting_per_source=8, max_wait_s=2.0) as srv:
        loop = asyncio.get_running_loop()
        socks = []
        try:
            for _ in range(40):
                sock = socket.socket()
                sock.setblocking(False)
                sock.bind(("127.0.0.3", 0))
                socks.append(sock)
                await asyncio.wait_for(loop.sock_connect(sock, ("127.0.0.1", srv.port)), 5)
            await until(lambda: srv.stats["connections"] == 40)
            assert srv.guard.pending["127.0.0.3"] == SLOTS
            assert len(srv.guard.waiting["127.0.0.3"]) == 8
            assert srv.stats["turned_away"] == 40 - SLOTS - 8
            good = await transport.connect("127.0.0.1", srv.port, token=TOKEN, retries=0)
            await good.close()
            await until(lambda: srv.stats["turned_away"] == 40 - SLOTS, timeout=6.0)
            assert srv.guard.pending["127.0.0.3"] == SLOTS and not srv.guard.waiting
        finally:
            for sock in socks:
                sock.close()
        # the silent ones leave: their slots and their line are free again
        await until(lambda: not srv.guard.pending and not srv.guard.waiting)
