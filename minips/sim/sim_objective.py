"""What the simulated workers train: a cheap synthetic objective, or a real small model.

Both offer the same four things to ``simulate.py``: ``size`` (coordinates), ``initial()``
(the starting weights), ``gradient(worker, w, rng) -> (grad, loss)`` (one worker's next
batch at weights ``w``) and ``evaluate(w) -> {"loss", ["accuracy"]}`` (a line of eval.jsonl).

- ``Quadratic``: ``0.5·mean(a·(w − w*)²)`` with curvatures ``a`` in [0.1, 1] and a batch's
  noise of ``noise / √batch`` per coordinate; thousands of workers in seconds.
- ``sim_model.ModelObjective``: the run's model and data set through the code a real worker
  runs (``models``, ``data``, ``device.Trainer``); it imports torch, so ``objective`` imports it
  only when asked for it.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import numpy as np

from minips.run.config import RunConfig

__all__ = ["Objective", "Quadratic", "objective"]


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
