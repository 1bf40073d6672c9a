"""A real in-process global server with `minips group` processes played by hand over loopback.

``Cluster`` starts a ``GlobalServer`` (``--external-groups``) on port 0, connects ``groups``
hand-written group processes (role ``group``) and one worker control channel per group, so the
grouping runs and every group gets its ASSIGN; ``pull`` / ``exchange`` speak for a group, and
``evaluate`` PULLs the global weights as an evaluator does. Shared by the tests of the counters'
bounds and of exactly-once (tests/test_counters.py, tests/test_exactly_once.py).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
from conftest import recv_as

from minips import sparse
from minips.core.config import RunConfig
from minips.net import transport
from minips.net.channel import Channel
from minips.server import GlobalServer, ServerConfig
from minips.wire import control, messages
from minips.wire.fields import Payload

TOKEN = "raw-group-test-secret-0123"
N = 6  # weights


class Cluster:
    """A global server, ``groups`` hand-driven group processes, one worker per group."""

    def __init__(self, tmp: Path, groups: int = 1, **run: Any) -> None:
        mode = {"mode": "gssp", "groups": groups} if groups > 1 else {"mode": "ssp"}
        cfg = ServerConfig(run=RunConfig(lr_warmup=0.0, workers=groups, **mode, **run),
                           host="127.0.0.1", port=0, token=TOKEN, run_dir=str(tmp),
                           calib_timeout_s=10.0, linger_s=1.0, external_groups=groups)
        self.srv = GlobalServer(cfg, np.zeros(N, np.float32))
        self.n_groups = groups
        self.port = 0
        self.groups: dict[int, Channel] = {}  # group id -> its group process's channel
        self.ctls: list[Channel] = []
        self.others: list[Channel] = []

    async def start(self) -> Cluster:
        self.port = await self.srv.start()
        chans = [await self.connect_group(7300 + i) for i in range(self.n_groups)]
        for w in range(self.n_groups):  # speeds 1:4, so gssp makes one group of each
            ctl = await transport.connect("127.0.0.1", self.port, role="worker", worker_id=w,
                                          token=TOKEN)
            await ctl.send(control.Stats(clock=0, step_time=0.01 * 4 ** w, loss=1.0))
            self.ctls.append(ctl)
        for ch in chans:
            self.groups[(await recv_as(ch, control.Assign)).group] = ch
        return self

    async def connect_group(self, port: int) -> Channel:
        ch = await transport.connect("127.0.0.1", self.port, role="group", token=TOKEN,
                                     address=f"127.0.0.1:{port}")
        self.others.append(ch)
        return ch

    async def pull(self, ch: Channel) -> messages.GlobalWeights:
        await ch.send(messages.Pull(clock=0))
        return await recv_as(ch, messages.GlobalWeights)

    async def exchange(self, ch: Channel, delta: float = 1.0,
                       **counters: Any) -> messages.Message:
        """EXCHANGE a dense delta of ``delta`` everywhere with ``counters``; the answer."""
        encoding, codec, buffers = sparse.encode_vector(np.full(N, delta, np.float32))
        fields = {"session": 1, "seq": 1, **counters}
        await ch.send(messages.Exchange(**fields, payload=Payload(encoding, codec,
                                        tuple(buffers))))
        return await asyncio.wait_for(ch.recv(), 10)

    async def evaluate(self) -> messages.GlobalWeights:
        """An evaluator's PULL on a fresh connection: the global weights and counters."""
        ev = await transport.connect("127.0.0.1", self.port, role="evaluator", token=TOKEN)
        try:
            await ev.send(messages.Pull(clock=0))
            return await recv_as(ev, messages.GlobalWeights)
        finally:
            await ev.close()

    def weights(self) -> np.ndarray:
        assert self.srv.core.weights is not None
        return self.srv.core.weights.copy()

    async def close(self) -> None:
        for ch in self.ctls + self.others:
            await ch.close()
        await self.srv.close()


def values(w: messages.GlobalWeights) -> np.ndarray:
    """(n,) float32 the weights a GLOBAL_WEIGHTS carries."""
    return np.asarray(sparse.decode_vector(w.payload, w.size))


async def closed(ch: Channel, timeout: float = 5.0) -> bool:
    """The peer closed ``ch`` within ``timeout`` seconds (messages before that are skipped)."""
    async def drain() -> None:
        try:
            while True:
                await ch.recv()
        except (ConnectionError, asyncio.IncompleteReadError):
            return

    try:
        await asyncio.wait_for(drain(), timeout)
    except asyncio.TimeoutError:
        return False
    return True
