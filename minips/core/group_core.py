"""A group server's rules without IO: weights, SGD, clocks, rounds, the exchange's counters.

``GroupCore`` is what a group *decides*; ``serve/group.py``'s ``GroupServer`` (asyncio) holds one
and carries out its actions, and the simulator drives the same class in simulated time. Each entry
point takes an event and the time ``now`` and returns the actions its shell is to perform, in the
order they are due: a worker joins, leaves or falls silent (``join``, ``leave``, ``tick``); it
pushes (``push``); its PULL is answered when SSP allows (``may_answer``, ``weights_message``);
the group exchanges with the global server (``begin_exchange``, ``exchanged``) or meets a new
one (``rebase``).

Invariants: every change of the weights goes through ``_change``, which notes it in the group's
change log and keeps the downlink's sums up to date; no weight that is not finite goes out
(``downlink.Diverged``); at most one exchange is in flight.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from minips import sparse
from minips.core import optim, ssp
from minips.core.actions import Log
from minips.core.balance import Balancer
from minips.core.changelog import ChangeLog
from minips.core.config import RunConfig
from minips.core.downlink import Answer, check_finite, group_downlink
from minips.core.exact_exchange import group_sync
from minips.core.exchange import Delta, ExchangeResult, Outgoing
from minips.core.local_steps import outer_sgd
from minips.errors import RemoteProtocolError
from minips.wire import control, messages
from minips.wire.fields import Payload

__all__ = [
    "Action",
    "AllLeft",
    "BudgetSpent",
    "Reply",
    "StartExchange",
    "Wake",
    "GroupCore",
    "worker_times",
]


# -- the actions: what the core asks its shell to do ------------------------------------------

@dataclass(frozen=True)
class Reply:
    """Send ``msg`` (an ACK) to worker ``worker``, the one whose message this answers."""

    worker: int
    msg: messages.Ack


@dataclass(frozen=True)
class Wake:
    """The group's lowest clock or its membership changed: a held PULL may be answerable now
    (``GroupCore.may_answer``)."""


@dataclass(frozen=True)
class StartExchange:
    """``sync_every`` pushes since the last exchange: start one with the global server unless
    one is in flight (``GroupCore.begin_exchange``)."""


@dataclass(frozen=True)
class AllLeft:
    """The group's last worker left: a final exchange is due (a ``final`` flush)."""


@dataclass(frozen=True)
class BudgetSpent:
    """The global server's answer says the run is over: answer every PULL with ``done`` and
    flush a last delta (``GroupServer.finish``)."""


Action = Reply | Wake | StartExchange | AllLeft | BudgetSpent | Log


# -- the rules -------------------------------------------------------------------------------

class GroupCore:
    """State and rules of one group. Plain attributes hold the whole state (``state_dict``)."""

    def __init__(self, group: int, run: RunConfig, weights: np.ndarray | None, *,
                 members: list[int] | None = None, now: float = 0.0) -> None:
        self.finished = False  # final delta flushed
        self.members: set[int] = set()  # worker ids the global server assigned here
        self.open_membership = False  # any worker id may join (a `minips group` process)
        # each worker's iteration as this group sees it (PUSH interval less the SSP hold) and
        # its compute time: what the grouping, GDTopK and LB-BSP use (ssp.Iterations)
        self.iters = ssp.Iterations()
        self.group, self.run = group, run
        if weights is not None:
            self.setup(group, run, weights, members or [], now=now)

    def setup(self, group: int, run: RunConfig, weights: np.ndarray, members: list[int], *,
              now: float, open_membership: bool = False) -> None:
        """The training state: weights, optimizer, clocks (a `minips group` gets it late);
        ``members`` count as joined at ``now``; ``open_membership``: any worker id may join
        (a `minips group`: the global server places its workers)."""
        self.group, self.run = group, run
        self.open_membership = open_membership
        self.weights = np.array(weights, dtype=np.float32)  # (n,) this group's model
        # the exchange's delta, seq and counters: group_sync picks GroupSync (top-k) or, with
        # --xchg-mode exact, ExactSync (core/exact_exchange.py)
        self.xchg = group_sync(run, self.weights)
        self.xchg_bytes = {"bytes_to_global": 0, "bytes_from_global": 0}  # exchanges so far
        self.opt = _server_sgd(run, self.weights.size)
        self.budget = run.budget_samples()  # the run's samples, for WEIGHTS.progress; 0: none
        # samples per epoch, for the lr warm-up and schedule (looked up only when one is on)
        self.train_size = (run.epoch_samples()
                           if run.lr_warmup > 0 or run.lr_schedule != "constant" else 0)
        self.table = ssp.ClockTable(run.staleness_bound, run.lease_s)
        self.rounds: ssp.Rounds[tuple[Delta, int]] = ssp.Rounds()  # (gradient, samples)
        self.version = 0  # updates applied to self.weights
        self.unapplied = 0  # samples pushed, not applied yet (a BSP round still open)
        self.global_version = 0  # global version seen at the last exchange
        self.counters = {"pushes": 0, "samples": 0}
        self.done = False  # budget spent; answer every PULL with done
        # the workers' kept fraction (GDTopK's, which the global server chooses per group), sent
        # with every WEIGHTS
        self.ratio = run.ratio
        # local steps H of this group's workers (the run's, or the global server's choice
        # with local_steps 0: auto; core/local_steps.py); sent with every WEIGHTS
        self.local_steps = run.local_steps or run.local_steps_max
        # LB-BSP: each worker's batch follows its speed (balance.py); None in the other modes
        self.balancer = Balancer(run.batch_size, run.balance_every) if run.sync.balanced else None
        # for each weights version the indices it touched: PULLs, exchanges follow the changes
        self.changes = ChangeLog(self.weights.size)
        self._xchg_mark = 0  # the change log's version when the last exchange began
        self.downlink = group_downlink(run, self.weights, self.changes)  # None: answers are dense
        self._joined: set[int] = set()
        self._since_publish = 0  # pushes since the downlink's last publish (``publish``)
        # the downlink's answers as they go out, checked and encoded once (``_wire_answer``):
        # since -> (answer, its payload), all of the downlink's version ``_wired_at``
        self._wired: dict[int, tuple[Answer, Payload]] = {}
        self._wired_at = -1
        for w in members:
            self.expect(w, now)

    # -- membership -----------------------------------------------------------------------

    def expect(self, w: int, now: float) -> None:
        """Count worker ``w`` in the group before it connects (so BSP rounds wait for it)."""
        self.members.add(w)
        self.table.join(w, now, 0)

    def refusal(self, hello: control.Hello) -> str:
        """Why a HELLO may not open a session with this group ("": it may)."""
        if hello.role != "worker":
            return f"group server {self.group} accepts workers only"
        if hello.group >= 0 and hello.group != self.group:  # e.g. a port reused after a restart
            return f"this is group server {self.group}, not {hello.group}"
        w = hello.worker_id
        if not self.open_membership and w not in self.members:
            return f"worker {w} is not a member of group {self.group}"
        if self.open_membership and not 0 <= w < self.run.workers:
            return f"worker id {w} out of range 0..{self.run.workers - 1}"
        return ""

    def join(self, w: int, now: float) -> list[Action]:
        """Worker ``w`` connected: its first message is an ACK with its starting clock."""
        self._joined.add(w)
        self.iters.start(w)  # time away from the group is no iteration
        self.finished = False  # a (re)grouped worker arrived: a final flush is due again
        start = self.table.join(w, now)
        return [Reply(w, messages.Ack(clock=start, version=self.version))]

    def leave(self, w: int) -> list[Action]:
        """Worker ``w``'s connection closed (LEAVE, or it broke)."""
        self.table.leave(w)
        return self._after_membership_change()

    def tick(self, now: float, heard: dict[int, float]) -> list[Action]:
        """A timer: renew each worker's lease as of ``heard[w]`` (when its connection last
        carried bytes, if within ``lease_s``), then expire the workers silent for longer."""
        for w, t in heard.items():
            if now - t < self.run.lease_s:  # renewed as of its last bytes: a lease lasts lease_s
                self.table.heartbeat(w, t)
        expired = self.table.expire(now)
        if not expired:
            return []
        return [Log("expired", {"workers": list(expired)}), *self._after_membership_change()]

    def _after_membership_change(self) -> list[Action]:
        actions: list[Action] = []
        if self.run.in_rounds:
            actions += self._apply_rounds()
        actions.append(Wake())
        if not len(self.table) and self._joined and not self.finished:
            actions.append(AllLeft())
        return actions

    # -- gradients --------------------------------------------------------------------------

    def push(self, w: int, msg: messages.Push, now: float) -> list[Action]:
        """Decode, account and apply (or queue, in BSP) one PUSH of worker ``w`` (a member of
        the table): its ACK; ``Wake`` when the lowest clock moved (only that can release a
        held PULL); ``StartExchange`` every ``sync_every`` pushes. A PUSH past the run's
        ``max_steps`` raises ``RemoteProtocolError``, nothing applied."""
        if 0 < self.run.max_steps < msg.clock:
            raise RemoteProtocolError("PUSH past the run's --max-steps",
                                      expected=f"clock <= {self.run.max_steps}", got=msg.clock)
        grad = sparse.decode_vector(msg.payload, self.weights.size)
        floor = self.table.min_clock()
        self.table.push(w, msg.clock, now)
        iteration = self.iters.push(w, now, msg.step_time)
        self._count(msg)
        self._since_publish += 1
        if self.balancer is not None:  # a first PUSH closes no iteration: its compute stands in
            self.balancer.observe(w, msg.step_time if iteration is None else iteration,
                                  msg.samples)
        # BSP (staleness 0) averages the pushes of one clock and applies them once, at the lr of
        # the round's place in the run: W workers in BSP are synchronous SGD, schedule included
        # (``reference.train``). Other modes apply each push as it arrives, with the lr divided
        # by the m live workers of the group: one round of m pushes moves as far as a BSP step.
        logs: list[Action] = []
        if self.run.in_rounds:
            self.rounds.add(msg.clock, (grad, msg.samples))
            logs = self._apply_rounds()
        else:
            self._apply(grad, msg.samples, len(self.table))
        actions: list[Action] = [Reply(w, messages.Ack(clock=msg.clock, version=self.version)),
                                 *logs]
        if self.table.min_clock() != floor or self.done:
            actions.append(Wake())
        if self.run.sync.exchange_due(self.xchg.since["pushes"], self.run.sync_every):
            actions.append(StartExchange())
        return actions

    def _count(self, msg: messages.Push) -> None:
        self.xchg.count(msg.samples, msg.step_time, msg.loss)
        self.counters["pushes"] += 1
        self.counters["samples"] += msg.samples
        self.unapplied += msg.samples

    def _apply_rounds(self) -> list[Action]:
        """Apply each complete BSP round once: the mean of its gradients (LB-BSP: weighted by
        their samples), one SGD step; LB-BSP's new batch sizes, when due, as a ``balance`` log."""
        actions: list[Action] = []
        for _, pushes in self.rounds.pop_complete(self.table.min_clock()):
            grads, counts = [g for g, _ in pushes], [n for _, n in pushes]
            weights = counts if self.balancer is not None else None
            self._apply(sparse.average(grads, self.weights.size, weights), sum(counts))
            if self.balancer is not None:
                live = sorted(w for w in self.table.clocks if isinstance(w, int))
                new = self.balancer.round_done(live)
                if new is not None:
                    actions.append(Log("balance", {"batches": {str(w): b
                                                               for w, b in new.items()}}))
        return actions

    def _apply(self, grad: Delta, samples: int, share: int = 1) -> None:
        """One SGD step on ``samples`` samples; ``share`` > 1 applies 1/share of it (one push
        of a round of share)."""
        # an update a worker computed carries its lr already (``next_lr_factor``)
        if self.run.optimizer_on_worker:
            lr = self.run.outer_lr
        else:
            lr = self.run.lr * self._lr_factor(samples)
            if self.run.group_momentum == "cluster" and self.run.momentum != 0:
                self.opt.momentum, scale = self._cluster_momentum()
                lr *= scale
        self.opt.lr = lr / max(1, share)
        plain = self.opt.momentum == 0 and self.opt.weight_decay == 0  # only g's entries move
        touched = grad.indices if plain and isinstance(grad, sparse.SparseVector) else None
        # ExactSync (--xchg-mode exact, chosen by group_sync) keeps w_sync where the weights
        # move; GroupSync does nothing here
        self.xchg.moving(self.weights, touched)
        self._change(touched, lambda: self.opt.step(self.weights, grad))
        self.version += 1
        self.unapplied -= samples

    def _cluster_momentum(self) -> tuple[float, float]:
        """``group_momentum`` "cluster": the momentum that decays per push of the whole
        cluster, as one group's does, and the lr factor that goes with it. A group that makes
        a share f of the cluster's pushes (``GroupSync.share``) uses momentum m^(1/f) and its
        lr times (1 - m^(1/f)) / (1 - m), so that lr / (1 - momentum), how far a push moves in
        the long run, is the run's; one group (f = 1) is unchanged. With "group", the default,
        the run's momentum decays per push of the group, k times slower than one group's when
        k groups run at one pace (docs/results.md, "Why does dense GSSP lose points behind a
        link?")."""
        m = self.run.momentum
        per_push = m ** (1.0 / self.xchg.share)
        return per_push, (1.0 - per_push) / (1.0 - m)

    def _change(self, idx: np.ndarray | None, apply: Callable[[], None]) -> None:
        """Change the weights (``apply``) at ``idx`` (None: anywhere): the change log notes it
        and the downlink's sums follow (both O(len(idx)))."""
        before = None if self.downlink is None else self.downlink.moving(self.weights, idx)
        apply()
        self.changes.note(idx)
        if self.downlink is not None:
            self.downlink.moved(self.weights, idx, before)

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

    def next_lr_factor(self) -> float:
        """The lr factor of the next update a worker computes from the weights it pulls now
        (optimizer on the worker): ``_lr_factor`` of one BSP round (``batch_size`` x the live
        workers) or of one push. In BSP every PULL of a round is answered once the round
        before is applied, so it is the factor the server would use: synchronous SGD."""
        pushes = max(1, len(self.table)) if self.run.in_rounds else 1
        return self._lr_factor(self.run.batch_size * pushes)

    def progress(self) -> float:
        """The fraction of the run's budget (``RunConfig.budget_samples``) done, as this group
        knows it (its own samples applied, the others' as of its last exchange); 0 without a
        samples budget."""
        if self.budget <= 0:
            return 0.0
        return min(1.0, max(0.0, (self.xchg.cluster_samples() - self.unapplied) / self.budget))

    # -- weights ----------------------------------------------------------------------------

    def at_cap(self, clock: int) -> bool:
        """A worker at ``clock`` made the run's ``max_steps`` pushes: its run is over."""
        return 0 < self.run.max_steps <= clock

    def may_answer(self, w: int, clock: int = -1) -> bool:
        """A PULL of ``w`` at ``clock`` may be answered now: SSP allows its next step, or the
        run is over (for everyone, or for ``w``: ``at_cap``)."""
        return (self.done or self.at_cap(clock) or w not in self.table
                or self.table.may_start(w))

    def waiting_for(self, w: int) -> list[int]:
        """The live workers whose clocks hold ``w``'s next step back ([] when it may start):
        whom a held PULL waited for (WEIGHTS ``waited_for``)."""
        return [int(v) for v in self.table.waiting_for(w)]  # type: ignore[call-overload]

    def has_lease(self, w: int) -> bool:
        """``w`` counts in the group's clocks: its lease has not run out (a PUSH from a worker
        that lost it is answered ERROR ``lease``)."""
        return w in self.table

    def live_count(self) -> int:
        """How many workers count in the group's clocks now."""
        return len(self.table)

    def publish(self) -> None:
        """With a compressed downlink, publish the weights' largest changes (``downlink.py``);
        the PULLs answered after it get the update up to it. A publish is due once per
        ``publish_every`` pushes (0: one a round of the live members, so a member's PULL
        brings about one publish, not one per push of the others), when the run is over, and
        whenever the weights have drifted past ``down_drift`` from the published ones: every
        answer stays within the bound."""
        if self.downlink is None:
            return
        every = self.run.publish_every or max(1, len(self.table))
        if (self._since_publish >= every or self.done
                or self.downlink.drift_now() > self.run.down_drift):
            if self.downlink.publish(self.weights):
                self._since_publish = 0

    def weights_message(self, w: int | None, waited_for: list[int],
                        since: int = -1, clock: int = -1,
                        held_s: float = 0.0) -> messages.Weights:
        """WEIGHTS for worker ``w`` holding version ``since``, pulling at ``clock``: the weights
        themselves (dense downlink; version = updates applied), or, with a compressed downlink,
        the update from ``since`` to the last publish (``publish``, ``downlink.py``); ``done``
        when the run is over, for everyone or for ``w`` (``at_cap``). The answer of a member's
        PULL that the SSP bound held ``held_s`` seconds is counted for the next exchange (its
        lead and wait reach the global server: ``GroupSync.pulled``)."""
        lead = self.table.lead(w) if w is not None and w in self.table else 0
        if w is not None and w in self.table:
            self.xchg.pulled(w, lead, held_s)
            self.iters.held(w, held_s)  # not part of its iteration: it waited on the others
        if self.downlink is None:
            check_finite(self.weights, self.group)
            version, base, wire = self.version, -1, sparse.encode_vector(self.weights)
        else:
            version, base, wire = self._wire_answer(since)
        low = self.table.min_clock()
        return messages.Weights(  # drift: how far the weights sent are from the group's
            version=version, since=base, payload=wire,
            done=self.done or self.at_cap(clock), group=self.group, waited_for=waited_for,
            ratio=self.ratio, lr_factor=self.next_lr_factor(), progress=self.progress(),
            local_steps=self.local_steps, batch=self._batch_of(w),
            lead=lead, min_clock=-1 if low is None else low,
            drift=-1.0 if self.downlink is None else round(self.downlink.last_drift, 6))

    def _wire_answer(self, since: int) -> tuple[int, int, Payload]:
        """The downlink's answer to a copy at ``since`` as it goes out: its version, its since
        and its payload, the values checked finite (``check_finite``) and encoded once per
        answer, then shared by the PULLs that get the same one (workers that pulled together
        hold the same version: most PULLs between two publishes). Whether the weights are
        finite is asked of every PULL."""
        assert self.downlink is not None
        answer = self.downlink.answer(since)
        if self._wired_at != self.downlink.pub:  # a publish: the answers are new ones
            self._wired.clear()
            self._wired_at = self.downlink.pub
        made = self._wired.get(since)
        if made is None or made[0] is not answer:
            check_finite(answer.payload, self.group, self.downlink.finite())
            wire = sparse.encode_vector(answer.payload,
                                        value_dtype=self.downlink.wire_values(answer))
            made = self._wired[since] = (answer, wire)
        elif not self.downlink.finite():
            check_finite(answer.payload, self.group, False)  # raises Diverged
        return answer.version, answer.since, made[1]

    def _batch_of(self, w: int | None) -> int:
        """LB-BSP: the samples of ``w``'s next step; 0 (the run's batch) in the other modes."""
        if self.balancer is None or w is None:
            return 0
        return min(self.balancer.batch_of(w), messages.MAX_BATCH)  # what a PUSH may carry

    def set_ratio(self, ratio: float) -> None:
        """GDTopK: the kept fraction the global server chose for this group's workers (sent
        with every WEIGHTS)."""
        self.ratio = float(ratio)

    def set_local_steps(self, steps: int) -> None:
        """Local steps: the H the global server chose for this group's workers (with
        ``local_steps`` auto; sent with every WEIGHTS); 0 keeps the current one."""
        if steps > 0:
            self.local_steps = int(steps)

    def spend_budget(self) -> list[Action]:
        """The run's budget is spent: every PULL is answered now, with ``done``."""
        self.done = True
        return [Wake()]

    # -- exchange and checkpoint ---------------------------------------------------------

    def start_flush(self, final: bool) -> bool:
        """A flush may go out (False: the final one went out already); ``final`` marks it."""
        if self.finished:
            return False
        self.finished = final
        return True

    def flush_failed(self, final: bool) -> None:
        """A flush did not reach the global server: a final one is due again."""
        self.finished = self.finished and not final

    def stop(self) -> None:
        """The group server closes: no flush is due any more."""
        self.finished = True

    # Every ``sync_every`` pushes the shell exchanges with the global server through an
    # ``exchange.GroupLink`` (a direct call in-process, EXCHANGE / EXCHANGE_REPLY over TCP for a
    # `minips group`). When the budget is spent (``done``) the group flushes a last delta, and
    # a ``final`` one when its last worker leaves; a flush sends everything left, dense.

    def begin_exchange(self, final: bool, traffic: dict[str, int]) -> Outgoing:
        """The next exchange: the delta since the last one and the group's counters, with
        ``traffic`` (bytes from / to its workers so far: ``bytes_in``, ``bytes_out``); dense
        for a flush, ``final`` or after ``done``."""
        extra = {"version": self.version, "final": final, **traffic, **_iterations(self.iters),
                 "min_clock": self.table.min_clock(), "max_clock": self.table.max_clock()}
        if self.xchg.pending is not None:  # sent again as it was
            return self.xchg.begin(self.weights, extra)
        # what a top-k exchange may have to send (a dense or exact one looks at no log), asked
        # only while the exchange knows where its last one left entries unsent (``left``):
        # else it looks over all n and the log's union would be thrown away (with the workers'
        # optimizer, a union of ~17 pushes of 617 entries per LeNet-5 exchange at 1%)
        changed = (self.changes.since(self._xchg_mark)
                   if self.xchg.kept < 1.0 and self.xchg.left is not None else None)
        self._xchg_mark = self.changes.version
        return self.xchg.begin(self.weights, extra, dense=final or self.done, changed=changed)

    def exchanged(self, out: Outgoing, res: ExchangeResult, seconds: float) -> list[Action]:
        """The global server's answer ``res`` to ``out`` (after ``seconds``): take it, count its
        bytes, log it; ``BudgetSpent`` when it says the run is over and this group did not know."""
        touched = self.xchg.touches(out, res)
        self._change(touched, lambda: self.xchg.complete(self.weights, out, res))
        self.global_version = res.version
        self.xchg_bytes["bytes_to_global"] += res.bytes_up
        self.xchg_bytes["bytes_from_global"] += res.bytes_down
        actions: list[Action] = [Log("exchange", {
            "exchange_s": seconds, "global_version": res.version, "seq": out.stats["seq"],
            "min_clock": out.stats["min_clock"], "max_clock": out.stats["max_clock"],
            "sent": _entries(out.delta), "got": _entries(res.weights),
            "share": round(self.xchg.share, 4), **self.xchg_bytes, **worker_times(out.stats),
            **({} if self.downlink is None else self.downlink.counts())})]
        if res.done and not self.done:
            actions.append(BudgetSpent())
        return actions

    def rebase(self, weights: np.ndarray, server_seq: int | None) -> list[Action]:
        """Reconnected to a (restarted) global server that holds this group's exchanges up to
        seq ``server_seq``: take its weights, keep what this group applied since its last exchange
        and what the server lost of its exchanges on top (sent with the next exchange), keep
        clocks and optimizer state."""
        w = np.asarray(weights, dtype=np.float32)
        replay = None

        def take() -> None:
            nonlocal replay
            self.weights, replay = self.xchg.rebase(self.weights, w, server_seq)

        self._change(None, take)
        if server_seq is None:
            return []
        return [Log("resync", {"held_seq": server_seq, "seq": self.xchg.seq,
                               "replay_samples": -1 if replay is None else replay.samples})]

    def state_dict(self) -> dict[str, Any]:
        """Everything a checkpoint needs to rebuild this group server."""
        return {"group": self.group, "weights": self.weights.copy(),
                "w_sync": self.xchg.w_sync.copy(),
                "opt": self.opt.state_dict(), "clocks": dict(self.table.clocks),
                "version": self.version, "global_version": self.global_version,
                "counters": dict(self.counters), "ratio": self.ratio,
                "local_steps": self.local_steps,
                "exchange": self.xchg.state_dict(), "xchg_bytes": dict(self.xchg_bytes)}

    def load_state_dict(self, state: dict[str, Any], now: float) -> None:
        """Take back what ``state_dict`` gave (checkpoint resume). The saved workers count as
        live again at ``now``, each at its saved clock; one that does not come back expires by
        lease."""
        saved_weights = np.asarray(state["weights"], dtype=np.float32)
        self._change(None, lambda: self.weights.__setitem__(slice(None), saved_weights))
        saved = state.get("exchange", {"session": self.xchg.session, "seq": 0})  # older files
        self.xchg.load_state_dict(saved, state["w_sync"])
        self.opt.load_state_dict(state["opt"])
        self.table.restore({int(w): int(c) for w, c in state["clocks"].items()}, now)
        self.version, self.global_version = state["version"], state["global_version"]
        self.counters = {k: int(state["counters"].get(k, 0)) for k in ("pushes", "samples")}
        self.ratio = state["ratio"]
        self.set_local_steps(int(state.get("local_steps", 0)))  # 0 in older files: the run's
        self.xchg_bytes = {k: int(state.get("xchg_bytes", {}).get(k, 0))  # 0 in older files
                           for k in ("bytes_to_global", "bytes_from_global")}


def _server_sgd(run: RunConfig, size: int) -> optim.SGD:
    """The group's optimizer: the run's SGD, or with the optimizer on the workers the outer
    one (``local_steps.outer_sgd``; ``avg`` at lr 1 adds the updates pushed as they are, O(k)
    when sparse)."""
    if run.optimizer_on_worker:
        return outer_sgd(run, size)
    return optim.SGD(size, lr=run.lr, momentum=run.momentum, weight_decay=run.weight_decay)


def _iterations(iters: ssp.Iterations) -> dict[str, Any]:
    """An exchange's iteration figures (``Iterations.take``): ``iter_time``, the mean over the
    workers (GDTopK's group figure; 0.0: none measured), and per worker ``iter_workers``,
    ``iter_us`` (its mean iteration) and ``compute_us`` (its mean compute time), in
    microseconds (EXCHANGE's int lists)."""
    taken = iters.take()
    mean = sum(t.iteration_s for t in taken.values()) / len(taken) if taken else 0.0
    return {"iter_time": mean, "iter_workers": list(taken),
            "iter_us": [_us(t.iteration_s) for t in taken.values()],
            "compute_us": [_us(t.compute_s) for t in taken.values()]}


def _us(seconds: float) -> int:
    return max(0, round(seconds * 1e6))


def worker_times(stats: dict[str, Any]) -> dict[str, dict[str, float]]:
    """An exchange's per-worker figures as a record's fields: ``iteration_s`` and
    ``compute_s``, ``{worker: seconds}`` (the group's record, ``exchange`` lines)."""
    ws = stats.get("iter_workers") or []
    pick = zip(ws, stats.get("iter_us") or [], stats.get("compute_us") or [], strict=False)
    rows = [(str(w), i / 1e6, c / 1e6) for w, i, c in pick]
    return {"iteration_s": {w: i for w, i, _ in rows}, "compute_s": {w: c for w, _, c in rows}}


def _entries(d: Delta) -> int:
    """How many entries an exchange or its reply carried (dense: all)."""
    return int(d.nnz if isinstance(d, sparse.SparseVector) else d.size)
