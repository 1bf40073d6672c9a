"""GSSP with one group is SSP (issue 54): the exchange with the global server every
``sync_every`` pushes neither loses, doubles nor delays a push, and leaves the optimizer's
momentum as it was.

Four workers pull and push a small vector model in a fixed order through the real cores
(``GroupCore``, ``GlobalCore``; no sockets, no clock), each gradient a function of the weights
its worker pulled. A plain momentum SGD loop over the same pushes is the reference: with one
group every push moves the group's weights by one SGD step at lr / 4, whatever the exchange
does. An exchange is answered at once, or while 2 or 6 more pushes land on the group (pushes
applied after the EXCHANGE went out and before its reply, which the group's rebase keeps).
Checked: every weights vector a worker pulls is the reference's; after every reply of a dense
or exact exchange the global weights are the group's weights when the exchange began; at the
end, after the group's flush, the global weights are the reference's. (After a dense flush a
top-k exchange's reply sets only its top entries of the group's copy, so the group's weights
lag there until later replies: a flush is the group's last exchange.) SSP and GSSP
(``--groups 1``) give the same weights, bit for bit: nothing in the cores tells them apart.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from minips import sparse
from minips.core import optim
from minips.core.actions import reply
from minips.core.config import RunConfig
from minips.core.exchange import ExchangeResult, Outgoing
from minips.core.global_core import GlobalCore
from minips.core.group_core import GroupCore, StartExchange
from minips.core.roster import GroupHandle
from minips.sim.simulate import SimConfig, simulate
from minips.wire import messages

N = 48  # parameters of the vector model
WORKERS = 4
ROUNDS = 40  # each worker pushes this many times: 160 pushes, 40 exchanges
SAMPLES = 64
# float32 rounding: each dense exchange adds w_sync + (sent - w_sync) - sent, about one ulp of
# the weights (|w| < 2), to the group's weights; 40 exchanges and momentum 0.9 (x10) keep it
# well under this. A push lost, doubled or applied late moves an entry by lr / 4 x |g| > 1e-3.
ATOL = 2e-5


def start_weights() -> np.ndarray:
    return np.random.default_rng(54).standard_normal(N).astype(np.float32)


def gradient(w: np.ndarray, worker: int, clock: int, k: int) -> np.ndarray | sparse.SparseVector:
    """The gradient worker ``worker`` pushes at ``clock`` from the weights ``w`` it pulled: a
    quadratic's, (w - target) x curvature, plus noise of its own; its ``k`` entries of largest
    magnitude as a SparseVector when ``k`` < N (sparse pushes)."""
    rng = np.random.default_rng(1000 * worker + clock)
    target = np.linspace(-1.0, 1.0, N, dtype=np.float32)
    curvature = np.linspace(0.5, 2.0, N, dtype=np.float32)
    g = ((w - target) * curvature + rng.standard_normal(N).astype(np.float32)).astype(np.float32)
    if k >= N:
        return g
    idx = np.sort(np.argsort(-np.abs(g))[:k]).astype(np.uint32)
    return sparse.SparseVector(idx, g[idx], N)


def push(clock: int, grad: np.ndarray | sparse.SparseVector) -> messages.Push:
    return messages.Push(clock=clock, samples=SAMPLES, step_time=0.04, loss=0.0,
                         payload=sparse.encode_vector(grad))


def as_dense(grad: np.ndarray | sparse.SparseVector) -> np.ndarray:
    return grad.to_dense() if isinstance(grad, sparse.SparseVector) else grad


@dataclass
class Case:
    """One way of running the group: its RunConfig fields, sparse pushes (``k`` < N) and
    how many pushes land while an exchange is in flight (``lag``)."""

    fields: dict[str, Any] = field(default_factory=dict)
    k: int = N
    lag: int = 0

    def run(self, mode: str) -> RunConfig:
        """Lab 2's optimizer and bound; GSSP with ``--groups 1`` unless ``fields`` say."""
        lab = {"lr": 0.05, "momentum": 0.9, "weight_decay": 5e-4, "lr_warmup": 0.0,
               "groups": 1 if mode == "gssp" else 0}
        return RunConfig(mode=mode, workers=WORKERS, staleness=3, sync_every=4,
                         **{**lab, **self.fields}).validate()


class Reference:
    """SSP's arithmetic with nothing in between: each push one SGD step at lr / workers."""

    def __init__(self, run: RunConfig) -> None:
        self.weights = start_weights()
        self.opt = optim.SGD(N, lr=run.lr / WORKERS, momentum=run.momentum,
                             weight_decay=run.weight_decay)

    def pull(self, w: int) -> np.ndarray:
        return self.weights.copy()

    def push(self, w: int, clock: int, grad: np.ndarray | sparse.SparseVector) -> None:
        self.opt.step(self.weights, grad)


class OneGroup:
    """One group server's core and the global server's core, driven in a fixed order; an
    exchange is merged when it goes out and its reply taken ``lag`` pushes later."""

    def __init__(self, run: RunConfig, lag: int) -> None:
        self.lag = lag
        self.glob = GlobalCore(run, start_weights(), regroup=False, wall=lambda: 1e9)
        members = list(range(WORKERS))
        for w in members:
            self.glob.admit(w, 0.0)
        self.glob.groups_formed([GroupHandle(0, "", members)], dict.fromkeys(members, 0), 0.0)
        assert self.glob.weights is not None
        self.core = GroupCore(0, run, self.glob.weights, members=members)
        for w in members:
            self.core.join(w, 0.0)
        self.flight: tuple[Outgoing, ExchangeResult] | None = None
        self.due = 0  # pushes left before the reply of the exchange in flight is taken
        self.replies = 0
        self.since_begin: list[np.ndarray] = []  # the group's weights when each exchange began

    def pull(self, w: int) -> np.ndarray:
        assert self.core.may_answer(w)
        msg = self.core.weights_message(w, [])
        got = sparse.decode_vector(msg.payload, N)
        return np.array(as_dense(got), dtype=np.float32)

    def push(self, w: int, clock: int, grad: np.ndarray | sparse.SparseVector) -> None:
        actions = self.core.push(w, push(clock, grad), 0.0)
        if self.flight is not None:
            self.due -= 1
            if self.due <= 0:
                self.take_reply()
        if self.flight is None and any(isinstance(a, StartExchange) for a in actions):
            self.begin(final=False)
            if self.lag == 0:
                self.take_reply()

    def begin(self, final: bool) -> None:
        out = self.core.begin_exchange(final, {"bytes_in": 0, "bytes_out": 0})
        self.since_begin.append(self.core.weights.copy())
        res = reply(self.glob.merge(0, out.delta, out.stats, 0.0), ExchangeResult)
        self.flight, self.due = (out, res), self.lag

    def take_reply(self) -> None:
        assert self.flight is not None
        out, res = self.flight
        self.core.exchanged(out, res, 0.0)
        self.flight = None
        self.replies += 1

    def flush(self) -> None:
        """The group's last, dense exchange, answered at once (what ``finish`` does)."""
        if self.flight is not None:
            self.take_reply()
        self.begin(final=True)
        self.take_reply()


def train(case: Case, mode: str, reference: bool = False) -> tuple[Any, list[np.ndarray]]:
    """Four workers, ``ROUNDS`` rounds: all pull, then all push in an order that turns each
    round (so each push was computed 0 to 3 updates ago); returns the driver and every
    weights vector a worker pulled, in order."""
    run = case.run(mode)
    driver: Reference | OneGroup = Reference(run) if reference else OneGroup(run, case.lag)
    pulled = []
    for r in range(ROUNDS):
        held = {w: driver.pull(w) for w in range(WORKERS)}
        pulled += [held[w] for w in range(WORKERS)]
        for i in range(WORKERS):
            w = (r + i) % WORKERS
            driver.push(w, r + 1, gradient(held[w], w, r + 1, case.k))
    pulled.append(driver.pull(0))  # the weights as training ends, before any flush
    if isinstance(driver, OneGroup):
        driver.flush()
    return driver, pulled


CASES = {
    "dense exchange": Case(),
    "dense exchange, 2 pushes in flight": Case(lag=2),
    "dense exchange, 6 pushes in flight": Case(lag=6),
    "top-k exchange (25%)": Case({"xchg_ratio": 0.25}),
    "top-k exchange (25%), 2 pushes in flight": Case({"xchg_ratio": 0.25}, lag=2),
    "exact exchange": Case({"xchg_mode": "exact"}),
    "exact exchange, 2 pushes in flight": Case({"xchg_mode": "exact"}, lag=2),
    "exact exchange, 6 pushes in flight": Case({"xchg_mode": "exact"}, lag=6),
    # plain SGD and sparse pushes: only the pushed entries move (the exact exchange's sparse
    # record of before-values, its scatter-only rebase)
    "exact exchange, sparse pushes, 2 in flight": Case(
        {"xchg_mode": "exact", "momentum": 0.0, "weight_decay": 0.0}, k=6, lag=2),
    "dense exchange, sparse pushes, 2 in flight": Case(
        {"momentum": 0.0, "weight_decay": 0.0}, k=6, lag=2),
}


@pytest.mark.parametrize("name", list(CASES))
def test_one_group_pulls_what_ssp_without_exchanges_would(name: str) -> None:
    case = CASES[name]
    ref, want = train(case, "ssp", reference=True)
    for mode in ("ssp", "gssp"):
        group, got = train(case, mode)
        assert group.replies >= ROUNDS * WORKERS // (max(4, case.lag) + 1)  # exchanges happened
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            np.testing.assert_allclose(a, b, rtol=0, atol=ATOL,
                                       err_msg=f"{mode}: pull {i} (round {i // WORKERS})")
        assert group.glob.weights is not None
        np.testing.assert_allclose(group.glob.weights, ref.weights, rtol=0, atol=ATOL,
                                   err_msg=f"{mode}: the global weights after the flush")


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if "top-k" not in n])
def test_every_reply_brings_the_global_weights_to_the_group_at_its_begin(name: str) -> None:
    """A dense or exact exchange sends everything: once merged, the global weights are the
    group's weights as they were when the exchange began (one group: nothing else merges)."""
    case = CASES[name]
    group = OneGroup(case.run("gssp"), case.lag)
    seen: list[np.ndarray] = []
    take = group.take_reply

    def checked() -> None:
        assert group.glob.weights is not None
        seen.append(group.glob.weights.copy())
        take()

    group.take_reply = checked  # type: ignore[method-assign]
    for r in range(ROUNDS // 4):
        held = {w: group.pull(w) for w in range(WORKERS)}
        for w in range(WORKERS):
            group.push(w, r + 1, gradient(held[w], w, r + 1, case.k))
    assert len(seen) >= ROUNDS // 4 * WORKERS // (max(4, case.lag) + 1)
    for i, (glob, began) in enumerate(zip(seen, group.since_begin, strict=False)):
        np.testing.assert_allclose(glob, began, rtol=0, atol=ATOL, err_msg=f"exchange {i}")


# GSSP as Lab 2 runs it, its groups chosen (``--groups 0``), which the cores learn only as
# the group's share of the workers: the lr warm-up and the decay follow the same samples
CHOSEN = Case({"groups": 0, "lr_warmup": 0.3, "lr_schedule": "cosine", "epochs": 0.2}, lag=2)


@pytest.mark.parametrize("name", ["dense exchange, 2 pushes in flight",
                                  "exact exchange, 6 pushes in flight",
                                  "top-k exchange (25%), 2 pushes in flight",
                                  "groups chosen, lr warm-up and cosine decay"])
def test_ssp_and_gssp_with_one_group_are_the_same_run(name: str) -> None:
    case = CASES.get(name, CHOSEN)
    (ssp, a), (gssp, b) = train(case, "ssp"), train(case, "gssp")
    np.testing.assert_array_equal(np.stack(a), np.stack(b))  # one machine: the same arithmetic
    np.testing.assert_array_equal(ssp.core.weights, gssp.core.weights)
    np.testing.assert_array_equal(ssp.core.opt.velocity, gssp.core.opt.velocity)


def test_on_the_simulator_gssp_of_equal_workers_is_ssp(tmp_path: Path) -> None:
    """The whole cluster in simulated time, Lab 2's way (four workers of one speed, jitter
    0.1, GSSP choosing its groups), each exchange merged 30 ms after it is due so pushes land
    while it is in flight: GSSP forms one group and ends at SSP's weights, bit for bit."""
    ends = {}
    for mode in ("ssp", "gssp"):
        run = RunConfig(mode=mode, workers=WORKERS, lr=0.05, lr_warmup=0.0, dataset="synthetic",
                        epochs=100)
        summary = simulate(SimConfig(run=run, slowdowns=[1.0], jitter=0.1, xchg_latency_s=0.03,
                                     dim=200, max_pushes=400, out_dir=str(tmp_path), name=mode))
        assert summary["groups"] == 1 and summary["mean_staleness"] > 0.5
        ends[mode] = np.load(tmp_path / mode / "final_weights.npy")
    assert np.abs(ends["ssp"]).max() > 0  # it trained
    np.testing.assert_array_equal(ends["ssp"], ends["gssp"])  # one machine: the same arithmetic
