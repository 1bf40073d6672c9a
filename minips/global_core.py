"""The global server's rules without IO: the authoritative weights, merges, budget, ratios.

``GlobalCore`` is what the global server *decides*; ``server.GlobalServer`` (asyncio) is how it
talks. A group's exchange is ``merge(g, delta, stats) -> ExchangeResult``; the roster
(``roster.py``, also sans-IO) holds who is in which group and GDTopK's ratios. Times come from
two injected clocks (``clock``: monotonic seconds, ``wall``: epoch seconds for records); no
asyncio, sockets, clocks or torch inside (tests/test_group_core.py checks). What needs IO goes
to hooks, no-ops here, that the shell overrides:

- ``on_ratios(new)``: GDTopK chose new ratios ``{group: ratio}`` (already in the handles);
- ``on_done()``: the budget is spent: tell the groups and the workers;
- ``on_all_final()``: every group flushed its final delta: end, or wait for workers to rejoin;
- ``on_diverged(reason)``: a group sent NaN or inf (not merged): the run fails;
- ``log(event, **fields)``: one line of the run's record.

Invariants (server.py's docstring has the run's whole course): ``weights`` changes only in
``merge`` (weights += delta of one group scaled by the sync policy's merge rule, version += 1),
so the global weights are the initial weights plus every delta any group sent; once ``done``,
merges still land: nothing sent is lost.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from minips import protocol, sparse
from minips.config import RunConfig, dataset_train_size
from minips.exchange import Delta, ExchangeResult, push_message, wire_size
from minips.replica import Replica, exchange_ratio
from minips.roster import Roster

__all__ = ["GlobalCore"]


class GlobalCore:
    """The global weights, their version, the run's samples and budget, the roster."""

    def __init__(self, run: RunConfig, weights: np.ndarray | None, *, regroup: bool,
                 clock: Callable[[], float], wall: Callable[[], float]) -> None:
        self.run = run
        self.now, self.wall = clock, wall
        self.weights = None if weights is None else np.array(weights, dtype=np.float32)
        self.version = 0  # merges applied to self.weights
        self.samples = 0  # training samples all groups reported
        self.roster = Roster(run, regroup=regroup)
        self.workers = self.roster.workers  # worker id -> WorkerEntry
        self.groups = self.roster.groups  # group id -> GroupHandle
        self.replicas: dict[int, Replica] = {}  # group id -> what it holds of the weights
        self.done = False
        self.done_reason = ""
        self.failure = ""  # why the run ended short or broken ("" = it did not; run_end.py)
        self.train_size = dataset_train_size(run.dataset, run.train_size)
        self.started_training = 0.0  # wall time when the groups were formed

    # -- GDTopK ratios -----------------------------------------------------------------------

    def _update_ratios(self) -> None:
        """GDTopK: when the ratio policy (roster.update_ratios, ratios.py) gives new ratios, log
        them and hand them to ``on_ratios``."""
        new = self.roster.update_ratios(self.now())
        if not new:
            return
        policy = self.roster.policy
        self.log("ratios", ratios={str(g): r for g, r in new.items()},
                 iter_time={str(g): policy.times.get(g) for g in new} if policy else {})
        self.on_ratios(new)

    def _observe_iter_time(self, g: int, stats: dict[str, Any]) -> None:
        """An exchange's measured iteration time (``iter_time``) feeds the GDTopK policy."""
        if self.roster.policy is not None:
            self.roster.observe_iter_time(g, stats.get("iter_time"), self.now())
            self._update_ratios()

    # -- merging -----------------------------------------------------------------------------

    def merge(self, g: int, delta: Delta, stats: dict[str, Any]) -> ExchangeResult:
        """Add group ``g``'s delta (dense or sparse) to the global weights; answer with what
        the group's copy of them lacks (``replica.py``: dense weights, or entries to set). An
        exchange that repeats the group's last (session, seq) (its reply was lost) is answered
        without merging again (with what the lost reply set, again)."""
        assert self.weights is not None
        h = self.groups[g]
        key = (int(stats.get("session", -1)), int(stats.get("seq", -1)))
        repeat = key[1] >= 0 and key == h.last_exchange
        if repeat:
            self.log("merge_repeat", group=g, seq=key[1])
        else:
            h.last_exchange = key
            self._add_delta(g, delta, stats)
        reply = self.replica(g).answer(self.weights, repeat)
        return ExchangeResult(reply, self.version, self.done, self.samples)

    def merge_counted(self, g: int, delta: Delta, stats: dict[str, Any]) -> ExchangeResult:
        """``merge`` for a group in this process (or a simulated one): its bytes are those of
        the PUSH and WEIGHTS a `minips group` process would exchange instead."""
        res = self.merge(g, delta, stats)
        res.bytes_up = wire_size(push_message(delta, stats))
        res.bytes_down = wire_size(self.weights_message(res.weights))
        return res

    def replica(self, g: int) -> Replica:
        """The global server's copy of what group ``g`` holds of the global weights."""
        assert self.weights is not None
        if g not in self.replicas:
            self.replicas[g] = Replica(self.weights.size, exchange_ratio(self.run))
        return self.replicas[g]

    def _add_delta(self, g: int, delta: Delta, stats: dict[str, Any]) -> None:
        """Merge one new exchange of group ``g``: weights, counters, its log line, the budget."""
        assert self.weights is not None
        h = self.groups[g]
        values = delta.values if isinstance(delta, sparse.SparseGrad) else delta
        if not np.isfinite(np.sum(values, dtype=np.float64)):  # any NaN / inf makes the sum one
            self.on_diverged(f"group {g} sent a non-finite update (NaN or inf) at merge "
                             f"{self.version}: the model diverged; try a lower --lr")
            return  # not applied: the run fails
        scale = self.run.sync.merge_scale(self.run.merge, len(self.groups))
        sparse.scatter_add(self.weights, delta, scale)
        self.version += 1
        self.samples += int(stats.get("samples", 0))
        h.merges += 1
        h.final = bool(stats.get("final"))  # a non-final merge after a final one: it is back
        h.traffic = {k: int(stats.get(k, 0)) for k in ("bytes_in", "bytes_out")}
        self._observe_iter_time(g, stats)
        self.log("merge", group=g, group_samples=stats.get("samples", 0),
                  **{k: v for k, v in stats.items() if k not in ("version", "samples")})
        self.check_budget()

    def check_budget(self) -> None:
        if self.run.epochs > 0 and self.samples >= self.run.epochs * self.train_size:
            self.finish("epochs")
        if self.groups and all(h.final for h in self.groups.values()):
            self.on_all_final()  # the end, or a wait for the workers to rejoin

    def trained_s(self) -> float:
        """Seconds since the groups were formed (the wall budget's clock)."""
        return self.wall() - self.started_training if self.started_training else 0.0

    def finish(self, reason: str) -> None:
        """Budget spent (or the run failed): ``done``, logged, and ``on_done`` tells the rest."""
        if self.done:
            return
        self.done, self.done_reason = True, reason
        self.log("done", reason=reason)
        self.on_done()

    # -- weights and traffic for the other roles-----------------------------------------------

    def weights_message(self, weights: Delta | None = None, final: bool = False,
                        members: list[int] | None = None) -> Any:
        """GLOBAL_WEIGHTS with the global weights (or an exchange's sparse answer: entries to
        set) and the run's counters."""
        w = self.weights if weights is None else weights
        w = w if w is not None else np.zeros(0, np.float32)
        encoding, codec, buffers = sparse.encode_gradient(w)
        traffic = self.traffic()
        return protocol.GlobalWeights(
            version=self.version, done=final or self.done, size=int(w.size),
            samples=self.samples, t=self.wall() - self.run.t0, train_s=self.trained_s(),
            done_reason=self.done_reason, bytes_up=traffic["bytes_up"],
            bytes_down=traffic["bytes_down"], members=members or [], encoding=encoding,
            codec=codec, buffers=tuple(buffers))

    def traffic(self) -> dict[str, int]:
        """Worker <-> group bytes so far (external groups: as of their last exchange)."""
        up = down = 0
        for h in self.groups.values():
            b = h.server.traffic() if h.server is not None else h.traffic
            up, down = up + b.get("bytes_in", 0), down + b.get("bytes_out", 0)
        return {"bytes_up": up, "bytes_down": down}

    # -- hooks: the IO side overrides them ----------------------------------------------------

    def on_ratios(self, new: dict[int, float]) -> None:
        """GDTopK's new ratios, already in the group handles: deliver them."""

    def on_done(self) -> None:
        """The budget is spent: tell the groups and the workers."""

    def on_all_final(self) -> None:
        """Every group flushed its final delta."""

    def on_diverged(self, reason: str) -> None:
        """A group's delta held NaN or inf; it was not merged."""

    def log(self, event: str, **fields: Any) -> None:
        """One line of the run's record."""
