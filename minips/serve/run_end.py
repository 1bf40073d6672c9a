"""How a global server's run ends: budget spent, every worker gone, or the model diverged.

The rules are the core's (``GlobalCore.budget_left``, the ``AllFinal`` and ``Fail`` actions);
this module is the asyncio side: the wait, the console, the ERRORs.

A run is over when its budget is spent (epochs, wall time: ``GlobalCore.finish``) or when
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
import logging

from minips.serve.server_io import ServerIO, send_quiet
from minips.wire import messages

__all__ = ["every_group_final", "fail", "REJOIN_POLL_S"]

log = logging.getLogger("minips.server")

REJOIN_POLL_S = 0.5  # how often the wait for workers looks whether a group is training again


def every_group_final(io: ServerIO) -> None:
    """Every group flushed its final delta: end the run, or wait for the workers to rejoin."""
    left = io.core.budget_left()
    if not left:
        io.perform(io.core.finish("workers left"))
        io.finished.set()
    elif io.rejoin is None or io.rejoin.done():
        io.rejoin = io.spawn(_wait_for_workers(io, left))


async def _wait_for_workers(io: ServerIO, left: str) -> None:
    core, wait = io.core, io.cfg.rejoin_wait_s
    core.log("waiting_for_workers", wait_s=wait, left=left)
    log.warning("every worker is gone with budget left (%s); waiting up to %.0f s for them to "
                "rejoin (--rejoin-wait)", left, wait)
    deadline = asyncio.get_running_loop().time() + wait
    while not core.done and all(h.final for h in core.groups.values()):
        if asyncio.get_running_loop().time() >= deadline:
            fail(io, "workers_gone", f"the run ended short of its budget: every worker was "
                 f"gone for {wait:.0f} s with {left} left (--rejoin-wait)")
            return
        await asyncio.sleep(REJOIN_POLL_S)
    if not core.done:
        core.log("workers_back")
        log.warning("workers are back; training goes on")


def fail(io: ServerIO, code: str, reason: str) -> None:
    """End the run now because of ``reason`` (kept in ``core.failure``); tell the workers."""
    core = io.core
    if core.failure:
        return
    core.failure = reason
    core.log("failed", code=code, reason=reason)
    log.error("%s", reason)
    for entry in core.workers.values():
        if entry.ch is not None:
            io.spawn(send_quiet(entry.ch, messages.Error(code=code, reason=reason)))
    io.perform(core.finish(code))
    io.finished.set()
