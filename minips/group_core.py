"""A group server's rules without IO: weights, SGD, clocks, rounds, the downlink's answers.

``GroupCore`` is what a group *decides*; ``group.GroupServer`` (asyncio) is how it talks. The
core takes a message (a PUSH, a PULL that may be answered, an exchange's reply, a worker that
joins or leaves) and returns the answer, with the time from an injected ``clock``; it imports
no asyncio, sockets, clocks or torch (tests/test_group_core.py checks). What it needs from the
IO side are four hooks, no-ops here, that the shell overrides:

- ``wake()``: a waiting PULL may have become answerable (a push, a leave);
- ``start_exchange()``: ``sync_every`` pushes since the last exchange;
- ``all_left()``: the last worker left: a final exchange is due;
- ``traffic()``: bytes from / to the group's workers, for the exchange's counters; and ``log``.

The rules themselves (SSP inside the group, BSP rounds as synchronous SGD, the learning rate of
one push, the compressed downlink) are described in group.py's docstring.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from minips import optim, protocol, sparse, ssp
from minips.compress.ratios import IterTimer
from minips.config import RunConfig, dataset_train_size
from minips.downlink import Downlink
from minips.exchange import Exchange, ExchangeResult, GroupLink, Outgoing
from minips.replica import exchange_ratio

__all__ = ["GroupCore"]


class GroupCore:
    """State and rules of one group. Plain attributes hold the whole state (``state_dict``)."""

    def __init__(self, group: int, run: RunConfig, weights: np.ndarray | None,
                 link: GroupLink | None, *, members: list[int] | None = None,
                 clock: Callable[[], float]) -> None:
        self.now = clock
        self.finished = False  # final delta flushed
        self.members: set[int] = set()  # worker ids the global server assigned here
        self.iters = IterTimer()  # time between a worker's pushes, for GDTopK (compress/ratios.py)
        self.group, self.run = group, run
        if weights is not None and link is not None:
            self.setup(group, run, weights, link, members or [])

    def setup(self, group: int, run: RunConfig, weights: np.ndarray, link: GroupLink,
              members: list[int]) -> None:
        """The training state: weights, optimizer, clocks (a `minips group` gets it late)."""
        self.group, self.run, self.link = group, run, link
        self.weights = np.array(weights, dtype=np.float32)  # (n,) this group's model
        self.xchg = Exchange(self.weights, ratio=exchange_ratio(run))  # delta, seq, counters
        self.xchg_bytes = {"bytes_to_global": 0, "bytes_from_global": 0}  # exchanges so far
        self.opt = optim.SGD(self.weights.size, lr=run.lr, momentum=run.momentum,
                             weight_decay=run.weight_decay)
        # samples per epoch, for the lr warm-up and schedule (looked up only when one is on)
        self.train_size = (dataset_train_size(run.dataset, run.train_size)
                           if run.lr_warmup > 0 or run.lr_schedule != "constant" else 0)
        self.table = ssp.ClockTable(run.staleness_bound, run.lease_s)
        self.rounds: ssp.Rounds[Any] = ssp.Rounds()
        self.version = 0  # updates applied to self.weights
        self.unapplied = 0  # samples pushed, not applied yet (a BSP round still open)
        self.global_version = 0  # global version seen at the last exchange
        self.counters = {"pushes": 0, "samples": 0}
        self.done = False  # budget spent; answer every PULL with done
        self.ratio = run.ratio  # GDTopK ratio the global server chose for this group
        down = run.downlink_ratio()  # PULL answers: sparse updates of w_pub, or dense weights
        self.downlink = Downlink(self.weights, down) if down < 1 else None
        self._joined: set[int] = set()
        for w in members:
            self.expect(w)

    # -- membership -----------------------------------------------------------------------

    def expect(self, w: int) -> None:
        """Count worker ``w`` in the group before it connects (so BSP rounds wait for it)."""
        self.members.add(w)
        self.table.join(w, self.now(), 0)

    def _join(self, w: int) -> int:
        self._joined.add(w)
        self.finished = False  # a (re)grouped worker arrived: a final flush is due again
        return self.table.join(w, self.now())

    def _leave(self, w: int) -> None:
        self.table.leave(w)
        self._after_membership_change()

    def _after_membership_change(self) -> None:
        if self.run.in_rounds:
            self._apply_rounds()
        self.wake()
        if not len(self.table) and self._joined and not self.finished:
            self.all_left()

    # -- gradients --------------------------------------------------------------------------

    def on_push(self, w: int, msg: Any) -> Any:
        """Decode, account and apply (or queue, in BSP) one worker push; return the ACK."""
        grad = sparse.decode_gradient(msg.encoding, msg.codec, msg.buffers, self.weights.size)
        self.table.push(w, msg.clock, self.now())
        self.iters.push(w, self.now())
        self._count(msg)
        if self.run.in_rounds:
            self.rounds.add(msg.clock, (grad, msg.samples))
            self._apply_rounds()
        else:
            self._apply(grad, msg.samples, len(self.table))
        self.wake()
        if self.run.sync.exchange_due(self.xchg.since["pushes"], self.run.sync_every):
            self.start_exchange()
        return protocol.Ack(clock=msg.clock, version=self.version)

    def _count(self, msg: Any) -> None:
        self.xchg.count(msg.samples, msg.step_time, msg.loss)
        self.counters["pushes"] += 1
        self.counters["samples"] += msg.samples
        self.unapplied += msg.samples

    def _apply_rounds(self) -> None:
        """Apply each complete BSP round once: the mean of its gradients, one SGD step."""
        for _, pushes in self.rounds.pop_complete(self.table.min_clock()):
            grads = [g for g, _ in pushes]
            self._apply(sparse.average(grads, self.weights.size), sum(n for _, n in pushes))

    def _apply(self, grad: Any, samples: int, share: int = 1) -> None:
        """One SGD step on ``samples`` samples; ``share`` > 1 applies 1/share of it (one push
        of a round of share)."""
        self.opt.lr = self.run.lr * self._lr_factor(samples) / max(1, share)
        self.opt.step(self.weights, grad)
        self.version += 1
        self.unapplied -= samples

    def _lr_factor(self, samples: int) -> float:
        """The warm-up and decay for an update of ``samples`` (``optim.lr_factor``), at the
        run's samples before it: all pushes counted (exchange.py) less those not applied yet.
        A group that is the whole cluster (bsp, ssp, asp) knows that count exactly, so BSP is
        synchronous SGD step for step (``reference.train``). A GSSP group knows the others'
        samples as of its last exchange, and warms up on its own samples over its share of
        the cluster (its live workers out of all workers)."""
        if not self.train_size:
            return 1.0
        ramp = self.run.lr_warmup * self.train_size
        budget = self.run.epochs * self.train_size
        seen = self.xchg.cluster_samples() - self.unapplied
        if self.run.fixed_groups == 1:
            return optim.lr_factor(self.run.lr_schedule, seen=seen, step=samples, ramp=ramp,
                                   budget=budget)
        share = max(1, len(self.table)) / max(1, self.run.workers)
        own = self.counters["samples"] - self.unapplied
        return (optim.warmup_factor((own + samples) / share, ramp)
                * optim.decay_at(self.run.lr_schedule, seen, budget))

    # -- weights ----------------------------------------------------------------------------

    def may_answer(self, w: int) -> bool:
        return self.done or w not in self.table or self.table.may_start(w)

    def publish(self) -> None:
        """With a compressed downlink, publish the weights' largest changes (``downlink.py``);
        the PULLs answered after it get the update up to it."""
        if self.downlink is not None:
            self.downlink.publish(self.weights)

    def weights_message(self, w: int | None, waited_for: list[int], since: int = -1) -> Any:
        """WEIGHTS for worker ``w`` holding version ``since``: the weights themselves (dense
        downlink; version = updates applied), or, with a compressed downlink, the update from
        ``since`` to the last publish (``publish``, ``downlink.py``)."""
        payload: sparse.SparseGrad | np.ndarray = self.weights
        version, base = self.version, -1
        if self.downlink is not None:
            answer = self.downlink.answer(since)
            version, base, payload = answer.version, answer.since, answer.payload
        encoding, codec, buffers = sparse.encode_gradient(payload)
        info = {"group": self.group, "waited_for": waited_for, "ratio": self.ratio,
                "lead": self.table.lead(w) if w in self.table else 0,
                "min_clock": self.table.min_clock()}
        if self.downlink is not None:  # how far the weights sent are from the group's
            info["drift"] = round(self.downlink.last_drift, 6)
        return protocol.Weights(version=version, since=base, encoding=encoding, codec=codec,
                                buffers=tuple(buffers), done=self.done, info=info)

    # -- exchange and checkpoint ---------------------------------------------------------

    def begin_exchange(self, final: bool = False) -> Outgoing:
        """The next exchange: the delta since the last one and the group's counters (dense
        for a flush, ``final`` or after ``done``)."""
        extra = {"version": self.version, "final": final, **self.traffic(),
                 "iter_time": self.iters.take(),
                 "min_clock": self.table.min_clock(), "max_clock": self.table.max_clock()}
        return self.xchg.begin(self.weights, extra, dense=final or self.done)

    def exchanged(self, out: Outgoing, res: ExchangeResult, seconds: float) -> bool:
        """The global server's answer ``res`` to ``out`` (after ``seconds``): take it, count its
        bytes, log it. True when it says the budget is spent and this group did not know yet."""
        self.xchg.complete(self.weights, out, res)
        self.global_version = res.version
        self.xchg_bytes["bytes_to_global"] += res.bytes_up
        self.xchg_bytes["bytes_from_global"] += res.bytes_down
        self.log("exchange", exchange_s=seconds, global_version=res.version,
                 seq=out.stats["seq"], min_clock=out.stats["min_clock"],
                 max_clock=out.stats["max_clock"], sent=_entries(out.delta),
                 got=_entries(res.weights), **self.xchg_bytes)
        return bool(res.done) and not self.done

    def reload(self, weights: np.ndarray, link: GroupLink, held: int | None = None) -> None:
        """Reconnected to a (restarted) global server that holds this group's exchanges up to
        seq ``held``: take its weights, keep what this group applied since its last exchange
        and what the server lost of its exchanges on top (sent with the next exchange), keep
        clocks and optimizer state."""
        w = np.asarray(weights, dtype=np.float32)
        self.weights, replay = self.xchg.rebase(self.weights, w, held)
        self.link = link
        if held is not None:
            self.log("resync", held_seq=held, seq=self.xchg.seq,
                     replay_samples=-1 if replay is None else replay.samples)

    def state_dict(self) -> dict[str, Any]:
        """Everything a checkpoint needs to rebuild this group server."""
        return {"group": self.group, "weights": self.weights.copy(),
                "w_sync": self.xchg.w_sync.copy(),
                "opt": self.opt.state_dict(), "clocks": dict(self.table.clocks),
                "version": self.version, "global_version": self.global_version,
                "counters": dict(self.counters), "ratio": self.ratio,
                "exchange": self.xchg.state_dict(), "xchg_bytes": dict(self.xchg_bytes)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take back what ``state_dict`` gave (checkpoint resume). The saved workers count as
        live again, each at its saved clock; one that does not come back expires by lease."""
        self.weights[:] = np.asarray(state["weights"], dtype=np.float32)
        saved = state.get("exchange", {"session": self.xchg.session, "seq": 0})  # older files
        self.xchg.load_state_dict(saved, state["w_sync"])
        self.opt.load_state_dict(state["opt"])
        self.table.restore({int(w): int(c) for w, c in state["clocks"].items()}, self.now())
        self.version, self.global_version = state["version"], state["global_version"]
        self.counters = {k: int(state["counters"].get(k, 0)) for k in ("pushes", "samples")}
        self.ratio = state["ratio"]
        self.xchg_bytes = {k: int(state.get("xchg_bytes", {}).get(k, 0))  # 0 in older files
                           for k in ("bytes_to_global", "bytes_from_global")}

    # -- hooks: the IO side overrides them ----------------------------------------------------

    def wake(self) -> None:
        """A waiting PULL may have become answerable."""

    def start_exchange(self) -> None:
        """``sync_every`` pushes since the last exchange: one is due."""

    def all_left(self) -> None:
        """The last worker left the group: a final exchange is due."""

    def traffic(self) -> dict[str, int]:
        """Bytes received from / sent to this group's workers so far."""
        return {"bytes_in": 0, "bytes_out": 0}

    def log(self, event: str, **fields: Any) -> None:
        """One line of the group's record (``event``, ``fields``)."""


def _entries(d: Any) -> int:
    """How many entries an exchange or its reply carried (dense: all)."""
    return int(d.nnz if isinstance(d, sparse.SparseGrad) else d.size)
