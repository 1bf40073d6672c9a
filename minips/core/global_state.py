"""What a global checkpoint holds and how its parts come back (numpy, sans-IO, no files).

``GlobalCore.checkpoint_state`` / ``load_state_dict`` use these; ``server_checkpoint.py`` writes and
reads the file (``checkpoint.py``: atomic, no pickle). A snapshot is taken in one call (no
``await`` inside), so the global weights, the counters and each in-process group's weights,
optimizer state and clocks are consistent with each other; arrays are copies. The last merged
exchange of each group (session, seq) is saved too, so a group process that resends an exchange
the restored server already holds does not get it merged twice, and so that it can send again
those the checkpoint lacks: each snapshot records it in ``GroupHandle.snapshots``, which the
replies to group processes name (unsaved.py). The global server's copies of what each group
holds of the weights (``replica.py``) are not saved: after a resume each group's first answer is
dense (a group process's PULL resets it).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from minips.core.roster import GroupHandle, Roster, WorkerEntry
from minips.run import checkpoint
from minips.run.config import RunConfig

__all__ = ["snapshot", "restore_workers", "restore_group"]


def snapshot(run: RunConfig, roster: Roster, weights: np.ndarray, *, version: int,
             samples: int, saved_at: float, train_s: float) -> dict[str, Any]:
    """The checkpoint state now (see the module docstring); marks each group's snapshots."""
    for h in roster.groups.values():  # replies to group processes name these (unsaved.py)
        h.snapshots = [h.snapshots[-1], h.last_exchange]
    groups = {g: {"members": list(h.members), "ratio": h.ratio, "step_time": h.step_time,
                  "merges": h.merges, "last_exchange": list(h.last_exchange),
                  "state": h.peer.state_dict()}
              for g, h in roster.groups.items()}
    workers = {w: {"group": e.group, "step_time": e.step_time, "clock": e.clock}
               for w, e in roster.workers.items()}
    return {"format": checkpoint.FORMAT, "saved_at": saved_at, "t0": run.t0,
            "fingerprint": checkpoint.fingerprint(run.to_info(), weights.size),
            "train_s": train_s, "weights": weights.copy(), "version": version,
            "samples": samples, "workers": workers, "groups": groups}


def restore_workers(run: RunConfig, roster: Roster, state: dict[str, Any]) -> np.ndarray:
    """The checkpoint's workers, each with its group and last speed (none connected yet); return
    its weights. ``ConfigError`` when it belongs to another model or config."""
    weights = np.asarray(state["weights"], dtype=np.float32)
    checkpoint.check_compatible(state, run.to_info(), weights.size)
    for key, e in state["workers"].items():
        roster.workers[int(key)] = WorkerEntry(int(key), step_time=e["step_time"],
                                               clock=e["clock"], group=e["group"])
    return weights


def restore_group(h: GroupHandle, saved: dict[str, Any]) -> None:
    """Group ``h`` (opened again, in-process or waiting for its group process) as saved."""
    if saved["state"] is not None:
        h.peer.load_state_dict(saved["state"])
    h.ratio, h.step_time, h.merges = saved["ratio"], saved["step_time"], saved["merges"]
    session, seq = saved.get("last_exchange", (-1, -1))  # absent in older checkpoints
    h.last_exchange = (int(session), int(seq))
    h.snapshots = [h.last_exchange] * 2  # the checkpoint file is the one snapshot there is
