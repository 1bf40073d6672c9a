"""Worker loop against a real global server on loopback (one process, one event loop).

The reference tests of the issue: N workers in BSP through minips end with the weights of the
plain single-process loop (minips.ml.reference.train) on the same data order and seed.
"""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path
from typing import cast

import numpy as np
import pytest
from conftest import cached_reference, records, until

from minips.core.config import RunConfig, WorkerConfig
from minips.evaluator import evaluate_loop
from minips.ml import data, models
from minips.net import channel, transport
from minips.record.rundir import read_jsonl
from minips.server import GlobalServer, ServerConfig
from minips.wire import control, messages
from minips.wire.fields import Payload
from minips.worker import EmulatedLink, Worker, WorkerStopped

TOKEN = "test-secret"


@pytest.fixture(scope="module")
def train_set() -> data.Dataset:
    return data.load_dataset("fashion-mnist", "train", download=False, fallback=False)


async def run_cluster(run: RunConfig, tmp_path: Path, *, evaluator: bool = False,
                      slowdowns: list[float] | None = None) -> GlobalServer:
    """A global server (in-process groups) and ``run.workers`` workers in this event loop."""
    init = models.get_flat(models.build_model(run.model, run.seed))
    cfg = ServerConfig(run=run, host="127.0.0.1", port=0, token=TOKEN, run_dir=str(tmp_path))
    srv = GlobalServer(cfg, init)
    port = await srv.start()
    factors = slowdowns or [1.0] * run.workers
    wcfg = [WorkerConfig(server_port=port, token=TOKEN, worker_id=i, slowdown=f,
                         run_dir=str(tmp_path)) for i, f in enumerate(factors)]
    jobs = [Worker(c).run() for c in wcfg]
    if evaluator:
        jobs.append(evaluate_loop(WorkerConfig(server_port=port, token=TOKEN,
                                               run_dir=str(tmp_path))))
    try:
        await asyncio.wait_for(asyncio.gather(*jobs), 120)
        await asyncio.wait_for(srv.wait_finished(), 30)
    finally:
        await srv.close()
    return srv


def bsp_run(workers: int, momentum: float, steps: int, optimizer_at: str = "server"
            ) -> RunConfig:
    return RunConfig(mode="bsp", compressor="none", workers=workers, momentum=momentum,
                     max_steps=steps, base_step_s=0.0, calib_steps=1, lr=0.05, lr_warmup=0.0,
                     eval_every_s=0.2, optimizer_at=optimizer_at)


# the optimizer on the group server (workers push gradients) or on each worker (workers push
# the update of their own SGD): BSP is synchronous SGD either way
PLACES = pytest.mark.parametrize("optimizer_at", ["server", "worker"])


def reference_weights(run: RunConfig, train_set: data.Dataset, workers: int) -> np.ndarray:
    """The plain single-process loop on ``run``'s model, seed and steps over ``workers`` shards."""
    return cached_reference(run.model, train_set, lr=run.lr, seed=run.seed,
                            steps=run.max_steps, workers=workers, momentum=run.momentum,
                            weight_decay=run.weight_decay)


def schedule_reference(run: RunConfig, train_set: data.Dataset) -> np.ndarray:
    """The plain loop with ``run``'s whole lr schedule (warm-up, decay over ``train_size``): one
    step per round on the mean of ``run.workers`` gradients, ``run.max_steps`` rounds."""
    return cached_reference(run.model, train_set, lr=run.lr, seed=run.seed, steps=run.max_steps,
                            workers=run.workers, momentum=run.momentum,
                            weight_decay=run.weight_decay, lr_warmup=run.lr_warmup,
                            lr_schedule=run.lr_schedule, train_size=run.train_size)


@PLACES
@pytest.mark.timeout(120)
async def test_one_worker_bsp_matches_reference(tmp_path: Path, train_set: data.Dataset,
                                                optimizer_at: str) -> None:
    run = bsp_run(1, 0.9, 12, optimizer_at)
    srv = await run_cluster(run, tmp_path)
    ref = reference_weights(run, train_set, workers=1)
    assert srv.core.weights is not None
    np.testing.assert_allclose(srv.core.weights, ref, rtol=1e-5, atol=1e-6)
    assert srv.core.samples == 12 * run.batch_size
    assert not np.allclose(ref, models.get_flat(models.build_model("lenet5", 0)))


@PLACES
@pytest.mark.timeout(120)
async def test_two_workers_bsp_match_averaged_reference(tmp_path: Path, train_set: data.Dataset,
                                                        optimizer_at: str) -> None:
    run = bsp_run(2, 0.0, 10, optimizer_at)
    srv = await run_cluster(run, tmp_path)
    ref = reference_weights(run, train_set, workers=2)
    assert srv.core.weights is not None
    np.testing.assert_allclose(srv.core.weights, ref, rtol=1e-5, atol=1e-6)
    # and not what a single worker would have done
    one = reference_weights(run, train_set, workers=1)
    assert not np.allclose(srv.core.weights, one, rtol=1e-5, atol=1e-6)


@PLACES
@pytest.mark.timeout(120)
async def test_eight_workers_bsp_are_synchronous_sgd_with_the_lr_schedule(
        tmp_path: Path, train_set: data.Dataset, optimizer_at: str) -> None:
    """8 workers in BSP, at 4 speeds, with momentum, weight decay, a warm-up and a cosine decay
    over the budget reach the weights of the plain loop with the same schedule: one step per
    round with the mean of the 8 gradients, at the lr of the round's place in the run. With
    the optimizer on the workers each keeps its own velocity and takes the lr factor its
    WEIGHTS said; the mean of their 8 updates is the same step."""
    rounds, workers = 50, 8
    run = RunConfig(mode="bsp", compressor="none", workers=workers, momentum=0.9,
                    optimizer_at=optimizer_at,
                    weight_decay=5e-4, lr=0.05, lr_warmup=0.3, lr_schedule="cosine",
                    epochs=1.0, train_size=rounds * workers * 64,  # the budget ends with round 50
                    max_steps=rounds, base_step_s=0.001, calib_steps=1, eval_every_s=0.5)
    srv = await run_cluster(run, tmp_path, slowdowns=[1, 1, 1.5, 1.5, 2, 2, 4, 4])
    ref = schedule_reference(run, train_set)
    assert srv.core.weights is not None and srv.core.samples == rounds * workers * 64
    # float32 sums of the 8 gradients in arrival order: ~1e-6 apart after 50 rounds
    np.testing.assert_allclose(srv.core.weights, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.timeout(120)
async def test_dgc_as_published_with_the_optimizer_on_the_workers_trains(
        tmp_path: Path) -> None:
    """GSSP, 4 workers in 2 groups, the optimizer on the workers and every piece of DGC on:
    momentum correction, masking, local clipping and the warm-up over the first 10% of the
    run; LeNet-5 on Fashion-MNIST learns (about 0.4 epoch) while uploading ~1%."""
    run = RunConfig(mode="gssp", groups=2, workers=4, compressor="dgc", ratio=0.01,
                    optimizer_at="worker", momentum_masking=True, grad_clip=5.0,
                    compressor_opts={"warmup_fraction": 0.1}, lr=0.05, lr_warmup=0.0,
                    max_steps=100, base_step_s=0.0, calib_steps=1, eval_every_s=5.0)
    test = data.load_dataset("fashion-mnist", "test", download=False, fallback=False)
    test = test.subset(np.arange(2000))
    before, _ = models.evaluate(run.model, models.get_flat(models.build_model(run.model, 0)),
                                test)
    srv = await run_cluster(run, tmp_path, slowdowns=[1.0, 1.0, 2.0, 2.0])
    assert srv.core.weights is not None
    after, _ = models.evaluate(run.model, srv.core.weights, test)
    assert before < 0.2 and after > 0.55, (before, after)  # measured: 0.09 -> 0.68-0.70
    recs = read_jsonl(tmp_path / "worker-0.jsonl")
    assert recs[0]["kept_fraction"] > 0.1 and recs[-1]["kept_fraction"] < 0.012  # warmed up
    assert all(0 < r["clip_scale"] <= 1 and r["lr_factor"] == 1.0 for r in recs)


@pytest.mark.timeout(120)
async def test_worker_records_and_evaluator(tmp_path: Path) -> None:
    run = RunConfig(mode="ssp", staleness=1, compressor="topk", ratio=0.05, workers=2,
                    max_steps=15, base_step_s=0.01, calib_steps=1, eval_every_s=0.1,
                    eval_limit=500)
    await run_cluster(run, tmp_path, evaluator=True, slowdowns=[1.0, 3.0])
    recs = read_jsonl(tmp_path / "worker-1.jsonl")
    assert [r["clock"] for r in recs] == list(range(1, 16))
    for key in ("t", "staleness", "wait_s", "waited_for", "bytes_raw", "bytes_wire", "loss",
                "step_time", "kept_fraction", "samples", "group"):
        assert key in recs[0], key
    assert all(r["step_time"] >= 0.03 - 1e-3 for r in recs)  # slowdown 3 x 10 ms
    assert all(r["bytes_wire"] < r["bytes_raw"] / 5 for r in recs)  # 5% top-k, varint
    # the downlink too: the first PULL gets the whole weights, then updates of 5% (+ the drift
    # bound) each: far less than 15 dense answers
    assert recs[-1]["link_bytes_down"] < 15 * recs[0]["bytes_raw"] / 3
    fast = read_jsonl(tmp_path / "worker-0.jsonl")
    assert max(r["staleness"] for r in fast) <= 1
    evals = read_jsonl(tmp_path / "eval.jsonl")
    assert evals and evals[-1]["final"] is True
    assert evals[-1]["samples"] == 30 * run.batch_size
    assert evals[-1]["bytes_up"] > 0 and evals[-1]["bytes_down"] > 0


class _Sink:
    """The smallest channel: remembers what was sent."""

    def __init__(self) -> None:
        self.sent: list[object] = []

    async def send(self, msg: object) -> None:
        self.sent.append(msg)


async def test_link_adds_its_latency_to_every_send() -> None:
    """(Its rates pace the channel itself: tests/test_links.py, on real sockets.)"""
    sink = _Sink()
    link = EmulatedLink(cast(channel.Channel, sink), bandwidth_bps=0.0, latency_s=0.02)
    msg = messages.Push(clock=1, payload=Payload("dense-f32", {}, (bytes(50_000),)))
    t = time.perf_counter()
    await link.send(msg)
    took = time.perf_counter() - t
    assert sink.sent == [msg]
    assert 0.02 - 0.002 <= took < 0.5


async def test_a_server_error_stops_the_worker_and_says_why(tmp_path: Path) -> None:
    """An ERROR on the control channel ends the run: the worker records why and raises it
    (``minips worker`` then exits non-zero with that line) instead of ending as if done."""
    run = RunConfig(workers=1, calib_steps=1)

    async def server(ch: channel.Channel) -> None:
        assert isinstance(await ch.recv(), control.Stats)  # the calibration
        await ch.send(control.Error(code="invalid", reason="test: this worker must stop"))

    srv = await transport.serve("127.0.0.1", 0, token=TOKEN, handler=server,
                                accept=lambda hello: {**run.to_info(), "worker_id": 0})
    cfg = WorkerConfig(server_port=srv.port, token=TOKEN, worker_id=0, run_dir=str(tmp_path))
    try:
        with pytest.raises(WorkerStopped, match="global server sent ERROR invalid: test: this"):
            await asyncio.wait_for(Worker(cfg).run(), 60)
    finally:
        srv.close()
        await srv.wait_closed()
    stopped = [r for r in read_jsonl(tmp_path / "worker-0.jsonl") if r.get("event") == "stopped"]
    assert len(stopped) == 1 and "this worker must stop" in stopped[0]["reason"]


@pytest.mark.timeout(120)
async def test_an_unreachable_group_server_is_reported_once_while_retrying(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """ASSIGN names a port where nothing listens: the worker records it (event and warning)
    once, keeps retrying, and ends cleanly when the run is over."""
    run = RunConfig(workers=1, calib_steps=1)
    with socket.socket() as closed:  # bound, never listening: connections are refused
        closed.bind(("127.0.0.1", 0))
        dead = closed.getsockname()[1]

        async def server(ch: channel.Channel) -> None:
            assert isinstance(await ch.recv(), control.Stats)  # the calibration
            await ch.send(control.Assign(group=0, address=f":{dead}", ratio=0.01, staleness=3))
            await until(lambda: bool(records(tmp_path / "worker-0.jsonl",
                                             event="group_unreachable")), 30)
            await ch.send(control.Leave(reason="done"))
            await ch.recv()

        srv = await transport.serve("127.0.0.1", 0, token=TOKEN, handler=server,
                                    accept=lambda hello: {**run.to_info(), "worker_id": 0})
        cfg = WorkerConfig(server_port=srv.port, token=TOKEN, worker_id=0, run_dir=str(tmp_path))
        try:
            await asyncio.wait_for(Worker(cfg).run(), 60)
        finally:
            srv.close()
            await srv.wait_closed()
    events = records(tmp_path / "worker-0.jsonl", event="group_unreachable")
    assert len(events) == 1 and events[0]["address"] == f"127.0.0.1:{dead}"
    assert f"cannot reach group server 127.0.0.1:{dead}" in caplog.text
