"""A worker back before a resumed global server has opened its checkpoint's groups again.

`minips server --resume` listens first and then opens the checkpoint's in-process groups (each
binds a port); a worker that reconnects in between used to get ERROR ``internal`` (KeyError:
its saved group was not open yet) and exit 2 (tests/test_readme_netns.py's edge board, once in
a full suite). Real servers on loopback (port 0), the second one's group opening held on an
event so that the worker comes back exactly in that window."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from minips.core.config import RunConfig, WorkerConfig
from minips.record.checkpoint import load, save
from minips.server import GlobalServer, ServerConfig
from minips.wire import control

TOKEN = "resume-race-test-secret-0123"
N = 8  # weights


def server(run_dir: Path) -> GlobalServer:
    cfg = ServerConfig(run=RunConfig(lr_warmup=0.0, workers=1, mode="gssp"), port=0,
                       token=TOKEN, run_dir=str(run_dir), checkpoint_every_s=0.0)
    return GlobalServer(cfg, None)


async def grouped_checkpoint(tmp_path: Path) -> dict[str, Any]:
    """The checkpoint of a server whose worker 0 is in in-process group 0."""
    srv = server(tmp_path / "first")
    await srv.start()
    try:
        srv.perform(srv.core.on_initial(np.zeros(N, np.float32)))
        srv.perform(srv.core.admit(0, 0.0))
        handle = await srv.open_group(0, [0])
        srv.perform(srv.core.groups_formed([handle], {0: 0}, 0.0))
        path = tmp_path / "checkpoint.npz"
        save(path, srv.checkpoint_state())
    finally:
        await srv.close()
    return load(path)


@pytest.mark.timeout(60)
async def test_a_worker_back_before_the_groups_reopen_is_told_its_group(tmp_path: Path) -> None:
    from minips.worker import connect_role

    state = await grouped_checkpoint(tmp_path)
    assert state["groups"]["0"]["members"] == [0], state["groups"]
    srv = server(tmp_path / "resumed")
    srv.restore(state)
    opening, go = asyncio.Event(), asyncio.Event()
    open_group = srv.open_group

    async def held(g: int, members: list[int]) -> Any:  # the resumed server, between listen and
        opening.set()  # its groups' ports: a worker's reconnect lands here
        await go.wait()
        return await open_group(g, members)

    srv.open_group = held  # type: ignore[method-assign]
    started = asyncio.ensure_future(srv.start())
    ch = None
    try:
        await asyncio.wait_for(opening.wait(), 10)
        assert srv.port, "listening before the groups are opened again"
        cfg = WorkerConfig(server_port=srv.port, token=TOKEN)
        ch = await connect_role(cfg, "127.0.0.1", srv.port, "worker", 0)
        for _ in range(20):  # the session's first turns run while the groups are still held
            await asyncio.sleep(0)
        go.set()
        await asyncio.wait_for(started, 10)
        msg = await asyncio.wait_for(ch.recv(), 10)
        assert isinstance(msg, control.Assign), msg  # before the fix: ERROR internal, KeyError
        assert msg.group == 0 and msg.address.startswith(":"), msg  # its in-process port
    finally:
        go.set()
        if ch is not None:
            await ch.close()
        if not started.done():
            started.cancel()
        await srv.close()
