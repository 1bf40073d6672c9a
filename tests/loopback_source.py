"""A client connection from a chosen loopback address (127.0.0.2, 127.0.0.3, ...): a server keeps
its limits and back-offs per source address (minips/net/guard.py), so a test that plays a
hostile or broken peer gives it an address of its own, and the good peers of the same test, on
127.0.0.1, are not turned away with it."""

from __future__ import annotations

import asyncio
import socket

from minips.net import channel
from minips.net.endpoints import shared_secret
from minips.wire import control, handshake

__all__ = ["connect_from"]


async def connect_from(source: str, host: str, port: int, *, token: str, role: str = "worker",
                       worker_id: int = -1, group: int = -1, address: str = "",
                       options: channel.Options | None = None,
                       timeout: float = 10.0) -> channel.Channel:
    """One connection from ``source`` and its handshake (no retry): the authenticated channel,
    or ``AuthError`` on REFUSE, ``ConnectionError`` when the server closes it first (a source
    in back-off is closed unread)."""
    opts = options or channel.Options()
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    sock.setblocking(False)
    try:
        sock.bind((source, 0))
        await asyncio.wait_for(loop.sock_connect(sock, (host, port)), timeout)
    except BaseException:
        sock.close()
        raise
    conn = handshake.Connection(handshake.Side.CLIENT, limits=opts.limits)
    _, proto = await loop.create_connection(lambda: channel.FrameProtocol(conn, opts), sock=sock)
    ch = channel.Channel(proto)
    hs = handshake.ClientHandshake(shared_secret(token), role=role, worker_id=worker_id,
                                   address=address, group=group)
    try:
        await asyncio.wait_for(_handshake(ch, hs), timeout)
    except BaseException:
        ch.abort("handshake failed")
        raise
    if opts.heartbeat:
        ch.start_heartbeat(opts.heartbeat)
    return ch


async def _handshake(ch: channel.Channel, hs: handshake.ClientHandshake) -> None:
    """The client half of the handshake (protocol.md, section 5), as ``transport.connect``."""
    await ch.send(hs.hello)
    reply = await ch.recv()
    if isinstance(reply, control.Challenge):
        await ch.send(hs.on_challenge(reply))
        reply = await ch.recv()
    welcome = hs.on_reply(reply)
    ch.welcome_info, ch.worker_id = welcome.info, welcome.worker_id

