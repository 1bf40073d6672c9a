"""minips over asyncio: ``connect`` (with retry) and ``serve``, each running its half of the
handshake, then handing out a ``Channel`` (channel.py) that sends and receives whole messages.

All protocol decisions live in the sans-IO modules (``minips.wire.protocol``); this module only
opens connections and runs the handshake over them. It is the entry point: the listening side
(``serve``, ``Server``) is in tcp_server.py, with its invariants; the retry loop is
``net_retry.backoff``.

Invariants: ``connect`` takes at most ``timeout`` seconds, retries included; a connection whose
handshake failed is aborted.

Public API:
- ``install_uvloop() -> bool``: use uvloop's event loop policy where it imports.
- ``Channel`` (channel.py), ``Options`` and the socket sizes ``SOCKET_BUFFER_BYTES`` /
  ``WRITE_BYTES`` (frame_protocol.py, which also holds the timeout and queue constants).
- ``async connect(host, port, *, role, worker_id, token, timeout, retries, ssl, ...) -> Channel``
  raises ``AuthError`` on REFUSE, ``ConnectionError`` when unreachable within ``timeout``.
- ``async serve(host, port, *, accept, handler, token, ssl, options) -> Server``:
  ``accept(hello) -> dict`` (may be async) returns WELCOME's info (key ``worker_id`` sets the id
  sent back) or raises ``AuthError(reason)`` to refuse; then ``await handler(channel)``.
- ``Channel``: ``send(msg, compress=False)``, ``recv(timeout=None)`` (HEARTBEATs are absorbed;
  one reader at a time), ``send_error(code, reason)``, ``set_alloc(alloc)``, ``peer_hello``,
  ``welcome_info``, ``worker_id``, ``last_recv`` (``loop.time()`` of the last bytes),
  ``bytes_sent``/``bytes_received``, ``start_heartbeat(interval)``,
  ``start_silence_limit(seconds)`` (abort once the peer sent nothing that long), ``error``,
  ``close(leave=None)``, ``close_nowait()``, ``abort(reason)``.
- ``Server``: ``host``, ``port``, ``stats`` (connections, accepted, refused, protocol_errors,
  limit_exceeded, read_timeouts, handshake_timeouts, handler_errors, turned_away: closed
  unread by ``guard``), ``guard``, ``channels``, ``close()``, ``wait_closed()``; also an async
  context manager.
"""

from __future__ import annotations

import asyncio
import ssl as ssl_module

from minips.errors import AuthError
from minips.net import net_retry
from minips.net.channel import Channel
from minips.net.endpoints import shared_secret
from minips.net.frame_protocol import SOCKET_BUFFER_BYTES, WRITE_BYTES, FrameProtocol, Options
from minips.net.tcp_server import Server, serve
from minips.wire import protocol as p

__all__ = [
    "SOCKET_BUFFER_BYTES", "WRITE_BYTES", "install_uvloop", "Options", "Channel", "Server",
    "connect", "serve",
]


def install_uvloop() -> bool:
    """Make new event loops uvloop loops when uvloop is installed; True if it is."""
    try:
        import uvloop
    except ImportError:
        return False
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return True


# ---------------------------------------------------------------------------------------------
# Client


async def _open(host: str, port: int, side: p.Side, options: Options,
                ssl: ssl_module.SSLContext | None, server_hostname: str | None) -> Channel:
    loop = asyncio.get_running_loop()
    conn = p.Connection(side, alloc=options.alloc, limits=options.limits)
    _, proto = await loop.create_connection(
        lambda: FrameProtocol(conn, options), host, port, ssl=ssl,
        server_hostname=(server_hostname or host) if ssl else None)
    return Channel(proto)


async def _client_handshake(ch: Channel, hs: p.ClientHandshake) -> None:
    await ch.send(hs.hello)
    reply = await ch.recv()
    if isinstance(reply, p.Challenge):
        await ch.send(hs.on_challenge(reply))
        reply = await ch.recv()
    welcome = hs.on_reply(reply)
    ch.welcome_info, ch.worker_id = welcome.info, welcome.worker_id


async def _attempt(host: str, port: int, hs: p.ClientHandshake, options: Options,
                   ssl: ssl_module.SSLContext | None, server_hostname: str | None) -> Channel:
    ch = await _open(host, port, p.Side.CLIENT, options, ssl, server_hostname)
    try:
        await _client_handshake(ch, hs)
    except BaseException:
        ch.abort("handshake failed")
        raise
    if options.heartbeat:
        ch.start_heartbeat(options.heartbeat)
    return ch


async def connect(
    host: str, port: int, *, role: str = "worker", worker_id: int = -1,
    capabilities: tuple[str, ...] = (), address: str = "", group: int = -1,
    token: str | bytes | None = None, timeout: float = 10.0, retries: int | None = 5,
    ssl: ssl_module.SSLContext | None = None, server_hostname: str | None = None,
    options: Options | None = None, version: int = p.PROTOCOL_VERSION,
) -> Channel:
    """Connect and handshake; retry unreachable addresses with exponential backoff and jitter
    (``net_retry.backoff``), ``retries`` times (None: as often as ``timeout`` allows).

    ``token`` defaults to $MINIPS_TOKEN ("" means none). The whole call, retries included, takes
    at most ``timeout`` seconds. ``version`` exists so tests can speak a wrong one.
    """
    opts = options or Options()

    async def attempt(left: float) -> Channel:
        hs = p.ClientHandshake(shared_secret(token), version=version, role=role,
                               worker_id=worker_id, capabilities=capabilities, address=address,
                               group=group)
        return await asyncio.wait_for(_attempt(host, port, hs, opts, ssl, server_hostname), left)

    # refused, reset, unreachable, too slow: tried again; AuthError (REFUSE) passes through
    return await net_retry.backoff(attempt, timeout=timeout,
                                   what=f"could not connect to {host}:{port}", fatal=(AuthError,),
                                   attempts=None if retries is None else retries + 1)
