"""How a global server's run ends: budget spent, every worker gone, or the model diverged.

A run is over when its budget is spent (epochs, wall time: ``GlobalServer.finish``) or when
every group has flushed its final delta because its last worker left. The second is a success
only when nothing is left to train for (the workers' ``max_steps`` cap, or no budget at all).
With budget left, every worker is gone at once only for a while (stopped, partitioned past the
lease, restarted), so the server waits ``rejoin_wait_s`` for them, saying so on its console;
a group's first non-final merge means they are back. If none comes back in time, the run ends
with ``failure`` set and `minips server` exits 3, naming the cause.

A merge whose delta is not finite (NaN or inf: the model diverged) is not applied; the run
ends at once with ``failure`` set, and every connected worker gets ERROR "diverged".

Invariant: ``failure`` is "" for a run that ended normally, else one line saying why not.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING, Any

from minips import protocol

if TYPE_CHECKING:
    from minips.server import GlobalServer

__all__ = ["budget_left", "every_group_final", "fail", "REJOIN_POLL_S"]

log = logging.getLogger("minips.server")

REJOIN_POLL_S = 0.5  # how often the wait for workers looks whether a group is training again


def budget_left(srv: GlobalServer) -> str:
    """What is left of the budget ("" when it is spent, or when the workers end the run: a
    ``max_steps`` cap or no budget at all)."""
    run = srv.run
    if run.max_steps > 0:
        return ""
    if run.epochs > 0 and srv.samples < run.epochs * srv.train_size:
        return f"{srv.samples:,} of {int(run.epochs * srv.train_size):,} samples"
    trained = srv.trained_s()
    if run.wall_s > 0 and trained < run.wall_s:
        return f"{trained:.0f} of {run.wall_s:.0f} s of training"
    return ""


def every_group_final(srv: GlobalServer) -> None:
    """Every group flushed its final delta: end the run, or wait for the workers to rejoin."""
    left = budget_left(srv)
    if not left:
        srv.finish("workers left")
        srv.finished.set()
    elif srv.rejoin is None or srv.rejoin.done():
        srv.rejoin = srv.spawn(_wait_for_workers(srv, left))


async def _wait_for_workers(srv: GlobalServer, left: str) -> None:
    wait = srv.cfg.rejoin_wait_s
    srv.log("waiting_for_workers", wait_s=wait, left=left)
    log.warning("every worker is gone with budget left (%s); waiting up to %.0f s for them to "
                "rejoin (--rejoin-wait)", left, wait)
    deadline = asyncio.get_running_loop().time() + wait
    while not srv.done and all(h.final for h in srv.groups.values()):
        if asyncio.get_running_loop().time() >= deadline:
            fail(srv, "workers_gone", f"the run ended short of its budget: every worker was "
                 f"gone for {wait:.0f} s with {left} left (--rejoin-wait)")
            return
        await asyncio.sleep(REJOIN_POLL_S)
    if not srv.done:
        srv.log("workers_back")
        log.warning("workers are back; training goes on")


def fail(srv: GlobalServer, code: str, reason: str) -> None:
    """End the run now because of ``reason`` (kept in ``srv.failure``); tell the workers."""
    if srv.failure:
        return
    srv.failure = reason
    srv.log("failed", code=code, reason=reason)
    log.error("%s", reason)
    for entry in srv.workers.values():
        if entry.ch is not None:
            srv.spawn(_send_error(entry.ch, code, reason))
    srv.finish(code)
    srv.finished.set()


async def _send_error(ch: Any, code: str, reason: str) -> None:
    with contextlib.suppress(ConnectionError, OSError):
        await ch.send(protocol.Error(code=code, reason=reason))
