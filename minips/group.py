"""Group server: one group's model copy, SGD state and SSP clock table (numpy, asyncio, no torch).

The rules live in ``group_core.GroupCore`` (no IO); ``GroupServer`` is their asyncio shell: it
listens, runs one session per worker, holds a PULL until SSP allows it, exchanges with the
global server in the background and expires silent workers.

A group server accepts its workers' PULL / PUSH on its own port and applies their gradients to its
copy of the weights with ``optim.SGD``. SSP inside the group: a PULL is answered only when
``ssp.ClockTable.may_start`` allows; BSP (staleness 0) averages the pushes of one clock
(``ssp.Rounds``) and applies them once, at the lr of the round's place in the run (so W
workers in BSP are synchronous SGD, schedule included: ``reference.train``); other modes apply
each push as it arrives with the learning rate divided by the number of live workers m of the
group, so that one round of m pushes moves the weights as far as one BSP step (the modes then
compare at one learning rate, and adding workers does not multiply the step size).

Every ``sync_every`` pushes the group exchanges with the global server through a ``GroupLink``
(a direct call in-process, PUSH/WEIGHTS over TCP for a separate `minips group`); ``exchange.py``
keeps the delta bookkeeping (no update is lost, each delta is merged exactly once, also when a
reply is lost; top-k both ways at ``xchg_ratio``, dense for a flush) and at most one exchange is
in flight. When the budget is spent (``done``) every waiting PULL is answered with ``done`` and
the group flushes a last delta; when its last worker leaves it flushes a ``final`` delta so the
global server knows the group is finished.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from minips import protocol, transport, validation
from minips.config import RunConfig
from minips.downlink import held_version
from minips.errors import AuthError, RemoteProtocolError
from minips.exchange import ExchangeResult, GroupLink, Outgoing
from minips.group_core import GroupCore
from minips.metrics import JsonlWriter

__all__ = ["ExchangeResult", "GroupLink", "GroupServer"]  # the first two: from exchange.py

EXPIRE_PERIOD_S = 1.0  # how often leases are checked; well under any sensible lease_s


class GroupServer(GroupCore):
    """One group's rules (``GroupCore``) on a port: sessions, waiting PULLs, exchanges, leases.

    Plain attributes hold the whole state (see ``state_dict``), so a checkpoint can save it.
    """

    def __init__(self, group: int, run: RunConfig, weights: np.ndarray | None,
                 link: GroupLink | None, *, members: list[int] | None = None,
                 writer: JsonlWriter | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.writer = writer
        self.channels: dict[int, Any] = {}  # worker id -> its open connection
        self._closed_bytes = {"bytes_in": 0, "bytes_out": 0}  # traffic of closed connections
        self._changed = asyncio.Event()  # set whenever a waiting PULL may have become answerable
        self.ready = asyncio.Event()  # set once the group has its weights (setup)
        self._exchange_task: asyncio.Task[None] | None = None
        self._publishing: asyncio.Future[None] | None = None  # the publish due this turn
        self._tasks: set[asyncio.Task[Any]] = set()
        self.server: Any = None
        self.port = 0
        self.open_membership = False  # any worker id may join (a `minips group` process)
        self.rejected: collections.Counter[str] = collections.Counter()  # ERRORs sent, by code
        super().__init__(group, run, weights, link, members=members, clock=clock)

    def setup(self, group: int, run: RunConfig, weights: np.ndarray, link: GroupLink,
              members: list[int]) -> None:
        """The training state (``GroupCore.setup``); a `minips group` gets it late."""
        super().setup(group, run, weights, link, members)
        self.ready.set()

    # -- hooks of the core ------------------------------------------------------------------

    def wake(self) -> None:
        self._changed.set()

    def all_left(self) -> None:
        self._spawn(self.flush(final=True))

    # -- membership -----------------------------------------------------------------------

    async def _expire_loop(self) -> None:
        """Every EXPIRE_PERIOD_S: renew each worker's lease as of the last bytes its connection
        carried, then expire the workers silent for more than lease_s."""
        loop = asyncio.get_running_loop()
        await self.ready.wait()
        while True:  # also after a final flush: workers may rejoin (close() cancels it)
            await asyncio.sleep(EXPIRE_PERIOD_S)
            now = self.now()
            for w, ch in self.channels.items():
                silent = loop.time() - ch.last_recv
                if not ch.closed and silent < self.run.lease_s:
                    # renewed as of its last bytes, not of this check: a lease lasts lease_s
                    self.table.heartbeat(w, now - silent)
            expired = self.table.expire(now)
            if expired:
                self.log("expired", workers=list(expired))
                self._after_membership_change()

    # -- weights ----------------------------------------------------------------------------

    async def answer_pull(self, w: int, since: int = -1) -> Any:
        """Wait until ``w`` may start its next step (or the run is done); return WEIGHTS for a
        worker that holds the published weights of version ``since`` (-1: none)."""
        waited: list[int] = []
        while not self.may_answer(w):
            waited = waited or [int(v) for v in self.table.waiting_for(w)]  # type: ignore[call-overload]
            self._changed.clear()
            await self._changed.wait()
        await self._publish()
        return self.weights_message(w, waited, since)

    async def _publish(self) -> None:
        """With a compressed downlink: publish the weights' largest changes once for all the
        PULLs this turn of the event loop answers (they arrived together, or a BSP round or the
        staleness bound released them together), not once per PULL: a publish is O(n) (an exact
        top-k), an answer only touches what it sends. Every such PULL still gets weights at
        least as new as when it arrived."""
        if self.downlink is None:
            return
        if self._publishing is None:
            self._publishing = asyncio.get_running_loop().create_future()
            asyncio.get_running_loop().call_soon(self._publish_now, self._publishing)
        await asyncio.shield(self._publishing)  # a PULL given up on must not cancel the others'

    def _publish_now(self, done: asyncio.Future[None]) -> None:
        self._publishing = None
        assert self.downlink is not None
        try:
            self.publish()
        except Exception as exc:  # the PULLs waiting for it fail (their sessions end), not hang
            done.set_exception(exc)
        else:
            done.set_result(None)

    # -- exchange with the global server -------------------------------------------------------

    def start_exchange(self) -> None:
        """Start an asynchronous exchange unless one is already in flight."""
        if self._exchange_task is None or self._exchange_task.done():
            self._exchange_task = self._spawn(self._exchange())

    async def _exchange(self, final: bool = False) -> None:
        """Send a lost exchange again first (same seq), then the delta since the last one."""
        pending = self.xchg.pending
        if pending is None or await self._send(pending):
            out = self.begin_exchange(final)
            if await self._send(out):
                return
        self.finished = self.finished and not final  # the global server is away: retry later

    async def _send(self, out: Outgoing) -> bool:
        """One exchange; False (``out`` stays pending) when the global server is away."""
        t = self.now()
        try:
            res = await self.link.exchange(self.group, self.xchg.delta(out), out.stats)
        except ConnectionError:
            return False
        if self.exchanged(out, res, self.now() - t):
            self.finish()
        return True

    async def flush(self, final: bool = False) -> None:
        """Wait for the exchange in flight, then send what is left (``final``: the last one)."""
        while self._exchange_task is not None and not self._exchange_task.done():
            await asyncio.wait([self._exchange_task])
        if self.finished:
            return
        self.finished = final
        self._exchange_task = self._spawn(self._exchange(final))
        await asyncio.wait([self._exchange_task])

    def finish(self) -> None:
        """The budget is spent: release every waiting PULL with ``done``; flush a last delta."""
        self.done = True
        self._changed.set()
        self._spawn(self.flush(final=not len(self.table)))

    # -- network --------------------------------------------------------------------------

    async def serve(self, host: str, port: int, token: str, ssl: Any = None,
                    options: transport.Options | None = None) -> int:
        """Listen for this group's workers (``options``: timeouts, buffers); return the port."""
        self.server = await transport.serve(host, port, token=token, accept=self._accept,
                                            handler=self.handle, ssl=ssl, options=options)
        self.port = int(self.server.port)
        self._spawn(self._expire_loop())
        return self.port

    def _accept(self, hello: Any) -> dict[str, Any]:
        if hello.role != "worker":
            raise AuthError(f"group server {self.group} accepts workers only")
        if hello.group >= 0 and hello.group != self.group:  # e.g. a port reused after a restart
            raise AuthError(f"this is group server {self.group}, not {hello.group}")
        if not self.open_membership and hello.worker_id not in self.members:
            raise AuthError(f"worker {hello.worker_id} is not a member of group {self.group}")
        if self.open_membership and not 0 <= hello.worker_id < self.run.workers:
            raise AuthError(f"worker id {hello.worker_id} out of range 0..{self.run.workers - 1}")
        return {"group": self.group}

    async def handle(self, ch: Any) -> None:
        """One worker connection, one request at a time (``_session``)."""
        await self.ready.wait()
        w = int(ch.worker_id)
        old = self.channels.pop(w, None)
        if old is not None:  # the newest connection with an id wins; the old one is told why
            await validation.replace(old, w, self.rejected, f"group {self.group}")
        self.channels[w] = ch
        ch.start_heartbeat(self.run.heartbeat_s)  # so the worker can tell we are still here
        start = self._join(w)
        try:
            await self._session(ch, w, start)
        except RemoteProtocolError as exc:
            await validation.reject(ch, exc, self.rejected, f"group {self.group}")
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            if self.channels.get(w) is ch:
                del self.channels[w]
                self._leave(w)
            self._closed_bytes["bytes_in"] += ch.bytes_received
            self._closed_bytes["bytes_out"] += ch.bytes_sent
            await ch.close()

    async def _session(self, ch: Any, w: int, start: int) -> None:
        """One request at a time: the next message is not read before this one is answered, so
        a worker that sends ahead (a flood) waits on TCP, and its PUSH is taken only after the
        WEIGHTS it pulled went out (SSP holds it like any other worker)."""
        await ch.send(protocol.Ack(clock=start, version=self.version))
        pulled: int | None = None  # clock of the last PULL: a PUSH must follow one
        sent = -1  # version of the last WEIGHTS on this connection (downlink.held_version)
        while True:
            # one message per turn: a worker with many queued (a flood) takes turns with the rest
            await asyncio.sleep(0)
            msg = await ch.recv()
            if isinstance(msg, protocol.Pull):
                pulled = msg.clock
                sent = await self._send_pull(ch, w, held_version(msg.since, sent))
            elif isinstance(msg, protocol.Push):
                validation.check_push_order(pulled, msg.clock)
                pulled = None
                await self._send_push(ch, w, msg)
            elif isinstance(msg, protocol.Leave):
                return
            else:
                raise validation.unexpected(msg, "worker")

    def traffic(self) -> dict[str, int]:
        """Bytes received from / sent to this group's workers so far."""
        up = self._closed_bytes["bytes_in"] + sum(c.bytes_received for c in self.channels.values())
        down = self._closed_bytes["bytes_out"] + sum(c.bytes_sent for c in self.channels.values())
        return {"bytes_in": up, "bytes_out": down}

    async def _send_pull(self, ch: Any, w: int, since: int) -> int:
        """Answer a PULL once SSP allows; give up as soon as the connection closes meanwhile
        (the worker then leaves the group at once, not when its lease runs out). Returns the
        version the answer brought the worker to."""
        if self.may_answer(w):  # the common case: no wait, no tasks
            await self._publish()
            reply = self.weights_message(w, [], since)
            with contextlib.suppress(ConnectionError):
                await ch.send(reply)
            return int(reply.version)
        answer = asyncio.ensure_future(self.answer_pull(w, since))
        closed = asyncio.ensure_future(ch.wait_closed())
        try:
            await asyncio.wait((answer, closed), return_when=asyncio.FIRST_COMPLETED)
        finally:
            answer.cancel()
            closed.cancel()
        if not answer.done():  # cancel() above only asked a pending one to stop
            raise ConnectionResetError("connection closed while its PULL waited")
        with contextlib.suppress(ConnectionError):  # e.g. cut off: the peer stopped reading
            await ch.send(answer.result())
        return int(answer.result().version)

    async def _send_push(self, ch: Any, w: int, msg: Any) -> None:
        if w not in self.table:  # its lease expired while it was silent: rejoin and pull first
            await ch.send(protocol.Error(code="lease", reason=f"worker {w}: lease expired, "
                                         "reconnect and pull the current weights"))
            raise ConnectionResetError("lease expired")
        validation.check_push(msg)
        await ch.send(self.on_push(w, msg))

    async def close(self) -> None:
        """Stop listening and cancel the background tasks."""
        self.finished = True
        for t in list(self._tasks):
            t.cancel()
        for ch in list(self.channels.values()):
            await ch.close()
        if self.server is not None:
            self.server.close()
            with contextlib.suppress(Exception):
                await self.server.wait_closed()

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def log(self, event: str, **fields: Any) -> None:
        if self.writer is not None:
            self.writer.write({"t": time.time() - self.run.t0, "event": event, "group": self.group,
                               **fields, "version": self.version, **self.counters,
                               **self.traffic()})
