"""minips over asyncio: ``connect`` (with retry) and ``serve``, each running its half of the
handshake, then handing out a ``Channel`` (channel.py) that sends and receives whole messages.

All protocol decisions live in the sans-IO modules (``minips.wire``); this module only opens
connections and runs the handshake over them. The file holds, in order:

- ``CountingLog``: log lines that count instead of repeating. The first event of a kind is
  logged at once, the rest as "N times in the last S s" at most once a period
  (``guard.LogSummary`` decides; this module owns the logger and the asyncio timer that flushes
  counts nobody followed up).
- ``backoff``, the one retry loop of minips: exponential backoff with jitter, bounded by a
  deadline. Every place that tries to reach a peer again uses it: ``connect`` (a client's
  connection and handshake, hence also a `minips group` process registering and reconnecting
  with the global server) and a worker reaching its group server (worker.py).
- The listening side: ``serve`` and ``Server``, which run the server half of the handshake on
  each connection, then hand the ``Channel`` to the handler.
- The client side: ``install_uvloop`` and ``connect``.

Invariants:
- ``connect`` takes at most ``timeout`` seconds, retries included; a connection whose handshake
  failed is aborted.
- ``backoff`` makes the first attempt at once; after a failure of a kind in ``retry_on`` it
  waits ``first``, then twice as long each time up to ``most``, each delay times a random
  factor in [0.5, 1) (jitter: peers that lost a server together do not come back in step), and
  never past the deadline; a set ``wake`` event cuts a wait short (a worker told of a new group
  address tries it at once). It gives up with ``Unreachable`` (a ``ConnectionError`` naming
  the address and the failure in words: refused, unreachable, timed out) once the deadline has
  passed or ``attempts`` were made; any other exception (or one in ``fatal``: a refused
  secret) passes through at once.
- A server handler only ever sees an authenticated channel: HELLO, CHALLENGE, AUTH and WELCOME
  have passed within ``handshake_timeout``, and ``accept`` agreed.
- Before that a connection costs a few KB (16 KiB frames at most, handshake.py), at most
  ``Options.guard.max_pending_per_source`` of them per address and ``max_pending`` in all are in
  the handshake until their MAC is checked; more from one address wait their turn in a bounded
  line (guard.py) for at most ``max_wait_s``, so many good peers behind one address are all
  admitted, none turned away; an address that failed the secret too often waits, as does one
  whose authenticated sessions were cut for protocol violations too often in a row
  (``Server._judge``: a flooder in a reconnect loop is served a trickle, not a session a turn).
- A peer's protocol error, a refused or timed-out handshake, or a failing ``accept`` /
  ``handler`` closes that one connection (the peer is told why, with ERROR or REFUSE) and is
  counted in ``Server.stats``; the server keeps serving the others.
- A flood of refused or rejected peers costs a few log lines per period, not one line per peer,
  and no count is lost: pending counts are logged within 1.5 periods, or at ``flush``.

What a caller can count on:
- ``connect`` raises ``AuthError`` on REFUSE, ``Unreachable`` when unreachable within
  ``timeout``, and at once ``TLSError`` (a ``ConnectionError``) naming why TLS failed: the
  certificate (not signed by the CA, not for the name or address dialled) or a peer that speaks
  plain text.
- ``serve``'s ``accept(hello) -> dict`` (may be async; ``Accept``) returns WELCOME's info (key
  ``worker_id`` sets the id sent back) or raises ``AuthError(reason)`` to refuse; then
  ``await handler(channel)`` (``Handler``).
- ``Server.stats`` counts connections, accepted, refused, protocol_errors, limit_exceeded,
  read_timeouts, handshake_timeouts, handler_errors, turned_away (closed unread by ``guard``)
  and waited (connections that waited for a slot of their address).

The ``Channel`` that ``connect`` and the handler get (``send(msg, compress=False)``,
``recv(timeout=None)`` (HEARTBEATs are absorbed; one reader at a time),
``send_error(code, reason)``, ``set_alloc(alloc)``, ``peer_hello``, ``welcome_info``,
``worker_id``, ``last_recv`` (``loop.time()`` of the last bytes),
``bytes_sent``/``bytes_received``, ``start_heartbeat(interval)``,
``start_silence_limit(seconds)`` (abort once the peer sent nothing that long), ``error``,
``close(leave=None)``, ``close_nowait()``, ``abort(reason)``), its ``Options`` and the socket
sizes ``SOCKET_BUFFER_BYTES`` / ``WRITE_BYTES`` are defined in channel.py, with the timeout and
queue constants.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno
import inspect
import logging
import random
import socket
import ssl as ssl_module
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from minips.errors import AuthError, RemoteProtocolError
from minips.net import guard as g
from minips.net.channel import Channel, FrameProtocol, Options
from minips.net.endpoints import format_address, shared_secret
from minips.net.guard import LogSummary
from minips.wire import checks, control, fields, handshake, messages

__all__ = [
    "CountingLog",
    "FIRST_S",
    "MOST_S",
    "delay",
    "backoff",
    "Unreachable",
    "NoAnswer",
    "failure_kind",
    "Accept",
    "Handler",
    "Server",
    "serve",
    "install_uvloop",
    "TLSError",
    "tls_failure",
    "connect",
]


# -- log lines that count instead of repeating -----------------------------------------------------

class CountingLog:
    """``note`` events of a kind; lines go to ``logger`` at WARNING level."""

    def __init__(self, logger: logging.Logger, period_s: float | None = None) -> None:
        self.logger = logger
        self.summary = LogSummary() if period_s is None else LogSummary(period_s)
        self._timer: asyncio.TimerHandle | None = None

    def note(self, kind: str, detail: str) -> None:
        """Count one event; log it now if it is the first of its kind in a period."""
        loop = asyncio.get_running_loop()
        line = self.summary.event(kind, detail, loop.time())
        if line is not None:
            self.logger.warning("%s", line)
        elif self._timer is None:
            self._timer = loop.call_later(self.summary.period_s, self._due)

    def _due(self) -> None:
        self._timer = None
        loop = asyncio.get_running_loop()
        for line in self.summary.due(loop.time()):
            self.logger.warning("%s", line)
        if self.summary.counts:  # a kind whose period has not passed yet
            self._timer = loop.call_later(self.summary.period_s / 2, self._due)

    def flush(self) -> None:
        """Log every count still pending (at shutdown)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for line in self.summary.flush(asyncio.get_running_loop().time()):
            self.logger.warning("%s", line)


# -- the one retry loop: exponential backoff with jitter, bounded by a deadline --------------------

T = TypeVar("T")

FIRST_S, MOST_S = 0.05, 2.0  # the first and the longest wait between attempts, s


def delay(failures: int, first: float = FIRST_S, most: float = MOST_S,
          rng: Callable[[float, float], float] = random.uniform) -> float:
    """The wait after the ``failures``-th failure in a row (1, 2, ...): ``first`` doubled each
    time up to ``most``, times a random factor in [0.5, 1)."""
    return min(most, first * 2 ** (failures - 1)) * rng(0.5, 1.0)


def _ignore(exc: BaseException) -> None:
    """``on_fail``'s default: a failure is only retried."""


async def backoff(attempt: Callable[[float], Awaitable[T]], *, timeout: float, what: str,
                  retry_on: tuple[type[BaseException], ...] = (OSError, asyncio.TimeoutError),
                  fatal: tuple[type[BaseException], ...] = (),
                  attempts: int | None = None, first: float = FIRST_S, most: float = MOST_S,
                  on_fail: Callable[[BaseException], None] = _ignore,
                  wake: asyncio.Event | None = None) -> T:
    """``await attempt(seconds left)`` until it returns, retrying failures in ``retry_on`` (but
    not in ``fatal``) for up to ``timeout`` seconds and ``attempts`` attempts (None: as many as
    fit).

    ``on_fail(exc)`` sees each retried failure. Raises ``Unreachable`` (a ``ConnectionError``)
    naming ``what``, the number of attempts and the last failure in words once the deadline or
    ``attempts`` is reached; no attempt is made with no time left (it could only time out)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    failures = 0
    telling: BaseException | None = None  # the failure the error will name
    while True:
        try:
            return await attempt(max(0.0, deadline - loop.time()))
        except fatal:
            raise
        except retry_on as exc:
            failures += 1
            on_fail(exc)
            # an attempt the deadline cut short says less than a refusal or a missing route
            telling = exc if telling is None or not _timed_out(exc) else telling
            if attempts is not None and failures >= attempts or deadline <= loop.time():
                raise Unreachable(what, timeout, failures, telling) from None
            await _wait(min(delay(failures, first, most), deadline - loop.time()), wake)
            if deadline <= loop.time():  # no time left for an attempt that could succeed
                raise Unreachable(what, timeout, failures, telling) from None


def _timed_out(exc: BaseException) -> bool:
    return isinstance(exc, (asyncio.TimeoutError, TimeoutError))


class NoAnswer(asyncio.TimeoutError):
    """The port took the connection but answered nothing to the HELLO within the time left."""


def failure_kind(exc: BaseException) -> str:
    """What a failed attempt to reach a peer says, in words: refused, unreachable, timed out,
    a name that does not resolve, reset; else the exception itself."""
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused (nothing listens on that port, or a firewall rejects it)"
    if isinstance(exc, NoAnswer):
        return ("timed out (the port took the connection, then answered nothing to the "
                "handshake: a hung server, or not a minips server)")
    if _timed_out(exc):
        return ("timed out (no answer: the host is down, or a firewall drops the packets)")
    if isinstance(exc, socket.gaierror):
        return f"the host name does not resolve ({exc.strerror})"
    if isinstance(exc, OSError) and exc.errno in _UNREACHABLE:
        return f"unreachable ({exc.strerror}: no route to that address from here)"
    if isinstance(exc, ConnectionResetError):
        return "connection reset by the peer"
    return repr(exc)


_UNREACHABLE = {errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EHOSTDOWN, errno.ENETDOWN,
                errno.EADDRNOTAVAIL, errno.EINVAL}  # EINVAL: a blackhole route


class Unreachable(ConnectionError):
    """``backoff`` gave up: every attempt failed within the time given. The message names the
    address (``what``), the time, the attempts and the last failure in words
    (``failure_kind``); ``last`` is that failure, ``kind`` its words, ``silent`` whether
    nothing answered at all."""

    def __init__(self, what: str, timeout: float, failures: int, last: BaseException) -> None:
        self.last, self.kind = last, failure_kind(last)
        # nothing answered on that port (refused, no route, timed out, no such name): not a
        # server that speaks another protocol (TLS) either
        self.silent = _timed_out(last) or isinstance(last, (ConnectionRefusedError,
                                                              socket.gaierror)) \
            or isinstance(last, OSError) and last.errno in _UNREACHABLE
        super().__init__(f"{what} within {timeout} s ({failures} attempt"
                         f"{'s' if failures != 1 else ''}): {self.kind}")


async def _wait(seconds: float, wake: asyncio.Event | None) -> None:
    """Sleep ``seconds``, or less when ``wake`` is set meanwhile (it is cleared first)."""
    if wake is None:
        await asyncio.sleep(seconds)
        return
    wake.clear()
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(wake.wait(), seconds)


# -- the listening side: serve and Server ----------------------------------------------------------

log = logging.getLogger("minips.net.transport")

Accept = Callable[[control.Hello], "dict[str, Any] | Awaitable[dict[str, Any]]"]
Handler = Callable[[Channel], Awaitable[None]]
_TURNED_AWAY = {  # Guard.admit's reasons, as an operator reads them
    "backoff": "too many failed handshakes (wrong secret) or sessions cut for protocol "
                "violations in a row: it must wait",
    "per_source": "too many handshakes open and waiting from this address at once",
    "total": "too many handshakes open at once",
}


def _source(ch: Channel) -> str:
    """The peer's address without the port: what limits and back-off are kept per."""
    peer = ch.peername
    return str(peer[0]) if isinstance(peer, tuple) else "local"


class Server:
    """A listening minips server: handshakes each connection, then runs ``handler`` on it.

    Before a peer has authenticated, ``guard`` (guard.py) caps how many handshakes run at once
    (per source address and in total) and makes a source that keeps failing wait; a connection
    over its address's cap waits for a slot (unread, in a bounded line, at most
    ``guard.GuardLimits.max_wait_s``, then it is turned away); connections over the other caps or in
    back-off are closed at once, unread. Refusals are logged as counts."""

    def __init__(self, accept: Accept, handler: Handler, token: str | bytes | None,
                 options: Options) -> None:
        self.accept, self.handler, self.token, self.options = accept, handler, token, options
        self.limits = options.limits  # what authenticated peers may send (set_limits)
        self.host, self.port = "", 0
        self.channels: set[Channel] = set()
        self.stats = collections.Counter({k: 0 for k in (
            "connections", "accepted", "refused", "protocol_errors", "limit_exceeded",
            "read_timeouts", "handshake_timeouts", "handler_errors", "turned_away", "waited")})
        self.guard = g.Guard(options.guard)
        self._turns: set[asyncio.Future[bool]] = set()  # connections waiting for a slot
        self.counted = CountingLog(log)  # refusals, as counts
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def _made(self, proto: FrameProtocol) -> None:
        self.stats["connections"] += 1
        ch = Channel(proto)
        source = _source(ch)
        why = self.guard.admit(source, proto.loop.time())
        turn: asyncio.Future[bool] | None = None
        if why == "wait":  # its address's slots are taken: it waits, unread, for one
            turn = proto.loop.create_future()
            self.guard.queue(source, turn)
            self._turns.add(turn)
            self.stats["waited"] += 1
        elif why:  # closed unread: costs no handshake, no HMAC, no buffer
            self._turn_away(source, why)
            ch.close_nowait()
            return
        else:
            self.guard.opened(source)
        task = asyncio.create_task(self._serve_one(ch, source, turn))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _release(self, source: str) -> None:
        """A handshake of ``source`` no longer holds its slot: the oldest connection waiting
        for one of that address's slots takes it."""
        turn = self.guard.closed(source)
        if turn is not None:
            assert isinstance(turn, asyncio.Future)
            self._turns.discard(turn)
            turn.set_result(True)

    async def _my_turn(self, turn: asyncio.Future[bool], source: str) -> bool:
        """Wait for a slot of ``source`` (``turn``); False when none came within ``max_wait_s``
        (it is turned away) or the server stops (the connection then holds no slot)."""
        try:
            await asyncio.wait_for(asyncio.shield(turn), self.guard.limits.max_wait_s)
        except asyncio.TimeoutError:
            if not turn.done():  # the address's slots are held by handshakes that do not end
                self._turn_away(source, "per_source")
        finally:  # no slot (timed out, stopped, cancelled): it leaves the line
            if not (turn.done() and turn.result()):
                self.guard.gave_up(source, turn)
                self._turns.discard(turn)
        return turn.done() and turn.result()

    def _turn_away(self, source: str, why: str) -> None:
        """Count and log a connection the guard said no to (``why``: a ``Guard.admit`` reason)."""
        self.stats["turned_away"] += 1
        self.counted.note(f"turned away ({why})", f"{source}: " + _TURNED_AWAY[why])

    def set_limits(self, limits: checks.Limits) -> None:
        """Check every authenticated peer's frames against ``limits`` from now on: a server
        that learned its model's size narrows them to it (``checks.Limits.sized_for``), and
        makes room in the process's lz4 budget for two whole frames of it."""
        self.limits = limits
        checks.INFLATE_BUDGET.at_least(2 * limits.max_raw_bytes)
        for ch in list(self.channels):
            ch.set_limits(limits)

    async def _serve_one(self, ch: Channel, source: str,
                         turn: asyncio.Future[bool] | None) -> None:
        session = False  # the handshake passed: how the session ends counts (``_judge``)
        try:
            if turn is not None and not await self._my_turn(turn, source):
                return
            if await self._admit(ch, source):
                session = True
                self.channels.add(ch)
                ch.set_limits(self.limits)  # set_limits may have come during the handshake
                await self.handler(ch)
        except (RemoteProtocolError, ConnectionError):
            pass  # the protocol already counted it and told the peer
        except Exception as e:  # a bug in accept() or handler(): tell the peer, keep serving
            self.stats["handler_errors"] += 1
            log.exception("handler failed for %s", ch.peername)
            await ch.send_error("internal", f"{type(e).__name__}: {e}")
        finally:
            self.channels.discard(ch)
            await ch.close()
            if session:
                self._judge(ch, source)

    def _judge(self, ch: Channel, source: str) -> None:
        """A session ended: one cut for a protocol violation (the frame layer's ERROR, or the
        handler's ``send_error`` with a code of ``guard.VIOLATIONS``) counts against its source,
        which waits before its next handshake once it has too many in a row; any other end
        clears the count (guard.py)."""
        if not (isinstance(ch.error, RemoteProtocolError) or ch.error_sent in g.VIOLATIONS):
            self.guard.behaved(source)
        elif (wait := self.guard.violated(source, asyncio.get_running_loop().time())) > 0:
            self.counted.note("back-off", f"{source}: {self.guard.violations(source)} sessions "
                              f"in a row cut for protocol violations: refused for {wait:.1f} s")

    async def _admit(self, ch: Channel, source: str) -> bool:
        """Run the handshake, holding one of ``source``'s slots until its MAC is checked (an
        authenticated peer counts as itself, not as its address); False (and counted) when it
        was refused or failed."""
        slot = [True]  # still held: released once, by whichever comes first

        def release() -> None:
            if slot:
                slot.clear()
                self._release(source)

        try:
            if self.guard.backoff_left(source, asyncio.get_running_loop().time()) > 0:
                self._turn_away(source, "backoff")  # it waited while its address went wrong
                return False
            await asyncio.wait_for(self._handshake(ch, source, release),
                                   self.options.handshake_timeout)
        except AuthError as e:
            self.stats["refused"] += 1
            self.counted.note("refused", f"{source}: {e.reason}")
            return False
        except asyncio.TimeoutError:
            self.stats["handshake_timeouts"] += 1
            return False
        finally:
            release()
        self.stats["accepted"] += 1
        return True

    def _check_auth(self, hs: handshake.ServerHandshake, auth: control.Auth,
                    source: str, release: Callable[[], None]) -> control.Refuse | None:
        """``hs.on_auth`` with the source's back-off applied: a source still in back-off is cut
        off before its MAC is even checked; a wrong MAC starts or lengthens its back-off. Once
        the MAC is checked the connection's slot is ``release``d."""
        now = asyncio.get_running_loop().time()
        if self.guard.backoff_left(source, now) > 0:
            self._turn_away(source, "backoff")
            raise ConnectionAbortedError("source in back-off")
        refuse = hs.on_auth(auth)
        release()
        if refuse is None:
            self.guard.succeeded(source)
        elif (wait := self.guard.failed(source, now)) > 0:
            self.counted.note("back-off", f"{source} failed {self.guard.failures(source)} "
                              f"handshakes in a row: refused for {wait:.1f} s")
        return refuse

    async def _handshake(self, ch: Channel, source: str, release: Callable[[], None]) -> None:
        hs = handshake.ServerHandshake(shared_secret(self.token))
        hello = await ch.recv()
        assert isinstance(hello, control.Hello)  # the state machine allows nothing else first
        reply = hs.on_hello(hello)
        await ch.send(reply)
        if isinstance(reply, control.Refuse):
            raise AuthError(reply.reason)
        auth = await ch.recv()
        assert isinstance(auth, control.Auth)
        refuse = self._check_auth(hs, auth, source, release)
        info: dict[str, Any] = {}
        if refuse is None:
            try:
                got = self.accept(hello)
                info = await got if inspect.isawaitable(got) else got
            except AuthError as e:
                refuse = control.Refuse(code="refused", reason=e.reason[: fields.MAX_TEXT])
        if refuse is not None:
            await ch.send(refuse)
            raise AuthError(refuse.reason)
        ch.peer_hello, ch.welcome_info = hello, info
        ch.worker_id = int(info.get("worker_id", hello.worker_id))
        await ch.send(hs.welcome(ch.worker_id, info))
        if self.options.heartbeat:
            ch.start_heartbeat(self.options.heartbeat)

    def close(self) -> None:
        """Stop listening and close every connection."""
        self.counted.flush()
        if self._server is not None:
            self._server.close()
        for turn in list(self._turns):  # connections waiting for a slot: none will come
            self._turns.discard(turn)
            if not turn.done():
                turn.set_result(False)
        for ch in list(self.channels):
            ch.close_nowait()

    async def wait_closed(self) -> None:
        if self._server is not None:
            await self._server.wait_closed()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def __aenter__(self) -> Server:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()
        await self.wait_closed()


async def serve(host: str, port: int, *, accept: Accept, handler: Handler,
                token: str | bytes | None = None, ssl: ssl_module.SSLContext | None = None,
                options: Options | None = None) -> Server:
    """Listen on host:port (port 0: any free port, see ``Server.port``) and serve minips.

    ``token`` defaults to $MINIPS_TOKEN; with one set, clients without it are refused.
    """
    options = options or Options()
    server = Server(accept, handler, token, options)

    def factory() -> FrameProtocol:
        proto = FrameProtocol(handshake.Connection(handshake.Side.SERVER, alloc=options.alloc,
                                                   limits=server.limits), options)
        proto.on_made, proto.stats = server._made, server.stats
        return proto

    loop = asyncio.get_running_loop()
    # the kernel's accept queue holds as many connections as may be in the handshake at once:
    # asyncio's default (100) drops the SYNs of a lab's workers connecting together beyond it,
    # and a dropped SYN is sent again only after 1, 3, 7, 15 s
    server._server = await loop.create_server(factory, host, port, ssl=ssl,
                                              backlog=options.guard.max_pending)
    sockname = server._server.sockets[0].getsockname()
    server.host, server.port = sockname[0], sockname[1]
    return server


# -- the client side: connect, with retry ----------------------------------------------------------

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


class TLSError(ConnectionError):
    """A TLS connection could not be set up; the message names the cause (the certificate, the
    name or address it is for, a peer that speaks plain text). Not retried: trying again
    cannot fix it."""


def tls_failure(host: str, port: int, exc: ssl_module.SSLError) -> TLSError:
    """``exc`` from the TLS handshake with ``host:port``, said as its cause and the way out."""
    where = f"TLS with {format_address(host, port)}"
    if isinstance(exc, ssl_module.SSLCertVerificationError):
        return TLSError(f"{where}: certificate verify failed: {exc.verify_message} (the "
                        "certificate must be signed by the --tls-ca file and name the address "
                        f"dialled: subjectAltName=IP:{host} or DNS:{host})")
    if exc.reason == "WRONG_VERSION_NUMBER":
        return TLSError(f"{where}: the peer answered in plain text, not TLS (a server started "
                        "without --tls-cert?)")
    return TLSError(f"{where} failed: {exc.reason or exc}")


async def _open(host: str, port: int, side: handshake.Side, options: Options,
                ssl: ssl_module.SSLContext | None, server_hostname: str | None) -> Channel:
    loop = asyncio.get_running_loop()
    conn = handshake.Connection(side, alloc=options.alloc, limits=options.limits)
    try:
        _, proto = await loop.create_connection(
            lambda: FrameProtocol(conn, options), host, port, ssl=ssl,
            server_hostname=(server_hostname or host) if ssl else None)
    except ssl_module.SSLError as exc:
        raise tls_failure(host, port, exc) from None
    return Channel(proto)


async def _client_handshake(ch: Channel, hs: handshake.ClientHandshake) -> None:
    await ch.send(hs.hello)
    reply = await ch.recv()
    if isinstance(reply, control.Challenge):
        await ch.send(hs.on_challenge(reply))
        reply = await ch.recv()
    welcome = hs.on_reply(reply)
    ch.welcome_info, ch.worker_id = welcome.info, welcome.worker_id


def _not_minips(host: str, port: int, err: RemoteProtocolError) -> RemoteProtocolError:
    """A bad magic in the handshake's answer, said as what answered: the first line of what it
    sent (``err.got``, receive.py keeps its first bytes), printable, cut to 40 characters."""
    first = bytes(err.got or b"").split(b"\n", 1)[0].rstrip(b"\r")
    text = "".join(c if c.isprintable() else "?" for c in first.decode("latin-1"))
    text = text if len(text) <= 40 else text[:39] + "…"
    return RemoteProtocolError(f"{format_address(host, port)} is not a minips server (it "
                               f"answered '{text}')", expected=err.expected, got=err.got)


async def _attempt(host: str, port: int, hs: handshake.ClientHandshake, options: Options,
                   ssl: ssl_module.SSLContext | None, server_hostname: str | None,
                   opened: list[Channel]) -> Channel:
    """Connect and handshake (``opened`` gets the channel once the port took the connection:
    a caller whose deadline cuts the handshake short can tell ``NoAnswer``); a peer that
    speaks another protocol is named by what it sent (``_not_minips``)."""
    ch = await _open(host, port, handshake.Side.CLIENT, options, ssl, server_hostname)
    opened.append(ch)
    try:
        await _client_handshake(ch, hs)
    except BaseException as exc:
        # the decoder's error, also when it came before the recv that saw the channel closed
        err = exc if isinstance(exc, RemoteProtocolError) else ch.error
        ch.abort("handshake failed")
        if isinstance(err, RemoteProtocolError) and err.expected == checks.MAGIC:
            raise _not_minips(host, port, err) from None
        raise
    if options.heartbeat:
        ch.start_heartbeat(options.heartbeat)
    return ch


async def connect(
    host: str, port: int, *, role: str = "worker", worker_id: int = -1,
    capabilities: tuple[str, ...] = (), address: str = "", group: int = -1,
    token: str | bytes | None = None, timeout: float = 10.0, retries: int | None = 5,
    ssl: ssl_module.SSLContext | None = None, server_hostname: str | None = None,
    options: Options | None = None, version: int = messages.PROTOCOL_VERSION,
) -> Channel:
    """Connect and handshake; retry unreachable addresses with exponential backoff and jitter
    (``backoff``), ``retries`` times (None: as often as ``timeout`` allows).

    ``token`` defaults to $MINIPS_TOKEN ("" means none). The whole call, retries included, takes
    at most ``timeout`` seconds. ``version`` exists so tests can speak a wrong one.
    """
    opts = options or Options()

    async def attempt(left: float) -> Channel:
        hs = handshake.ClientHandshake(shared_secret(token), version=version, role=role,
                               worker_id=worker_id, capabilities=capabilities, address=address,
                               group=group)
        opened: list[Channel] = []
        try:
            return await asyncio.wait_for(_attempt(host, port, hs, opts, ssl, server_hostname,
                                                   opened), left)
        except asyncio.TimeoutError:
            if opened:  # the port took the connection, then said nothing in time
                raise NoAnswer() from None
            raise

    # refused, reset, unreachable, too slow: tried again; REFUSE and TLS failures pass through
    return await backoff(attempt, timeout=timeout,
                                   what=f"could not connect to {host}:{port}",
                                   fatal=(AuthError, TLSError),
                                   attempts=None if retries is None else retries + 1)
