"""A group server as its own process (`minips group`): the TCP link to the global server.

``serve_group`` listens for the group's workers first (so their address is known), registers
with the global server as role ``group`` (HELLO.address = where its workers connect; HELLO's
capability ``tls`` when it serves them TLS), takes the
group id from ASSIGN, PULLs the global weights (GLOBAL_WEIGHTS: ``size``, ``members``) and
serves until the global server says ``done``. ``TcpLink`` carries each exchange: EXCHANGE(delta,
counters) -> EXCHANGE_REPLY.

Faults: when the global server is lost, the group keeps serving its workers (their pushes are
applied locally; exchanges wait) and reconnects with backoff and jitter for ``reconnect_s``; on
reconnect it takes the global weights and keeps its own not-yet-sent delta on top
(``GroupServer.reload``), so a global server resumed from a checkpoint gets this group's work
since its last exchange, and the exchanges the checkpoint lacks once more (exchange.py): each
EXCHANGE_REPLY from the global server names the seqs it holds. A replacement group process is
given a group whose server is gone (``sessions.adopt``); it starts from the global weights.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import numpy as np

from minips import sparse
from minips.core.config import RunConfig
from minips.core.exchange import Delta, ExchangeResult, exchange_message
from minips.core.replay import seqs_in
from minips.errors import ConfigError, RemoteProtocolError
from minips.net import transport
from minips.net.channel import Channel
from minips.net.endpoints import (
    TLS_CAPABILITY,
    check_bind,
    client_ssl,
    format_address,
    server_ssl,
)
from minips.record.rundir import RunDir
from minips.serve.group import GroupServer
from minips.wire import control, messages

__all__ = [
    "TcpLink",
    "DroppedWaiting",
    "serve_group",
    "run_group_process",
    "GroupConfig",
]

POLL_S = 0.2  # how often the serving loop looks at the link and the group
STATUS_EVERY_S = 10.0  # how often `minips group` says where its group is (one console line)


class TcpLink:
    """GroupLink over TCP for a `minips group` process: EXCHANGE the delta, wait for the reply.

    A reader task owns the channel: EXCHANGE_REPLY (or GLOBAL_WEIGHTS, for the registering
    PULL) answers the request in flight, LEAVE "done" finishes the group. Each
    exchange counts the channel's bytes since the last one (heartbeats and the registering
    PULL included) as its ``bytes_up`` / ``bytes_down``.
    """

    def __init__(self, ch: Channel) -> None:
        self.ch = ch
        self.group: GroupServer | None = None
        self._reply: asyncio.Future[Any] | None = None
        self.closed = asyncio.Event()
        self.reader: asyncio.Task[None] = asyncio.ensure_future(asyncio.sleep(0))
        self._counted = (0, 0)  # the channel's bytes (sent, received) already counted

    async def request(self, msg: Any) -> Any:
        """Send ``msg`` and wait for the message that answers it (``ConnectionError`` when the
        global server is gone)."""
        if self.closed.is_set():
            raise ConnectionError("global server link is closed")
        self._reply = asyncio.get_running_loop().create_future()
        await self.ch.send(msg)
        return await self._reply

    async def exchange(self, group: int, delta: Delta,
                       stats: dict[str, Any]) -> ExchangeResult:
        """EXCHANGE ``delta`` (dense or sparse); the reply holds the global weights
        (``dense-f32``) or the entries of the group's copy to set (``sparse-v1``)."""
        reply = await self.request(exchange_message(delta, stats))
        w = sparse.decode_vector(reply.payload, delta.size)
        up, down = self.ch.bytes_sent, self.ch.bytes_received
        res = ExchangeResult(w, reply.version, reply.done, reply.samples,
                             seqs_in(reply.info, "saved_exchanges", stats["session"]),
                             up - self._counted[0], down - self._counted[1])
        self._counted = (up, down)
        return res

    async def read(self) -> None:
        """Dispatch what the global server sends until the channel closes."""
        try:
            while True:
                msg = await self.ch.recv()
                if (isinstance(msg, (messages.ExchangeReply, messages.GlobalWeights))
                        and self._reply and not self._reply.done()):
                    self._reply.set_result(msg)
                elif isinstance(msg, control.Assign) and self.group is not None:
                    self.group.set_send_settings(msg.ratio, msg.local_steps)
                elif isinstance(msg, control.Leave) and self.group is not None:
                    self.group.finish()
        except (ConnectionError, RemoteProtocolError) as exc:
            if self._reply is not None and not self._reply.done():
                self._reply.set_exception(ConnectionError(f"global server gone: {exc}"))
        finally:
            self.closed.set()
            if self._reply is not None and not self._reply.done():
                self._reply.set_exception(ConnectionError("global server link closed"))


async def _register(cfg: GroupConfig, gs: GroupServer, address: str,
                    timeout: float) -> TcpLink:
    """Connect as role ``group``, take ASSIGN and the global weights; (re)load the group."""
    # HELLO says whether this group serves its workers TLS: a TLS global server registers only
    # a group that does, a plain one only a group that does not (server.py)
    ch = await transport.connect(cfg.server_host, cfg.server_port, role="group", address=address,
                                 group=gs.core.group, token=cfg.token, timeout=timeout,
                                 retries=None, ssl=client_ssl(cfg.tls_ca),  # transport.backoff
                                 capabilities=(TLS_CAPABILITY,) if cfg.tls_cert else ())
    run = RunConfig.from_info(ch.welcome_info)
    ch.start_heartbeat(run.heartbeat_s)  # the global server drops a group silent for the lease
    link = TcpLink(ch)
    try:
        assign = await ch.recv()
    except (ConnectionError, asyncio.IncompleteReadError) as exc:  # dropped while it waited
        raise DroppedWaiting(str(exc) or type(exc).__name__) from exc
    if isinstance(assign, control.Error):  # e.g. every group has its server already
        await ch.close()
        raise ConfigError(f"the global server refused this group server: {assign.reason}")
    if not isinstance(assign, control.Assign):
        await ch.close()
        raise RemoteProtocolError("expected ASSIGN", got=type(assign).__name__)
    link.reader = asyncio.create_task(link.read())
    try:
        init = await link.request(messages.Pull(clock=0))
    except ConnectionError as exc:
        raise DroppedWaiting(str(exc)) from exc
    if not isinstance(init, messages.GlobalWeights):
        raise RemoteProtocolError("expected GLOBAL_WEIGHTS", got=type(init).__name__)
    weights = np.asarray(sparse.decode_vector(init.payload, init.size))
    if gs.core.group == int(assign.group) and gs.ready.is_set():
        server_seqs = seqs_in(init.info, "last_exchange", gs.core.xchg.session)
        gs.reload(weights, link, None if server_seqs is None else server_seqs[0])
    else:  # late joiners are placed by the global server, not told here: open membership
        gs.setup(int(assign.group), run, weights, link, list(init.members))
        if gs.writer is not None:  # it served another group before: that record is done
            gs.writer.close()
        gs.writer = RunDir(cfg.run_dir, t0=run.t0).writer(f"group-{gs.core.group}")
    gs.set_send_settings(float(assign.ratio), int(assign.local_steps))
    link.group = gs
    return link


class DroppedWaiting(ConnectionError):
    """The global server dropped this group server after its handshake, before ASSIGN and the
    global weights came (it was stopped or cut off past the lease while the grouping waited)."""


async def _register_again(cfg: GroupConfig, gs: GroupServer, address: str, timeout: float,
                          announce: bool, waiting: str = "waited for the grouping") -> TcpLink:
    """``_register``, again when the global server drops this group server after the handshake,
    before ASSIGN and the global weights came: while it waits for the grouping (stopped, or cut
    off past the lease: ASSIGN never comes on that connection), or while it registers again
    with a resumed server that is killed before it answered (the 30-minute soak, seed 0: a
    second kill 1.4 s after a resume ended the group process with exit 2). For up to
    ``timeout`` and then ``reconnect_s``; a refusal is final."""
    deadline = asyncio.get_running_loop().time() + max(timeout, cfg.reconnect_s)
    drops = 0
    while True:
        left = deadline - asyncio.get_running_loop().time()
        try:
            return await _register(cfg, gs, address, max(left, 1.0))
        except DroppedWaiting as exc:  # a refusal, a TLS or secret error stays final
            if asyncio.get_running_loop().time() >= deadline:
                raise
            if announce:
                print(f"minips group: the global server dropped this group server while it "
                      f"{waiting} ({exc}); registering again for up to {left:.0f} s",
                      flush=True)
            drops += 1  # a server that drops each registration is not hammered
            await asyncio.sleep(transport.delay(drops))


async def serve_group(cfg: GroupConfig, *, announce: bool = True) -> GroupServer:
    """Listen, register with the global server, take the group it assigns; serve until done,
    reconnecting to the global server when it is lost."""
    check_bind(cfg.host, cfg.token, cfg.insecure)
    gs = GroupServer(-1, RunConfig(), None, None)
    gs.report_events = True  # its workers' links and leases, to the global server's console
    port = await gs.serve(cfg.host, cfg.port, cfg.token, server_ssl(cfg.tls_cert, cfg.tls_key))
    # a wildcard host is replaced by the global server (sessions.group_address)
    address = format_address(cfg.advertise_host or cfg.host, port)
    if announce:
        print(f"minips group listening on {address}, registering with "
              f"{cfg.server_host}:{cfg.server_port}; waiting for the grouping", flush=True)
    link = await _register_again(cfg, gs, address, cfg.connect_timeout_s, announce)
    said = asyncio.get_running_loop().time()
    try:
        # all workers gone is not the end: they may rejoin
        while True:
            if gs.core.finished and gs.core.done:
                # the final flush went out: its reply is in (or it failed and is due again)
                # before this process closes, else the global server merged samples this
                # group's record never shows, or a cancelled send lost them
                await gs.settle()
                if gs.core.finished:
                    break
            if link.closed.is_set():
                gs.log("global_lost")
                link = await _register_again(cfg, gs, address, cfg.reconnect_s, announce,
                                             "registered again")
                gs.log("global_back")
            await asyncio.sleep(POLL_S)
            if announce and asyncio.get_running_loop().time() - said >= STATUS_EVERY_S:
                said = asyncio.get_running_loop().time()
                print(_status(gs), flush=True)
    finally:
        link.reader.cancel()
        await gs.close()
        await link.ch.close(leave="done")
    return gs


def _status(gs: GroupServer) -> str:
    """'minips group 1: 3 workers live, clocks 40..43, 162 pushes, 41 exchanges'."""
    core = gs.core
    table = core.table
    clocks = (f"clocks {table.min_clock()}..{table.max_clock()}" if len(table)
              else "no worker live")
    return (f"minips group {core.group}: {len(table)} workers live, {clocks}, "
            f"{core.counters['pushes']} pushes, {core.xchg.seq} exchanges")


def run_group_process(cfg: GroupConfig) -> None:
    """`minips group`: register with the global server, then serve the assigned workers."""
    transport.install_uvloop()
    asyncio.run(serve_group(cfg))


@dataclass
class GroupConfig:
    """A group server running as its own process (`minips group`)."""

    server_host: str = "127.0.0.1"  # global server address
    server_port: int = 7070  # global server port
    host: str = "127.0.0.1"  # listen address for this group's workers
    port: int = 7071  # listen port; 0 = any free port
    # host told to workers; None: ``host``, or, when that is a wildcard, the address the global
    # server sees this process connect from
    advertise_host: str | None = None
    token: str = ""  # shared secret (MINIPS_TOKEN)
    tls_cert: str | None = None  # PEM certificate to serve workers with
    tls_key: str | None = None  # key for tls_cert
    tls_ca: str | None = None  # CA file to verify the global server; None = plain TCP
    run_dir: str = "runs/group"  # metrics directory
    connect_timeout_s: float = 10.0  # give up on an unreachable global server after this
    reconnect_s: float = 120.0  # how long to keep trying when the global server is lost
    insecure: bool = False  # allow a non-loopback listen address without a secret
