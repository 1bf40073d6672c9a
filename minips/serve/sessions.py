"""The global server's sessions (asyncio): workers' control channels, evaluators, and external
group servers (`minips group` processes).

A worker's control session carries STATS (calibration at clock 0, then its measured speed every
second), an optional INIT_WEIGHTS with its initial weights (when the server had none yet:
WELCOME said ``need_init``; the first one to arrive is taken; at most one per session, dense
float32: a second one, or another encoding, is ERROR ``invalid`` and the connection is closed)
and LEAVE; the server answers with ASSIGN when the worker's group or ratio is set or changes.
An evaluator PULLs the global weights (GLOBAL_WEIGHTS) every few seconds until the run is over.

A group process connects as role ``group`` before the grouping and waits in ``pending_groups``;
``external_group`` hands it a group (ASSIGN) behind a ``RemoteGroup`` peer (``peers.py``).
The session is then: PULL -> GLOBAL_WEIGHTS (the initial weights, ``members``), and
EXCHANGE(delta, counters) -> EXCHANGE_REPLY (the merged global weights, or with a sparse exchange
the entries of the group's copy to set: exchange.py) until LEAVE. An EXCHANGE before the
connection's first PULL is refused (ERROR ``order``): the server's record of what the group
holds of the weights starts with that PULL. Its counters are bounded per message
(``conversation.check_exchange``) and for the run (``merge.Merger.check_counters``). A group process
that connects after the grouping — restarted, or reconnecting to a restarted global server —
adopts a group no server serves, its own first (``adopt``); one whose connection closes
before the grouping leaves ``pending_groups``.

Which message may come when is the conversation's table (``wire/conversation.py``: each
session holds one ``Conversation`` and feeds it every message it reads); what a message does is
the core's rule (``GlobalCore.on_stats`` / ``on_initial`` / ``on_exchange`` / ``group_pull`` /
``group_left``). These sessions read the channel, feed the conversation, hand the actions the
core returns to the server and send its ``GroupReply`` back to the group that asked (``Shell``: what
they use of ``server.GlobalServer``, which imports this module, not the other way round).

Invariants: a worker's and an evaluator's session take one message per turn of the event loop
and read the next only once the last is handled, so a peer that floods waits on TCP
(channel.py) while the others are served.
A worker has at most one control channel (a new connection with its id replaces
the old one, which gets ERROR ``replaced``); one cut for a protocol violation leaves its group's
SSP clocks as after a LEAVE unless it is connected to its group server (``GroupPeer.forget``), so a
client in a reconnect loop never holds its group back; STATS clocks are not compared (they
count steps in the worker's current group and start again after a move); the initial weights
are taken once, dense, with a bounded size. A group has at most one connected group process (its
``RemoteGroup``); an exchange whose seq is not above the last merged one of its session is
answered without merging (``GlobalCore.merge``). A group process's HELLO address is HOST:PORT
(else REFUSE, ``endpoints.check_group_address``); a wildcard host is replaced by the host it
connects from, and the address workers are sent is logged (``group_address``). A group
process's connection that carries no bytes (not even HEARTBEAT) for ``lease_s`` is closed: its
group counts as lost, free for a replacement to adopt; when none comes within ``REHOME_LEASES``
leases, its workers move to the live groups nearest in speed.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

import numpy as np

from minips import sparse
from minips.core.actions import AllFinal, GlobalAction, GroupReply, Rehomed, reply
from minips.core.global_core import GlobalCore
from minips.core.roster import GroupHandle
from minips.errors import ConfigError, RemoteProtocolError
from minips.net.channel import Channel
from minips.net.endpoints import reachable
from minips.serve import validation
from minips.serve.peers import GroupPeer, NoGroup
from minips.wire import control, conversation, frames, messages
from minips.wire.conversation import Conversation, Role

__all__ = ["Shell", "send_quiet", "worker_session", "initial_weights", "evaluator_session",
           "RemoteGroup", "external_group", "group_session", "adopt", "awaited", "group_address",
           "PENDING_POLL_S", "REHOME_LEASES"]

log = logging.getLogger("minips.server")

PENDING_POLL_S = 0.1  # how often the grouping looks for a group process that has not come yet
REHOME_LEASES = 3  # a lost group with no replacement after this many leases: move its workers
ADOPTION_POLL_S = 0.25  # how often a resumed server looks whether a group process adopted a group

Spawn = Callable[[Coroutine[Any, Any, Any]], "asyncio.Task[Any]"]


class Shell(Protocol):
    """What the sessions use of the global server (``server.GlobalServer``)."""

    core: GlobalCore  # the rules
    controls: dict[int, Channel]  # worker id -> its control channel
    peers: dict[int, GroupPeer]  # group id -> its server
    pending_groups: list[Channel]  # group processes not given a group yet
    rejected: collections.Counter[str]  # ERRORs sent, by code
    weights_ready: asyncio.Event  # the global weights exist
    groups_opened: asyncio.Event  # every group of the grouping has its handle
    finished: asyncio.Event  # the run is over
    evaluated_final: asyncio.Event  # the evaluator got the final weights

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Run ``coro`` in the background (the server cancels what is left on close)."""

    def perform(self, actions: list[GlobalAction]) -> None:
        """Do what the core decided, in order."""

    def peer(self, g: int) -> GroupPeer:
        """Group ``g``'s server (``NoGroup`` when none is known)."""

    def count_exchange(self, g: int, up: int, down: int) -> None:
        """Group ``g``'s exchange took ``up`` bytes on the wire and its reply ``down``."""

    def traffic(self, g: int | None = None) -> dict[str, int]:
        """Worker <-> group bytes: the run's (``bytes_up``, ``bytes_down``), and group ``g``'s
        own (``bytes_in``, ``bytes_out``)."""

    async def tell_group(self, w: int) -> None:
        """Send worker ``w`` its group (ASSIGN), if it is connected and the group is served."""

    def scored(self, score: control.Score) -> None:
        """An evaluator's SCORE: into the run's ledger, its record and the console."""


async def send_quiet(ch: Channel, msg: messages.Message) -> None:
    """Send ``msg``; a connection gone meanwhile is no error here."""
    with contextlib.suppress(ConnectionError, OSError):
        await ch.send(msg)


# -- workers and evaluators ----------------------------------------------------------------

async def worker_session(srv: Shell, ch: Channel, w: int) -> None:
    """Worker ``w``'s control channel, until it leaves or is lost."""
    core = srv.core
    old = srv.controls.get(w)
    if old is not None:  # the newest connection with an id wins; the old one is told why
        srv.spawn(validation.replace(old, w, srv.rejected, "global server"))
    srv.controls[w] = ch
    srv.perform(core.worker_joined(w))
    conv = Conversation(Role.CONTROL)  # INIT_WEIGHTS once, dense f32
    try:
        if core.workers[w].group >= 0:  # a reconnect after grouping: tell it its group again
            await srv.tell_group(w)
        while not core.workers[w].left:
            # one message per turn: a peer with many queued (a flood) takes turns with the rest,
            # and its next message is read only once this one is handled (as serve/group.py)
            await asyncio.sleep(0)
            msg = await ch.recv()
            conv.receive(msg)
            if isinstance(msg, messages.Pull):  # calibration: the link probe (roster.py)
                await _probe_answer(srv, ch, w)
            else:
                _on_control(srv, w, msg)
    except RemoteProtocolError:
        if (g := core.workers[w].group) >= 0:  # out of its group's clocks, as after a LEAVE
            srv.peer(g).forget(w)
        raise
    finally:
        if srv.controls.get(w) is ch:
            del srv.controls[w]
            srv.perform(core.worker_gone(w))


def _on_control(srv: Shell, w: int, msg: messages.Message) -> None:
    """Handle one control message (one the conversation let pass: STATS, INIT_WEIGHTS, LEAVE,
    the link probe's PUSH)."""
    if isinstance(msg, control.Stats):
        conversation.check_stats(msg)
        srv.perform(srv.core.on_stats(w, msg, time.monotonic()))
    elif isinstance(msg, messages.InitWeights):
        srv.perform(srv.core.on_initial(initial_weights(msg)))
    elif isinstance(msg, control.Leave):
        srv.perform(srv.core.worker_leaving(w, msg.reason))
    elif isinstance(msg, messages.Push):  # the link probe's upload: timed, its payload dropped
        srv.perform(srv.core.probe_pushed(w, time.monotonic()))


async def _probe_answer(srv: Shell, ch: Channel, w: int) -> None:
    """The link probe's PULL: the global weights whole, timed from when they go out (a wait for
    the first initial weights is no part of the worker's link)."""
    await srv.weights_ready.wait()
    srv.perform(srv.core.probe_pulled(w, time.monotonic()))
    await ch.send(srv.core.weights_message(traffic=srv.traffic()))


def initial_weights(msg: messages.InitWeights) -> np.ndarray:
    """(n,) float32 initial weights a worker sent (the server was started without --init); their
    size is checked by the message (``messages.MAX_PARAMS``), their encoding (dense float32) by
    the conversation before decoding."""
    w = sparse.decode_vector(msg.payload, msg.size)
    assert isinstance(w, np.ndarray)  # dense-f32 decodes to an array
    return w.astype(np.float32, copy=False)


async def evaluator_session(srv: Shell, ch: Channel) -> None:
    """PULL -> WEIGHTS until LEAVE. A SCORE (the evaluator's accuracy on weights it pulled)
    goes to ``srv.scored``; the score of the final weights sets ``evaluated_final`` (an
    evaluator that sends none LEAVEs once it has them: the server waits for either)."""
    conv = Conversation(Role.EVALUATOR)
    while True:
        await asyncio.sleep(0)  # one message per turn, as on every channel
        msg = await ch.recv()
        conv.receive(msg)
        if conv.left:
            return
        if isinstance(msg, control.Score):
            srv.scored(msg)
            if msg.final:
                srv.evaluated_final.set()
            continue
        await srv.weights_ready.wait()
        if srv.core.done:  # budget spent: answer with the final weights (after the groups'
            await srv.finished.wait()  # final deltas, a bounded wait), marked done
        final = srv.core.done and srv.finished.is_set()
        await ch.send(srv.core.weights_message(final=final, traffic=srv.traffic()))


# -- group processes -------------------------------------------------------------------------

class RemoteGroup(NoGroup):
    """``GroupPeer`` of a `minips group` process: its channel; a new ratio goes as ASSIGN."""

    def __init__(self, ch: Channel, spawn: Spawn, traffic: dict[str, int] | None = None) -> None:
        super().__init__(traffic)
        self.ch, self.spawn = ch, spawn

    @property
    def connected(self) -> bool:
        return True

    def send_settings(self, assign: control.Assign) -> None:
        self.spawn(send_quiet(self.ch, assign))

    async def finish(self) -> None:
        await send_quiet(self.ch, control.Leave(reason="done"))


async def external_group(srv: Shell, g: int, members: list[int], wait_s: float) -> GroupHandle:
    """Give group ``g`` to the next waiting group process (``ConfigError`` when none comes
    within ``wait_s``)."""
    deadline = time.monotonic() + wait_s
    while not srv.pending_groups:
        if time.monotonic() > deadline:
            raise ConfigError(f"no external group server connected for group {g}")
        await asyncio.sleep(PENDING_POLL_S)
    ch = srv.pending_groups.pop(0)
    handle = GroupHandle(g, group_address(ch), members, ratio=srv.core.ratio_of(g), served=True)
    srv.peers[g] = RemoteGroup(ch, srv.spawn)
    await ch.send(srv.core.assign_message(handle))
    return handle


def group_address(ch: Channel) -> str:
    """Where workers reach a group process: the address in its HELLO (HOST:PORT, checked at
    admission), a wildcard host replaced by the host this server sees it connect from; logged
    when it is not the HELLO's own."""
    assert ch.peer_hello is not None
    said = ch.peer_hello.address
    address = reachable(said, ch.peername[0])
    if address != said:
        log.info("group server listening on %s is advertised to its workers as %s (the host "
                 "it connected from; minips group --advertise sets another)", said, address)
    return address


def _served_by(srv: Shell, handle: GroupHandle, ch: Channel) -> bool:
    peer = srv.peers.get(handle.id)
    return isinstance(peer, RemoteGroup) and peer.ch is ch


async def group_session(srv: Shell, ch: Channel) -> None:
    """One group process's connection, until it leaves, is lost, or is silent for lease_s."""
    core = srv.core
    ch.start_silence_limit(core.run.lease_s)  # group processes send HEARTBEAT
    if not srv.groups_opened.is_set() and not await _wait_for_grouping(srv, ch):
        return
    handle = next((h for h in core.groups.values() if _served_by(srv, h, ch)), None)
    if handle is None:
        handle = await adopt(srv, ch)
    conv = Conversation(Role.GROUP)  # PULL before EXCHANGE
    try:
        while handle is not None and not await _on_group_message(srv, ch, handle, conv):
            pass
    finally:
        if handle is not None and _served_by(srv, handle, ch):
            _lost(srv, ch, handle)


async def _wait_for_grouping(srv: Shell, ch: Channel) -> bool:
    """Wait in ``pending_groups`` until the groups are open; False when the connection closes
    first (it leaves the queue: no group is given to a process that is gone)."""
    srv.pending_groups.append(ch)
    opened = asyncio.ensure_future(srv.groups_opened.wait())
    closed = asyncio.ensure_future(ch.wait_closed())
    try:
        await asyncio.wait((opened, closed), return_when=asyncio.FIRST_COMPLETED)
    finally:
        opened.cancel()
        closed.cancel()
    if srv.groups_opened.is_set():
        return True
    if ch in srv.pending_groups:  # not when a grouping that failed had taken it already
        srv.pending_groups.remove(ch)
    return False


def _lost(srv: Shell, ch: Channel, handle: GroupHandle) -> None:
    """Group ``handle``'s process is gone (its last traffic known is kept): wait for a
    replacement, then move its workers."""
    srv.peers[handle.id] = NoGroup(srv.peer(handle.id).traffic())
    srv.perform(srv.core.group_lost(handle.id, final=handle.final))
    if handle.final or srv.core.done:  # the end of the run
        return
    wait = REHOME_LEASES * srv.core.run.lease_s
    others = any(g != handle.id and h.address for g, h in srv.core.groups.items())
    then = (f"else its workers move to another group in {wait:.0f} s" if others else
            "no other group can take its workers meanwhile")  # one group: nowhere to go
    log.warning("group %d: its group server %s is gone (%s); a new `minips group --connect` to "
                "this server takes the group over, %s", handle.id, handle.address,
                ch.error or "connection closed", then)
    srv.spawn(_rehome_later(srv, handle.id, wait))


async def awaited(srv: Shell, g: int) -> None:
    """Group ``g`` of a resumed server's checkpoint: its group process adopts it again as it
    reconnects (within its backoff's 2 s); if none has within ``REHOME_LEASES`` leases, the
    group is lost as a live one is (said, then its workers move after as long again). Once
    adopted, the group is watched as any served group is (``_lost``), not here."""
    wait = REHOME_LEASES * srv.core.run.lease_s
    if await _adopted_within(srv, g, wait) or srv.core.done:
        return
    srv.perform(srv.core.group_lost(g))
    others = any(h != g and srv.core.groups[h].served for h in srv.core.groups)
    log.warning("group %d: no group process came back to the resumed server in %.0f s; a new "
                "`minips group --connect` to this server takes the group over, %s", g, wait,
                f"else its workers move to another group in {wait:.0f} s" if others else
                "no other group can take its workers meanwhile")
    await _rehome_later(srv, g, wait)


async def _adopted_within(srv: Shell, g: int, wait: float) -> bool:
    """Whether a group process served group ``g`` at some point of the next ``wait`` s
    (looked at every ``ADOPTION_POLL_S``; False at once when the run is done)."""
    deadline = time.monotonic() + wait
    while not srv.core.groups[g].served:
        if srv.core.done or time.monotonic() >= deadline:
            return False
        await asyncio.sleep(ADOPTION_POLL_S)
    return True


async def _rehome_later(srv: Shell, g: int, wait: float) -> None:
    """No group process took group ``g`` over within ``wait`` s: send its workers to the live
    groups nearest in speed (``GlobalCore.rehome``); the empty group no longer holds the end of
    the run. A group adopted meanwhile and lost again waits anew, from that loss (``_lost``)."""
    if await _adopted_within(srv, g, wait):
        return
    actions = srv.core.rehome(g)
    srv.perform(actions)
    for a in actions:
        if isinstance(a, Rehomed):
            log.warning("group %d: no group server took it over in %.0f s; its workers %s moved "
                        "to group(s) %s", g, wait, sorted(a.moved), sorted(set(a.moved.values())))


async def adopt(srv: Shell, ch: Channel) -> GroupHandle | None:
    """Give a (re)started group process the group no server serves (its own first)."""
    core = srv.core
    assert ch.peer_hello is not None
    handle = core.roster.orphan(ch.peer_hello.group)
    if handle is None:
        await ch.send_error("refused", f"every one of the run's {len(core.groups)} groups "
                            "already has a group server")
        return None
    srv.peers[handle.id] = RemoteGroup(ch, srv.spawn, srv.peer(handle.id).traffic())
    srv.perform(core.group_served(handle.id, group_address(ch)))
    if not core.done and all(h.final for h in core.groups.values()):  # the run waits for its
        srv.perform([AllFinal()])  # workers: from now on (GlobalServer._every_group_final)
    await ch.send(core.assign_message(handle))
    for w in handle.members:
        srv.spawn(srv.tell_group(w))
    return handle


async def _answer(srv: Shell, ch: Channel, actions: list[GlobalAction]) -> None:
    """Carry out the core's ``actions``, then send its ``GroupReply`` to the group process on
    ``ch``."""
    srv.perform(actions)
    for a in actions:
        if isinstance(a, GroupReply) and isinstance(a.answer, (messages.ExchangeReply,
                                                          messages.GlobalWeights)):
            await ch.send(a.answer)


async def _on_group_message(srv: Shell, ch: Channel, handle: GroupHandle,
                            conv: Conversation) -> bool:
    """Handle one message of a group process; True when it left. An EXCHANGE follows the
    connection's first PULL (the server's mirror of what the group holds,
    ``exchange.GroupMirror``, starts there): the conversation refuses one before it, ERROR
    ``order``."""
    core, msg = srv.core, await ch.recv()
    conv.receive(msg)
    if isinstance(msg, messages.Pull):  # the group takes these weights whole (exchange.py)
        await _answer(srv, ch, core.group_pull(handle.id, time.monotonic(), srv.traffic()))
    elif isinstance(msg, messages.Exchange):
        conversation.check_exchange(msg)
        assert core.weights is not None
        delta = sparse.decode_vector(msg.payload, core.weights.size)
        # traffic counts of all its sessions, on top of what its earlier ones reported
        info = handle.across_sessions(msg.info, srv.peer(handle.id).traffic())
        actions = core.on_exchange(handle.id, delta, info, time.monotonic(),
                                   srv.traffic(handle.id))
        answer = reply(actions, messages.ExchangeReply)  # counted before the merge is logged
        srv.count_exchange(handle.id, frames.wire_size(msg), frames.wire_size(answer))
        await _answer(srv, ch, actions)
    elif isinstance(msg, control.Leave):
        srv.perform(core.group_left(handle.id))
        return True
    return False
