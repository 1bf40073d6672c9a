"""How a run's end reaches its peers: after LEAVE(done) the global server closes the worker's
control channel itself (protocol.md section 6: the sender closes after LEAVE); with
``--max-steps N`` a group server answers a PULL at clock >= N with WEIGHTS ``done`` and refuses
a PUSH with clock > N (ERROR ``invalid``). Hand-written clients against a real in-process
server, and one real worker (torch) whose run ends on the budget.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import recv_as
from raw_group import closed

from minips import sparse
from minips.core.config import RunConfig, WorkerConfig
from minips.net import transport
from minips.net.endpoints import parse_address
from minips.record.rundir import read_jsonl
from minips.server import GlobalServer, ServerConfig
from minips.wire import control, messages
from minips.wire.fields import Payload

TOKEN = "run-limits-test-secret-0123"

pytestmark = pytest.mark.timeout(60)


def make_server(tmp_path: Path, init: np.ndarray | None, **run: Any) -> GlobalServer:
    cfg = ServerConfig(run=RunConfig(lr_warmup=0.0, **run), host="127.0.0.1", port=0,
                       token=TOKEN, run_dir=str(tmp_path), calib_timeout_s=10.0, linger_s=1.0)
    return GlobalServer(cfg, init)


def push(clock: int, n: int) -> messages.Push:
    encoding, codec, buffers = sparse.encode_vector(np.ones(n, np.float32))
    return messages.Push(clock=clock, samples=1, payload=Payload(encoding, codec,
                         tuple(buffers)))


async def worker(port: int) -> tuple[Any, Any]:
    """Worker 0's control channel (after its STATS) and its group connection (after ACK)."""
    ctl = await transport.connect("127.0.0.1", port, role="worker", worker_id=0, token=TOKEN)
    await ctl.send(control.Stats(clock=0, step_time=0.01, loss=1.0))
    host, gport = parse_address((await recv_as(ctl, control.Assign)).address)
    ch = await transport.connect(host, gport, role="worker", worker_id=0, token=TOKEN)
    assert (await recv_as(ch, messages.Ack)).clock == 0
    return ctl, ch


async def step(ch: Any, clock: int, n: int) -> messages.Weights:
    """PULL at ``clock``; PUSH ``clock`` + 1 unless the answer says done."""
    await ch.send(messages.Pull(clock=clock))
    w = await recv_as(ch, messages.Weights)
    if not w.done:
        await ch.send(push(clock + 1, n))
        assert (await recv_as(ch, messages.Ack)).clock == clock + 1
    return w


async def test_leave_done_is_followed_by_the_server_closing_the_control_channel(
        tmp_path: Path) -> None:
    srv = make_server(tmp_path, np.zeros(2, np.float32), workers=1, mode="asp", sync_every=1,
                      epochs=1.0, train_size=3)
    port = await srv.start()
    ctl, ch = await worker(port)
    try:
        for clock in range(3):  # 3 samples: the budget
            await step(ch, clock, 2)
        leave = await recv_as(ctl, control.Leave)
        assert leave.reason == "done"
        assert await closed(ctl, 2.0)  # was open until the worker left its group (~3 s)
        assert not ch.closed  # the group connection is the worker's to close
        assert (await step(ch, 3, 2)).done is True
    finally:
        await ch.close(leave="bye")
        await ctl.close()
        await asyncio.wait_for(srv.wait_finished(), 10)
        await srv.close()
    left = [r for r in read_jsonl(tmp_path / "global.jsonl") if r["event"] == "left"]
    assert [r["reason"] for r in left] == ["done"]


async def test_max_steps_answers_done_at_the_cap_and_refuses_a_push_past_it(
        tmp_path: Path) -> None:
    srv = make_server(tmp_path, np.zeros(3, np.float32), workers=1, mode="asp", max_steps=2)
    port = await srv.start()
    ctl, ch = await worker(port)
    try:
        assert [(await step(ch, c, 3)).done for c in range(2)] == [False, False]
        assert (await step(ch, 2, 3)).done is True  # clock 2 = the cap (pushes 3, 4 were ACKed)
        await ch.send(push(3, 3))  # after that PULL, a PUSH past the cap
        err = await recv_as(ch, control.Error)
        assert err.code == "invalid" and "max-steps" in err.reason
        assert await closed(ch)
        gs = srv.peers[0].server  # type: ignore[attr-defined]
        assert gs.core.version == 2 and gs.core.counters["pushes"] == 2
    finally:
        await ch.close()
        await ctl.close()
        await srv.close()


@pytest.mark.timeout(120)
async def test_a_real_worker_ends_normally_when_the_server_closes_after_leave_done(
        tmp_path: Path) -> None:
    """A torch worker on an epochs budget: the server's LEAVE(done) and close end its run
    normally (no ERROR, no reconnect), and the run finishes."""
    from minips.ml import models
    from minips.worker import Worker

    run = RunConfig(mode="asp", compressor="none", workers=1, epochs=1.0, train_size=4 * 64,
                    sync_every=1, base_step_s=0.0, calib_steps=1, lr_warmup=0.0)
    srv = GlobalServer(ServerConfig(run=run, host="127.0.0.1", port=0, token=TOKEN,
                                    run_dir=str(tmp_path)),
                       models.get_flat(models.build_model(run.model, run.seed)))
    port = await srv.start()
    try:
        w = Worker(WorkerConfig(server_port=port, token=TOKEN, worker_id=0, run_dir=str(tmp_path)))
        await asyncio.wait_for(w.run(), 90)
        await asyncio.wait_for(srv.wait_finished(), 30)
    finally:
        await srv.close()
    assert srv.core.done_reason == "epochs" and not srv.failure
    events = [r.get("event") for r in read_jsonl(tmp_path / "worker-0.jsonl") if "event" in r]
    assert not {"stopped", "control_lost", "control_gave_up"} & set(events)
