"""The change log (core/changelog.py) and the work it bounds: the exact downlink, the group's
exchange and the global server's answer to a group look only at what changed.

A seeded random sequence of pushes, PULLs, exchanges (replies lost, flushes), regroups (workers
moving to the other group, or leaving and coming back) and rebases drives a GlobalCore and its
GroupCores (two in GSSP) without IO: a worker that PULLs `since` the version it holds rebuilds
its group's weights bit for bit (the exact downlink),
and a twin cluster whose logs forget everything (so every step takes the old pass over n) ends
each step with the same weights, deltas and replies."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

from minips import sparse
from minips.core import actions, changelog
from minips.core.changelog import ChangeLog, TopDiff
from minips.core.config import RunConfig
from minips.core.downlink import Downlink, ExactDownlink, apply_weights
from minips.core.exchange import ExchangeResult, GroupMirror, GroupSync
from minips.core.global_core import GlobalCore
from minips.core.group_core import GroupCore
from minips.core.roster import GroupHandle
from minips.wire import messages
from minips.wire.fields import Payload

N = 2000
WORKERS = 3


def ints(*xs: int) -> np.ndarray:
    return np.array(xs, dtype=np.uint32)


def since(log: ChangeLog, v: int) -> list[int]:
    """``log.since(v)`` as a list (it must know)."""
    got = log.since(v)
    assert got is not None
    return [int(i) for i in got]


def test_the_log_names_every_index_changed_since_a_version_and_no_more() -> None:
    log = ChangeLog(100)
    assert since(log, 0) == []
    log.note(ints(5, 9))
    log.note(ints(9, 1))
    assert since(log, 0) == [1, 5, 9] and since(log, 1) == [1, 9]
    assert since(log, 2) == [] and log.since(3) is None and log.since(-1) is None
    log.note(None)  # a dense change: nothing before it can be answered sparsely
    assert log.since(2) is None and since(log, 3) == [] and log.oldest == 3


def test_the_log_is_bounded_in_versions_and_entries() -> None:
    log = ChangeLog(1000, max_versions=3, max_entries=10)
    for v in range(5):
        log.note(ints(v))
    assert log.oldest == 2 and log.since(1) is None and since(log, 2) == [2, 3, 4]
    log.note(np.arange(9, dtype=np.uint32))  # 9 + the newest earlier one: 10 at most
    assert log.oldest == 4 and len(since(log, 4)) == 9  # versions 5 and 6: {4} and 0..8
    log.note(np.arange(11, dtype=np.uint32))  # alone past the bound: none kept
    assert log.oldest == log.version == 7 and log.since(6) is None


def test_answers_brought_forward_and_merged_are_the_unions_themselves() -> None:
    rng = np.random.default_rng(3)
    log = ChangeLog(500, max_versions=12, max_entries=400)
    noted: list[np.ndarray | None] = []
    for _ in range(300):
        if rng.random() < 0.6:
            k = int(rng.integers(0, 60))
            idx = rng.choice(500, k, replace=False).astype(np.uint32)  # any order
            idx = np.sort(idx) if rng.random() < 0.8 else idx
            noted.append(None if rng.random() < 0.02 else idx)
            log.note(noted[-1])
        v = int(rng.integers(max(0, log.version - 14), log.version + 1))
        got = log.since(v)
        later = noted[v:]
        if any(x is None for x in later) or v < log.oldest:
            assert got is None
            continue
        want = sorted(set(np.concatenate([np.empty(0, np.uint32), *later]).tolist()))
        assert got is not None and got.dtype == np.uint32 and got.tolist() == want


# -- the paths follow the changes: what the log does not name is not looked at ------------------

def test_a_sparse_exchange_looks_only_where_the_weights_changed_or_were_left_behind() -> None:
    w = np.zeros(N, np.float32)
    xchg = GroupSync(w, kept=0.001)  # k = 2
    w[[5, 7, 11]] = [3.0, 2.0, 1.0]
    out = xchg.begin(w, {}, changed=ints(5, 11))  # 7 is not named: not looked at
    assert isinstance(out.delta, sparse.SparseVector) and out.delta.indices.tolist() == [5, 11]
    xchg.complete(w, out, ExchangeResult(sparse.SparseVector.empty(N), 1, False))
    w[3] = 0.5
    again = xchg.begin(w, {}, changed=ints(3))
    assert isinstance(again.delta, sparse.SparseVector)
    assert again.delta.indices.tolist() == [3]  # nothing was left behind the first time
    # (5 and 11 were sent: the rebase on the reply took them back to w_sync's 0)
    whole = GroupSync(np.zeros(N, np.float32), kept=0.001).begin(w, {})  # no log: all n
    assert isinstance(whole.delta, sparse.SparseVector)
    assert whole.delta.indices.tolist() == [3, 7]


def test_top_diffs_of_one_size_share_one_selector_and_each_answers_exactly(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A group's exchange and the mirror of it pass over n with one selector per size (one
    (n,) scratch for all the groups of a process), and each still gets its own exact top-k:
    the k largest |now - copy|, ties to the lowest index."""
    n, k = 50_000, 500  # past the selector's small-vector partition: the sampled path
    made: list[int] = []

    class Counted(changelog.TopKSelector):
        def __init__(self, size: int) -> None:
            made.append(size)
            super().__init__(size)

    monkeypatch.setattr(changelog, "TopKSelector", Counted)
    monkeypatch.setattr(TopDiff, "_selectors", {})
    rng = np.random.default_rng(5)
    diffs = [TopDiff(n, k), TopDiff(n, k)]
    for _ in range(3):
        for top in diffs:
            now, copy = (rng.standard_normal(n).astype(np.float32) for _ in range(2))
            idx, diff, left = top.top(now, copy, None)
            mag = np.abs(now - copy)
            want = np.sort(np.argsort(-mag, kind="stable")[:k])
            assert idx.tolist() == want.tolist() and left is None
            np.testing.assert_array_equal(diff, (now - copy)[want])
    assert made == [n] and TopDiff._selectors[n].path == "sample"


def test_a_group_mirror_answers_from_what_the_global_weights_changed_at() -> None:
    g = np.zeros(N, np.float32)
    log = ChangeLog(N)
    rep = GroupMirror(N, 0.001)  # k = 2
    rep.reset(g, log.version)
    g[[4, 8, 12]] = [1.0, 3.0, 2.0]
    g[20] = 9.0  # changed behind the log's back: not looked at
    log.note(ints(4, 8, 12))
    first = rep.answer(g, False, log)
    assert isinstance(first, sparse.SparseVector) and first.indices.tolist() == [8, 12]
    second = rep.answer(g, False, log)  # 4 was left behind: it goes now, and only it
    assert isinstance(second, sparse.SparseVector) and second.indices.tolist() == [4]


def test_the_compressed_downlink_chooses_among_changed_coordinates_and_keeps_its_sums() -> None:
    rng = np.random.default_rng(0)
    w = rng.standard_normal(N).astype(np.float32)
    log = ChangeLog(N)
    d = Downlink(w, 0.002, drift=1.0, changes=log)  # k = 4
    for _ in range(30):
        idx = np.sort(rng.choice(N, 9, replace=False)).astype(np.uint32)
        before = d.moving(w, idx)
        w[idx] += rng.standard_normal(9).astype(np.float32)
        log.note(idx)
        d.moved(w, idx, before)
        assert d.drift_now() == pytest.approx(d.drift(w), rel=1e-6, abs=1e-12)
        d.publish(w)
        assert d.drift_now() == pytest.approx(d.drift(w), rel=1e-6, abs=1e-12)
        assert d.behind is not None
        assert set(np.flatnonzero(w != d.w_pub).tolist()) == set(d.behind.tolist())
    w[0] += 100.0  # behind the log's back: the downlink does not see it
    d.publish(w)
    assert d.w_pub[0] != w[0]


# -- any sequence, both ways --------------------------------------------------------------------

def run_config(rng: np.random.Generator, down_mode: str) -> RunConfig:
    mode = str(rng.choice(["asp", "ssp", "bsp", "gssp"]))
    xchg = [0.01, 0.05, 1.0][int(rng.integers(3))]
    return RunConfig(workers=WORKERS, mode=mode, staleness=2, optimizer_at="worker",
                     compressor="topk", ratio=0.02, xchg_ratio=xchg, down_mode=down_mode,
                     down_drift=0.05, lr_warmup=0.0, sync_every=1_000_000, lease_s=1e9)


class Cluster:
    """A GlobalCore and its group cores (two in GSSP, one otherwise) of WORKERS workers, no
    IO; ``forget``: every change log forgets at once, so every step takes the pass over all n
    it took before the log."""

    def __init__(self, run: RunConfig, w0: np.ndarray, forget: bool) -> None:
        self.glob = GlobalCore(run, w0, regroup=False, wall=lambda: 1e9)
        count = 2 if run.mode == "gssp" else 1
        self.where = {w: w % count for w in range(WORKERS)}  # worker -> its group now
        for w in self.where:
            self.glob.roster.admit(w)
        handles = [GroupHandle(g, f"h:{g}", self.members(g)) for g in range(count)]
        self.glob.groups_formed(handles, dict(self.where), 0.0)
        self.groups = [GroupCore(g, run, w0, members=self.members(g)) for g in range(count)]
        if forget:
            self.glob.merger.changes = ChangeLog(N, max_entries=0)
            for group in self.groups:
                group.changes = ChangeLog(N, max_entries=0)
                if group.downlink is not None:
                    group.downlink.changes = group.changes
        self.clocks = {w: self._clock(self.groups[g].join(w, 0.0)) for w, g in self.where.items()}
        self.copies: dict[int, tuple[np.ndarray | None, int]] = {w: (None, -1) for w in self.where}

    def members(self, g: int) -> list[int]:
        return [w for w, h in self.where.items() if h == g]

    @staticmethod
    def _clock(actions: list[Any]) -> int:
        return int(actions[0].msg.clock)

    def may_push(self, w: int) -> bool:
        return self.groups[self.where[w]].table.may_start(w)

    def push(self, w: int, grad: np.ndarray | sparse.SparseVector) -> None:
        self.clocks[w] += 1
        enc, codec, bufs = sparse.encode_vector(grad)
        msg = messages.Push(clock=self.clocks[w], samples=4, payload=Payload(enc, codec,
                            tuple(bufs)))
        self.groups[self.where[w]].push(w, msg, 0.0)

    def pull(self, w: int) -> messages.Weights:
        """Worker ``w`` PULLs since the version it holds and applies the answer."""
        group = self.groups[self.where[w]]
        group.publish()
        copy, held = self.copies[w]
        msg = group.weights_message(w, [], held, self.clocks[w])
        self.copies[w] = (apply_weights(copy, held, msg, N), msg.version)
        return msg

    def exchange(self, g: int, lose: bool, final: bool) -> tuple[Any, Any]:
        group = self.groups[g]
        out = group.begin_exchange(final, {"bytes_in": 0, "bytes_out": 0})
        res = actions.reply(self.glob.merge(g, out.delta, out.stats, 0.0), ExchangeResult)
        if not lose:
            group.exchanged(out, res, 0.0)
        return out, res

    def regroup(self, w: int, g: int) -> None:
        """Worker ``w`` leaves its group for group ``g`` (its own again: a reconnect); a new
        connection holds nothing."""
        self.groups[self.where[w]].leave(w)
        self.where[w] = g
        self.clocks[w] = self._clock(self.groups[g].join(w, 0.0))
        self.copies[w] = (None, -1)

    def rebase(self, g: int) -> None:
        """A new global server: group ``g`` takes its weights whole (a PULL)."""
        msg = actions.reply(self.glob.group_pull(g, 0.0), messages.GlobalWeights)
        weights = sparse.decode_vector(msg.payload, N)
        assert isinstance(weights, np.ndarray)
        self.groups[g].rebase(weights, None)


def a_push(rng: np.random.Generator) -> np.ndarray | sparse.SparseVector:
    """An update as a worker pushes it: mostly sparse (a few to a tenth of the entries), now
    and then dense or empty."""
    kind = rng.random()
    if kind < 0.05:
        return (rng.standard_normal(N) * 0.01).astype(np.float32)
    k = 0 if kind < 0.1 else int(rng.integers(1, N // 10))
    idx = np.sort(rng.choice(N, k, replace=False)).astype(np.uint32)
    return sparse.SparseVector(idx, (rng.standard_normal(k) * 0.1).astype(np.float32), N)


def step(rng: np.random.Generator, clusters: list[Cluster]) -> list[Any]:
    """One random event, the same for every cluster; what each returned."""
    first = clusters[0]
    g = int(rng.integers(len(first.groups)))
    roll = rng.random()
    if roll < 0.45:
        ready = [w for w in range(WORKERS) if first.may_push(w)]
        if ready:
            w, grad = int(rng.choice(ready)), a_push(rng)
            for c in clusters:
                c.push(w, grad)
            return [None] * len(clusters)
        roll = 0.5
    if roll < 0.7:
        w = int(rng.integers(WORKERS))
        return [c.pull(w) for c in clusters]
    if roll < 0.9:
        lose, final = bool(rng.random() < 0.25), bool(rng.random() < 0.1)
        return [c.exchange(g, lose, final) for c in clusters]
    if roll < 0.96:
        w = int(rng.integers(WORKERS))
        for c in clusters:
            c.regroup(w, g)
        return [None] * len(clusters)
    for c in clusters:
        c.rebase(g)
    return [None] * len(clusters)


def bits(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, np.float32).view(np.uint32)


@pytest.mark.parametrize("seed", range(40))
def test_any_sequence_then_a_pull_since_v_rebuilds_the_weights_bit_for_bit(seed: int) -> None:
    rng = np.random.default_rng(seed)
    run = run_config(rng, "exact")
    w0 = rng.standard_normal(N).astype(np.float32)
    c = Cluster(run, w0, forget=False)
    assert all(isinstance(group.downlink, ExactDownlink) for group in c.groups)
    updates = 0
    for _ in range(120):
        step(rng, [c])
        for w in range(WORKERS):  # now and then every worker catches up
            if rng.random() < 0.1:
                msg = c.pull(w)
                updates += msg.since >= 0
                copy, _ = c.copies[w]
                weights = c.groups[c.where[w]].weights
                assert copy is not None and np.array_equal(bits(copy), bits(weights))
    assert updates > 0  # sparse answers, not only dense ones


def same(a: Any, b: Any) -> bool:
    """Equal payloads, results and messages, arrays compared entry for entry."""
    if isinstance(a, sparse.SparseVector) and isinstance(b, sparse.SparseVector):
        return np.array_equal(a.indices, b.indices) and np.array_equal(a.values, b.values)
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        return np.array_equal(a, b)
    if isinstance(a, tuple) and isinstance(b, tuple):
        return all(same(x, y) for x, y in zip(a, b, strict=True))
    if hasattr(a, "delta") and hasattr(b, "delta"):  # Outgoing (sessions are random)
        keep = [k for k in a.stats if k != "session"]
        return same(a.delta, b.delta) and [a.stats[k] for k in keep] == [b.stats[k] for k in keep]
    if hasattr(a, "weights") and hasattr(b, "weights"):  # ExchangeResult
        return same(a.weights, b.weights) and a.version == b.version
    if isinstance(a, messages.Weights) and isinstance(b, messages.Weights):
        return a.meta() == b.meta() and [bytes(x) for x in a.payload.buffers] == [
            bytes(y) for y in b.payload.buffers]
    return bool(a == b)


@pytest.mark.parametrize("seed", range(25))
@pytest.mark.parametrize("down_mode,values", [("auto", "f32"), ("auto", "f16"), ("exact", "f32")])
def test_the_paths_over_the_changes_choose_what_the_passes_over_n_chose(
        seed: int, down_mode: str, values: str) -> None:
    rng = np.random.default_rng(1000 + seed)
    run = dataclasses.replace(run_config(rng, down_mode), down_values=values)
    w0 = rng.standard_normal(N).astype(np.float32)
    fast, slow = Cluster(run, w0, forget=False), Cluster(run, w0, forget=True)
    for _ in range(100):
        a, b = step(rng, [fast, slow])
        # (exact: the forgetful twin answers every PULL whole; compressed: the same answers)
        assert same(a, b) or (down_mode == "exact" and isinstance(a, messages.Weights))
        assert fast.glob.weights is not None and slow.glob.weights is not None
        assert np.array_equal(fast.glob.weights, slow.glob.weights)
        for f, o in zip(fast.groups, slow.groups, strict=True):
            assert np.array_equal(f.weights, o.weights)
            assert np.array_equal(f.xchg.w_sync, o.xchg.w_sync)
            d, e = f.downlink, o.downlink
            if isinstance(d, Downlink) and isinstance(e, Downlink):
                assert np.array_equal(d.w_pub, e.w_pub) and d.pub == e.pub
                assert d.drift_now() == pytest.approx(d.drift(f.weights), rel=1e-6, abs=1e-9)
