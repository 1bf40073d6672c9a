"""The global server's grouping IO (asyncio): opening the groups, placing a late worker, moving
workers, delivering GDTopK's ratios, the budgets' timers, reopening a checkpoint's groups.

The decisions are the core's (``GlobalCore.on_stats`` / ``calib_timeout`` return
``FormGroups``, ``PlaceLate``, ``Regroup``, ``SendRatios``; ``roster.py`` draws the groups);
these functions carry them out over ``server_io.ServerIO``, whose ``open_group`` (the
server's) starts a group's server in-process or hands the group to a `minips group` process.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from minips.core import global_core
from minips.core.roster import GroupHandle, WorkerEntry
from minips.serve import server_checkpoint
from minips.serve.server_io import ServerIO

__all__ = ["form_groups", "place_late", "regroup", "send_ratios", "start_budgets", "reopen"]


async def form_groups(io: ServerIO) -> None:
    """The first grouping: open each group, tell every worker its group, start the budgets."""
    core = io.core
    await io.weights_ready.wait()
    assignment = core.roster.first_assignment()
    core.roster.first_ratios(assignment, time.monotonic())  # open_group takes ratio_of(g)
    for g in sorted(set(assignment.values())):
        members = sorted(w for w, gg in assignment.items() if gg == g)
        core.groups[g] = await io.open_group(g, members)
    core.roster.refresh_step_times()
    core.started_training = time.time()
    for w, g in assignment.items():  # before groups_opened: place_late skips them
        core.workers[w].group = g
    core.log("groups", assignment={str(w): g for w, g in assignment.items()},
             ratios={str(g): h.ratio for g, h in core.groups.items()},
             addresses={str(g): h.address for g, h in core.groups.items()})
    io.groups_opened.set()
    for w, g in assignment.items():
        await io.assign(core.workers[w], g)
    start_budgets(io)


def start_budgets(io: ServerIO) -> None:
    """The wall-time budget's timer and the periodic checkpoint, once the groups exist."""
    if io.core.run.wall_s > 0:
        io.spawn(_wall_budget(io))
    if io.cfg.checkpoint_every_s > 0:
        io.spawn(server_checkpoint.save_loop(io))


async def _wall_budget(io: ServerIO) -> None:
    await asyncio.sleep(max(0.0, io.core.run.wall_s - io.core.trained_s()))
    io.perform(io.core.finish("wall time"))


async def place_late(io: ServerIO, entry: WorkerEntry) -> None:
    """A worker whose first STATS came after the groups were drawn up: once they are open,
    the group nearest its speed."""
    await io.groups_opened.wait()
    if entry.group < 0:
        await io.assign(entry, io.core.roster.place_late(entry))


async def regroup(io: ServerIO, assignment: dict[int, int]) -> None:
    """Speeds drifted (``grouping.Regrouper`` said so): move workers, open new groups."""
    core = io.core
    moved = core.roster.moved(assignment)
    for g in sorted(set(moved.values()) - set(core.groups)):
        core.groups[g] = await io.open_group(g, [])
    for w, g in moved.items():
        core.roster.move(w, g)
    core.log("regroup", moved={str(w): g for w, g in moved.items()})
    io.perform(core.regrouped(time.monotonic()))
    for w, g in moved.items():
        await io.assign(core.workers[w], g)


def send_ratios(io: ServerIO, new: dict[int, float]) -> None:
    """GDTopK's new ratios (already in the groups' peers): to the group servers that do not
    read them in-process (a new ASSIGN), and to every worker of those groups."""
    core = io.core
    for g in new:
        io.spawn(core.groups[g].peer.send_ratio(core.assign_message(core.groups[g])))
    for entry in core.workers.values():
        if entry.group in new:
            io.spawn(io.assign(entry, entry.group))


async def reopen(io: ServerIO, state: dict[str, Any]) -> None:
    """Open a checkpoint's groups again (the core took the rest: ``GlobalCore.load_state_dict``):
    in-process ones with their saved state; a group process adopts its group when it
    connects."""
    core = io.core
    core.grouped = True
    for key, saved in sorted(state["groups"].items(), key=lambda kv: int(kv[0])):
        g, members = int(key), list(saved["members"])
        h = (GroupHandle(g, "", members) if io.cfg.external_groups
             else await io.open_group(g, members))
        global_core.restore_group(h, saved)
        core.groups[g] = h
    core.roster.restore_regrouper()
    core.started_training = time.time() - float(state["train_s"])
    io.groups_opened.set()
    core.log("resumed", checkpoint=str(server_checkpoint.path_of(io.cfg)),
             saved_at=state["saved_at"])
    start_budgets(io)
