"""Group server: one group's model copy, SGD state and SSP clock table (numpy, asyncio, no torch).

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

from minips import optim, protocol, sparse, ssp, transport, validation
from minips.config import RunConfig, dataset_train_size
from minips.downlink import Downlink, held_version
from minips.errors import AuthError, RemoteProtocolError
from minips.exchange import Exchange, ExchangeResult, GroupLink, Outgoing
from minips.gdtopk import IterTimer
from minips.metrics import JsonlWriter
from minips.replica import exchange_ratio

__all__ = ["ExchangeResult", "GroupLink", "GroupServer"]  # the first two: from exchange.py

EXPIRE_PERIOD_S = 1.0  # how often leases are checked; well under any sensible lease_s


class GroupServer:
    """State and message handling of one group; ``serve()`` puts it on a port.

    Plain attributes hold the whole state (see ``state_dict``), so a checkpoint can save it.
    """

    def __init__(self, group: int, run: RunConfig, weights: np.ndarray | None,
                 link: GroupLink | None, *, members: list[int] | None = None,
                 writer: JsonlWriter | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.writer = writer
        self.now = clock
        self.channels: dict[int, Any] = {}  # worker id -> its open connection
        self._closed_bytes = {"bytes_in": 0, "bytes_out": 0}  # traffic of closed connections
        self._changed = asyncio.Event()  # set whenever a waiting PULL may have become answerable
        self.ready = asyncio.Event()  # set once the group has its weights (setup)
        self._exchange_task: asyncio.Task[None] | None = None
        self._publishing: asyncio.Future[None] | None = None  # the publish due this turn
        self._tasks: set[asyncio.Task[Any]] = set()
        self.server: Any = None
        self.port = 0
        self.finished = False  # final delta flushed
        self.members: set[int] = set()  # worker ids the global server assigned here
        self.open_membership = False  # any worker id may join (a `minips group` process)
        self.rejected: collections.Counter[str] = collections.Counter()  # ERRORs sent, by code
        self.iters = IterTimer()  # time between a worker's pushes, for GDTopK (gdtopk.py)
        self.group, self.run = group, run
        if weights is not None and link is not None:
            self.setup(group, run, weights, link, members or [])

    def setup(self, group: int, run: RunConfig, weights: np.ndarray, link: GroupLink,
              members: list[int]) -> None:
        """The training state: weights, optimizer, clocks (a `minips group` gets it late)."""
        self.group, self.run, self.link = group, run, link
        self.weights = np.array(weights, dtype=np.float32)  # (n,) this group's model
        self.xchg = Exchange(self.weights, ratio=exchange_ratio(run))  # delta, seq, counters
        self.xchg_bytes = {"bytes_to_global": 0, "bytes_from_global": 0}  # exchanges so far
        self.opt = optim.SGD(self.weights.size, lr=run.lr, momentum=run.momentum,
                             weight_decay=run.weight_decay)
        # samples per epoch, for the lr warm-up and schedule (looked up only when one is on)
        self.train_size = (dataset_train_size(run.dataset, run.train_size)
                           if run.lr_warmup > 0 or run.lr_schedule != "constant" else 0)
        self.table = ssp.ClockTable(run.staleness_bound, run.lease_s)
        self.rounds: ssp.Rounds[Any] = ssp.Rounds()
        self.version = 0  # updates applied to self.weights
        self.unapplied = 0  # samples pushed, not applied yet (a BSP round still open)
        self.global_version = 0  # global version seen at the last exchange
        self.counters = {"pushes": 0, "samples": 0}
        self.done = False  # budget spent; answer every PULL with done
        self.ratio = run.ratio  # GDTopK ratio the global server chose for this group
        down = run.downlink_ratio()  # PULL answers: sparse updates of w_pub, or dense weights
        self.downlink = Downlink(self.weights, down) if down < 1 else None
        self._joined: set[int] = set()
        for w in members:
            self.expect(w)
        self.ready.set()

    # -- membership -----------------------------------------------------------------------

    def expect(self, w: int) -> None:
        """Count worker ``w`` in the group before it connects (so BSP rounds wait for it)."""
        self.members.add(w)
        self.table.join(w, self.now(), 0)

    def _join(self, w: int) -> int:
        self._joined.add(w)
        self.finished = False  # a (re)grouped worker arrived: a final flush is due again
        return self.table.join(w, self.now())

    def _leave(self, w: int) -> None:
        self.table.leave(w)
        self._after_membership_change()

    def _after_membership_change(self) -> None:
        if self.run.in_rounds:
            self._apply_rounds()
        self._changed.set()
        if not len(self.table) and self._joined and not self.finished:
            self._spawn(self.flush(final=True))

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

    # -- gradients --------------------------------------------------------------------------

    def on_push(self, w: int, msg: Any) -> Any:
        """Decode, account and apply (or queue, in BSP) one worker push; return the ACK."""
        grad = sparse.decode_gradient(msg.encoding, msg.codec, msg.buffers, self.weights.size)
        self.table.push(w, msg.clock, self.now())
        self.iters.push(w, self.now())
        self._count(msg)
        if self.run.in_rounds:
            self.rounds.add(msg.clock, (grad, msg.samples))
            self._apply_rounds()
        else:
            self._apply(grad, msg.samples, len(self.table))
        self._changed.set()
        if self.run.sync.exchange_due(self.xchg.since["pushes"], self.run.sync_every):
            self.start_exchange()
        return protocol.Ack(clock=msg.clock, version=self.version)

    def _count(self, msg: Any) -> None:
        self.xchg.count(msg.samples, msg.step_time, msg.loss)
        self.counters["pushes"] += 1
        self.counters["samples"] += msg.samples
        self.unapplied += msg.samples

    def _apply_rounds(self) -> None:
        """Apply each complete BSP round once: the mean of its gradients, one SGD step."""
        for _, pushes in self.rounds.pop_complete(self.table.min_clock()):
            grads = [g for g, _ in pushes]
            self._apply(sparse.average(grads, self.weights.size), sum(n for _, n in pushes))

    def _apply(self, grad: Any, samples: int, share: int = 1) -> None:
        """One SGD step on ``samples`` samples; ``share`` > 1 applies 1/share of it (one push
        of a round of share)."""
        self.opt.lr = self.run.lr * self._lr_factor(samples) / max(1, share)
        self.opt.step(self.weights, grad)
        self.version += 1
        self.unapplied -= samples

    def _lr_factor(self, samples: int) -> float:
        """The warm-up and decay for an update of ``samples`` (``optim.lr_factor``), at the
        run's samples before it: all pushes counted (exchange.py) less those not applied yet.
        A group that is the whole cluster (bsp, ssp, asp) knows that count exactly, so BSP is
        synchronous SGD step for step (``reference.train``). A GSSP group knows the others'
        samples as of its last exchange, and warms up on its own samples over its share of
        the cluster (its live workers out of all workers)."""
        if not self.train_size:
            return 1.0
        ramp = self.run.lr_warmup * self.train_size
        budget = self.run.epochs * self.train_size
        seen = self.xchg.cluster_samples() - self.unapplied
        if self.run.fixed_groups == 1:
            return optim.lr_factor(self.run.lr_schedule, seen=seen, step=samples, ramp=ramp,
                                   budget=budget)
        share = max(1, len(self.table)) / max(1, self.run.workers)
        own = self.counters["samples"] - self.unapplied
        return (optim.warmup_factor((own + samples) / share, ramp)
                * optim.decay_at(self.run.lr_schedule, seen, budget))

    # -- weights ----------------------------------------------------------------------------

    async def answer_pull(self, w: int, since: int = -1) -> Any:
        """Wait until ``w`` may start its next step (or the run is done); return WEIGHTS for a
        worker that holds the published weights of version ``since`` (-1: none)."""
        waited: list[int] = []
        while not self._may_answer(w):
            waited = waited or [int(v) for v in self.table.waiting_for(w)]  # type: ignore[call-overload]
            self._changed.clear()
            await self._changed.wait()
        await self._publish()
        return self.weights_message(w, waited, since)

    def _may_answer(self, w: int) -> bool:
        return self.done or w not in self.table or self.table.may_start(w)

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
            self.downlink.publish(self.weights)
        except Exception as exc:  # the PULLs waiting for it fail (their sessions end), not hang
            done.set_exception(exc)
        else:
            done.set_result(None)

    def weights_message(self, w: int | None, waited_for: list[int], since: int = -1) -> Any:
        """WEIGHTS for worker ``w`` holding version ``since``: the weights themselves (dense
        downlink; version = updates applied), or, with a compressed downlink, the update from
        ``since`` to the last publish (``_publish``, ``downlink.py``)."""
        payload: sparse.SparseGrad | np.ndarray = self.weights
        version, base = self.version, -1
        if self.downlink is not None:
            answer = self.downlink.answer(since)
            version, base, payload = answer.version, answer.since, answer.payload
        encoding, codec, buffers = sparse.encode_gradient(payload)
        info = {"group": self.group, "waited_for": waited_for, "ratio": self.ratio,
                "lead": self.table.lead(w) if w in self.table else 0,
                "min_clock": self.table.min_clock()}
        if self.downlink is not None:  # how far the weights sent are from the group's
            info["drift"] = round(self.downlink.last_drift, 6)
        return protocol.Weights(version=version, since=base, encoding=encoding, codec=codec,
                                buffers=tuple(buffers), done=self.done, info=info)

    # -- exchange with the global server -------------------------------------------------------

    def start_exchange(self) -> None:
        """Start an asynchronous exchange unless one is already in flight."""
        if self._exchange_task is None or self._exchange_task.done():
            self._exchange_task = self._spawn(self._exchange())

    async def _exchange(self, final: bool = False) -> None:
        """Send a lost exchange again first (same seq), then the delta since the last one."""
        pending = self.xchg.pending
        if pending is None or await self._send(pending):
            out = self.xchg.begin(self.weights, self._extra(final), dense=final or self.done)
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
        self.xchg.complete(self.weights, out, res)
        self.global_version = res.version
        self.xchg_bytes["bytes_to_global"] += res.bytes_up
        self.xchg_bytes["bytes_from_global"] += res.bytes_down
        self.log("exchange", exchange_s=self.now() - t, global_version=res.version,
                 seq=out.stats["seq"], min_clock=out.stats["min_clock"],
                 max_clock=out.stats["max_clock"], sent=_entries(out.delta),
                 got=_entries(res.weights), **self.xchg_bytes)
        if res.done and not self.done:
            self.finish()
        return True

    def _extra(self, final: bool) -> dict[str, Any]:
        """Counters an exchange carries besides the pushes since the last one."""
        return {"version": self.version, "final": final, **self.traffic(),
                "iter_time": self.iters.take(),
                "min_clock": self.table.min_clock(), "max_clock": self.table.max_clock()}

    def reload(self, weights: np.ndarray, link: GroupLink, held: int | None = None) -> None:
        """Reconnected to a (restarted) global server that holds this group's exchanges up to
        seq ``held``: take its weights, keep what this group applied since its last exchange
        and what the server lost of its exchanges on top (sent with the next exchange), keep
        clocks and optimizer state."""
        w = np.asarray(weights, dtype=np.float32)
        self.weights, replay = self.xchg.rebase(self.weights, w, held)
        self.link = link
        if held is not None:
            self.log("resync", held_seq=held, seq=self.xchg.seq,
                     replay_samples=-1 if replay is None else replay.samples)

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
        if self._may_answer(w):  # the common case: no wait, no tasks
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

    def state_dict(self) -> dict[str, Any]:
        """Everything a checkpoint needs to rebuild this group server."""
        return {"group": self.group, "weights": self.weights.copy(),
                "w_sync": self.xchg.w_sync.copy(),
                "opt": self.opt.state_dict(), "clocks": dict(self.table.clocks),
                "version": self.version, "global_version": self.global_version,
                "counters": dict(self.counters), "ratio": self.ratio,
                "exchange": self.xchg.state_dict(), "xchg_bytes": dict(self.xchg_bytes)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take back what ``state_dict`` gave (checkpoint resume). The saved workers count as
        live again, each at its saved clock; one that does not come back expires by lease."""
        self.weights[:] = np.asarray(state["weights"], dtype=np.float32)
        saved = state.get("exchange", {"session": self.xchg.session, "seq": 0})  # older files
        self.xchg.load_state_dict(saved, state["w_sync"])
        self.opt.load_state_dict(state["opt"])
        self.table.restore({int(w): int(c) for w, c in state["clocks"].items()}, self.now())
        self.version, self.global_version = state["version"], state["global_version"]
        self.counters = {k: int(state["counters"].get(k, 0)) for k in ("pushes", "samples")}
        self.ratio = state["ratio"]
        self.xchg_bytes = {k: int(state.get("xchg_bytes", {}).get(k, 0))  # 0 in older files
                           for k in ("bytes_to_global", "bytes_from_global")}


def _entries(d: Any) -> int:
    """How many entries an exchange or its reply carried (dense: all)."""
    return int(d.nnz if isinstance(d, sparse.SparseGrad) else d.size)
