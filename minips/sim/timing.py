"""The simulator's models: of time (compute steps, links, workers that fail) and of what the
simulated workers train (a cheap synthetic objective, or a real small model).

Sans-IO and clock-free: every function takes the simulated time it needs. ``simulate.py``
asks them when a step starts, when a message is sent, and when a worker leaves or rejoins.
The file holds, in order:

- **failures**: ``Failure(worker, at_s, down_s)``: the worker's connection drops at ``at_s``
  (what it had in flight is lost, its group sees it leave) and it rejoins ``down_s`` later
  (``None``: never). ``parse_failures("3@10+5,6@20")`` reads the CLI's ``--fail``.
- **compute** (``StepTimes``): a step of worker ``w`` takes ``step_s[w]`` (``slowdown ×
  base_step_s``, or a time measured on a real run), times ``1 + jitter·N(0, 1)``, never under a
  tenth of it; or, given a trace per worker (the step times a real run measured,
  ``scripts/compare_simulate.py``), its k-th step takes the trace's k-th time (past the trace's
  end: ``step_s[w]``, jittered). The jitter draws from random streams of its own (one a
  worker, from the seed), never from the workers' gradient streams: it moves *when* a step
  ends, not *what* it computes, so a BSP run gives the same weights with or without it.
  Without jitter, workers of one speed stay in lock-step and their staleness is 0 by
  construction;
- **links** (``Links``): each worker has one link; a message waits until the link is free,
  takes ``bytes / rate`` on it (rate in bytes/s, 0 = no limit), then ``latency_s`` plus
  ``latency_jitter_s·|N(0, 1)|`` to arrive, never before the link's previous message
  (TCP keeps the order);
- **objectives** (``Objective``): both kinds offer the same four things to ``simulate.py``:
  ``size`` (coordinates), ``initial()`` (the starting weights),
  ``gradient(worker, w, rng) -> (grad, loss)`` (one worker's next batch at weights ``w``) and
  ``evaluate(w) -> {"loss", ["accuracy"]}`` (a line of eval.jsonl).

  - ``Quadratic``: ``0.5·mean(a·(w − w*)²)`` with curvatures ``a`` in [0.1, 1] and a batch's
    noise of ``noise / √batch`` per coordinate; thousands of workers in seconds.
  - ``sim_model.ModelObjective``: the run's model and data set through the code a real worker
    runs (``models``, ``data``, ``device.Trainer``); it imports torch, so ``objective`` imports
    it only when asked for it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from minips.core.config import RunConfig
from minips.errors import ConfigError

__all__ = [
    "Failure",
    "parse_failures",
    "Links",
    "StepTimes",
    "Objective",
    "Quadratic",
    "objective",
]


# -- the models of time: failures, compute steps, links --------------------------------------------

@dataclass(frozen=True)
class Failure:
    """Worker ``worker`` drops at simulated ``at_s``; rejoins ``down_s`` later (None: never)."""

    worker: int
    at_s: float
    down_s: float | None = None


def parse_failures(text: str) -> list[Failure]:
    """``W@T`` (worker W leaves at T s for good) or ``W@T+D`` (rejoins D s later), comma
    separated: ``"3@10+5,6@20"``. ConfigError names the bad item."""
    out = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        try:
            worker, rest = item.split("@")
            at, _, down = rest.partition("+")
            fail = Failure(int(worker), float(at), float(down) if down else None)
        except ValueError:
            raise ConfigError(f"--fail {item!r}: expected W@T or W@T+D (worker, seconds)") \
                from None
        if fail.worker < 0 or not 0 <= fail.at_s < math.inf or (
                fail.down_s is not None and not 0 <= fail.down_s < math.inf):
            raise ConfigError(f"--fail {item!r}: worker and times must be >= 0 and finite")
        out.append(fail)
    return out


JITTER_STREAM = 0x6A17  # names the jitter's random streams apart from the gradients' (seed, w)


class StepTimes:
    """Each worker's compute time per step: ``base`` jittered, or its trace while it lasts."""

    def __init__(self, base: list[float], jitter: float,
                 traces: list[list[float]] | None = None, seed: int = 0) -> None:
        self.base, self.jitter = [float(b) for b in base], jitter
        # plain floats: a trace of numpy scalars would reach the PUSH records (and the
        # messages' checks, which take Python numbers only) as numpy scalars
        self.traces = [[float(x) for x in t] for t in traces] if traces else [[] for _ in base]
        self.steps = [0] * len(base)  # steps drawn so far, per worker
        # one stream a worker, its own: the jitter never shifts a worker's gradient draws
        self.rngs = [np.random.default_rng((seed, JITTER_STREAM, w)) for w in range(len(base))]

    def next(self, w: int) -> float:
        """Worker ``w``'s next step (a draw from its jitter stream only when jittered)."""
        k, trace = self.steps[w], self.traces[w]
        self.steps[w] += 1
        if k < len(trace):
            return trace[k]
        if not self.jitter:
            return self.base[w]
        spread = 1 + self.jitter * float(self.rngs[w].standard_normal())
        return max(0.1 * self.base[w], self.base[w] * spread)


class Links:
    """Every worker's link: when a message sent now arrives."""

    def __init__(self, workers: int, rate: float, latency_s: float, latency_jitter_s: float,
                 seed: int) -> None:
        self.rate, self.latency_s, self.jitter_s = rate, latency_s, latency_jitter_s
        self.busy = [0.0] * workers  # each link is busy sending until then
        self.last = [0.0] * workers  # arrival time of each link's last message
        self.rng = np.random.default_rng(seed)

    def arrival(self, w: int, now: float, nbytes: int) -> float:
        """Worker ``w``'s link takes a message of ``nbytes`` at ``now``: when it arrives."""
        start = max(now, self.busy[w])
        self.busy[w] = start + (nbytes / self.rate if self.rate else 0.0)
        delay = self.latency_s
        if self.jitter_s:
            delay += self.jitter_s * abs(float(self.rng.standard_normal()))
        self.last[w] = max(self.busy[w] + delay, self.last[w])
        return self.last[w]

    def reset(self, w: int, now: float) -> None:
        """A new connection for ``w`` (after a failure): nothing queued on it."""
        self.busy[w] = self.last[w] = now


# -- what the simulated workers train --------------------------------------------------------------

class Objective(Protocol):
    size: int

    def initial(self) -> np.ndarray: ...

    def gradient(self, worker: int, w: np.ndarray, rng: np.random.Generator
                 ) -> tuple[np.ndarray, float]: ...

    def evaluate(self, w: np.ndarray) -> dict[str, float]: ...


class Quadratic:
    """``0.5·mean(a·(w − w*)²)``; a batch's gradient is exact plus noise / √batch."""

    def __init__(self, dim: int, noise: float, seed: int, batch: int = 1) -> None:
        rng = np.random.default_rng(seed)
        self.target = rng.standard_normal(dim).astype(np.float32)
        self.curv = rng.uniform(0.1, 1.0, dim).astype(np.float32)
        self.size = dim
        self.scale = np.float32(noise / math.sqrt(batch))

    def initial(self) -> np.ndarray:
        return np.zeros(self.size, np.float32)

    def loss(self, w: np.ndarray) -> float:
        return float(0.5 * np.mean(self.curv * (w - self.target) ** 2))

    def gradient(self, worker: int, w: np.ndarray, rng: np.random.Generator
                 ) -> tuple[np.ndarray, float]:
        """The gradient at ``w`` plus one batch's noise, drawn from ``rng`` (the worker's)."""
        g = self.curv * (w - self.target)
        noise = rng.standard_normal(w.size).astype(np.float32) * self.scale
        return (g + noise).astype(np.float32, copy=False), 0.0  # float32 already: no copy

    def evaluate(self, w: np.ndarray) -> dict[str, float]:
        return {"loss": self.loss(w)}


def objective(run: RunConfig, *, real: bool, dim: int, noise: float, **model_opts: Any
              ) -> Objective:
    """The run's objective: ``real`` -> the run's model on its data set (``sim_model``), else
    a ``Quadratic`` of ``dim`` coordinates."""
    if real:
        from minips.sim.sim_model import ModelObjective

        return ModelObjective(run, **model_opts)
    return Quadratic(dim, noise, run.seed, run.batch_size)
