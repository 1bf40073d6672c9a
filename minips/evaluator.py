"""The evaluator (role ``evaluator``): it pulls the global weights every ``eval_every_s`` (more
often once the budget is nearly spent: ``next_pull_s``) and writes accuracy, loss and the
global counters to eval.jsonl until the run is done; when the global server is lost it
reconnects for up to ``reconnect_s``, as a worker does. The run is done when it scored the
final weights, or when the server said LEAVE "done" (it stops: it waited for the final score
as long as it could): the evaluator then exits at once, without a retry. A LEAVE never cuts
a score short: one in progress, the final weights' above all, is written first.

It measures the run, so it keeps out of its way: an evaluation point's time is when its weights
arrived (not when scoring them ended), and the process lowers its own CPU priority by
``EVAL_NICE`` so that, on a machine whose cores the workers share with it, scoring thousands of
test images at once does not take a core from the training it measures.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import time

import numpy as np
import torch

from minips import sparse
from minips.core.config import RunConfig, WorkerConfig
from minips.errors import RemoteProtocolError
from minips.ml import data, models
from minips.net import transport
from minips.net.channel import Channel
from minips.record.metrics import record
from minips.record.rundir import JsonlWriter, RunDir
from minips.wire import control, messages
from minips.worker import EmulatedLink, Stopped, connect_role, leave

__all__ = ["EVAL_NICE", "END_PULL_S", "budget_left_s", "evaluate_loop", "next_pull_s",
           "run_evaluator"]

EVAL_NICE = 10  # added to the evaluator's niceness: it gets the CPU the training leaves


log = logging.getLogger("minips.worker")


async def evaluate_loop(cfg: WorkerConfig) -> None:
    """Pull the global weights every eval_every_s, evaluate, append to eval.jsonl; until done."""
    torch.set_num_threads(cfg.torch_threads)
    ch = await connect_role(cfg, cfg.server_host, cfg.server_port, "evaluator", -1)
    run = RunConfig.from_info(dict(ch.welcome_info))
    # the test split, or the validation samples held out of training (run.val_size)
    test = data.evaluation_set(run.dataset, cfg.data_dir or run.data_dir, val_size=run.val_size,
                               limit=run.eval_limit, synthetic=cfg.data == "synthetic",
                               fallback=False)
    # the final weights are scored on every test sample, as the tables score every row (DDP
    # and LB-BSP included); the periodic points on the first eval_limit (cheaper, for curves)
    full = test if not run.eval_limit else data.evaluation_set(
        run.dataset, cfg.data_dir or run.data_dir, val_size=run.val_size, limit=0,
        synthetic=cfg.data == "synthetic", fallback=False)
    record(cfg.run_dir, "evaluator", test.meta)
    writer = RunDir(cfg.run_dir, t0=run.t0).writer("eval")
    size = models.param_count(run.model)
    last, scored, score_s = -1, -math.inf, 0.0  # version scored last, when, how long it took
    try:
        while True:
            t = time.monotonic()  # the period counts from each PULL
            try:
                await ch.send(messages.Pull(clock=0))
                w = await EmulatedLink(ch, 0, 0).expect(messages.GlobalWeights)
            except (ConnectionError, RemoteProtocolError, asyncio.IncompleteReadError,
                    Stopped) as exc:
                # LEAVE "done" read, or waiting unread behind a connection that then closed
                if _said_done(exc) or await _listen(ch, 0.0):
                    _say_over(last)
                    return
                if isinstance(exc, Stopped) and exc.final:
                    raise
                ch = await _reconnect_evaluator(cfg, writer, run, exc)
                continue
            arrived, left = time.monotonic(), budget_left_s(run, w)
            # near the end, skip a score that would outlast the run: the final one comes first
            near_end = -run.eval_every_s < left < score_s
            # (the half period: the PULLs near the end come more often than the scores)
            if w.done or (w.version != last and arrived - scored >= run.eval_every_s / 2
                          and not near_end):
                last, scored = w.version, arrived
                scored_on = full if w.done else test
                acc, loss = _evaluate_once(run, w, size, scored_on, writer,
                                           time.time() - run.t0)
                score_s = time.monotonic() - arrived
                if ch.welcome_info.get("scores"):  # the server keeps them: tell it
                    await _send_score(ch, w, acc, loss, len(scored_on))
            if w.done:
                return
            now = time.monotonic()
            if await _listen(ch, next_pull_s(run, left - (now - arrived), now - t)):
                _say_over(last)
                return
    finally:
        writer.close()
        await leave(ch)


END_PULL_S = 0.5  # near the end of the budget, PULL this often (the final weights come soon)


def budget_left_s(run: RunConfig, w: messages.GlobalWeights) -> float:
    """Seconds of training the run likely has left as of ``w`` (inf: no telling): the wall
    time left, or the samples left (``RunConfig.budget_samples``: epochs, or every worker's
    ``max_steps`` pushes) at the rate so far."""
    left = run.wall_s - w.train_s if run.wall_s > 0 else math.inf
    budget = run.budget_samples()
    if budget > 0 and w.samples > 0 and w.train_s > 0:
        left = min(left, (budget - w.samples) * w.train_s / w.samples)
    return left


def next_pull_s(run: RunConfig, left: float, since_pull: float) -> float:
    """Seconds until the next PULL: the rest of ``eval_every_s`` since the last PULL, or,
    when the budget is likely spent (``left``) before that, just after it and then every
    ``END_PULL_S``, so the final weights are scored, and every role exits, within about
    ``END_PULL_S`` of the end instead of up to a whole period after it. An estimate a whole
    period wrong is dropped (back to the period)."""
    period = max(0.0, run.eval_every_s - since_pull)
    if -run.eval_every_s < left < period:
        return max(END_PULL_S, left)
    return period


def _said_done(exc: BaseException) -> bool:
    """``exc`` is the server's LEAVE "done" (``Stopped``: final, and no ERROR)."""
    return isinstance(exc, Stopped) and exc.final and not exc.error


async def _listen(ch: Channel, seconds: float) -> bool:
    """Wait ``seconds`` (until the next PULL) reading the connection: True as soon as the
    server says LEAVE "done", also when it came before the connection closed (0 s: only
    what is already read); an ERROR raises ``Stopped``, as on a PULL. False when the time
    is up, or at once when the connection ended otherwise: the next PULL finds out."""
    end = time.monotonic() + seconds
    with contextlib.suppress(asyncio.TimeoutError, ConnectionError, RemoteProtocolError,
                             asyncio.IncompleteReadError):
        while True:  # nothing else comes unasked: anything else is passed over
            msg = await ch.recv(timeout=max(0.0, end - time.monotonic()))
            if isinstance(msg, control.Error):
                raise Stopped(msg)
            if isinstance(msg, control.Leave):
                return _said_done(Stopped(msg))
    return False


def _say_over(version: int) -> None:
    """The server said the run is over before this evaluator had the final weights (it
    stopped waiting for them; its run directory has them, final_weights.npy)."""
    scored = f"the last score is of version {version}" if version >= 0 else "none scored"
    log.warning("evaluator: the run is over (the global server said done) before the final "
                "weights came; %s", scored)


async def _reconnect_evaluator(cfg: WorkerConfig, writer: JsonlWriter, run: RunConfig,
                               exc: BaseException) -> Channel:
    """The global server is lost (it may come back with --resume): reconnect as a worker does,
    for up to ``reconnect_s`` (then ConnectionError)."""
    writer.write({"t": time.time() - run.t0, "event": "server_lost", "reason": str(exc)})
    log.warning("evaluator: global server lost (%s); reconnecting for up to %.0f s", exc,
                cfg.reconnect_s)
    ch = await connect_role(cfg, cfg.server_host, cfg.server_port, "evaluator", -1,
                            timeout=cfg.reconnect_s, retries=None)
    writer.write({"t": time.time() - run.t0, "event": "server_back"})
    return ch


def _evaluate_once(run: RunConfig, w: messages.GlobalWeights, size: int,
                   test: data.Dataset, writer: JsonlWriter, t: float) -> tuple[float, float]:
    """Score ``w`` on ``test``; the point's time ``t`` is when the weights arrived. Returns
    (accuracy, loss)."""
    flat = np.asarray(sparse.decode_vector(w.payload, size))
    acc, loss = models.evaluate(run.model, flat, test)
    writer.write({**dict(w.info), "t": t, "version": w.version, "accuracy": acc,
                  "loss": loss, "final": bool(w.done), "test_samples": len(test)})
    return acc, loss


async def _send_score(ch: Channel, w: messages.GlobalWeights, acc: float, loss: float,
                      tested: int) -> None:
    """SCORE to the global server (what it prints and keeps: summary.json, the dashboard);
    a score it cannot take is lost, never the evaluation (eval.jsonl has it)."""
    finite = loss if math.isfinite(loss) else 0.0
    with contextlib.suppress(ConnectionError, OSError):
        await ch.send(control.Score(version=w.version, accuracy=min(1.0, max(0.0, acc)),
                                    loss=finite, tested=tested, final=bool(w.done)))


def run_evaluator(cfg: WorkerConfig) -> None:
    """`minips evaluator`: evaluate the global weights until the run is done."""
    with contextlib.suppress(OSError):  # lower priority only (never refused, but be safe)
        os.nice(EVAL_NICE)
    transport.install_uvloop()
    asyncio.run(evaluate_loop(cfg))
