"""Emulated speeds that change: a worker's slowdown as a schedule, and random throttling
(no IO, no clocks: the time ``t`` comes in as an argument).

A worker's emulated factor F stretches each step to at least F x ``base_step_s`` x b /
``batch_size`` for a step of b samples (worker.py, ``Worker._stretch``). F is constant by default;
edge boards are not (a Jetson throttles when hot), so F may follow

- a **schedule** ``F@T,F@T,...``: factor F from T seconds on, T counted from the worker's
  first ASSIGN (the start of its training; calibration sees the factor at 0). ``4@0,1@60s``:
  4x for the first minute, then 1x. A plain ``F`` is the flat schedule ``F@0``. The first step
  starts at 0 and the times increase.
- **throttling** ``P,MIN-MAX,SECONDS``: time is cut into intervals of SECONDS; in each one a
  worker is throttled with probability P, by a factor drawn uniformly in [MIN, MAX], which
  multiplies its scheduled one. The draw is a function of (run seed, worker id, interval) only,
  so a run is reproducible and every worker draws its own intervals.

In a per-worker list (``minips local --slowdown``) workers are separated by commas, and a
worker's schedule continues while its steps have T > 0: ``1,1,4@0,1@60s,2`` is four workers,
the third one 4x until 60 s. ``FxN`` repeats a flat factor N times (``1,1,2x2,4``).

Invariants: every factor is > 0; ``Schedule.factor`` is a step function, right-continuous;
``Throttle.factor`` is 1 or in [MIN, MAX]; ``Schedule.text()`` parses back to the same schedule.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

from minips.errors import ConfigError

__all__ = ["Schedule", "parse_schedule", "parse_schedules", "Throttle", "parse_throttle",
           "Slowdown"]


@dataclass(frozen=True)
class Schedule:
    """Factor F from each step's start on: ``steps`` = ((from_s, F), ...), from_s increasing,
    the first 0."""

    steps: tuple[tuple[float, float], ...] = ((0.0, 1.0),)

    def __post_init__(self) -> None:
        starts = [t for t, _ in self.steps]
        if not starts or starts[0] != 0 or starts != sorted(set(starts)):
            raise ConfigError(f"slowdown schedule {self.text()!r}: its times must start at 0 "
                              "and increase")
        if any(f <= 0 for _, f in self.steps):
            raise ConfigError(f"slowdown factors must be > 0, got {self.text()!r}")

    @classmethod
    def flat(cls, factor: float) -> Schedule:
        return cls(((0.0, float(factor)),))

    @property
    def first(self) -> float:
        """The factor at 0 (what calibration sees)."""
        return self.steps[0][1]

    @property
    def changes(self) -> bool:
        """The factor changes at some time."""
        return len(self.steps) > 1

    def factor(self, t: float) -> float:
        """F at ``t`` seconds into training (before 0: the first factor)."""
        i = bisect.bisect_right([s for s, _ in self.steps], t) - 1
        return self.steps[max(0, i)][1]

    def text(self) -> str:
        """``F@T,...`` (``F`` for a flat schedule): what ``parse_schedule`` reads back."""
        if len(self.steps) == 1 and self.steps[0][0] == 0:
            return f"{self.steps[0][1]:g}"
        return ",".join(f"{f:g}@{t:g}s" for t, f in self.steps)


def _step(part: str) -> tuple[float, float]:
    """``F@T`` (T in s, an ``s`` suffix allowed) or ``F`` (at 0)."""
    factor, at, when = part.partition("@")
    try:
        return (float(when.removesuffix("s")) if at else 0.0), float(factor)
    except ValueError:
        raise ConfigError(f"bad slowdown {part!r}, expected F, FxN or F@SECONDS") from None


def parse_schedule(text: str) -> Schedule:
    """One worker's ``--slowdown``: ``F`` or ``F@T,F@T,...`` (see the module docstring)."""
    steps = tuple(_step(p.strip()) for p in text.split(",") if p.strip())
    return Schedule(steps or ((0.0, 1.0),))


def parse_schedules(text: str) -> list[Schedule]:
    """``minips local --slowdown``: one schedule per worker, ``1,1,2x2,4@0,1@60s``."""
    out: list[list[tuple[float, float]]] = []
    for part in (p.strip() for p in text.split(",")):  # '1, 2' is 1,2
        if not part:  # '1,,2', '1,': a typo, not a worker
            raise ConfigError(f"bad slowdown {text!r}: an empty entry, expected F, FxN or F@T "
                              "between the commas")
        factor, x, count = part.partition("x")
        if x and "@" not in part:
            try:
                out += [[(0.0, float(factor))] for _ in range(int(count))]
            except ValueError:
                raise ConfigError(f"bad slowdown {part!r}, expected F or FxN") from None
            continue
        t, f = _step(part)
        if t > 0 and out:
            out[-1].append((t, f))  # the schedule of the worker before goes on
        else:
            out.append([(t, f)])
    return [Schedule(tuple(s)) for s in out]


@dataclass(frozen=True)
class Throttle:
    """Random throttling: each ``seconds``-long interval is throttled with ``probability``, by
    a factor uniform in [``low``, ``high``]."""

    probability: float  # chance that an interval is throttled, [0, 1]
    low: float  # smallest throttling factor, >= 1
    high: float  # largest, >= low
    seconds: float  # length of an interval, s > 0

    def __post_init__(self) -> None:
        if not (0 <= self.probability <= 1 and 1 <= self.low <= self.high and self.seconds > 0):
            raise ConfigError(f"bad throttle {self.text()!r}: expected P in [0, 1], "
                              "1 <= MIN <= MAX, SECONDS > 0")

    def factor(self, t: float, seed: int, worker: int) -> float:
        """The throttling factor at ``t`` s of worker ``worker`` in a run seeded ``seed``."""
        interval = max(0, int(t // self.seconds))
        rng = np.random.default_rng([seed, worker, interval, 0x7407])  # one draw per interval
        throttled, draw = rng.random(2)
        if throttled >= self.probability:
            return 1.0
        return float(self.low + (self.high - self.low) * draw)

    def text(self) -> str:
        return f"{self.probability:g},{self.low:g}-{self.high:g},{self.seconds:g}"


def parse_throttle(text: str) -> Throttle:
    """``--throttle P,MIN-MAX,SECONDS``, e.g. ``0.2,2-5,10``."""
    try:
        p, span, seconds = (s.strip() for s in text.split(","))
        low, _, high = span.partition("-")
        return Throttle(float(p), float(low), float(high or low), float(seconds.removesuffix("s")))
    except ValueError:
        raise ConfigError(f"bad throttle {text!r}, expected P,MIN-MAX,SECONDS") from None


@dataclass(frozen=True)
class Slowdown:
    """One worker's emulated factor over time: its schedule times its throttling."""

    schedule: Schedule = Schedule()
    throttle: Throttle | None = None
    seed: int = 0  # the run's seed
    worker: int = 0

    def factor(self, t: float) -> float:
        """F at ``t`` seconds into the worker's training."""
        f = self.schedule.factor(t)
        if self.throttle is not None:
            f *= self.throttle.factor(t, self.seed, self.worker)
        return f
