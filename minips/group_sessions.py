"""The global server's sessions with external group servers (`minips group` processes).

A group process connects as role ``group`` before the grouping and waits in ``pending_groups``;
``external_group`` hands it a group (ASSIGN). The session is then: PULL -> GLOBAL_WEIGHTS (the
initial weights, ``members``), and EXCHANGE(delta, counters) -> EXCHANGE_REPLY (the merged
global weights, or with a sparse exchange the entries of the group's copy to set: replica.py)
until LEAVE. A PULL resets the server's replica of the group's copy to the weights it answers.
A group process that connects after the grouping — restarted, or
reconnecting to a restarted global server — adopts a group whose server is gone, its own first.

Invariant: a group has at most one connected group process (``GroupHandle.ch``); a merge that
repeats the last (session, seq) of its group is answered without merging (``GlobalServer.merge``).
A group process's connection that carries no bytes (not even HEARTBEAT) for ``lease_s`` is
closed: its group counts as lost, free for a replacement to adopt; when none comes within
``REHOME_LEASES`` leases, its workers move to the live groups nearest in speed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Any

from minips import protocol, sparse, validation
from minips.config import reachable
from minips.errors import ConfigError
from minips.roster import GroupHandle

if TYPE_CHECKING:
    from minips.server import GlobalServer

__all__ = ["external_group", "group_session"]

log = logging.getLogger("minips.server")

PENDING_POLL_S = 0.1  # how often the grouping looks for a group process that has not come yet
REHOME_LEASES = 3  # a lost group with no replacement after this many leases: move its workers


async def external_group(srv: GlobalServer, g: int, members: list[int]) -> GroupHandle:
    """Give group ``g`` to the next waiting group process (``ConfigError`` when none comes)."""
    deadline = time.monotonic() + srv.cfg.calib_timeout_s
    while not srv.pending_groups:
        if time.monotonic() > deadline:
            raise ConfigError(f"no external group server connected for group {g}")
        await asyncio.sleep(PENDING_POLL_S)
    ch = srv.pending_groups.pop(0)
    handle = GroupHandle(g, _address(ch), members, srv.roster.ratio_of(g), ch=ch)
    await ch.send(srv.assign_msg(handle))
    return handle


def _initial(msg: Any, handle: GroupHandle) -> Any:
    """GLOBAL_WEIGHTS for a group process's PULL, naming the exchange the server merged last
    (unsaved.py)."""
    return dataclasses.replace(msg, last_exchange=list(handle.last_exchange))


def _reply(msg: Any, handle: GroupHandle) -> Any:
    """EXCHANGE_REPLY from the global weights message ``msg``: the merged weights (or the
    entries to set) and the last exchange in each of the last two checkpoint snapshots."""
    return protocol.ExchangeReply(
        version=msg.version, done=msg.done, samples=msg.samples,
        saved_exchanges=[list(key) for key in handle.snapshots], encoding=msg.encoding,
        codec=msg.codec, buffers=msg.buffers)


def _address(ch: Any) -> str:
    """Where workers reach a group process: the address in its HELLO, a wildcard host replaced
    by the host this server sees it connect from."""
    return reachable(ch.peer_hello.address, ch.peername[0])


async def group_session(srv: GlobalServer, ch: Any) -> None:
    """One group process's connection, until it leaves, is lost, or is silent for lease_s."""
    ch.start_silence_limit(srv.run.lease_s)  # group processes send HEARTBEAT
    if not srv.groups_opened.is_set():
        srv.pending_groups.append(ch)
        await srv.groups_opened.wait()
    handle = next((h for h in srv.groups.values() if h.ch is ch), None)
    if handle is None:
        handle = await _adopt(srv, ch)
    try:
        while handle is not None and not await _on_message(srv, ch, handle):
            pass
    finally:
        if handle is not None and handle.ch is ch:
            handle.ch = None
            srv.log("group_lost", group=handle.id)
            if not (handle.final or srv.done):  # not the end of the run
                wait = REHOME_LEASES * srv.run.lease_s
                log.warning("group %d: its group server %s is gone (%s); a new `minips group "
                            "--connect` to this server takes the group over, else its workers "
                            "move to another group in %.0f s", handle.id, handle.address,
                            ch.error or "connection closed", wait)
                srv.spawn(_rehome_later(srv, handle, wait))


async def _rehome_later(srv: GlobalServer, handle: GroupHandle, wait: float) -> None:
    """No group process took ``handle`` over within ``wait`` s: send its workers to the live
    groups nearest in speed; the empty group no longer holds the end of the run."""
    await asyncio.sleep(wait)
    if handle.ch is not None or srv.done:  # adopted meanwhile, or over
        return
    live = {g for g, h in srv.groups.items() if h.ch is not None}
    moved = srv.roster.rehome(handle.id, live)
    if not moved:
        return  # no live group: a replacement may still come
    handle.final = True
    srv.log("rehomed", group=handle.id, moved={str(w): g for w, g in moved.items()})
    log.warning("group %d: no group server took it over in %.0f s; its workers %s moved to "
                "group(s) %s", handle.id, wait, sorted(moved), sorted(set(moved.values())))
    for w, g in moved.items():
        await srv.assign(srv.workers[w], g)


async def _adopt(srv: GlobalServer, ch: Any) -> GroupHandle | None:
    """Give a (re)started group process the group whose server is gone (its own first)."""
    orphans = sorted((h for h in srv.groups.values() if h.ch is None and h.server is None),
                     key=lambda h: h.id != ch.peer_hello.group)
    if not orphans:
        await ch.send_error("refused", f"every one of the run's {len(srv.groups)} groups "
                            "already has a group server")
        return None
    handle = orphans[0]
    handle.ch, handle.address = ch, _address(ch)
    await ch.send(srv.assign_msg(handle))
    srv.log("group_adopted", group=handle.id, address=handle.address)
    for w in handle.members:
        srv.spawn(srv.assign(srv.workers[w], handle.id))
    return handle


async def _on_message(srv: GlobalServer, ch: Any, handle: GroupHandle) -> bool:
    """Handle one message of a group process; True when it left."""
    msg = await ch.recv()
    if isinstance(msg, protocol.Pull):  # the group takes these weights whole (replica.py)
        assert srv.weights is not None
        weights = srv.weights.copy()  # what goes out: merges may land before it is written
        srv.replica(handle.id).reset(weights)
        await ch.send(_initial(srv.weights_message(weights, members=handle.members), handle))
    elif isinstance(msg, protocol.Exchange):
        assert srv.weights is not None
        delta = sparse.decode_gradient(msg.encoding, msg.codec, msg.buffers, srv.weights.size)
        res = srv.merge(handle.id, delta, msg.info)
        await ch.send(_reply(srv.weights_message(res.weights), handle))
    elif isinstance(msg, protocol.Leave):
        handle.final = True
        srv.check_budget()
        return True
    else:
        raise validation.unexpected(msg, "group server")
    return False
