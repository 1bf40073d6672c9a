"""Group server: one group's model copy, SGD state and SSP clock table (numpy, asyncio, no torch).

The rules live in ``group_core.GroupCore`` (no IO); ``GroupServer`` is their asyncio shell and
holds one (``core``; it never writes the core's fields, it calls its entry points): it listens,
runs one session per worker, feeds the core each event with the time and performs the actions it
returns (``group_core.py``: sends the ACK, wakes held PULLs, exchanges with the global server in
the background, logs), holds a PULL until SSP allows it and expires silent workers. The rules
themselves are described in group_core.py's docstring.

A session reads one message, feeds it to its ``Conversation`` (``wire/conversation.py``: a
worker's PULL -> WEIGHTS -> PUSH -> ACK, a PUSH at the clock after its PULL's) and hands it to
the core; the conversation also remembers which weights version the worker holds, so its next
PULL gets only what changed since.

A compressed downlink (``downlink.py``) is published once for all the PULLs the server answers
in one turn of its event loop (they arrived together, or a BSP round or the staleness bound
released them together), not once per PULL: ``OncePerTurn`` runs one call of a function per turn
for every caller. Every such PULL still gets weights at least as new as when it arrived.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import Callable, Coroutine
from typing import Any

import numpy as np

from minips.core.config import RunConfig
from minips.core.downlink import trusted_since
from minips.core.exchange import GroupLink, Outgoing
from minips.core.group_core import (
    Action,
    AllLeft,
    BudgetSpent,
    GroupCore,
    Reply,
    StartExchange,
    Wake,
)
from minips.errors import AuthError, RemoteProtocolError
from minips.net import channel, transport
from minips.net.channel import Channel
from minips.record import trace
from minips.record.rundir import JsonlWriter
from minips.serve import validation
from minips.wire import checks, control, conversation, messages
from minips.wire.conversation import Conversation, Role

__all__ = ["OncePerTurn", "GroupServer"]


class OncePerTurn:
    """``await once()`` runs ``fn`` soon, once for every caller awaiting in this turn."""

    def __init__(self, fn: Callable[[], object]) -> None:
        self.fn = fn
        self._due: asyncio.Future[None] | None = None  # the call due this turn

    async def __call__(self) -> None:
        if self._due is None:
            loop = asyncio.get_running_loop()
            self._due = loop.create_future()
            loop.call_soon(self._run, self._due)
        await asyncio.shield(self._due)  # a caller given up on must not cancel the others'

    def _run(self, due: asyncio.Future[None]) -> None:
        self._due = None
        try:
            self.fn()
        except Exception as exc:  # the callers waiting for it fail (their sessions end), not hang
            due.set_exception(exc)
        else:
            due.set_result(None)


EXPIRE_PERIOD_S = 1.0  # how often leases are checked; well under any sensible lease_s
# a worker's connection that carried no bytes (not even the heartbeat it sends every
# heartbeat_s) for this many heartbeats has lost its link, or the worker is stopped: said once
# (``link_lost``), and again when bytes come back (``link_back``); the lease decides the rest
SILENT_HEARTBEATS = 3
MAX_REPORTED_EVENTS = 64  # events one EXCHANGE carries at most (names on the wire: <= 64)


class GroupServer:
    """One group's rules (``core``, a ``GroupCore``) on a port: sessions, waiting PULLs,
    exchanges over ``link``, leases. The core holds the whole training state (``state_dict``),
    so a checkpoint can save it; this shell holds the connections, tasks and the record."""

    def __init__(self, group: int, run: RunConfig, weights: np.ndarray | None,
                 link: GroupLink | None, *, members: list[int] | None = None,
                 writer: JsonlWriter | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.writer, self.clock = writer, clock
        self.link = link  # how exchanges reach the global server (a `minips group`: later)
        self.core = GroupCore(group, run, weights, members=members, now=clock())
        self.channels: dict[int, Channel] = {}  # worker id -> its open connection
        self._closed_bytes = {"bytes_in": 0, "bytes_out": 0}  # traffic of closed connections
        self._changed = asyncio.Event()  # set whenever a waiting PULL may have become answerable
        self.ready = asyncio.Event()  # set once the group has its weights (setup)
        if weights is not None:
            self.ready.set()
        self._exchange_task: asyncio.Task[None] | None = None
        self._publish_turn = OncePerTurn(self.core.publish)  # one downlink publish per turn
        self._tasks: set[asyncio.Task[Any]] = set()
        self.server: transport.Server | None = None
        self.port = 0
        self.rejected: collections.Counter[str] = collections.Counter()  # ERRORs sent, by code
        # events the operator reads on the global server's console (link lost / back, lease
        # expired): an in-process group calls the global server; a group process keeps them
        # for its log (``event``)
        self.notify: Callable[[str, dict[str, Any]], None] | None = None
        self.silent: dict[int, float] = {}  # worker -> loop time of its last bytes, while silent
        self.report_events = False  # a group process: events go with the next EXCHANGE
        self.outbox: list[tuple[str, int, int]] = []  # (event, worker, ms) not yet sent

    def setup(self, group: int, run: RunConfig, weights: np.ndarray, link: GroupLink,
              members: list[int]) -> None:
        """A `minips group` registered: its group, weights and link (``GroupCore.setup``);
        the global server places its workers (open membership)."""
        self.core.setup(group, run, weights, members, now=self.clock(), open_membership=True)
        self.link = link
        self.fit_limits()
        self.ready.set()

    def fit_limits(self) -> None:
        """Narrow what workers may send to this model's frames (``checks.Limits.sized_for``),
        once the model is known."""
        weights = getattr(self.core, "weights", None)
        if self.server is not None and weights is not None:
            self.server.set_limits(checks.DEFAULT_LIMITS.sized_for(weights.size))

    # -- the core's entry points at this clock, and its actions performed ----------------------

    def expect(self, w: int) -> None:
        """Count worker ``w`` in the group before it connects (``GroupCore.expect``)."""
        self.core.expect(w, self.clock())

    def forget(self, w: int) -> None:
        """Worker ``w`` was cut for a protocol violation on its control channel: unless it is
        connected here, it leaves the clock table as after a LEAVE (``peers.GroupPeer``)."""
        if w not in self.channels:
            self._perform(self.core.leave(w))

    def set_send_settings(self, ratio: float, local_steps: int = 0) -> None:
        """What an ASSIGN sets of how this group's workers send: GDTopK's ratio
        (``GroupCore.set_ratio``) and, with local steps auto, their H
        (``GroupCore.set_local_steps``; 0: unchanged)."""
        self.core.set_ratio(ratio)
        self.core.set_local_steps(local_steps)

    def state_dict(self) -> dict[str, Any]:
        return self.core.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.core.load_state_dict(state, self.clock())

    def on_push(self, w: int, msg: messages.Push) -> messages.Ack:
        """One PUSH of worker ``w`` (``GroupCore.push``): return its ACK."""
        return _ack(self._perform(self.core.push(w, msg, self.clock())))

    def reload(self, weights: np.ndarray, link: GroupLink,
               server_seq: int | None = None) -> None:
        """A new global server holds this group's exchanges up to seq ``server_seq``
        (``GroupCore.rebase``); ``link`` reaches it."""
        self.link = link
        self._perform(self.core.rebase(weights, server_seq))
        self.fit_limits()

    def _perform(self, actions: list[Action]) -> messages.Ack | None:
        """Do what the core asked, in order; return its reply to the worker (None if none)."""
        reply = None
        for a in actions:
            if isinstance(a, Reply):
                reply = a.msg  # the session that passed the message in sends it
            elif isinstance(a, Wake):
                self._changed.set()
            elif isinstance(a, StartExchange):
                self.start_exchange()
            elif isinstance(a, AllLeft):
                self._spawn(self.flush(final=True))
            elif isinstance(a, BudgetSpent):
                self.finish()
            elif a.event == "expired":
                self.event("expired", **a.fields)
            else:
                self.log(a.event, **a.fields)
        return reply

    def event(self, event: str, **fields: Any) -> None:
        """One of the events an operator should read (the record, and ``notify``)."""
        self.log(event, **fields)
        if self.notify is not None:
            self.notify(event, {"group": self.core.group, **fields})
        self._report(event, fields.get("workers", [fields.get("worker")]),
                     fields.get("silent_s", fields.get("after_s", 0.0)))

    def _report(self, event: str, workers: list[Any], seconds: float | None) -> None:
        """A group process: ``event`` of ``workers`` goes with the next EXCHANGE (the global
        server prints it; a `left` only of a worker whose control channel it does not hold)."""
        if self.report_events:
            for w in workers:
                self.outbox.append((event, int(w), int(1000 * float(seconds or 0.0))))
            del self.outbox[:-MAX_REPORTED_EVENTS]  # the latest; the record keeps every one

    # -- membership -----------------------------------------------------------------------

    async def _expire_loop(self) -> None:
        """Every EXPIRE_PERIOD_S: renew each worker's lease as of the last bytes its connection
        carried, then expire the workers silent for more than lease_s."""
        loop = asyncio.get_running_loop()
        await self.ready.wait()
        while True:  # also after a final flush: workers may rejoin (close() cancels it)
            await asyncio.sleep(EXPIRE_PERIOD_S)
            now = self.clock()
            heard = {w: now - (loop.time() - ch.last_recv)
                     for w, ch in self.channels.items() if not ch.closed}
            self._watch_links(loop.time())
            self._perform(self.core.tick(now, heard))

    def _watch_links(self, now: float) -> None:
        """``link_lost`` for a worker whose connection went silent for SILENT_HEARTBEATS
        heartbeats, ``link_back`` (with how long) once bytes come again, on it or on a new
        connection of the same worker."""
        silent_after = SILENT_HEARTBEATS * max(self.core.run.heartbeat_s, 0.5)
        for w, ch in list(self.channels.items()):
            quiet = now - ch.last_recv
            if quiet >= silent_after and w not in self.silent:
                self.silent[w] = ch.last_recv
                self.event("link_lost", worker=w, silent_s=round(quiet, 1))
            elif quiet < silent_after and w in self.silent:
                since = self.silent.pop(w)
                self.event("link_back", worker=w, after_s=round(now - quiet - since, 1))

    # -- weights ----------------------------------------------------------------------------

    async def answer_pull(self, w: int, since: int = -1, clock: int = -1) -> messages.Weights:
        """Wait until ``w`` may start its next step (or the run is done, for everyone or for
        ``w`` at ``clock``); return WEIGHTS for a worker that holds the published weights of
        version ``since`` (-1: none)."""
        waited: list[int] = []
        t = self.clock()
        while not self.core.may_answer(w, clock):
            waited = waited or self.core.waiting_for(w)
            self._changed.clear()
            await self._changed.wait()
        held_s = self.clock() - t if waited else 0.0  # the SSP bound's wait, not the publish's
        await self._publish()
        return self.core.weights_message(w, waited, since, clock, held_s)

    async def _publish(self) -> None:
        """With a compressed downlink: publish once for all the PULLs this turn of the event
        loop answers (``group.py``)."""
        if self.core.downlink is not None:
            await self._publish_turn()

    # -- exchange with the global server -------------------------------------------------------

    def start_exchange(self) -> None:
        """Start an asynchronous exchange unless one is already in flight."""
        if self._exchange_task is None or self._exchange_task.done():
            self._exchange_task = self._spawn(self._exchange())

    async def _exchange(self, final: bool = False) -> None:
        """Send a lost exchange again first (same seq), then the delta since the last one."""
        pending = self.core.xchg.pending
        if pending is None or await self._send(pending):
            out = self.core.begin_exchange(final, {**self.traffic(), **self._events()})
            if await self._send(out):
                return
        self.core.flush_failed(final)  # the global server is away: retry later

    def _events(self) -> dict[str, Any]:
        """The events not yet reported, as EXCHANGE's three lists (taken: an exchange sent
        again carries them again, and the global server logs the one it merges)."""
        taken, self.outbox = self.outbox, []
        return {"events": [e for e, _, _ in taken], "event_workers": [w for _, w, _ in taken],
                "event_ms": [ms for _, _, ms in taken]} if taken else {}

    async def _send(self, out: Outgoing) -> bool:
        """One exchange; False (``out`` stays pending) when the global server is away."""
        assert self.link is not None
        t = self.clock()
        try:
            res = await self.link.exchange(self.core.group, out.delta, out.stats)
        except ConnectionError:
            return False
        self._perform(self.core.exchanged(out, res, self.clock() - t))
        return True

    async def flush(self, final: bool = False) -> None:
        """Wait for the exchange in flight, then send what is left (``final``: the last one)."""
        await self.settle()
        if not self.core.start_flush(final):
            return
        self._exchange_task = self._spawn(self._exchange(final))
        await asyncio.wait([self._exchange_task])

    async def settle(self) -> None:
        """Wait until no exchange is in flight."""
        while self._exchange_task is not None and not self._exchange_task.done():
            await asyncio.wait([self._exchange_task])

    def finish(self) -> None:
        """The budget is spent: release every waiting PULL with ``done``; flush a last delta."""
        self._perform(self.core.spend_budget())
        self._spawn(self.flush(final=not self.core.live_count()))

    # -- network --------------------------------------------------------------------------

    async def serve(self, host: str, port: int, token: str, ssl: Any = None,
                    options: channel.Options | None = None) -> int:
        """Listen for this group's workers (``options``: timeouts, buffers); return the port."""
        self.server = await transport.serve(host, port, token=token, accept=self._accept,
                                            handler=self.handle, ssl=ssl, options=options)
        self.port = int(self.server.port)
        if trace.TRACER is not None:  # --trace: this port's connections are group-G's frames
            trace.TRACER.name_port(self.port, f"group-{self.core.group}")
        self.fit_limits()
        self._spawn(self._expire_loop())
        return self.port

    def _accept(self, hello: control.Hello) -> dict[str, Any]:
        refused = self.core.refusal(hello)
        if refused:
            raise AuthError(refused)
        return {"group": self.core.group}

    async def handle(self, ch: Channel) -> None:
        """One worker connection, one request at a time (``_session``)."""
        await self.ready.wait()
        w = int(ch.worker_id)
        where = f"group {self.core.group}"
        old = self.channels.pop(w, None)
        if old is not None:  # the newest connection with an id wins; the old one is told why
            await validation.replace(old, w, self.rejected, where)
        self.channels[w] = ch
        ch.start_heartbeat(self.core.run.heartbeat_s)  # so the worker can tell we are still here
        first = _ack(self._perform(self.core.join(w, self.clock())))  # its starting clock
        lost = False  # the connection broke (no LEAVE: the worker was killed, or cut off)
        try:
            await self._session(ch, w, first)
        except RemoteProtocolError as exc:
            await validation.reject(ch, exc, self.rejected, where)
        except (ConnectionError, asyncio.IncompleteReadError):
            lost = True
        finally:
            if self.channels.get(w) is ch:
                del self.channels[w]
                # said once: not after its lease expired (`expired` said it), nor at the end
                said = lost and self.core.has_lease(w) and not self.core.done
                self._perform(self.core.leave(w))
                if said:
                    self.log("left", worker=w, reason="connection lost")
                    self._report("left", [w], 0.0)
            self._closed_bytes["bytes_in"] += ch.bytes_received
            self._closed_bytes["bytes_out"] += ch.bytes_sent
            await ch.close()

    async def _session(self, ch: Channel, w: int, first: messages.Message) -> None:
        """One request at a time: the next message is not read before this one is answered, so
        a worker that sends ahead (a flood) waits on TCP, and its PUSH is taken only after the
        WEIGHTS it pulled went out (SSP holds it like any other worker)."""
        conv = Conversation(Role.WORKER)  # PULL -> WEIGHTS -> PUSH -> ACK
        conv.send(first)
        await ch.send(first)
        while not conv.left:
            # one message per turn: a worker with many queued (a flood) takes turns with the rest
            await asyncio.sleep(0)
            msg = await ch.recv()
            conv.receive(msg)
            if isinstance(msg, messages.Pull):
                await self._send_pull(ch, w, conv, msg)
            elif isinstance(msg, messages.Push):
                await self._send_push(ch, w, conv, msg)

    def traffic(self) -> dict[str, int]:
        """Bytes received from / sent to this group's workers so far (one pass over the
        connections: asked twice an exchange here, and of every group by each of the global
        server's record lines, ``GlobalServer.figures``)."""
        up, down = self._closed_bytes["bytes_in"], self._closed_bytes["bytes_out"]
        for c in self.channels.values():
            up += c.bytes_received
            down += c.bytes_sent
        return {"bytes_in": up, "bytes_out": down}

    async def _send_pull(self, ch: Channel, w: int, conv: Conversation,
                         msg: messages.Pull) -> None:
        """Answer a PULL once SSP allows, with what changed since the version the worker holds
        (``downlink.trusted_since``)."""
        reply = await self._answer_or_close(ch, w, trusted_since(msg.since, conv.sent_version),
                                            msg.clock)
        conv.send(reply)
        with contextlib.suppress(ConnectionError):  # e.g. cut off: the peer stopped reading
            await ch.send(reply)

    async def _answer_or_close(self, ch: Channel, w: int, since: int,
                               clock: int) -> messages.Weights:
        """The answer of a PULL at ``clock``; give up as soon as the connection closes
        meanwhile (the worker then leaves the group at once, not when its lease runs out)."""
        if self.core.may_answer(w, clock):  # the common case: no wait, no tasks
            return await self.answer_pull(w, since, clock)
        answer = asyncio.ensure_future(self.answer_pull(w, since, clock))
        closed = asyncio.ensure_future(ch.wait_closed())
        try:
            await asyncio.wait((answer, closed), return_when=asyncio.FIRST_COMPLETED)
        finally:
            answer.cancel()
            closed.cancel()
        if not answer.done():  # cancel() above only asked a pending one to stop
            raise ConnectionResetError("connection closed while its PULL waited")
        return answer.result()

    async def _send_push(self, ch: Channel, w: int, conv: Conversation,
                         msg: messages.Push) -> None:
        """Take a PUSH (the conversation checked its turn and clock) and answer its ACK."""
        if not self.core.has_lease(w):  # its lease expired while it was silent: rejoin, pull
            await ch.send(control.Error(code="lease", reason=f"worker {w}: lease expired, "
                                         "reconnect and pull the current weights"))
            raise ConnectionResetError("lease expired")
        conversation.check_push(msg)
        ack = self.on_push(w, msg)
        conv.send(ack)
        await ch.send(ack)

    async def close(self) -> None:
        """Stop listening, cancel the background tasks and close the group's record."""
        self.core.stop()
        for t in list(self._tasks):
            t.cancel()
        for ch in list(self.channels.values()):
            await ch.close()
        if self.server is not None:
            self.server.close()
            with contextlib.suppress(Exception):
                await self.server.wait_closed()
        if self.writer is not None:
            self.writer.close()

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def log(self, event: str, **fields: Any) -> None:
        """One line of the group's record, with its counters and traffic."""
        core = self.core
        if self.writer is not None:
            self.writer.write({"t": time.time() - core.run.t0, "event": event,
                               "group": core.group, **fields, "version": core.version,
                               **core.counters, **self.traffic()})


def _ack(reply: messages.Ack | None) -> messages.Ack:
    """The core's reply to a join or a PUSH, which is always an ACK."""
    if not isinstance(reply, messages.Ack):
        raise RuntimeError(f"the group core answered with {reply!r}, not an ACK")
    return reply
