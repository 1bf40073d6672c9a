"""The global server's sessions with workers (control channel) and evaluators.

A worker's control session carries STATS (calibration at clock 0, then its measured speed every
second), an optional INIT_WEIGHTS with its initial weights (when the server had none yet:
WELCOME said ``need_init``; the first one to arrive is taken) and LEAVE; the server answers
with ASSIGN when the worker's group or ratio is set or changes. An evaluator PULLs the global
weights every few seconds until the run is over.

Invariants: a worker has at most one control channel (a new connection with its id replaces
the old one, which gets ERROR ``replaced``); STATS clocks are not compared (they count steps in
the worker's current group and start again after a move); the initial weights are taken once,
dense, with a bounded size.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from minips import protocol, sparse, validation
from minips.errors import RemoteProtocolError
from minips.roster import WorkerEntry

if TYPE_CHECKING:
    from minips.server import GlobalServer

__all__ = ["worker_session", "evaluator_session"]


async def worker_session(srv: GlobalServer, ch: Any, w: int) -> None:
    """Worker ``w``'s control channel, until it leaves or is lost."""
    entry = srv.workers[w]
    if entry.ch is not None:  # the newest connection with an id wins; the old one is told why
        srv.spawn(validation.replace(entry.ch, w, srv.rejected, "global server"))
    entry.ch, entry.left = ch, False
    srv.roster.seated(w)
    srv.log("joined", worker=w)
    try:
        if entry.group >= 0:  # a reconnect after grouping: tell it its group again
            await srv.assign(entry, entry.group)
        while not entry.left:
            _on_message(srv, entry, await ch.recv())
    finally:
        if entry.ch is ch:
            entry.ch = None
            srv.log("left", worker=w, reason="leave" if entry.left else "connection lost")


def _on_message(srv: GlobalServer, entry: WorkerEntry, msg: Any) -> None:
    """Handle one control message."""
    if isinstance(msg, protocol.Stats):
        validation.check_stats(msg)
        srv.on_stats(entry, msg)
    elif isinstance(msg, protocol.InitWeights):
        _on_initial(srv, initial_weights(msg))
    elif isinstance(msg, protocol.Leave):
        entry.left = True
    else:
        raise validation.unexpected(msg, "worker on the control channel")


def _on_initial(srv: GlobalServer, weights: np.ndarray) -> None:
    """The first initial weights are taken. Every worker that joined before they arrived was told
    ``need_init``, so more may follow: those are dropped if their size is the run's."""
    if srv.weights is None:
        srv.weights = weights
        srv.weights_ready.set()
    elif weights.size != srv.weights.size:
        raise RemoteProtocolError("initial weights of another model size",
                                  expected=srv.weights.size, got=weights.size)


def initial_weights(msg: Any) -> np.ndarray:
    """(n,) float32 initial weights a worker sent (the server was started without --init); their
    size is checked by the message (``global_messages.MAX_PARAMS``)."""
    w = sparse.decode_gradient(msg.encoding, msg.codec, msg.buffers, msg.size)
    if not isinstance(w, np.ndarray):
        raise RemoteProtocolError("initial weights must be dense", got=msg.encoding)
    return w.astype(np.float32)


async def evaluator_session(srv: GlobalServer, ch: Any) -> None:
    """PULL -> GLOBAL_WEIGHTS until LEAVE; the answer with the final weights sets
    ``evaluated_final``."""
    while True:
        msg = await ch.recv()
        if isinstance(msg, protocol.Leave):
            return
        if not isinstance(msg, protocol.Pull):
            raise validation.unexpected(msg, "evaluator")
        await srv.weights_ready.wait()
        final = srv.done and srv.finished.is_set()
        await ch.send(srv.weights_message(final=final))
        if final:
            srv.evaluated_final.set()
