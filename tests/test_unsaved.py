"""A `minips group` process's exchanges that a global server resumed from its checkpoint lacks
are sent again exactly once (exchange.py, exchange.py), against the real merge, snapshot and
resume of ``GlobalServer`` with made-up seqs; no group process, no network for the group side.

Deltas are whole numbers, so every sum is exact: after each resume and the exchanges that
follow it, the global weights and sample count must equal everything the group applied.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from minips.core import actions
from minips.core.config import RunConfig
from minips.core.exchange import ExchangeResult, GroupSync
from minips.core.replay import Unsaved, seqs_in
from minips.core.roster import GroupHandle
from minips.record.checkpoint import load, save
from minips.server import GlobalServer, ServerConfig
from minips.wire import messages

N = 3  # weights


class Sim:
    """One group session against a chain of real global servers (each resumed from the last
    one's checkpoint file), driven step by step."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp = tmp_path
        self.srv = self._server()
        self.srv.perform(self.srv.core.on_initial(np.zeros(N, np.float32)))
        self.srv.core.group_opened(GroupHandle(0, "", [0]), 0.0)
        self.weights = np.zeros(N, np.float32)  # the group's weights
        self.xchg = GroupSync(self.weights)
        self.applied, self.samples = np.zeros(N, np.float32), 0  # all the group ever applied
        self.files: list[Path] = []  # the server's snapshots, written; the last two may be lost
        self.servers = [self.srv]

    def _server(self) -> GlobalServer:
        cfg = ServerConfig(run=RunConfig(lr_warmup=0.0, workers=1, mode="ssp"), port=0,
                           token="unsaved-test-secret-0123", run_dir=str(self.tmp),
                           external_groups=1, checkpoint_every_s=0.0)
        return GlobalServer(cfg, None)

    def push(self, k: int) -> None:
        """A worker's push applied in the group: weights move by k, 10*k samples."""
        self.weights += np.float32(k)
        self.xchg.count(10 * k, 0.1, 1.0)
        self.applied += np.float32(k)
        self.samples += 10 * k

    def exchange(self, lose_reply: bool = False) -> None:
        """The pending exchange (if any) and a new one, as GroupServer._exchange sends them."""
        if self.xchg.pending is not None and not self._send(self.xchg.pending, lose_reply):
            return
        self._send(self.xchg.begin(self.weights, {}), lose_reply)

    def _send(self, out: Any, lose_reply: bool) -> bool:
        merged = self.srv.core.merge(0, out.delta, out.stats, 0.0)
        res = actions.reply(merged, ExchangeResult)
        reply = self.srv.core.merger.exchange_reply(0, res.weights, self.srv.core.done)
        if lose_reply:
            return False
        saved = seqs_in(reply.info, "saved_exchanges", self.xchg.session)
        self.xchg.complete(self.weights, out, ExchangeResult(
            res.weights, res.version, res.done, res.samples, saved))
        return True

    def snapshot(self) -> None:
        path = self.tmp / f"snapshot-{len(self.files)}.npz"
        save(path, self.srv.core.checkpoint_state())
        self.files.append(path)

    async def resume(self, newest_written: bool = True) -> None:
        """kill -9 and --resume: from the newest snapshot, or the one before (the newest one's
        write was in flight); then the group reconnects (PULL -> WEIGHTS, reload)."""
        path = self.files[-1 if newest_written or len(self.files) < 2 else -2]
        self.files = [path]
        self.srv = self._server()
        self.srv.restore(load(path))
        await self.srv.start()
        self.servers.append(self.srv)
        await self.reconnect()

    async def reconnect(self) -> None:
        h = self.srv.core.groups[0]
        info = actions.reply(self.srv.core.group_pull(h.id, 0.0), messages.GlobalWeights).info
        held = seqs_in(info, "last_exchange", self.xchg.session)
        assert held is not None and self.srv.core.weights is not None
        self.weights, _ = self.xchg.rebase(self.weights, self.srv.core.weights.copy(), held[0])

    def assert_all_merged(self) -> None:
        self.exchange()
        self.exchange()  # the first may have been a pending one
        assert self.xchg.pending is None
        np.testing.assert_array_equal(self.srv.core.weights, self.applied)
        assert self.srv.core.samples == self.samples
        np.testing.assert_array_equal(self.weights, self.applied)

    async def close(self) -> None:
        for srv in self.servers:
            await srv.close()


@pytest.fixture
async def sim(tmp_path: Path) -> Any:
    s = Sim(tmp_path)
    yield s
    await s.close()


async def test_merges_after_the_checkpoint_are_sent_again_once(sim: Sim) -> None:
    for k in (1, 2, 3):
        sim.push(k)
        sim.exchange()
    sim.snapshot()  # holds seqs 1..3
    for k in (4, 5):
        sim.push(k)
        sim.exchange()  # seqs 4, 5: merged, not in the checkpoint
    sim.push(6)  # applied, not exchanged yet
    await sim.resume()
    sim.assert_all_merged()  # 4 + 5 once more, with 6; 1..3 not again
    await sim.reconnect()  # a blip, no restart: nothing to send again
    sim.assert_all_merged()


async def test_a_second_crash_before_a_new_checkpoint_does_not_send_the_replay_twice(
        sim: Sim) -> None:
    for k in (1, 2):
        sim.push(k)
        sim.exchange()
    sim.snapshot()
    sim.push(3)
    sim.exchange()
    await sim.resume()  # seq 3 lost: it goes out again inside seq 4
    sim.push(4)
    sim.exchange()
    await sim.resume()  # the same checkpoint again: 3 and 4 lost, sent once each
    sim.assert_all_merged()


async def test_a_pending_exchange_the_checkpoint_holds_is_answered_as_a_repeat(
        sim: Sim) -> None:
    sim.push(1)
    sim.exchange()
    sim.push(2)
    sim.exchange(lose_reply=True)  # seq 2 merged, its reply lost
    sim.snapshot()  # holds seq 2
    await sim.resume()
    sim.assert_all_merged()
    # the checkpoint's 2, then the check's seqs 3 and 4; seq 2 again would make 5
    assert sim.srv.core.groups[0].merges == 4


async def test_the_snapshot_before_an_interrupted_write_is_covered(sim: Sim) -> None:
    sim.push(1)
    sim.exchange()
    sim.snapshot()  # seq 1, written
    for k in (2, 3):
        sim.push(k)
        sim.exchange()
    sim.snapshot()  # seq 3: its write is killed midway
    sim.push(4)
    sim.exchange()
    await sim.resume(newest_written=False)  # from seq 1: 2, 3 and 4 lost
    sim.assert_all_merged()


async def test_a_crash_before_the_first_reply_loses_nothing(sim: Sim) -> None:
    sim.snapshot()  # holds no exchange of this session
    sim.push(1)
    sim.exchange(lose_reply=True)  # seq 1 merged, reply lost, not in the checkpoint
    await sim.resume()
    sim.assert_all_merged()
    assert sim.xchg.lost_track == 0


@pytest.mark.parametrize("seed", range(12))
async def test_random_faults_never_lose_or_double_a_delta(sim: Sim, seed: int) -> None:
    rng = random.Random(seed)
    sim.snapshot()  # the run's first checkpoint: no exchange yet
    for _ in range(60):
        r = rng.random()
        if r < 0.45:
            sim.push(rng.randint(1, 9))
        elif r < 0.75:
            sim.exchange(lose_reply=rng.random() < 0.2)
        elif r < 0.88:
            sim.snapshot()
        elif r < 0.94:
            await sim.resume(newest_written=rng.random() < 0.5)
        else:
            await sim.reconnect()
    sim.exchange()  # a reply lost last is sent again before the check's own exchanges
    sim.assert_all_merged()
    assert sim.xchg.lost_track == 0
    assert len(sim.xchg.unsaved.after if sim.xchg.unsaved else {}) <= 3  # bounded


def test_the_record_keeps_three_sums_and_says_when_it_cannot_tell() -> None:
    u = Unsaved(1)
    for seq in range(1, 8):
        saved = [0, 0] if seq < 3 else [0, 2] if seq < 6 else [2, 5]  # as replies name them
        u.merged(seq, np.ones(1, np.float32), 10, saved)
    assert sorted(u.after) == [2, 5, 7]
    assert u.after[2].samples == 50 and u.after[5].samples == 20 and u.after[7].samples == 0
    assert u.restore(4, pending=8) is None  # a seq it did not keep: lost, not guessed
    assert u.restore(4, pending=None) is not None  # counts from there on
    u.merged(9, np.ones(1, np.float32), 10, [4, 4])
    assert u.restore(9, pending=9) is not None and sorted(u.after) == [4, 9]
    assert seqs_in({"saved_exchanges": [[7, 3], [8, 4]]}, "saved_exchanges", 8) == [0, 4]
    assert seqs_in({"last_exchange": [8, 4]}, "last_exchange", 8) == [4]
    assert seqs_in({}, "last_exchange", 8) is None  # an older global server
    assert seqs_in({"last_exchange": [8, "4"]}, "last_exchange", 8) is None
