"""The global server's sessions with external group servers (`minips group` processes; asyncio).

A group process connects as role ``group`` before the grouping and waits in ``pending_groups``;
``external_group`` hands it a group (ASSIGN) behind a ``RemoteGroup`` peer (``roster.py``).
The session is then: PULL -> GLOBAL_WEIGHTS (the initial weights, ``members``), and
EXCHANGE(delta, counters) -> EXCHANGE_REPLY (the merged global weights, or with a sparse exchange
the entries of the group's copy to set: exchange.py) until LEAVE; the answers are the core's
(``GlobalCore.group_pull`` / ``group_push`` / ``group_left``). A group process that connects
after the grouping — restarted, or reconnecting to a restarted global server — adopts a group
no server serves, its own first.

Invariant: a group has at most one connected group process (its ``RemoteGroup``); a merge that
repeats the last (session, seq) of its group is answered without merging (``GlobalCore.merge``).
A group process's connection that carries no bytes (not even HEARTBEAT) for ``lease_s`` is
closed: its group counts as lost, free for a replacement to adopt; when none comes within
``REHOME_LEASES`` leases, its workers move to the live groups nearest in speed.
"""

from __future__ import annotations

import asyncio
import logging
import time

from minips import sparse
from minips.core.roster import GroupHandle, NoGroup
from minips.errors import ConfigError
from minips.net.channel import Channel
from minips.net.endpoints import reachable
from minips.serve import validation
from minips.serve.server_io import ServerIO, send_quiet
from minips.wire import messages

__all__ = ["RemoteGroup", "external_group", "group_session"]

log = logging.getLogger("minips.server")

PENDING_POLL_S = 0.1  # how often the grouping looks for a group process that has not come yet
REHOME_LEASES = 3  # a lost group with no replacement after this many leases: move its workers


class RemoteGroup(NoGroup):
    """``GroupPeer`` of a `minips group` process: its channel; a new ratio goes as ASSIGN."""

    def __init__(self, ch: Channel, ratio: float, traffic: dict[str, int] | None = None) -> None:
        super().__init__(ratio, traffic)
        self.ch = ch

    @property
    def connected(self) -> bool:
        return True

    async def send_ratio(self, assign: messages.Assign) -> None:
        await send_quiet(self.ch, assign)

    async def finish(self) -> None:
        await send_quiet(self.ch, messages.Leave(reason="done"))


async def external_group(io: ServerIO, g: int, members: list[int]) -> GroupHandle:
    """Give group ``g`` to the next waiting group process (``ConfigError`` when none comes)."""
    deadline = time.monotonic() + io.cfg.calib_timeout_s
    while not io.pending_groups:
        if time.monotonic() > deadline:
            raise ConfigError(f"no external group server connected for group {g}")
        await asyncio.sleep(PENDING_POLL_S)
    ch = io.pending_groups.pop(0)
    handle = GroupHandle(g, _address(ch), members,
                         peer=RemoteGroup(ch, io.core.roster.ratio_of(g)))
    await ch.send(io.core.assign_message(handle))
    return handle


def _address(ch: Channel) -> str:
    """Where workers reach a group process: the address in its HELLO, a wildcard host replaced
    by the host this server sees it connect from."""
    assert ch.peer_hello is not None
    return reachable(ch.peer_hello.address, ch.peername[0])


def _served_by(handle: GroupHandle, ch: Channel) -> bool:
    return isinstance(handle.peer, RemoteGroup) and handle.peer.ch is ch


async def group_session(io: ServerIO, ch: Channel) -> None:
    """One group process's connection, until it leaves, is lost, or is silent for lease_s."""
    core = io.core
    ch.start_silence_limit(core.run.lease_s)  # group processes send HEARTBEAT
    if not io.groups_opened.is_set():
        io.pending_groups.append(ch)
        await io.groups_opened.wait()
    handle = next((h for h in core.groups.values() if _served_by(h, ch)), None)
    if handle is None:
        handle = await _adopt(io, ch)
    try:
        while handle is not None and not await _on_message(io, ch, handle):
            pass
    finally:
        if handle is not None and _served_by(handle, ch):
            handle.peer = NoGroup(handle.ratio, handle.peer.traffic())
            core.log("group_lost", group=handle.id)
            if not (handle.final or core.done):  # not the end of the run
                wait = REHOME_LEASES * core.run.lease_s
                log.warning("group %d: its group server %s is gone (%s); a new `minips group "
                            "--connect` to this server takes the group over, else its workers "
                            "move to another group in %.0f s", handle.id, handle.address,
                            ch.error or "connection closed", wait)
                io.spawn(_rehome_later(io, handle, wait))


async def _rehome_later(io: ServerIO, handle: GroupHandle, wait: float) -> None:
    """No group process took ``handle`` over within ``wait`` s: send its workers to the live
    groups nearest in speed; the empty group no longer holds the end of the run."""
    await asyncio.sleep(wait)
    core = io.core
    if handle.peer.connected or core.done:  # adopted meanwhile, or over
        return
    moved = core.roster.rehome(handle.id)  # the empty group no longer holds the end of the run
    if not moved:
        return  # no live group: a replacement may still come
    core.log("rehomed", group=handle.id, moved={str(w): g for w, g in moved.items()})
    log.warning("group %d: no group server took it over in %.0f s; its workers %s moved to "
                "group(s) %s", handle.id, wait, sorted(moved), sorted(set(moved.values())))
    for w, g in moved.items():
        await io.assign(core.workers[w], g)


async def _adopt(io: ServerIO, ch: Channel) -> GroupHandle | None:
    """Give a (re)started group process the group no server serves (its own first)."""
    core = io.core
    assert ch.peer_hello is not None
    handle = core.roster.orphan(ch.peer_hello.group)
    if handle is None:
        await ch.send_error("refused", f"every one of the run's {len(core.groups)} groups "
                            "already has a group server")
        return None
    handle.peer = RemoteGroup(ch, handle.ratio, handle.peer.traffic())
    handle.address = _address(ch)
    await ch.send(core.assign_message(handle))
    core.log("group_adopted", group=handle.id, address=handle.address)
    for w in handle.members:
        io.spawn(io.assign(core.workers[w], handle.id))
    return handle


async def _on_message(io: ServerIO, ch: Channel, handle: GroupHandle) -> bool:
    """Handle one message of a group process; True when it left."""
    core, msg = io.core, await ch.recv()
    if isinstance(msg, messages.Pull):  # the group takes these weights whole (exchange.py)
        await ch.send(core.group_pull(handle.id))
    elif isinstance(msg, messages.Exchange):
        assert core.weights is not None
        delta = sparse.decode_vector(msg.encoding, msg.codec, msg.buffers, core.weights.size)
        reply = core.group_push(handle.id, delta, msg.info)
        io.perform(core.take_actions())
        await ch.send(reply)
    elif isinstance(msg, messages.Leave):
        io.perform(core.group_left(handle.id))
        return True
    else:
        raise validation.unexpected(msg, "group server")
    return False

