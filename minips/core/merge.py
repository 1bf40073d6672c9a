"""The global weights and the groups' exchanges with them: one round trip, in and out.

``Merger`` holds the global weights, their version and the run's samples, and what the global
server knows of each group's copy: its mirror (what the group holds, ``exchange.py``), the point
its copy was last brought up to (``synced``), the last merged seq of each of its sessions
(``merged``) and the change log of the weights. ``GlobalCore`` holds one and adds what a merge
decides beyond the weights (the budget, GDTopK's ratios, a failure). No IO: time comes as ``now``.

Invariants: ``weights`` changes only in ``merge`` (weights += delta of one group scaled by the
sync policy's merge rule, version += 1), so the global weights are the initial weights plus every
delta any group sent. Each (session, seq) of a group is merged at most once (``replay.Merged``: a
seq not above its session's last merged one is answered without merging). The run's counters
(samples, version, the groups' worker traffic summed) never pass ``MAX_COUNT`` (2^62): an
exchange that would take one past it is refused (``RemoteProtocolError``) before anything of it
is merged.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from minips import sparse
from minips.core.actions import Log
from minips.core.changelog import ChangeLog
from minips.core.config import RunConfig
from minips.core.exact_exchange import ExactMirror, group_mirror
from minips.core.exchange import (
    BETWEEN_GROUPS,
    Delta,
    ExchangeResult,
    GroupMirror,
    GroupSync,
    SyncPoint,
)
from minips.core.replay import MAX_SESSIONS, Merged
from minips.core.roster import Roster
from minips.errors import RemoteProtocolError
from minips.wire import messages
from minips.wire.messages import MAX_COUNT

__all__ = ["MergeOutcome", "Merger"]


@dataclass
class MergeOutcome:
    """What ``Merger.merge`` did: its ``logs`` (the merge's line last), the ``result`` that
    answers the group, whether the delta was ``added``, and ``diverged``: why it was not (a
    delta that is not finite; "" otherwise)."""

    result: ExchangeResult
    added: bool = False
    diverged: str = ""
    logs: list[Log] = field(default_factory=list)


class Merger:
    """The global weights, their version, the samples merged, and each group's copy of them."""

    def __init__(self, run: RunConfig, roster: Roster, weights: np.ndarray | None) -> None:
        self.run = run
        self.roster = roster
        self.groups = roster.groups  # group id -> GroupHandle
        self.weights = None if weights is None else np.array(weights, dtype=np.float32)
        self.version = 0  # merges applied to self.weights
        self.samples = 0  # training samples all groups reported
        # group id -> what it holds of the weights (``RunConfig.xchg_mode``)
        self.mirrors: dict[int, GroupMirror | ExactMirror] = {}
        # group id -> the global weights its copy was last brought up to (between-group
        # staleness: ``missed``, the merges of *other* groups since then, and ``base_age_s``);
        # none for a group resumed from a checkpoint until it is answered (the point is not saved)
        self.synced: dict[int, SyncPoint] = {}
        # for each merge the indices it touched: an answer to a group costs O(changes since)
        self.changes: ChangeLog | None = None  # made with the weights (``change_log``)
        self.merged: dict[int, Merged] = {}  # group id -> last merged seq of its sessions

    def merge(self, g: int, delta: Delta, stats: dict[str, Any], now: float, *, done: bool,
              traffic: Mapping[str, int] | None = None) -> MergeOutcome:
        """Add group ``g``'s delta (dense or sparse) to the global weights and answer with what
        the group's copy lacks (``exchange.py``: dense weights, or entries to set). A repeat (a
        seq not above its session's last merged one) is answered without merging, with what the
        lost reply set. ``traffic``: worker bytes as the shell counts them (``check_counters``).
        ``done``: the run's budget is spent (the answer says so)."""
        assert self.weights is not None
        h = self.groups[g]
        key = (int(stats.get("session", -1)), int(stats.get("seq", -1)))
        merged = self.merged.setdefault(g, Merged())
        repeat = key[1] >= 0 and merged.holds(*key)
        stale = self.between_groups(g, now)  # before the merge: how stale the exchange was
        logs: list[Log] = []
        diverged = ""
        if repeat:
            logs.append(Log("merge_repeat", {"group": g, "seq": key[1],
                                                 "merged_seq": merged.last[key[0]]}))
        else:
            self.check_counters(stats, traffic or {})
            if key[1] >= 0 and merged.full(key[0]):
                raise RemoteProtocolError(
                    f"group {g} had {MAX_SESSIONS} sessions already (one per group process "
                    "run): a new one is refused so that none is forgotten and merged twice",
                    expected="a session this group had", got=key[0])
            if key[1] >= 0:
                merged.note(*key)
            h.last_exchange = key
            diverged = self._add_delta(g, delta, stats)
        added, done = not repeat and not diverged, done or bool(diverged)  # diverged: it is over
        sent = self.mirror(g).answer(self.weights, repeat, self.change_log())
        self.synced_now(g, now)  # what the answer brings the group's copy up to
        res = ExchangeResult(sent, self.version, done, self.samples)
        if added:  # the shell adds the bytes of the exchange's frames (it counts them)
            fields = {k: v for k, v in stats.items() if k not in ("version", "samples")}
            logs.append(Log("merge", {"group": g, "group_samples": stats.get("samples", 0),
                                      **fields, **stale}))
        return MergeOutcome(res, added, diverged, logs)

    def _add_delta(self, g: int, delta: Delta, stats: dict[str, Any]) -> str:
        """Merge one new exchange of group ``g``: weights, counters; why not ("" when merged):
        a delta that is not finite is not merged."""
        assert self.weights is not None
        h = self.groups[g]
        values = delta.values if isinstance(delta, sparse.SparseVector) else delta
        if not np.isfinite(np.sum(values, dtype=np.float64)):  # any NaN / inf makes the sum one
            return (f"group {g} sent a non-finite update (NaN or inf) at merge {self.version}: "
                    "the model diverged; try a lower --lr")
        scale = self.run.sync.merge_scale(self.run.merge, len(self.groups))
        sparse.add_into(self.weights, delta, scale)
        self.change_log().note(delta.indices if isinstance(delta, sparse.SparseVector) else None)
        self.version += 1
        self.samples += int(stats.get("samples", 0))
        h.merges += 1
        h.final = bool(stats.get("final"))  # a non-final merge after a final one: it is back
        self.roster.observe_iterations(stats)  # its workers' iterations: what grouping uses
        return ""

    def pulled(self, g: int, now: float) -> np.ndarray:
        """A group process takes the global weights whole at ``now`` (registering, adopting,
        reconnecting): the copy that goes out, from which the server's mirror of its copy
        starts (exchange.py), and so does its staleness (``synced``)."""
        assert self.weights is not None
        weights = self.weights.copy()  # what goes out: merges may land before it is written
        self.mirror(g).reset(weights, self.change_log().version)
        self.synced_now(g, now)
        return weights

    def exchange_reply(self, g: int, weights: Delta, done: bool) -> messages.ExchangeReply:
        """EXCHANGE_REPLY: the merged weights (or the entries to set) and the last exchange in
        each of the server's last two checkpoint snapshots (exchange.py)."""
        return messages.ExchangeReply(
            version=self.version, done=done, samples=self.samples,
            saved_exchanges=[list(key) for key in self.groups[g].snapshots],
            payload=sparse.encode_vector(weights))

    def check_counters(self, stats: dict[str, Any], traffic: Mapping[str, int]) -> None:
        """Merging a group's exchange (its ``stats``) keeps every counter of the run within
        ``MAX_COUNT`` (2^62, what GLOBAL_WEIGHTS carries): the samples, the version, and the
        worker traffic of all groups (each reports its own so far, ``bytes_in`` / ``bytes_out``;
        ``traffic``: the run's ``bytes_up`` / ``bytes_down`` and the group's own ``bytes_in`` /
        ``bytes_out`` before this exchange, as the shell counts them). ``RemoteProtocolError``
        naming the counter otherwise."""
        after = {"samples": self.samples + int(stats.get("samples", 0)),
                 "version": self.version + 1}
        for name, key in (("bytes_in", "bytes_up"), ("bytes_out", "bytes_down")):
            after[name] = traffic.get(key, 0) - traffic.get(name, 0) + int(stats.get(name, 0))
        for name, value in after.items():
            if value > MAX_COUNT:
                raise RemoteProtocolError(f"the run's {name} would pass 2^62 with this exchange",
                                          expected=f"<= {MAX_COUNT}", got=value)

    def change_log(self) -> ChangeLog:
        """The global weights' change log (a new one for new weights: resumed, or the first)."""
        assert self.weights is not None
        if self.changes is None or self.changes.size != self.weights.size:
            self.changes = ChangeLog(self.weights.size)
        return self.changes

    def synced_now(self, g: int, now: float) -> None:
        """Group ``g``'s copy is brought up to the global weights as they are at ``now``."""
        self.synced[g] = SyncPoint(self.version, self.groups[g].merges, now)

    def between_groups(self, g: int, now: float) -> dict[str, Any]:
        """The between-group staleness of group ``g``'s exchange merged at ``now`` (before it
        is merged): ``missed`` and ``base_age_s`` (``exchange.SyncPoint``), both None when
        the server does not know what the group's copy rebased on (a group resumed from a
        checkpoint, before its first answer)."""
        point = self.synced.get(g)
        if point is None:
            return dict.fromkeys(BETWEEN_GROUPS)
        return point.between_groups(self.version, self.groups[g].merges, now)

    def share(self, g: int, sync: GroupSync) -> None:
        """Group ``g`` is served in this process and ``sync`` is its side of the exchange: a
        top-k mirror reads its ``w_sync`` instead of keeping a copy (``GroupMirror.share``)."""
        mirror = self.mirror(g)
        if isinstance(mirror, GroupMirror):
            mirror.share(sync)

    def mirror(self, g: int) -> GroupMirror | ExactMirror:
        """The global server's copy of what group ``g`` holds of the global weights."""
        assert self.weights is not None
        if g not in self.mirrors:
            self.mirrors[g] = group_mirror(self.run, self.weights.size)
        return self.mirrors[g]
