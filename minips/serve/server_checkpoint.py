"""The global server's checkpoint files: where they go, the periodic save, stale temp files.

What a checkpoint holds and how its parts come back is sans-IO: ``GlobalCore.checkpoint_state`` /
``load_state_dict`` and ``global_core.py``. This module does the IO: ``checkpoint.py`` writes
the file (atomic, no pickle) in a thread while the loop keeps serving, every
``checkpoint_every_s`` until the budget is spent. Failure handling: docs/operations.md.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import TYPE_CHECKING

from minips.record import checkpoint as checkpoint_mod
from minips.record.checkpoint import remove_stale_temps
from minips.serve.server_io import ServerIO

if TYPE_CHECKING:  # the server's config, for annotations only (server.py imports this)
    from minips.server import ServerConfig

__all__ = ["path_of", "save", "save_loop", "clean"]


def path_of(cfg: ServerConfig) -> Path:
    """Where the server keeps its checkpoint (``--checkpoint`` or run_dir/checkpoint.npz)."""
    return Path(cfg.checkpoint_path or Path(cfg.run_dir) / "checkpoint.npz")


def clean(io: ServerIO) -> None:
    """Delete the temporary files of checkpoint writes that were killed midway."""
    removed = remove_stale_temps(path_of(io.cfg))
    if removed:
        io.core.log("checkpoint_temps_removed", files=[str(p) for p in removed])


async def save_loop(io: ServerIO) -> None:
    """Checkpoint every ``checkpoint_every_s`` until the budget is spent."""
    while not io.core.done:
        await asyncio.sleep(io.cfg.checkpoint_every_s)
        await save(io)


async def save(io: ServerIO) -> None:
    """Snapshot now, write it in a thread (the loop keeps serving), log its size."""
    t = time.monotonic()
    state = io.core.checkpoint_state()
    io.saving = asyncio.ensure_future(asyncio.to_thread(checkpoint_mod.save, path_of(io.cfg), state))
    size = await asyncio.shield(io.saving)
    io.core.log("checkpoint", bytes=size, write_s=time.monotonic() - t)
