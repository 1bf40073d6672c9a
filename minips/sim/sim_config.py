"""What one simulated run is: the run's settings and the simulator's models of time and
gradients (``simulate.simulate`` runs it; ``minips simulate``'s flags fill it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from minips.run.config import RunConfig
from minips.sim.sim_timing import Failure

__all__ = ["SimConfig", "per_worker"]


@dataclass
class SimConfig:
    """One simulated run: the run's settings and the models of time and gradients."""

    run: RunConfig
    slowdowns: list[float] = field(default_factory=lambda: [1.0])  # per worker, last repeats
    step_times: list[float] = field(default_factory=list)  # s per worker (overrides slowdowns)
    step_traces: list[list[float]] = field(default_factory=list)  # per worker: s of step k
    jitter: float = 0.0  # relative spread of a step's compute time
    rate: float = 0.0  # link bytes per second each way per worker (0: no limit)
    latency_s: float = 0.0  # one way, per message
    latency_jitter_s: float = 0.0  # plus this times |N(0, 1)|
    xchg_latency_s: float = 0.0  # a group's exchange is merged this long after it is due
    failures: list[Failure] = field(default_factory=list)
    real: bool = False  # gradients of the run's model and data set (else synthetic)
    model_opts: dict[str, Any] = field(default_factory=dict)  # sim_model: train=, test=
    dim: int = 1000  # coordinates of the synthetic objective
    noise: float = 1.0  # gradient noise of one sample, per coordinate
    max_pushes: int = 0  # stop after this many pushes (0: the run's epochs budget)
    eval_every_s: float = 0.0  # simulated seconds between evaluations (0: the run's)
    out_dir: str = "runs"
    name: str = ""


def per_worker(values: list[float], n: int) -> list[float]:
    """``values`` for workers 0..n-1, the last one repeated."""
    return [values[min(w, len(values) - 1)] for w in range(n)]
