"""A `minips group` process ends only once its final flush is answered.

The full suite's run of test_faults' external-group resume failed once: the global server ended
with 72,128 samples, the workers' ACKed pushes, while the group process's last ``exchange``
record said 72,000. The group's serving loop (group_process.py ``serve_group``) stopped as soon
as the final flush had *started* (``GroupCore.start_flush`` marks it ``finished``): when its
0.2 s poll fell between the EXCHANGE and its reply, the process closed, cancelling the exchange
in flight. The global server had merged it, so the group's record lacked its last samples; a
poll before the send had finished would have lost them.

Replayed against a real in-process global server and the real ``serve_group``: the global
server holds its reply to the final EXCHANGE past a few polls.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import records
from raw_worker import join_group, open_control

from minips.core.config import RunConfig
from minips.serve import group_process, sessions
from minips.serve.group_process import GroupConfig, serve_group
from minips.server import GlobalServer, ServerConfig

TOKEN = "group-final-flush-secret-0123"
WALL_S = 1.0  # the run's budget
# the reply to the final EXCHANGE comes after the budget is spent and 4 polls more
HOLD_S = WALL_S + 4 * group_process.POLL_S

pytestmark = pytest.mark.timeout(60)


async def test_the_group_process_waits_for_its_final_flush_before_closing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    answer = sessions._answer
    held: list[float] = []

    async def slow_final_answer(srv: Any, ch: Any, actions: list[Any]) -> None:
        if any(getattr(a, "event", None) == "merge" and a.fields.get("final")
               for a in actions):
            held.append(HOLD_S)
            await asyncio.sleep(HOLD_S)
        await answer(srv, ch, actions)

    monkeypatch.setattr(sessions, "_answer", slow_final_answer)
    # the group's one worker joins it and leaves: its final delta goes out, held; the 1 s wall
    # budget is spent meanwhile (LEAVE "done" to the group process)
    cfg = ServerConfig(run=RunConfig(lr_warmup=0.0, workers=1, mode="ssp", wall_s=WALL_S),
                       host="127.0.0.1", port=0, token=TOKEN, run_dir=str(tmp_path / "global"),
                       calib_timeout_s=10.0, linger_s=1.0, external_groups=1)
    srv = GlobalServer(cfg, np.zeros(8, np.float32))
    port = await srv.start()
    group_dir = tmp_path / "group"
    serving = asyncio.ensure_future(serve_group(GroupConfig(
        server_port=port, port=0, token=TOKEN, run_dir=str(group_dir)), announce=False))
    ctl, assign = await open_control("127.0.0.1", port, 0, token=TOKEN)
    try:
        gport = int(assign.address.rsplit(":", 1)[1])  # the group process's
        grp, _ = await join_group("127.0.0.1", gport, 0, assign.group, token=TOKEN)
        await grp.close(leave="done")
        gs = await asyncio.wait_for(serving, 30)
    finally:
        await ctl.close()
        if not serving.done():
            serving.cancel()
        await srv.close()
    assert held == [HOLD_S], "the final EXCHANGE never reached the global server"
    final = [r for r in records(tmp_path / "global" / "global.jsonl", event="merge")
             if r["final"]]
    assert len(final) == 1
    got = records(group_dir / "group-0.jsonl", event="exchange")
    # the reply came after the process had polled 4 times: it waited for it and logged it
    assert got and got[-1]["seq"] == final[0]["seq"]
    assert gs.core.xchg.pending is None

