"""How a run ends (server.GlobalServer): every worker gone with budget left is a wait, then a
failure that says why; a non-finite update stops the run naming the cause; a server on loopback
with raw worker sessions, as in test_server.py."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import records, recv_as

from minips import sparse
from minips.core.config import RunConfig
from minips.net import transport
from minips.net.endpoints import parse_address
from minips.server import GlobalServer, ServerConfig
from minips.wire import control, messages
from minips.wire.fields import Payload

TOKEN = "run-end-test"


def make_server(tmp_path: Path, rejoin_wait_s: float, **run: Any) -> GlobalServer:
    cfg = ServerConfig(run=RunConfig(workers=1, mode="asp", sync_every=1, lr=1.0, momentum=0.0,
                                     weight_decay=0.0, lr_warmup=0.0, train_size=100, **run),
                       port=0, token=TOKEN, run_dir=str(tmp_path), calib_timeout_s=10.0,
                       linger_s=1.0, rejoin_wait_s=rejoin_wait_s)
    return GlobalServer(cfg, np.zeros(2, np.float32))


async def train(port: int, grads: list[np.ndarray]) -> tuple[Any, Any]:
    """Worker 0 joins, pushes ``grads`` to its group; (control channel, group channel)."""
    ctl = await transport.connect("127.0.0.1", port, role="worker", worker_id=0, token=TOKEN)
    await ctl.send(control.Stats(clock=0, step_time=0.01, loss=2.3))
    host, gport = parse_address((await recv_as(ctl, control.Assign)).address)
    ch = await transport.connect(host, gport, role="worker", worker_id=0, token=TOKEN)
    clock = (await recv_as(ch, messages.Ack)).clock
    for g in grads:
        await ch.send(messages.Pull(clock=clock))
        await recv_as(ch, messages.Weights)
        encoding, codec, buffers = sparse.encode_vector(g)
        clock += 1
        await ch.send(messages.Push(clock=clock, samples=1, payload=Payload(encoding, codec,
                                    tuple(buffers))))
        await recv_as(ch, messages.Ack)
    return ctl, ch


async def test_every_worker_gone_with_budget_left_waits_then_fails_saying_why(
        tmp_path: Path) -> None:
    srv = make_server(tmp_path, rejoin_wait_s=1.0, epochs=1.0)  # 100 samples; 2 are trained
    port = await srv.start()
    try:
        ctl, ch = await train(port, [np.ones(2, np.float32)] * 2)
        await ch.close(leave="bye")  # its only worker leaves: the group flushes a final delta
        await asyncio.wait_for(srv.finished.wait(), 10)
        waiting = records(tmp_path / "global.jsonl", event="waiting_for_workers")
        assert waiting and waiting[0]["left"] == "2 of 100 samples"
        assert "short of its budget" in srv.failure and "2 of 100 samples" in srv.failure
        await ctl.close()
    finally:
        await srv.close()


async def test_without_budget_left_the_workers_leaving_ends_the_run(tmp_path: Path) -> None:
    srv = make_server(tmp_path, rejoin_wait_s=60.0, max_steps=2)  # the workers' cap ends it
    port = await srv.start()
    try:
        ctl, ch = await train(port, [np.ones(2, np.float32)] * 2)
        await ch.close(leave="bye")
        await asyncio.wait_for(srv.finished.wait(), 10)
        assert srv.failure == "" and srv.core.done_reason == "workers left"
        await ctl.close()
    finally:
        await srv.close()


async def test_one_budget_spent_ends_the_run_with_no_alarm_for_the_other(
        tmp_path: Path) -> None:
    srv = make_server(tmp_path, rejoin_wait_s=60.0, epochs=0.02, wall_s=600.0)  # 2 samples
    port = await srv.start()
    try:
        ctl, ch = await train(port, [np.ones(2, np.float32)] * 2)
        await ch.close(leave="bye")  # done: the worker leaves, its group flushes a final delta
        await asyncio.wait_for(srv.finished.wait(), 5)  # not a wait for the wall budget
        assert srv.failure == "" and srv.core.done_reason == "epochs"
        assert srv.rejoin is None  # no wait for workers was started (nor its console alarm)
        assert not records(tmp_path / "global.jsonl", event="waiting_for_workers")
        await ctl.close()
    finally:
        await srv.close()


async def test_a_worker_back_within_the_wait_trains_on(tmp_path: Path) -> None:
    srv = make_server(tmp_path, rejoin_wait_s=30.0, epochs=1.0)
    port = await srv.start()
    try:
        ctl, ch = await train(port, [np.ones(2, np.float32)])
        await ch.close(leave="bye")
        await ctl.close()
        for _ in range(200):  # the server notices (polled: the final flush is asynchronous)
            if records(tmp_path / "global.jsonl", event="waiting_for_workers"):
                break
            await asyncio.sleep(0.05)
        ctl, ch = await train(port, [np.ones(2, np.float32)] * 2)
        for _ in range(40):
            if records(tmp_path / "global.jsonl", event="workers_back"):
                break
            await asyncio.sleep(0.05)
        assert records(tmp_path / "global.jsonl", event="workers_back")
        assert not srv.core.done and srv.failure == "" and srv.core.samples == 3
        await ch.close()
        await ctl.close()
    finally:
        await srv.close()


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the overflow is the point
async def test_a_non_finite_update_stops_the_run_naming_the_cause(tmp_path: Path) -> None:
    srv = make_server(tmp_path, rejoin_wait_s=60.0, epochs=1.0)
    port = await srv.start()
    try:
        huge = np.full(2, 3e38, np.float32)  # finite; two steps overflow float32 to -inf
        ctl, ch = await train(port, [huge, huge])
        err = await recv_as(ctl, control.Error)
        assert err.code == "diverged" and "non-finite" in err.reason
        await asyncio.wait_for(srv.finished.wait(), 10)
        assert "diverged" in srv.failure and "lower --lr" in srv.failure
        assert srv.core.weights is not None and np.isfinite(srv.core.weights).all()  # not applied
        await ch.close()
        await ctl.close()
    finally:
        await srv.close()
