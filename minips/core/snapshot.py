"""A global server's checkpoint state, sans-IO: what a snapshot holds, taken in one call, and how
it comes back in parts (``restore_workers``, then the groups with ``restore_groups``);
``global_core.GlobalCore`` takes and restores it, ``server.GlobalServer`` writes and reads the
file (``record/checkpoint.py``: atomic, no pickle).

A snapshot is taken in one call (no ``await`` inside), so the global weights, the counters and
each in-process group's weights, optimizer state and clocks (the shell hands those in, with each
group's worker traffic: ``held``) are consistent with each other; arrays are copies. The last
merged exchange of each group (session, seq) is saved too, with the last merged seq of each of
its sessions (``replay.Merged``), so a group process that resends an exchange the restored
server already holds does not get it merged twice, and so that it can send again those the
checkpoint lacks: each snapshot records it in
``GroupHandle.snapshots``, which the replies to group processes name (``replay.Unsaved``). The
global server's mirrors of what each group holds of the weights (``exchange.GroupMirror``) are
not saved: after a resume each group's first answer is dense (a group process's PULL resets it).

Invariants: a snapshot is consistent (taken without an ``await``; arrays are copies); a
checkpoint of another model or config is refused (``check_compatible``, ``ConfigError`` naming
each field), and one written before a field was fingerprinted reads as that field's default.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from minips.core.config import RunConfig
from minips.core.replay import Merged
from minips.core.roster import GroupHandle, Roster, WorkerEntry
from minips.errors import ConfigError

__all__ = ["snapshot", "restore_workers", "restore_groups", "restore_group", "FORMAT",
           "FINGERPRINT_FIELDS", "fingerprint", "check_compatible"]


def snapshot(run: RunConfig, roster: Roster, weights: np.ndarray, *, version: int,
             samples: int, saved_at: float, train_s: float, merged: dict[int, Merged],
             held: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """The checkpoint state now (see the module docstring); marks each group's snapshots.
    ``held``: what the shell holds of each group, saved with it: its worker ``traffic``, the
    bytes of its exchanges (``hop_bytes``) and, for a group server in the shell's process, its
    training ``state``."""
    for h in roster.groups.values():  # replies to group processes name these (exchange.py)
        h.snapshots = [h.snapshots[-1], h.last_exchange]
    groups = {g: {"members": list(h.members), "ratio": h.ratio, "step_time": h.step_time,
                  "local_steps": h.local_steps, "merges": h.merges,
                  "last_exchange": list(h.last_exchange),
                  "merged": merged[g].pairs() if g in merged else [],
                  # the hops' byte counters go on after a resume (summary, charts)
                  "traffic": dict(held.get(g, {}).get("traffic") or {}),
                  "hop_bytes": dict(held.get(g, {}).get("hop_bytes") or {}),
                  "state": held.get(g, {}).get("state")}
              for g, h in roster.groups.items()}
    workers = {w: {"group": e.group, "step_time": e.step_time, "clock": e.clock,
                   "iteration_s": e.iteration_s, "link_s": e.link_s}  # what grouping uses
               for w, e in roster.workers.items()}
    return {"format": FORMAT, "saved_at": saved_at, "t0": run.t0,
            "fingerprint": fingerprint(run.to_info(), weights.size),
            "train_s": train_s, "weights": weights.copy(), "version": version,
            "samples": samples, "workers": workers, "groups": groups}


def restore_workers(run: RunConfig, roster: Roster, state: dict[str, Any]) -> np.ndarray:
    """The checkpoint's workers, each with its group and last speed (none connected yet); return
    its weights. ``ConfigError`` when it belongs to another model or config."""
    weights = np.asarray(state["weights"], dtype=np.float32)
    check_compatible(state, run.to_info(), weights.size)
    for key, e in state["workers"].items():
        roster.workers[int(key)] = WorkerEntry(int(key), step_time=e["step_time"],
                                               clock=e["clock"], group=e["group"],
                                               iteration_s=e.get("iteration_s"),  # absent in
                                               link_s=e.get("link_s"))  # older checkpoints
    return weights


def restore_groups(roster: Roster, merged: dict[int, Merged],
                   handles: dict[int, GroupHandle], state: dict[str, Any]) -> None:
    """The checkpoint's groups (``state``) into their new ``handles`` and the ``roster``, with
    the last merged seq of each of their sessions (``merged``); the Regrouper goes on from the
    saved assignment."""
    for key, saved in state["groups"].items():
        h = handles[int(key)]
        restore_group(h, saved)
        merged[h.id] = Merged(saved.get("merged") or [list(h.last_exchange)])
    roster.groups.update(sorted(handles.items()))
    roster.restore_regrouper()


def restore_group(h: GroupHandle, saved: dict[str, Any]) -> None:
    """Group ``h`` (opened again, in-process or waiting for its group process) as saved; its
    training state, traffic and exchange bytes are the shell's to restore."""
    h.ratio, h.step_time, h.merges = saved["ratio"], saved["step_time"], saved["merges"]
    h.local_steps = int(saved.get("local_steps", 0))  # absent in older checkpoints: the run's
    session, seq = saved.get("last_exchange", (-1, -1))  # absent in older checkpoints
    h.last_exchange = (int(session), int(seq))
    h.snapshots = [h.last_exchange] * 2  # the checkpoint file is the one snapshot there is


FORMAT = 1  # bump when the meaning of the stored map changes


FINGERPRINT_FIELDS = ("model", "dataset", "mode", "workers", "groups", "batch_size", "lr",
                      "momentum", "weight_decay", "staleness", "sync_every", "merge",
                      "compressor", "ratio", "seed", "optimizer_at",
                      "outer_optimizer", "val_size")  # a resume must share them
# what a checkpoint written before a field was fingerprinted held: that field's default
FINGERPRINT_DEFAULTS = {"optimizer_at": "server", "outer_optimizer": "avg", "val_size": 0}


def fingerprint(run_info: dict[str, Any], size: int) -> dict[str, Any]:
    """The run settings a checkpoint is only valid for, plus the model's vector size."""
    return {**{k: run_info.get(k) for k in FINGERPRINT_FIELDS}, "size": int(size)}


def check_compatible(state: dict[str, Any], run_info: dict[str, Any], size: int) -> None:
    """Raise ``ConfigError`` naming each field where the checkpoint and this run differ."""
    if state.get("format") != FORMAT:
        raise ConfigError(f"checkpoint format {state.get('format')!r}, this build reads {FORMAT}")
    saved, ours = state.get("fingerprint", {}), fingerprint(run_info, size)
    saved = {**FINGERPRINT_DEFAULTS, **saved}
    diff = [f"{k}: checkpoint {saved.get(k)!r}, this run {v!r}" for k, v in ours.items()
            if saved.get(k) != v]
    if diff:
        raise ConfigError("checkpoint is from another model/config: " + "; ".join(diff))
