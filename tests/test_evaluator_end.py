"""How an evaluator hears that the run is over: a real global server on loopback (port 0), a
raw worker that spends the budget, and a `minips evaluator` process. The server tells an
evaluator still connected when it stops (LEAVE "done"): the evaluator exits 0 at once, with its
final score written when it had the final weights, and never retries the ended server."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from conftest import records, recv_as, until

from minips import sparse
from minips.core.config import RunConfig
from minips.ml import models
from minips.net import transport
from minips.net.endpoints import parse_address
from minips.server import GlobalServer, ServerConfig
from minips.wire import control, messages
from minips.wire.fields import Payload

TOKEN = "evaluator-end-test"
N = models.param_count("lenet5")
# the evaluator exits this soon after the server closed (0.3-0.4 s here: Python's and
# torch's exit); before LEAVE "done" it slept out its period, then retried for --reconnect
EXIT_S = 5.0
RECONNECT_LINE = "reconnecting for up to"


def make_server(tmp_path: Path, linger_s: float, eval_every_s: float) -> GlobalServer:
    """One ASP worker, a budget of 2 samples (2 pushes); eval_limit 200 keeps periodic scores
    short (the final one is on the whole synthetic test split)."""
    run = RunConfig(workers=1, mode="asp", sync_every=1, lr=0.01, momentum=0.0,
                    weight_decay=0.0, lr_warmup=0.0, train_size=100, epochs=0.02,
                    eval_every_s=eval_every_s, eval_limit=200)
    cfg = ServerConfig(run=run, port=0, token=TOKEN, run_dir=str(tmp_path), calib_timeout_s=10.0,
                       linger_s=linger_s, checkpoint_every_s=0.0)
    return GlobalServer(cfg, np.zeros(N, np.float32))


async def start_evaluator(tmp_path: Path, port: int) -> asyncio.subprocess.Process:
    """`minips evaluator` on synthetic data, its console in evaluator.log."""
    env = {**os.environ, "MINIPS_TOKEN": TOKEN, "PYTHONUNBUFFERED": "1"}
    out = open(tmp_path / "evaluator.log", "wb")  # noqa: SIM115 - the child holds it
    try:
        return await asyncio.create_subprocess_exec(
            sys.executable, "-m", "minips", "evaluator", "--connect", f"127.0.0.1:{port}",
            "--run-dir", str(tmp_path), "--data", "synthetic", env=env, stdout=out,
            stderr=asyncio.subprocess.STDOUT)
    finally:
        out.close()


async def spend_budget(port: int) -> tuple[Any, Any]:
    """Worker 0 joins and pushes twice (the budget); (control channel, group channel)."""
    ctl = await transport.connect("127.0.0.1", port, role="worker", worker_id=0, token=TOKEN)
    await ctl.send(control.Stats(clock=0, step_time=0.01, loss=2.3))
    host, gport = parse_address((await recv_as(ctl, control.Assign)).address)
    ch = await transport.connect(host, gport, role="worker", worker_id=0, token=TOKEN)
    clock = (await recv_as(ch, messages.Ack)).clock
    for _ in range(2):
        await ch.send(messages.Pull(clock=clock))
        await recv_as(ch, messages.Weights)
        encoding, codec, buffers = sparse.encode_vector(np.full(N, 1e-3, np.float32))
        clock += 1
        await ch.send(messages.Push(clock=clock, samples=1, payload=Payload(encoding, codec,
                                    tuple(buffers))))
        await recv_as(ch, messages.Ack)
    return ctl, ch


async def end_run(srv: GlobalServer, tmp_path: Path, proc: asyncio.subprocess.Process) -> float:
    """Spend the budget once the evaluator scored a first time, let the worker leave, wait
    for the server as `minips server` does and close it; the evaluator's exit, seconds after
    the close."""
    try:
        await until(lambda: bool(records(tmp_path / "eval.jsonl")), 60)  # it is at work
        ctl, ch = await spend_budget(srv.port)
        await ch.close(leave="bye")  # its group flushes a final delta: the run is over
        await ctl.close()
        await asyncio.wait_for(srv.wait_finished(), 60)
    finally:
        await srv.close()
    closed = time.monotonic()
    try:
        code = await asyncio.wait_for(proc.wait(), EXIT_S)
    except asyncio.TimeoutError:
        raise AssertionError(f"the evaluator still runs {EXIT_S} s after the server closed:\n"
                             f"{console(tmp_path)}") from None
    assert code == 0, console(tmp_path)
    return time.monotonic() - closed


async def stop(proc: asyncio.subprocess.Process) -> None:
    """Kill the evaluator if a failed test left it running."""
    if proc.returncode is None:
        proc.kill()
        await proc.wait()


def console(tmp_path: Path) -> str:
    return (tmp_path / "evaluator.log").read_text(errors="replace")


async def test_an_evaluator_the_server_stopped_waiting_for_exits_at_once(tmp_path: Path) -> None:
    """The server's wait for the final score is over (linger 0) while the evaluator sleeps out
    a 60 s period: LEAVE "done" ends it then, not a period later plus --reconnect."""
    srv = make_server(tmp_path, linger_s=0.0, eval_every_s=60.0)
    await srv.start()
    proc = await start_evaluator(tmp_path, srv.port)
    try:
        print(f"evaluator exited {await end_run(srv, tmp_path, proc):.2f} s after the server")
        assert RECONNECT_LINE not in console(tmp_path)
        assert "the run is over (the global server said done)" in console(tmp_path)
        lines = records(tmp_path / "eval.jsonl")
        assert not [r for r in lines if r.get("event") == "server_lost"], lines
        assert lines[-1]["version"] == 0 and not lines[-1]["final"]  # it never had the last
    finally:
        await stop(proc)


async def test_an_evaluator_connected_at_the_end_writes_the_final_score_and_exits(
        tmp_path: Path) -> None:
    """The usual end: the evaluator PULLs the final weights, scores them and exits 0 within
    EXIT_S of the server, its eval.jsonl ending with that final score."""
    srv = make_server(tmp_path, linger_s=30.0, eval_every_s=0.5)
    await srv.start()
    proc = await start_evaluator(tmp_path, srv.port)
    try:
        print(f"evaluator exited {await end_run(srv, tmp_path, proc):.2f} s after the server")
        assert RECONNECT_LINE not in console(tmp_path)
        last = records(tmp_path / "eval.jsonl")[-1]
        assert last["final"] and last["version"] == srv.core.version, last
        assert last["test_samples"] == 2_000  # the whole synthetic test split
    finally:
        await stop(proc)


async def test_a_leave_done_while_it_scores_an_older_version_ends_it_after_that_score(
        tmp_path: Path) -> None:
    """A stand-in global server answers the first PULL, then says LEAVE "done" and closes
    while the evaluator scores (the `minips ray` case: busy with an older version when the
    server stops): the score is written, then the loop ends, with no retry."""
    from minips.core.config import WorkerConfig
    from minips.evaluator import evaluate_loop

    run = RunConfig(eval_every_s=60.0, eval_limit=200)
    payload = Payload(*sparse.encode_vector(np.zeros(N, np.float32)))
    pulls: list[messages.Message] = []

    async def serve_one(ch: Any) -> None:
        pulls.append(await ch.recv())  # the first PULL
        await ch.send(messages.GlobalWeights(version=3, size=N, payload=payload))
        await ch.close(leave="done")  # at once: it is scoring version 3 meanwhile

    server = await transport.serve("127.0.0.1", 0, token=TOKEN, accept=lambda _: run.to_info(),
                                   handler=serve_one)
    try:
        cfg = WorkerConfig(server_host="127.0.0.1", server_port=server.port, token=TOKEN,
                           run_dir=str(tmp_path), data="synthetic", reconnect_s=30.0)
        await asyncio.wait_for(evaluate_loop(cfg), 30)  # no retry: it ends by itself
    finally:
        server.close()
        await server.wait_closed()
    assert len(pulls) == 1 and isinstance(pulls[0], messages.Pull)
    lines = records(tmp_path / "eval.jsonl")
    assert [(r.get("version"), r.get("final")) for r in lines] == [(3, False)], lines
