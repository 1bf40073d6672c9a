"""The exact group <-> global exchange (exact_exchange.py: ``ExactSync``, ``BeforeValues``,
``ExactMirror``): a group sends every entry it changed since its last exchange at
its delta, the global server answers every entry its weights changed at since the version the
group holds.

A seeded random sequence of pushes (sparse, dense, empty), PULLs, exchanges (replies lost,
flushes), regroups and rebases drives a GlobalCore and its GroupCores without IO
(test_changelog's ``Cluster``). After every step, bit for bit: each group's copy of the global
weights (``w_sync``) is the global weights as its last reply left them, and its weights equal
that copy wherever it changed nothing since; within float32 rounding (sums): the global weights
plus every group's unsent changes are the initial weights plus every push, each counted once.
Once nobody pushes, two rounds of exchanges leave every group on the global weights bit for bit.
The resume scenarios of test_unsaved run again with the exact exchange.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import test_unsaved
from conftest import records
from test_changelog import WORKERS, Cluster, a_push, bits
from test_exchange import through_a_group_process

from minips import sparse
from minips.core.changelog import ChangeLog
from minips.core.config import RunConfig
from minips.core.exact_exchange import (
    BeforeValues,
    ExactMirror,
    ExactSync,
    group_mirror,
    group_sync,
)
from minips.core.exchange import GroupSync
from minips.wire import messages

N = 2000  # test_changelog's model size


def ints(*xs: int) -> np.ndarray:
    return np.array(xs, dtype=np.uint32)


def run_config(rng: np.random.Generator, merge: str = "sum", xchg_mode: str = "exact"
               ) -> RunConfig:
    mode = str(rng.choice(["asp", "ssp", "bsp", "gssp"]))
    return RunConfig(workers=WORKERS, mode=mode, staleness=2, optimizer_at="worker",
                     compressor="topk", ratio=0.02, xchg_mode=xchg_mode, merge=merge,
                     down_mode="exact", lr_warmup=0.0, sync_every=1_000_000, lease_s=1e9)


class Tracked:
    """A ``Cluster`` with the exact exchange and what the test knows beside it: every change
    a push made to a group's weights (float64), and each group's copy of the global weights as
    its last reply (or PULL of them whole) left it."""

    def __init__(self, run: RunConfig, w0: np.ndarray) -> None:
        self.c = Cluster(run, w0, forget=False)
        self.applied = np.array(w0, np.float64)  # w0 + every change a push made
        self.copies = [np.array(w0) for _ in self.c.groups]  # each group's w_sync, expected

    def event(self, rng: np.random.Generator) -> str:
        """One random event: push, PULL, exchange (reply lost now and then), regroup, rebase."""
        c, roll = self.c, rng.random()
        g = int(rng.integers(len(c.groups)))
        ready = [w for w in range(WORKERS) if c.may_push(w)]
        if roll < 0.5 and ready:
            w = int(rng.choice(ready))
            self.applying(lambda: c.push(w, a_push(rng)))
            return "push"
        if roll < 0.6:
            c.pull(int(rng.integers(WORKERS)))
            return "pull"
        if roll < 0.9:
            lose = bool(rng.random() < 0.25)
            c.exchange(g, lose, final=bool(rng.random() < 0.1))
            if not lose:
                self.copies[g] = self.glob().copy()  # the reply: G as the merge left it
            return "exchange"
        if roll < 0.96:
            w = int(rng.integers(WORKERS))  # a BSP round its leave completes is applied
            self.applying(lambda: c.regroup(w, g))
            return "regroup"
        c.rebase(g)
        self.copies[g] = self.glob().copy()
        return "rebase"

    def applying(self, event: Callable[[], None]) -> None:
        """``event`` applies pushes: count what it changed in the groups' weights."""
        before = [group.weights.astype(np.float64) for group in self.c.groups]
        event()
        for group, was in zip(self.c.groups, before, strict=True):
            self.applied += group.weights.astype(np.float64) - was

    def glob(self) -> np.ndarray:
        assert self.c.glob.weights is not None
        return self.c.glob.weights

    def check(self) -> None:
        """Each group's copy is G as its last reply left it, bit for bit; G plus every
        group's unsent changes is w0 plus every push, each once (float32 sums: a tolerance)."""
        total = self.glob().astype(np.float64)
        for group, copy in zip(self.c.groups, self.copies, strict=True):
            sync = group.xchg.w_sync
            assert np.array_equal(bits(sync), bits(copy))
            total += group.weights.astype(np.float64) - sync
            pending = group.xchg.pending  # merged, its reply lost: in G already
            if pending is not None:
                delta = pending.delta
                total -= delta.to_dense() if isinstance(delta, sparse.SparseVector) else delta
        np.testing.assert_allclose(total, self.applied, rtol=0, atol=2e-5)

    def settle(self) -> None:
        """Nobody pushes: two rounds of exchanges (the first sends what is left and any
        pending one; the second brings every group what the others sent)."""
        for _ in range(2):
            for g in range(len(self.c.groups)):
                if self.c.groups[g].xchg.pending is not None:  # the repeat goes first
                    self.c.exchange(g, lose=False, final=False)
                self.c.exchange(g, lose=False, final=False)
                self.copies[g] = self.glob().copy()


@pytest.mark.parametrize("seed", range(30))
def test_any_sequence_keeps_the_copies_exact_and_every_push_counted_once(seed: int) -> None:
    rng = np.random.default_rng(seed)
    run = run_config(rng)
    w0 = rng.standard_normal(N).astype(np.float32)
    t = Tracked(run, w0)
    assert all(isinstance(group.xchg, ExactSync) for group in t.c.groups)
    seen: set[str] = set()
    for _ in range(150):
        seen.add(t.event(rng))
        t.check()
        w = int(rng.integers(WORKERS))  # the exact downlink: every change the log noted
        t.c.pull(w)
        copy, _ = t.c.copies[w]
        assert copy is not None
        assert np.array_equal(bits(copy), bits(t.c.groups[t.c.where[w]].weights))
    t.settle()
    t.check()
    for group in t.c.groups:  # every group on G, bit for bit, nothing left unsent
        assert np.array_equal(bits(group.weights), bits(t.glob()))
    assert {"push", "exchange"} <= seen


@pytest.mark.parametrize("seed", range(15))
def test_the_exact_exchange_ends_where_the_dense_one_does(seed: int) -> None:
    """Against ``--xchg-ratio 1`` (every entry, dense): the same sums, so the same weights
    within float32 rounding, step for step (the merge: the mean over groups)."""
    rng = np.random.default_rng(500 + seed)
    run = run_config(rng, merge="mean")
    w0 = rng.standard_normal(N).astype(np.float32)
    dense = dataclasses.replace(run, xchg_mode="topk", xchg_ratio=1.0)
    exact, twin = Tracked(run, w0), Tracked(dense, w0)
    for _ in range(120):
        state = rng.bit_generator.state
        exact.event(rng)
        rng.bit_generator.state = state
        twin.event(rng)
        np.testing.assert_allclose(exact.glob(), twin.glob(), rtol=0, atol=2e-5)
        for a, b in zip(exact.c.groups, twin.c.groups, strict=True):
            np.testing.assert_allclose(a.weights, b.weights, rtol=0, atol=2e-5)


# -- the work follows the changes --------------------------------------------------------------

def test_an_exchange_sends_what_the_pushes_changed_and_looks_nowhere_else() -> None:
    n = 1_000_000
    w = np.zeros(n, np.float32)
    xchg = ExactSync(w)
    xchg.moving(w, ints(5, 11, 7))
    w[[5, 11, 7]] += np.float32(1.5)
    w[3] = 9.0  # behind its back: never looked at, so never sent (no pass over n)
    out = xchg.begin(w, {})
    assert isinstance(out.delta, sparse.SparseVector)
    assert out.delta.indices.tolist() == [5, 7, 11] and out.delta.values.tolist() == [1.5] * 3
    assert xchg.before.dense is None  # no (n,) copy of the global weights is kept
    xchg.pending = None
    xchg.moving(w, None)  # a dense change (the optimizer on the servers): sent dense
    w += np.float32(1.0)
    assert isinstance(xchg.begin(w, {}).delta, np.ndarray)
    assert not any(isinstance(v, np.ndarray) and v.dtype == np.float32 and v.size == n
                   and v is not w for v in vars(xchg).values())


def test_the_answer_is_what_the_global_log_names_since_the_groups_version() -> None:
    g = np.arange(10, dtype=np.float32)
    log = ChangeLog(10, max_entries=100)  # (a quarter of n by default)
    mirror = ExactMirror(10)
    assert isinstance(mirror.answer(g, False, log), np.ndarray)  # unknown copy: dense once
    g[[2, 4]] += 1
    log.note(ints(2, 4))
    g[6] = 60.0  # behind the log's back: not answered (the answer never compares n entries)
    first = mirror.answer(g, False, log)
    assert isinstance(first, sparse.SparseVector) and first.indices.tolist() == [2, 4]
    g[8] += 1
    log.note(ints(8))
    again = mirror.answer(g, True, log)  # the same seq again: its reply was lost
    assert isinstance(again, sparse.SparseVector) and again.indices.tolist() == [2, 4, 8]
    g[1] += 1
    log.note(ints(1))
    new = mirror.answer(g, False, log)  # a new seq: the repeat's reply was taken
    assert isinstance(new, sparse.SparseVector) and new.indices.tolist() == [1]
    mirror.reset(g, log.version)  # a PULL of the weights whole
    none = mirror.answer(g, False, log)
    assert isinstance(none, sparse.SparseVector) and none.nnz == 0
    assert isinstance(mirror.answer(g, False, ChangeLog(10)), np.ndarray)  # a log too young


def test_a_repeated_exchange_is_merged_once_and_its_answer_covers_the_lost_one() -> None:
    rng = np.random.default_rng(7)
    run = dataclasses.replace(run_config(rng), mode="asp")
    w0 = np.zeros(N, np.float32)
    c = Cluster(run, w0, forget=False)
    group = c.groups[0]
    c.exchange(0, lose=False, final=False)  # the first answer is whole (a copy not known yet)
    c.push(0, sparse.SparseVector(ints(3, 9), np.array([3.0, 6.0], np.float32), N))
    first = group.weights[[3, 9]].tolist()  # -1 and -2: a third each (lr / 3 live workers)
    out, _ = c.exchange(0, lose=True, final=False)  # merged; the group never hears of it
    c.push(0, sparse.SparseVector(ints(9, 20), np.array([3.0, 6.0], np.float32), N))
    again, res = c.exchange(0, lose=False, final=False)  # the pending one, unchanged
    assert again is out and isinstance(res.weights, sparse.SparseVector)
    assert res.weights.indices.tolist() == [3, 9]  # what the lost reply set
    assert c.glob.weights is not None and c.glob.weights[[3, 9, 20]].tolist() == [*first, 0]
    c.exchange(0, lose=False, final=False)  # what was pushed while it was in flight
    assert c.glob.weights[[3, 9, 20]].tolist() == [-1, -3, -2]
    assert np.array_equal(group.weights, c.glob.weights) and c.glob.version == 3


def test_the_mode_is_a_run_setting() -> None:
    w = np.zeros(4, np.float32)
    exact, topk = RunConfig(xchg_mode="exact"), RunConfig()
    assert isinstance(group_sync(exact, w), ExactSync)
    assert type(group_sync(topk, w)) is GroupSync and topk.xchg_mode == "topk"
    assert isinstance(group_mirror(exact, 4), ExactMirror)
    with pytest.raises(ValueError, match="xchg_mode"):
        RunConfig(xchg_mode="dense").validate()


def test_before_values_are_kept_on_first_write_only() -> None:
    w = np.arange(6, dtype=np.float32)
    b = BeforeValues(6)
    b.save(w, ints(4, 1))
    w[[4, 1]] = [40.0, 10.0]
    b.save(w, ints(1, 2))  # 1 again: its first value stays
    w[[1, 2]] = [11.0, 20.0]
    assert b.at(w, ints(0, 1, 2, 4)).tolist() == [0, 1, 2, 4]
    assert b.materialize(w).tolist() == list(range(6))
    b.update(ints(1, 3), np.array([100.0, 300.0], np.float32))  # 3 is not held: stays the weights
    idx, val = b.take(w)
    assert idx.tolist() == [1, 2, 4] and val.tolist() == [100, 2, 4]
    assert b.take(w)[0].size == 0  # taken: the record starts again
    b.save(w, ints(2))
    assert b.covers(ints(1, 2, 5), ints(2, 5)) and not b.covers(ints(1, 2, 5), ints(2, 3))
    assert b.take(w)[0].tolist() == [2]  # the marks leave the record as it was


def test_a_groups_checkpoint_holds_its_copy_and_the_next_exchange_sends_the_same() -> None:
    rng = np.random.default_rng(9)
    run = dataclasses.replace(run_config(rng), mode="asp")
    c = Cluster(run, rng.standard_normal(N).astype(np.float32), forget=False)
    c.exchange(0, lose=False, final=False)
    c.push(0, a_push(rng))
    c.exchange(0, lose=True, final=False)  # pending: its entries' copy is what it was before
    c.push(1, a_push(rng))
    group = c.groups[0]
    state = group.state_dict()
    again = type(group)(0, run, np.zeros(N, np.float32), members=[0, 1, 2])
    again.load_state_dict(state, 0.0)
    assert np.array_equal(bits(again.xchg.w_sync), bits(group.xchg.w_sync))
    assert np.array_equal(bits(again.weights), bits(group.weights))
    # resumed, it sends everything its copy lacks (the pending exchange's part too: replay)
    lacks = group.weights - group.xchg.w_sync
    theirs = again.begin_exchange(False, {"bytes_in": 0, "bytes_out": 0}).delta
    got = theirs.to_dense() if isinstance(theirs, sparse.SparseVector) else theirs
    assert np.array_equal(bits(got), bits(lacks))


# -- resume: test_unsaved's scenarios with the exact exchange --------------------------------

class ExactSim(test_unsaved.Sim):
    """test_unsaved's group session, with the exact exchange both sides."""

    def __init__(self, tmp_path: Path) -> None:
        super().__init__(tmp_path)
        self.xchg = ExactSync(self.weights)

    def _server(self) -> Any:
        srv = super()._server()
        srv.core.run = dataclasses.replace(srv.core.run, xchg_mode="exact")
        return srv

    def push(self, k: int) -> None:
        self.xchg.moving(self.weights, None)  # every entry moves
        super().push(k)


SCENARIOS = [test_unsaved.test_merges_after_the_checkpoint_are_sent_again_once,
             test_unsaved.test_a_second_crash_before_a_new_checkpoint_does_not_send_the_replay_twice,
             test_unsaved.test_a_pending_exchange_the_checkpoint_holds_is_answered_as_a_repeat,
             test_unsaved.test_the_snapshot_before_an_interrupted_write_is_covered,
             test_unsaved.test_a_crash_before_the_first_reply_loses_nothing]


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda f: f.__name__[5:40])
async def test_a_resumed_global_server_gets_every_exchange_once(
        tmp_path: Path, scenario: Any) -> None:
    sim = ExactSim(tmp_path)
    try:
        assert isinstance(sim.srv.core.merger.mirror(0), ExactMirror)
        await scenario(sim)
    finally:
        await sim.close()


@pytest.mark.parametrize("seed", range(6))
async def test_random_faults_with_the_exact_exchange_never_lose_or_double_a_delta(
        tmp_path: Path, seed: int) -> None:
    sim = ExactSim(tmp_path)
    try:
        await test_unsaved.test_random_faults_never_lose_or_double_a_delta(sim, seed)
    finally:
        await sim.close()


# -- a real `minips group` process over loopback ---------------------------------------------

@pytest.mark.timeout(90)
async def test_a_group_process_exchanges_every_change_and_nothing_else(tmp_path: Path) -> None:
    """One hand-driven worker pushes sparse updates (the workers' optimizer) through a real
    `minips group` with the exact exchange: every exchange after the first sends and gets only
    the entries that changed, and the global weights end as every update applied, once."""
    n, pushes, k = 5000, 60, 50
    rng = np.random.default_rng(11)
    run = RunConfig(lr_warmup=0.0, workers=1, mode="asp", sync_every=2, optimizer_at="worker",
                    compressor="topk", ratio=k / n, epochs=1.0, train_size=pushes,
                    xchg_mode="exact", down_mode="exact")
    applied = np.zeros(n, np.float64)

    def an_update(weights: messages.Weights) -> sparse.SparseVector:
        idx = np.sort(rng.choice(n, k, replace=False)).astype(np.uint32)
        update = sparse.SparseVector(idx, rng.standard_normal(k).astype(np.float32), n)
        applied[idx] -= update.values  # the group applies it at the outer lr, 1
        return update

    srv, clock = await through_a_group_process(tmp_path, run, n, an_update)
    assert srv.core.weights is not None and srv.core.samples == clock
    np.testing.assert_allclose(srv.core.weights, applied, rtol=0, atol=1e-5)  # all, once
    xchg = records(tmp_path / "group-0.jsonl", event="exchange")
    assert len(xchg) >= pushes // 2 - 1
    assert all(0 < r["sent"] <= 2 * k for r in xchg if r["sent"])  # two pushes' entries
    assert all(r["got"] <= r["sent"] for r in xchg)  # one group: what it sent, back as set
