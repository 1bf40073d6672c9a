"""The global server's sessions with workers (control channel) and evaluators (asyncio).

A worker's control session carries STATS (calibration at clock 0, then its measured speed every
second), an optional INIT_WEIGHTS with its initial weights (when the server had none yet:
WELCOME said ``need_init``; the first one to arrive is taken) and LEAVE; the server answers
with ASSIGN when the worker's group or ratio is set or changes. An evaluator PULLs the global
weights (GLOBAL_WEIGHTS) every few seconds until the run is over. What a message does is the
core's rule (``GlobalCore.on_stats`` / ``on_initial``); this module reads the channel and
performs the actions the core returns.

Invariants: a worker has at most one control channel (a new connection with its id replaces
the old one, which gets ERROR ``replaced``); STATS clocks are not compared (they count steps in
the worker's current group and start again after a move); the initial weights are taken once,
dense, with a bounded size.
"""

from __future__ import annotations

import time

import numpy as np

from minips import sparse
from minips.core.roster import WorkerEntry
from minips.errors import RemoteProtocolError
from minips.net.channel import Channel
from minips.serve import validation
from minips.serve.server_io import ServerIO
from minips.wire import messages

__all__ = ["worker_session", "evaluator_session", "initial_weights"]


async def worker_session(io: ServerIO, ch: Channel, w: int) -> None:
    """Worker ``w``'s control channel, until it leaves or is lost."""
    core = io.core
    entry = core.workers[w]
    if entry.ch is not None:  # the newest connection with an id wins; the old one is told why
        io.spawn(validation.replace(entry.ch, w, io.rejected, "global server"))
    entry.ch, entry.left = ch, False
    core.roster.seated(w)
    core.log("joined", worker=w)
    try:
        if entry.group >= 0:  # a reconnect after grouping: tell it its group again
            await io.assign(entry, entry.group)
        while not entry.left:
            _on_message(io, entry, await ch.recv())
    finally:
        if entry.ch is ch:
            entry.ch = None
            core.log("left", worker=w, reason="leave" if entry.left else "connection lost")


def _on_message(io: ServerIO, entry: WorkerEntry, msg: messages.Message) -> None:
    """Handle one control message."""
    if isinstance(msg, messages.Stats):
        validation.check_stats(msg)
        io.perform(io.core.on_stats(entry.id, msg, time.monotonic()))
    elif isinstance(msg, messages.InitWeights):
        io.perform(io.core.on_initial(initial_weights(msg)))
    elif isinstance(msg, messages.Leave):
        entry.left = True
    else:
        raise validation.unexpected(msg, "worker on the control channel")


def initial_weights(msg: messages.InitWeights) -> np.ndarray:
    """(n,) float32 initial weights a worker sent (the server was started without --init); their
    size is checked by the message (``messages.MAX_PARAMS``)."""
    w = sparse.decode_vector(msg.encoding, msg.codec, msg.buffers, msg.size)
    if not isinstance(w, np.ndarray):
        raise RemoteProtocolError("initial weights must be dense", got=msg.encoding)
    return w.astype(np.float32)


async def evaluator_session(io: ServerIO, ch: Channel) -> None:
    """PULL -> WEIGHTS until LEAVE; the answer with the final weights sets ``evaluated_final``."""
    while True:
        msg = await ch.recv()
        if isinstance(msg, messages.Leave):
            return
        if not isinstance(msg, messages.Pull):
            raise validation.unexpected(msg, "evaluator")
        await io.weights_ready.wait()
        final = io.core.done and io.finished.is_set()
        await ch.send(io.core.weights_message(final=final))
        if final:
            io.evaluated_final.set()
