"""The global server's checkpoints: what a snapshot holds, how a resume rebuilds the server.

``checkpoint.py`` writes and reads the file (atomic, no pickle); this module decides what goes in
it and how ``GlobalServer`` takes it back. A snapshot is taken with no ``await`` inside, so the
global weights, the counters and each in-process group's weights, optimizer state and clocks are
consistent with each other; arrays are copies. The last merged exchange of each group (session,
seq) is saved too, so a group process that resends an exchange the restored server already holds
does not get it merged twice, and so that it can send again those the checkpoint lacks: each
snapshot records it in ``GroupHandle.snapshots``, which the replies to group processes name.
The global server's copies of what each group holds of the weights (``replica.py``) are not
saved: after a resume each group's first answer is dense (a group process's PULL resets it).
Failure handling: docs/operations.md.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from minips import checkpoint
from minips.roster import GroupHandle, WorkerEntry

if TYPE_CHECKING:
    from minips.server import GlobalServer

__all__ = ["path_of", "snapshot", "restore", "reopen", "save", "save_loop", "clean"]


def path_of(srv: GlobalServer) -> Path:
    """Where ``srv`` keeps its checkpoint (``--checkpoint`` or run_dir/checkpoint.npz)."""
    return Path(srv.cfg.checkpoint_path or Path(srv.cfg.run_dir) / "checkpoint.npz")


def clean(srv: GlobalServer) -> None:
    """Delete the temporary files of checkpoint writes that were killed midway."""
    removed = checkpoint.remove_stale_temps(path_of(srv))
    if removed:
        srv.log("checkpoint_temps_removed", files=[str(p) for p in removed])


def snapshot(srv: GlobalServer) -> dict[str, Any]:
    """The checkpoint state of ``srv`` now (see the module docstring)."""
    assert srv.weights is not None
    for h in srv.groups.values():  # replies to group processes name these (unsaved.py)
        h.snapshots = [h.snapshots[-1], h.last_exchange]
    groups = {g: {"members": list(h.members), "ratio": h.ratio, "step_time": h.step_time,
                  "merges": h.merges, "last_exchange": list(h.last_exchange),
                  "state": None if h.server is None else h.server.state_dict()}
              for g, h in srv.groups.items()}
    workers = {w: {"group": e.group, "step_time": e.step_time, "clock": e.clock}
               for w, e in srv.workers.items()}
    return {"format": checkpoint.FORMAT, "saved_at": time.time(), "t0": srv.run.t0,
            "fingerprint": checkpoint.fingerprint(srv.run.to_info(), srv.weights.size),
            "train_s": time.time() - srv.started_training, "weights": srv.weights.copy(),
            "version": srv.version, "samples": srv.samples, "workers": workers, "groups": groups}


def restore(srv: GlobalServer, state: dict[str, Any]) -> None:
    """Take ``state`` into ``srv`` before it starts; ``ConfigError`` when it belongs to another
    model or config. The groups are opened again by ``reopen`` once the server listens."""
    weights = np.asarray(state["weights"], dtype=np.float32)
    checkpoint.check_compatible(state, srv.run.to_info(), weights.size)
    srv.weights, srv.version, srv.samples = weights, state["version"], state["samples"]
    srv.weights_ready.set()
    for key, e in state["workers"].items():
        srv.workers[int(key)] = WorkerEntry(int(key), step_time=e["step_time"],
                                            clock=e["clock"], group=e["group"])


async def reopen(srv: GlobalServer, state: dict[str, Any]) -> None:
    """Open the checkpoint's groups again (in-process ones with their saved state)."""
    srv.grouped.set()
    for key, saved in sorted(state["groups"].items(), key=lambda kv: int(kv[0])):
        srv.groups[int(key)] = await _reopen_group(srv, int(key), saved)
    srv.roster.restore_regrouper()
    srv.started_training = time.time() - float(state["train_s"])
    srv.groups_opened.set()
    srv.log("resumed", checkpoint=str(path_of(srv)), saved_at=state["saved_at"])
    srv.start_budgets()


async def _reopen_group(srv: GlobalServer, g: int, saved: dict[str, Any]) -> GroupHandle:
    if srv.cfg.external_groups:  # a group process adopts it when it connects
        h = GroupHandle(g, "", list(saved["members"]), saved["ratio"])
    else:
        h = await srv.open_group(g, list(saved["members"]))
        if h.server is not None and saved["state"] is not None:
            h.server.load_state_dict(saved["state"])
    h.ratio, h.step_time, h.merges = saved["ratio"], saved["step_time"], saved["merges"]
    session, seq = saved.get("last_exchange", (-1, -1))  # absent in older checkpoints
    h.last_exchange = (int(session), int(seq))
    h.snapshots = [h.last_exchange] * 2  # the checkpoint file is the one snapshot there is
    return h


async def save_loop(srv: GlobalServer) -> None:
    """Checkpoint every ``checkpoint_every_s`` until the budget is spent."""
    while not srv.done:
        await asyncio.sleep(srv.cfg.checkpoint_every_s)
        await save(srv)


async def save(srv: GlobalServer) -> None:
    """Snapshot now, write it in a thread (the loop keeps serving), log its size."""
    t = time.monotonic()
    state = snapshot(srv)
    srv.saving = asyncio.ensure_future(asyncio.to_thread(checkpoint.save, path_of(srv), state))
    size = await asyncio.shield(srv.saving)
    srv.log("checkpoint", bytes=size, write_s=time.monotonic() - t)
