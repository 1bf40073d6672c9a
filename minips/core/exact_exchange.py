"""The exact exchange between a group and the global server (``--xchg-mode exact``): every
entry a group changed since its last exchange began goes up at its delta, ``w - w_sync`` (no
top-k, nothing left behind), and the global server answers every entry its change log names
after the version that group holds (``ExactMirror``: no copy of the group's weights, no
top-k). The first answer to a group whose version the server does not know (a new one, a resumed
server) is dense, as is one past ``DENSE_AT`` of n. Every message path is then O(changes): the
bytes on the hop are the changes, not k. Exactly once and resume are ``exchange.py``'s rules,
unchanged: the same (session, seq), and a repeat is answered from the version the group held
when it sent it.

The group keeps ``w_sync`` as before-values (``BeforeValues``: copy on first write, as pushes
land), so it holds one copy of the model, and the global server none per group.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from minips import sparse
from minips.core.changelog import ChangeLog
from minips.core.exchange import (
    DENSE_AT,
    ExchangeResult,
    GroupMirror,
    GroupSync,
    Outgoing,
    exchange_ratio,
)
from minips.core.replay import Tally
from minips.sparse import SparseVector

__all__ = ["BeforeValues", "ExactSync", "group_sync", "ExactMirror", "group_mirror"]


HELD, MARK = np.uint8(1), np.uint8(2)  # BeforeValues' mask: a before-value; covers' mark


class BeforeValues:
    """The group's copy of the global weights (``w_sync``) kept where it differs from the
    group's weights only: each entry's value before its first change since the record began
    (copy on first write), O(k) a change. A dense change (the optimizer on the servers), a
    new global server or a checkpoint's copy make it dense: every entry's value, a (n,) copy,
    until the next exchange begins. Invariant: the weights equal ``w_sync`` at every entry the
    record does not hold."""

    def __init__(self, size: int) -> None:
        self.size = size
        # (n,) uint8 per entry: HELD, it holds a before-value; MARK, ``covers`` marks it
        self._held = np.zeros(size, dtype=np.uint8)
        self._idx: list[np.ndarray] = []  # chunks of (c,) uint32, in the order first written
        self._val: list[np.ndarray] = []  # (c,) float32, their before-values
        self.dense: np.ndarray | None = None  # (n,) float32 every before-value; None: sparse
        self._tidy = True  # _idx is one chunk, increasing (or none)

    def save(self, weights: np.ndarray, idx: np.ndarray | None) -> None:
        """The weights are about to change at ``idx`` ((k,) distinct indices; None: anywhere):
        keep the values of those not held yet."""
        if self.dense is not None:
            return
        if idx is None:
            self.set_dense(self.materialize(weights))
            return
        new = np.asarray(idx).astype(np.intp)  # converted once, not at every fancy index
        fresh = self._held[new] == 0  # (k,) not changed since the record began
        if not fresh.all():
            new = new[fresh]
        if new.size:
            self._held[new] = HELD
            self._idx.append(new.astype(np.uint32))
            self._val.append(weights[new])
            self._tidy = False

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        """(m,) uint32 increasing indices held and (m,) float32 their before-values (sparse
        record only); consolidated once, then kept so."""
        assert self.dense is None
        if not self._idx:
            return np.empty(0, np.uint32), np.empty(0, np.float32)
        if not self._tidy:
            idx, val = np.concatenate(self._idx), np.concatenate(self._val)
            if idx.size > 1 and not (idx[1:] > idx[:-1]).all():  # one sorted push: as it is
                order = np.argsort(idx, kind="stable")  # sorted chunks: a merge of runs
                idx, val = idx[order], val[order]
            self._idx, self._val, self._tidy = [idx], [val], True
        return self._idx[0], self._val[0]

    def at(self, weights: np.ndarray, where: np.ndarray) -> np.ndarray:
        """(p,) float32 ``w_sync`` at ``where`` ((p,) uint32 increasing): the before-value
        where one is held, the weights elsewhere."""
        if self.dense is not None:
            return self.dense[where]
        out = weights[where]
        pos, hit = self._find(where)
        out[hit] = self.items()[1][pos[hit]]
        return out

    def update(self, where: np.ndarray, values: np.ndarray) -> None:
        """``w_sync`` at ``where`` ((p,) uint32 increasing) became ``values``: the held
        before-values there follow (an entry not held stays so: the weights are it)."""
        if self.dense is not None:
            self.dense[where] = values
            return
        pos, hit = self._find(where)
        self.items()[1][pos[hit]] = values[hit]

    def _find(self, where: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        idx = self.items()[0]
        pos = np.searchsorted(idx, where)  # (p,) int64
        np.minimum(pos, max(0, idx.size - 1), out=pos)
        hit = idx[pos] == where if idx.size else np.zeros(where.size, dtype=np.bool_)
        return pos, hit

    def covers(self, big: np.ndarray, small: np.ndarray) -> bool:
        """Every index of ``small`` is in ``big`` (both distinct): marked in the record's
        mask and counted, O(big + small) with no sort (the mask is left as it was)."""
        held = self._held
        held[small] |= MARK
        found = int(np.count_nonzero(held[big] & MARK))
        held[small] &= HELD
        return found == small.size

    def materialize(self, weights: np.ndarray) -> np.ndarray:
        """(n,) float32 ``w_sync`` whole (a new array: O(n), for checkpoints and resumes)."""
        if self.dense is not None:
            return self.dense.copy()
        out = np.array(weights, dtype=np.float32)
        idx, val = self.items()
        out[idx] = val
        return out

    def take(self, weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Every entry where the weights differ from ``w_sync`` ((m,) uint32 increasing) and
        ``w_sync`` there; the record starts again, empty."""
        if self.dense is not None:
            idx = np.flatnonzero(weights != self.dense).astype(np.uint32)  # NaN differs too
            val = self.dense[idx]
        else:
            idx, val = self.items()
        self.set_dense(None)
        return idx, val

    def set_dense(self, values: np.ndarray | None) -> None:
        """``w_sync`` is ``values`` whole ((n,) float32, kept as it is), or (None) the
        weights themselves: the record empty."""
        if self.dense is None and self._idx:
            self._held[self.items()[0]] = 0
        self._idx, self._val, self.dense, self._tidy = [], [], values, True


class ExactSync(GroupSync):
    """A group's side of the exact exchange: every entry it changed since the last exchange
    began goes up at its delta, ``w - w_sync`` (no top-k, nothing left behind); the reply sets
    every entry the global weights changed at since the version this group holds. ``w_sync``
    is kept as before-values (``BeforeValues``), so the group holds one copy of the model: the
    weights. The shell calls ``moving`` before each change of the weights by a push (the rebase
    of ``complete`` is not one: the record follows it by itself).

    The arithmetic is ``GroupSync``'s dense rule restricted to the entries it can change:
    ``sent`` = the weights at the begin, at the entries that differ from ``w_sync`` (``S``);
    after the reply (the entries ``R`` at ``G``'s values, or ``G`` whole) ``w_sync' = G`` there
    and ``w = w_sync' + (w - sent)`` at ``S | R``: exact (the reply's own values) where nothing
    was pushed in between, one float32 sum where something was."""

    def __init__(self, weights: np.ndarray, session: int | None = None) -> None:
        self.kept = 1.0  # everything that changed goes: no top-k
        self.left = None
        self.weights = weights  # the group's (n,) float32 weights (kept up to date by the calls)
        self.before = BeforeValues(weights.size)
        self._start(session)

    @property  # type: ignore[override]
    def w_sync(self) -> np.ndarray:
        """(n,) float32 the group's copy of the global weights, made whole (O(n): checkpoints,
        resumes, tests): the pending exchange's entries at what they were before it."""
        out = self.before.materialize(self.weights)
        if self.pending is not None and self.pending.synced is not None:
            assert isinstance(self.pending.sent, SparseVector)
            out[self.pending.sent.indices] = self.pending.synced
        return out

    @w_sync.setter
    def w_sync(self, values: np.ndarray) -> None:
        self.before.set_dense(np.array(values, dtype=np.float32))

    def moving(self, weights: np.ndarray, idx: np.ndarray | None) -> None:
        """The weights are about to change at ``idx`` (None: anywhere): keep ``w_sync`` there."""
        self.weights = weights
        self.before.save(weights, idx)

    def _outgoing(self, weights: np.ndarray, stats: dict[str, Any], dense: bool,
                  changed: np.ndarray | None) -> Outgoing:
        """Every entry the record holds whose value moved: ``sent`` the weights there,
        ``delta`` ``sent - w_sync`` (a flush is no different: nothing is left behind), dense
        past ``DENSE_AT`` of n."""
        self.weights = weights
        idx, synced = self.before.take(weights)  # (m,) uint32, (m,) float32
        sent = weights[idx]
        delta = sent - synced
        moved = delta != 0  # an entry pushed back to its value has nothing to send
        if not moved.all():
            idx, sent, delta, synced = idx[moved], sent[moved], delta[moved], synced[moved]
        n = weights.size
        out = SparseVector(idx, delta, n)  # nearly every entry (dense pushes): dense, smaller
        return Outgoing(SparseVector(idx, sent, n), stats,
                        out.to_dense() if idx.size > DENSE_AT * n else out, synced)

    def touches(self, out: Outgoing, res: ExchangeResult) -> np.ndarray | None:
        """``GroupSync.touches``: the entries sent and those the reply sets (a merge of two
        increasing runs), or None for a dense reply."""
        sent, reply = out.sent, res.weights
        if isinstance(reply, np.ndarray) or not isinstance(sent, SparseVector):
            return None
        if self.before.covers(reply.indices, sent.indices):  # the merge's reply: it does
            return reply.indices
        return sparse.union_sorted([sent.indices, reply.indices])

    def _rebase_on(self, weights: np.ndarray, out: Outgoing, res: ExchangeResult) -> None:
        """``w = w_sync' + (w - sent)`` at the entries the exchange or the reply names (all
        of them for a dense reply), ``w_sync'`` = the reply there; the record's before-values
        of entries pushed meanwhile become ``w_sync'``."""
        self.weights = weights
        sent, reply = out.sent, res.weights
        assert isinstance(sent, SparseVector) and out.synced is not None
        if isinstance(reply, np.ndarray):
            self._take_dense(weights, sent, reply)
        elif self.before.dense is None:
            self._take_entries(weights, sent, out.synced, reply)
        else:
            self._take_over(weights, out, res)

    def _take_entries(self, weights: np.ndarray, sent: SparseVector, synced: np.ndarray,
                      reply: SparseVector) -> None:
        """A sparse reply, the record sparse: scatters only, O(sent + reply + pushed since).
        The weights are set back to the copy (``w_sync`` before the reply: the record's
        before-values, ``synced`` at the entries sent), the reply is written over it, and
        what was pushed since the begin goes back on top where the exchange or the reply
        changed the copy; elsewhere the weights are as they were, bit for bit."""
        held, kept = self.before.items()  # (h,) pushed since the begin, the weights then
        was = weights[held]  # (h,) float32
        pushed = was - kept
        weights[held] = kept  # the weights at the begin (``sent`` at the entries sent)
        weights[sent.indices] = synced  # the copy before the reply
        sparse.set_into(weights, reply)  # the copy after it: w_sync'
        kept[:] = weights[held]  # the record's before-values become w_sync'
        moved = _within(held, sent.indices) | _within(held, reply.indices)
        weights[held] = np.where(moved, kept + pushed, was)

    def _take_over(self, weights: np.ndarray, out: Outgoing, res: ExchangeResult) -> None:
        """A sparse reply, the record dense (a dense change since the begin): the general
        rule at the entries the exchange or the reply names."""
        sent, reply = out.sent, res.weights
        assert isinstance(sent, SparseVector) and isinstance(reply, SparseVector)
        touched = self.touches(out, res)  # (t,) uint32 increasing
        assert touched is not None
        at_sent = np.searchsorted(touched, sent.indices)
        before = self.before.at(weights, touched)  # sent: the weights at the begin, there
        before[at_sent] = sent.values
        new = before.copy()  # w_sync': the reply where it sets, the old copy elsewhere
        new[at_sent] = out.synced
        new[np.searchsorted(touched, reply.indices)] = reply.values
        weights[touched] = new + (weights[touched] - before)
        self.before.update(touched, new)

    def _take_dense(self, weights: np.ndarray, sent: SparseVector, reply: np.ndarray) -> None:
        """A dense reply: ``w_sync' = G``; ``w = G + (w - sent)``, O(n)."""
        base = self.before.materialize(weights)  # sent where nothing was pushed meanwhile
        base[sent.indices] = sent.values
        step = weights - base  # (n,) what was pushed since the begin
        moved = np.flatnonzero(step).astype(np.uint32)
        weights[:] = reply
        weights[moved] += step[moved]
        self.before.set_dense(None)
        self.before.save(reply, moved)  # w_sync' = G where the weights differ from it

    def rebase(self, weights: np.ndarray, g: np.ndarray,
               server_seq: int | None = None) -> tuple[np.ndarray, Tally | None]:
        """``GroupSync.rebase`` (O(n): a new global server); the pending exchange's copy is
        ``g`` at its entries."""
        new, replay = super().rebase(weights, g, server_seq)
        self.weights = new
        if self.pending is not None and self.pending.synced is not None:
            assert isinstance(self.pending.sent, SparseVector)
            self.pending.synced = g[self.pending.sent.indices]
        return new, replay


def _within(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """(len(a),) bool: which entries of ``a`` are in ``b`` (both increasing), O(a log b)."""
    if b.size == 0:
        return np.zeros(a.size, dtype=np.bool_)
    pos = np.minimum(np.searchsorted(b, a), b.size - 1)
    return b[pos] == a


def group_sync(run: Any, weights: np.ndarray) -> GroupSync:
    """A group's side of the exchange ``run.xchg_mode`` names: ``exchange.GroupSync`` (top-k) or
    ``ExactSync`` (``weights``: the group's own array, which the exact one follows)."""
    if run.xchg_mode == "exact":
        return ExactSync(weights)
    return GroupSync(weights, kept=exchange_ratio(run))


# -- the global server's half ----------------------------------------------------------------


class ExactMirror:
    """The global server's side of the exact exchange for one group: the version of the global
    weights' change log the group holds (``base``: the last reply it took, known when its next
    new seq arrives), and the one its last reply brought (``last``). The answer is every entry
    the log names after ``base``, at the global weights' values: O(changes), no copy of what the
    group holds. A repeat is answered from the same ``base`` (the lost reply was not taken); the
    whole weights when the log does not reach back (a new or resumed server, a group far behind)
    or the entries pass ``DENSE_AT`` of n."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.base: int | None = None  # the version the group holds; None: unknown
        self.last: int | None = None  # the version the last reply brought it to

    def reset(self, weights: np.ndarray | None = None, version: int = 0) -> None:
        """The group took the weights whole at ``version`` (a PULL); None: unknown."""
        self.base = self.last = None if weights is None else version

    def answer(self, weights: np.ndarray, repeat: bool,
               changes: ChangeLog | None = None) -> np.ndarray | SparseVector:
        """The reply to an exchange merged (or repeated: ``repeat``) into ``weights``."""
        if not repeat:
            self.base = self.last  # a new seq: the group took the last reply
        idx = None if changes is None or self.base is None else changes.since(self.base)
        self.last = None if changes is None else changes.version
        if idx is None or idx.size > DENSE_AT * weights.size:
            return np.array(weights, dtype=np.float32)
        return SparseVector(idx, weights[idx], weights.size)


def group_mirror(run: Any, size: int) -> GroupMirror | ExactMirror:
    """The global server's side of one group's exchange, as ``run.xchg_mode`` names it."""
    if run.xchg_mode == "exact":
        return ExactMirror(size)
    return GroupMirror(size, exchange_ratio(run))
