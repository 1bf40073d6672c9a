"""The compressed downlink (minips/core/downlink.py) and the worker's copy of a group's weights.

Unit tests of the publish / answer rules, then a group server on a real socket: a worker-side
copy kept with ``downlink.apply_weights`` equals the group's ``w_pub`` bit for bit at every version
it was answered, and stays within the drift bound of the group's weights.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
from conftest import recv_as
from test_group import TOKEN, Global, push

from minips import sparse
from minips.core.changelog import ChangeLog
from minips.core.config import RunConfig
from minips.core.downlink import DRIFT, Downlink, ExactDownlink, apply_weights
from minips.errors import RemoteProtocolError
from minips.net import transport
from minips.serve.group import GroupServer
from minips.wire import messages
from minips.wire.fields import Payload

N = 1000


def weights(seed: int = 0, n: int = N) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(n).astype(np.float32)


class Copy:
    """What a worker holds: a copy of w_pub and its version, updated from answers."""

    def __init__(self) -> None:
        self.w: Any = None  # (n,) float32 once it holds a version
        self.held = -1

    def take(self, ans: Any, values: str = "f32") -> None:
        enc, codec, bufs = sparse.encode_vector(ans.payload, value_dtype=values)
        msg = messages.Weights(version=ans.version, since=ans.since, payload=Payload(enc, codec,
                               tuple(bufs)))
        self.w = apply_weights(self.w, self.held, msg, N)
        self.held = ans.version


def nudge(gs: GroupServer, clock: int, w: int = 0) -> None:
    """Worker ``w``'s push at ``clock`` moving coordinates 0..2 by 1.0 (an update: optimizer
    on the workers, 2 in the group: lr 1/2), as every change of a group's weights comes."""
    step = sparse.SparseVector(np.arange(3, dtype=np.uint32), np.full(3, -2.0, np.float32), N)
    gs.on_push(w, push(clock, step))


def update(ans: Any) -> sparse.SparseVector:
    """The payload of an answer that must be an update."""
    assert isinstance(ans.payload, sparse.SparseVector)
    return ans.payload


def test_publish_sends_the_largest_changes_and_keeps_the_rest_as_residual() -> None:
    w = weights()
    d = Downlink(w, 0.01, drift=1.0)
    moved = w.copy()
    moved[[5, 50, 500]] += [3.0, -2.0, 1.0]
    moved[7] += 1e-3
    assert d.k == 10
    assert d.publish(moved) == 4 and d.pub == 1  # only 4 moved: all published, exactly
    assert np.array_equal(d.w_pub, moved)
    assert d.publish(moved) == 0 and d.pub == 1  # nothing moved: no new version
    moved += np.linspace(-1e-3, 1e-3, N, dtype=np.float32)  # every coordinate moves a little
    moved[[1, 2]] += 5.0
    assert d.publish(moved) == 10
    sent = np.flatnonzero(d.w_pub != w)
    assert {1, 2}.issubset(sent.tolist()) and d.log[-1].size == 10
    assert np.count_nonzero(d.w_pub != moved) == N - 10  # the rest waits


def started(ratio: float) -> tuple[np.ndarray, Downlink, Copy]:
    """Weights, their downlink (no drift bound) and a worker's copy that took them dense."""
    w = weights()
    d = Downlink(w, ratio, drift=1.0)
    copy = Copy()
    copy.take(d.answer(-1))
    return w, d, copy


@pytest.mark.parametrize("n,k", [(61_706, 617), (61_706, 30_000), (1_000, 10), (40, 3), (5, 5)])
def test_a_publish_sends_the_k_largest_changes(n: int, k: int) -> None:
    rng = np.random.default_rng(n + k)
    for trial in range(10):
        w = weights(trial, n)
        d = Downlink(w, k / n, drift=1.0)  # no drift bound: exactly the top k
        assert d.k == k
        step = rng.standard_normal(n).astype(np.float32)
        if trial % 2:  # many zeros and repeated values: the sample's threshold is coarse
            step[rng.integers(0, n, n // 2)] = 0.0
            step[rng.integers(0, n, n // 4)] = 0.5
        moved = w + step
        mag = np.abs(moved - w)
        d.publish(moved)
        got = d.log[-1]
        assert got.size == min(k, np.count_nonzero(mag)) == np.unique(got).size
        assert np.array_equal(np.sort(mag[got]), np.sort(mag)[n - got.size:])


def test_answers_are_made_once_per_version_held_until_the_next_publish() -> None:
    w, d, _ = started(0.01)  # k = 10: each publish below sends all 10 that moved
    for lo in (0, 10):
        w[lo:lo + 10] += 1.0
        d.publish(w)
    first, again = d.answer(d.pub - 2), d.answer(d.pub - 2)
    assert isinstance(first.payload, sparse.SparseVector)
    assert first is again and first.payload.indices.size == 20  # shared, not made twice
    assert d.answer(-1) is d.answer(-1)
    assert d.answers == {"update": 2, "dense": 3}  # every answer counted (one by started)
    w[20:30] += 1.0
    d.publish(w)
    later = d.answer(d.pub - 3)
    assert isinstance(later.payload, sparse.SparseVector)
    assert later is not first and later.payload.indices.size == 30


def test_a_worker_that_follows_every_answer_holds_w_pub_bit_for_bit() -> None:
    rng = np.random.default_rng(1)
    w, d, copy = started(0.02)
    assert copy.held == 0 and np.array_equal(copy.w, w)
    for step in range(40):
        w += (0.01 * rng.standard_normal(N)).astype(np.float32)
        d.publish(w)
        if step % 3:  # pulls now and then: behind by one or several publishes
            ans = d.answer(copy.held)
            assert ans.since == copy.held and isinstance(ans.payload, sparse.SparseVector)
            copy.take(ans)
            assert copy.held == d.pub and np.array_equal(copy.w, d.w_pub)


def test_dense_resync_for_no_version_an_unknown_one_or_one_too_far_behind() -> None:
    w = weights()
    d = Downlink(w, 0.01, drift=1.0, log_size=3)
    for i in range(5):
        w[i] += 1.0
        d.publish(w)
    assert d.pub == 5
    for since in (-1, 1, 6, 99):  # none; the log holds 3..5 only; never published
        ans = d.answer(since)
        assert ans.since == -1 and ans.version == 5
        assert np.array_equal(np.asarray(ans.payload), d.w_pub)
    ans = d.answer(2)  # 3 publishes behind: in the log
    assert ans.since == 2 and update(ans).indices.tolist() == [2, 3, 4]
    empty = d.answer(5)
    assert empty.since == 5 and update(empty).nnz == 0


def test_a_nearly_dense_update_goes_dense() -> None:
    w = weights()
    d = Downlink(w, 0.3, drift=1.0, dense_fraction=0.4)
    d.publish(w + 1.0)
    assert d.answer(0).since == 0  # 30% of n: sparse
    d.publish(w + 2.0)
    assert d.answer(0).since == -1  # the two publishes name 60% of n: dense is smaller
    assert d.answer(1).since == 1


def test_drift_bound_publishes_as_much_as_it_needs_after_a_jump() -> None:
    w = weights()
    d = Downlink(w, 0.01, drift=0.05)
    jumped = w + np.float32(0.2)  # an exchange: every coordinate moves by 0.2 (~20% of |w|)
    count = d.publish(jumped)
    assert count > d.k
    assert d.drift(jumped) <= 0.05
    assert count < N  # the fewest that keep the bound, not everything
    small = jumped.copy()
    small[:3] += 1e-4  # a small move publishes k, no more
    assert d.publish(small) == d.k and d.drift(small) <= 0.05


def test_the_drift_sums_after_changes_anywhere_are_made_when_asked_and_match_anew(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Pushes that change every weight (the optimizer on the servers) leave the drift sums to
    be made when next asked, once, not at each push; sparse changes after them fold into that
    one; then they are kept up to date again, O(k) a change, and every figure equals the one
    made anew from the weights."""
    from minips.core import downlink

    passes: list[int] = []
    real = downlink.sq_norm

    def counted(x: np.ndarray) -> float:
        passes.append(x.size)
        return real(x)

    monkeypatch.setattr(downlink, "sq_norm", counted)
    w = weights()
    d = Downlink(w, 0.01)
    passes.clear()
    rng = np.random.default_rng(4)
    for _ in range(5):  # dense pushes: nothing computed
        before = d.moving(w, None)
        w -= np.float32(0.01) * rng.standard_normal(N).astype(np.float32)
        d.moved(w, None, before)
    at = np.array([3, 9], np.uint32)  # a sparse push after them: no parts to keep either
    before = d.moving(w, at)
    assert before is None
    w[at] += np.float32(0.5)
    d.moved(w, at, before)
    assert passes == []
    assert d.drift_now() == pytest.approx(d.drift(w), rel=1e-6)
    assert passes[:2] == [N, N]  # the two sums, once (``drift`` then made its own)
    passes.clear()
    assert d.finite() and passes == []  # up to date: asked again, nothing computed
    before = d.moving(w, at)  # a sparse push now: its parts, O(k)
    assert before is not None
    w[at] -= np.float32(0.25)
    d.moved(w, at, before)
    assert passes == [] and d.drift_now() == pytest.approx(d.drift(w), rel=1e-5)
    assert d.publish(w) >= d.k  # what it leaves behind is the drift made anew
    assert 0 < d.last_drift == pytest.approx(d.drift(w), rel=1e-5)


def test_no_update_is_lost_repeated_pulls_converge_to_the_weights_exactly() -> None:
    rng = np.random.default_rng(2)
    w, d, copy = started(0.01)
    for _ in range(20):  # training: the weights move everywhere
        w += (0.01 * rng.standard_normal(N)).astype(np.float32)
        d.publish(w)
        copy.take(d.answer(copy.held))
    assert not np.array_equal(copy.w, w)  # 1% per publish cannot keep up
    for _ in range(N // d.k + 1):  # the group stops changing; the worker keeps pulling
        d.publish(w)
        copy.take(d.answer(copy.held))
    assert np.array_equal(d.w_pub, w) and np.array_equal(copy.w, w)


def test_an_update_that_does_not_fit_the_copy_held_is_a_protocol_error() -> None:
    d = Downlink(weights(), 0.01)
    d.publish(weights(1))
    ans = d.answer(0)
    enc, codec, bufs = sparse.encode_vector(ans.payload)
    msg = messages.Weights(version=1, since=0, payload=Payload(enc, codec, tuple(bufs)))
    with pytest.raises(RemoteProtocolError):
        apply_weights(None, -1, msg, N)  # holds nothing
    with pytest.raises(RemoteProtocolError):
        apply_weights(weights(), 3, msg, N)  # holds another version


def test_down_ratio_defaults_to_the_ratio_of_a_sparse_compressor_and_dense_otherwise() -> None:
    assert RunConfig(compressor="none").downlink_ratio() == 1.0
    assert RunConfig(compressor="fp16", ratio=0.1).downlink_ratio() == 1.0
    assert RunConfig(compressor="gdtopk", ratio=0.02).downlink_ratio() == 0.02
    assert RunConfig(compressor="topk", down_ratio=1.0).downlink_ratio() == 1.0
    assert GroupServer(0, RunConfig(), weights(), Global(weights())).core.downlink is None


def test_f16_values_go_out_as_two_bytes_each_and_decode_as_before() -> None:
    idx = np.arange(0, 3000, 3, dtype=np.uint32)  # 1,000 coordinates
    vals = np.linspace(-2, 2, 1000).astype(np.float16).astype(np.float32)
    g = sparse.SparseVector(idx, vals, 4000)
    enc, codec, bufs = sparse.encode_vector(g, value_dtype="f16")
    assert codec["value"] == "f16" and memoryview(bufs[1]).nbytes == 2000
    back = sparse.decode_vector(Payload(enc, codec, bufs), 4000)
    assert isinstance(back, sparse.SparseVector)
    assert np.array_equal(back.indices, idx) and np.array_equal(back.values, vals)


class Watched:
    """Records, at every answer a group server builds, w_pub by version and the drift of the
    group's weights from it (what a worker holds can only be checked against its version: the
    other worker's PULLs publish newer ones meanwhile)."""

    def __init__(self, gs: GroupServer) -> None:
        assert isinstance(gs.core.downlink, Downlink)
        self.gs, self.down = gs, gs.core.downlink
        self.at: dict[int, np.ndarray] = {self.down.pub: self.down.w_pub.copy()}
        self.drifts: list[float] = []
        publish = self.down.publish

        def watched(weights: np.ndarray) -> int:
            count = publish(weights)
            self.at[self.down.pub] = self.down.w_pub.copy()
            self.drifts.append(self.down.drift(weights))
            return count

        self.down.publish = watched  # type: ignore[method-assign]


async def _worker_session(port: int, w_id: int, steps: int, watch: Watched) -> int:
    """A worker on a real connection: PULL with the version held, check the copy against the
    group's w_pub of that version, PUSH a made-up sparse gradient. Returns how many answers
    were updates (not the whole weights)."""
    ch = await transport.connect("127.0.0.1", port, role="worker", worker_id=w_id, group=0,
                                 token=TOKEN, timeout=5)
    try:
        clock = (await recv_as(ch, messages.Ack)).clock
        copy, held, updates = None, -1, 0
        rng = np.random.default_rng(w_id)
        for _ in range(steps):
            await ch.send(messages.Pull(clock=clock, since=held))
            msg = await recv_as(ch, messages.Weights)
            copy = apply_weights(copy, held, msg, N)
            held = msg.version
            updates += msg.since >= 0
            assert np.array_equal(copy, watch.at[held])  # bit for bit
            idx = np.sort(rng.choice(N, 20, replace=False)).astype(np.uint32)
            grad = sparse.SparseVector(idx, rng.standard_normal(20).astype(np.float32), N)
            enc, codec, bufs = sparse.encode_vector(grad)
            await ch.send(messages.Push(clock=clock + 1, samples=1, payload=Payload(enc, codec,
                                        tuple(bufs))))
            clock = (await recv_as(ch, messages.Ack)).clock
        return updates
    finally:
        await ch.close()


async def test_workers_on_a_real_socket_hold_w_pub_and_stay_within_the_drift_bound() -> None:
    run = RunConfig(workers=2, mode="asp", compressor="topk", ratio=0.02, lr=0.5,
                    momentum=0.9, sync_every=1000, lr_warmup=0)
    gs = GroupServer(0, run, weights(), Global(weights()), members=[0, 1])
    watch = Watched(gs)
    port = await gs.serve("127.0.0.1", 0, TOKEN)
    try:
        got = await asyncio.wait_for(asyncio.gather(
            *(_worker_session(port, w, 30, watch) for w in (0, 1))), 30)
    finally:
        await gs.close()
    assert all(n == 29 for n in got)  # the first answer is the whole weights, then updates
    # versions 0..29 at least: each of a worker's 29 pushes moved the weights before its next
    # PULL (the first PULLs found nothing to publish; PULLs arriving together share a publish),
    # and every publish left the weights within the bound
    assert len(watch.at) >= 30 and max(watch.drifts) <= DRIFT * (1 + 1e-6)


async def test_pulls_answered_in_one_turn_share_one_publish() -> None:
    """A publish is O(n): PULLs the group answers in one turn of its event loop get one
    publish between them, and the same version."""
    run = RunConfig(workers=2, mode="asp", compressor="topk", ratio=0.02, sync_every=1000,
                    optimizer_at="worker")
    gs = GroupServer(0, run, weights(), Global(weights()), members=[0, 1])
    assert gs.core.downlink is not None
    nudge(gs, 1)  # a few coordinates: the answer is an update, not dense
    first = await asyncio.wait_for(asyncio.gather(gs.answer_pull(0), gs.answer_pull(1)), 5)
    assert gs.core.downlink.pub == 1 and [m.version for m in first] == [1, 1]
    nudge(gs, 2)  # a few coordinates: the answer is an update, not dense
    second = await asyncio.wait_for(gs.answer_pull(0, since=1), 5)  # a later turn: a new one
    assert gs.core.downlink.pub == 2 and second.version == 2 and second.since == 1


async def test_a_publish_that_fails_fails_the_pulls_waiting_for_it_and_no_later_one() -> None:
    run = RunConfig(workers=2, mode="asp", compressor="topk", ratio=0.02, sync_every=1000,
                    optimizer_at="worker")
    gs = GroupServer(0, run, weights(), Global(weights()), members=[0, 1])
    assert gs.core.downlink is not None
    publish = gs.core.downlink.publish

    def broken(w: np.ndarray) -> int:
        raise MemoryError("no room for the residual")

    gs.core.downlink.publish = broken  # type: ignore[method-assign,assignment]
    nudge(gs, 1)  # past the drift bound: a publish is due
    got = await asyncio.wait_for(asyncio.gather(gs.answer_pull(0), gs.answer_pull(1),
                                                return_exceptions=True), 5)
    assert all(isinstance(e, MemoryError) for e in got)  # both told, neither left waiting
    gs.core.downlink.publish = publish  # type: ignore[method-assign]
    nudge(gs, 2)
    assert (await asyncio.wait_for(gs.answer_pull(0), 5)).version == 1


async def test_a_group_server_honours_only_the_version_it_sent_on_this_connection() -> None:
    """docs/protocol.md, section 3: an update answers only a PULL naming the version of the
    last WEIGHTS on the same connection; any other `since` gets the whole weights."""
    run = RunConfig(workers=1, mode="asp", compressor="topk", ratio=0.02, sync_every=1000)
    gs = GroupServer(0, run, weights(), Global(weights()), members=[0])
    port = await gs.serve("127.0.0.1", 0, TOKEN)

    async def pull(ch: Any, clock: int, since: int) -> messages.Weights:
        await ch.send(messages.Pull(clock=clock, since=since))
        return await recv_as(ch, messages.Weights)

    try:
        ch = await transport.connect("127.0.0.1", port, role="worker", worker_id=0, group=0,
                                     token=TOKEN, timeout=5)
        clock = (await recv_as(ch, messages.Ack)).clock
        first = await pull(ch, clock, 7)  # a version this connection was never sent
        assert first.since == -1 and first.payload.encoding == "dense-f32"
        again = await pull(ch, clock, first.version)
        assert again.since == first.version and again.payload.encoding == "sparse-v1"
        await ch.close()
        ch = await transport.connect("127.0.0.1", port, role="worker", worker_id=0, group=0,
                                     token=TOKEN, timeout=5)
        clock = (await recv_as(ch, messages.Ack)).clock
        fresh = await pull(ch, clock, again.version)  # sent, but on the old connection
        assert fresh.since == -1 and fresh.payload.encoding == "dense-f32"
        await ch.close()
    finally:
        await gs.close()


def test_f16_publishes_keep_the_copy_bit_for_bit_in_half_the_value_bytes() -> None:
    """``values="f16"``: a publish rounds what it publishes to float16 (the rounding stays in
    the residual), the updates go out with 2-byte values, and a worker following them holds
    w_pub exactly; the drift bound holds after every publish, the rounding counted."""
    rng = np.random.default_rng(3)
    w = weights()
    half, full = Downlink(w, 0.02, values="f16"), Downlink(w, 0.02)
    copy = Copy()
    copy.take(half.answer(-1))
    sizes = {"f16": 0, "f32": 0}
    for step in range(40):
        w += (0.01 * rng.standard_normal(N)).astype(np.float32)
        half.publish(w)
        full.publish(w)
        assert half.drift(w) <= DRIFT * (1 + 1e-6) and abs(half.drift(w) - half.last_drift) < 1e-6
        if step % 3:
            ans = half.answer(copy.held)
            assert half.wire_values(ans) == "f16"
            copy.take(ans, "f16")
            assert copy.held == half.pub and np.array_equal(copy.w, half.w_pub)
            sizes["f16"] += sum(memoryview(b).nbytes for b in
                                sparse.encode_vector(ans.payload, value_dtype="f16")[2])
            sizes["f32"] += sum(memoryview(b).nbytes for b in
                                sparse.encode_vector(ans.payload)[2])
    assert sizes["f16"] < 0.75 * sizes["f32"]
    # nothing is lost: published long enough, the residual of the rounding goes out too
    for _ in range(200):
        if not half.publish(w):
            break
    assert half.drift(w) <= 5e-4  # float16's own precision is what is left


def test_an_f16_publish_of_a_value_past_float16s_range_stays_exact_and_goes_out_as_f32() -> None:
    w = weights()
    d = Downlink(w, 0.01, values="f16")
    copy = Copy()
    copy.take(d.answer(-1))
    big = w.copy()
    big[7] = 1e6  # float16 ends at 65504
    d.publish(big)
    assert d.w_pub[7] == np.float32(1e6)
    ans = d.answer(copy.held)
    assert d.wire_values(ans) == "f32"
    copy.take(ans, d.wire_values(ans))
    assert np.array_equal(copy.w, d.w_pub) and np.isfinite(copy.w).all()


def test_down_values_is_a_run_setting_checked_like_the_others() -> None:
    assert RunConfig(down_values="f16").validate().down_values == "f16"
    with pytest.raises(Exception, match="down_values"):
        RunConfig(down_values="f8").validate()


def test_the_drift_bound_is_a_run_setting_a_group_server_uses() -> None:
    from minips.core.group_core import GroupCore
    run = RunConfig(compressor="topk", ratio=0.01, down_drift=0.05, down_values="f16").validate()
    core = GroupCore(0, run, weights(), members=[0])
    assert isinstance(core.downlink, Downlink)
    assert core.downlink.drift_bound == 0.05 and core.downlink.values == "f16"
    with pytest.raises(Exception, match="down_drift"):
        RunConfig(down_drift=-0.1).validate()


def test_the_exact_downlink_with_f16_values_holds_the_weights_to_float16_in_fewer_bytes() -> None:
    """``ExactDownlink(values="f16")``: an update's values go out rounded to float16; the
    worker's copy is the weights rounded to float16 where an update set them and exact where
    only the first (dense, float32) answer did, so it stays within float16's rounding of each
    weight however many updates it follows (each sets values, none adds), and the answers are
    well under 3/4 of the float32 ones' bytes. A value past float16's range goes out as f32,
    exactly; the float32 default stays bit for bit."""
    rng = np.random.default_rng(5)
    w = weights()
    log = ChangeLog(N)
    half, full = ExactDownlink(w, log, values="f16"), ExactDownlink(w, log)
    copy, exact = Copy(), Copy()
    copy.take(half.answer(-1))  # dense: float32 whatever the values
    exact.take(full.answer(-1))
    set_by_update = np.zeros(N, dtype=np.bool_)
    sizes = {"f16": 0, "f32": 0}
    for step in range(60):
        idx = np.unique(rng.integers(0, N, 30)).astype(np.uint32)
        w[idx] += (0.05 * rng.standard_normal(idx.size)).astype(np.float32)
        log.note(idx)
        if step % 3:
            ans = half.answer(copy.held)
            assert ans.since == copy.held and half.wire_values(ans) == "f16"
            copy.take(ans, "f16")
            set_by_update[update(ans).indices] = True
            sizes["f16"] += sum(memoryview(b).nbytes for b in
                                sparse.encode_vector(ans.payload, value_dtype="f16")[2])
            sizes["f32"] += sum(memoryview(b).nbytes for b in
                                sparse.encode_vector(ans.payload)[2])
            assert full.wire_values(full.answer(exact.held)) == "f32"
            exact.take(full.answer(exact.held))
            assert copy.held == exact.held == half.pub
            assert np.array_equal(exact.w, w)  # f32: bit for bit
            rounded = w.astype(np.float16).astype(np.float32)
            assert np.array_equal(copy.w[set_by_update], rounded[set_by_update])
            assert np.array_equal(copy.w[~set_by_update], w[~set_by_update])
            assert np.all(np.abs(copy.w - w) <= 2.0 ** -11 * np.abs(w))
    assert set_by_update.any() and sizes["f16"] < 0.75 * sizes["f32"]
    w[7] = 1e6  # past float16's 65504: that answer goes out as f32, and exact
    log.note(np.array([7], np.uint32))
    ans = half.answer(copy.held)
    assert half.wire_values(ans) == "f32"
    copy.take(ans, "f32")
    assert copy.w[7] == np.float32(1e6)
    with pytest.raises(ValueError, match="values"):
        ExactDownlink(w, log, values="f8")


def test_a_group_with_the_exact_downlink_takes_the_runs_down_values() -> None:
    from minips.core.group_core import GroupCore
    for values in ("f32", "f16"):
        run = RunConfig(compressor="topk", ratio=0.01, optimizer_at="worker", down_mode="exact",
                        down_values=values).validate()
        core = GroupCore(0, run, weights(), members=[0])
        assert isinstance(core.downlink, ExactDownlink) and core.downlink.values == values


@pytest.mark.parametrize("mode", ["gssp", "bsp"])
def test_the_exact_downlink_trains_as_the_dense_one_bit_for_bit_in_fewer_bytes(
        mode: str, tmp_path: Any) -> None:
    """The exact downlink brings each worker the group's weights themselves, as the dense one
    does: the simulator (the same cores, simulated time) ends with the same weights bit for bit,
    the group -> worker bytes a fraction of the dense ones (the changes since each PULL)."""
    import json

    from minips.sim.simulate import SimConfig, simulate

    got = {}
    for name, down in (("dense", {"down_ratio": 1.0}), ("exact", {"down_mode": "exact"})):
        cfg = RunConfig(workers=4, mode=mode, groups=2 if mode == "gssp" else 0, lr=0.02,
                        dataset="synthetic", epochs=100, base_step_s=0.04, compressor="topk",
                        ratio=0.05, optimizer_at="worker", **down)  # type: ignore[arg-type]
        simulate(SimConfig(run=cfg, slowdowns=[1, 1, 4, 4], dim=500, max_pushes=300,
                           out_dir=str(tmp_path), name=name))
        summary = json.loads((tmp_path / name / "summary.json").read_text())
        got[name] = (np.load(tmp_path / name / "final_weights.npy"),
                     summary["bytes_group_worker"])
    assert np.array_equal(got["exact"][0], got["dense"][0])
    assert got["exact"][1] < 0.5 * got["dense"][1]
