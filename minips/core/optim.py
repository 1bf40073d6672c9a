"""SGD with momentum and weight decay on a flat float32 vector, in numpy (servers have no torch).

The update is exactly ``torch.optim.SGD`` with ``dampening=0`` (tests/test_optim.py checks it
against torch on the same sequence of gradients)::

    d = g + weight_decay * w
    v = momentum * v + d                      (v starts at 0, so the first v is d)
    w = w - lr * (d + momentum * v)           if nesterov
    w = w - lr * v                            otherwise

With ``momentum`` 0 and ``weight_decay`` 0 the step is ``w = w - lr * g``, which touches only
the entries of a sparse ``g`` (O(k), not O(n)): that is how a group server applies the updates
workers push when the optimizer is on the workers (``RunConfig.optimizer_at``, lr 1 divided
among the pushes of a round, as for gradients).

A gradient is either dense, ``(n,) float32``, or sparse: any object with ``indices`` ``(k,)``
integer, ``values`` ``(k,)`` float and ``size == n`` (``sparse.SparseVector`` fits; this module does
not import it). A sparse gradient means zeros elsewhere, so weight decay and momentum still touch
every coordinate, as they would in torch. Repeated indices are summed.

The state is plain arrays and numbers (``state_dict`` / ``load_state_dict``) so a checkpoint can
store it without pickling.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import numpy as np

from minips.errors import ConfigError

__all__ = ["SGD", "SparseLike", "SCHEDULES", "warmup_factor", "decay_factor",
           "decay_at", "lr_factor"]

SCHEDULES = ("constant", "cosine")  # lr schedules over the run's budget


class SparseLike(Protocol):
    """What ``SGD.step`` needs of a sparse gradient."""

    @property
    def indices(self) -> np.ndarray: ...  # (k,) integer coordinates

    @property
    def values(self) -> np.ndarray: ...  # (k,) gradient values there

    @property
    def size(self) -> int: ...  # n, the length of the dense vector


class SGD:
    """Momentum SGD on one flat parameter vector of length ``size`` (see the module docstring)."""

    def __init__(self, size: int, lr: float, momentum: float = 0.9, weight_decay: float = 5e-4,
                 nesterov: bool = False) -> None:
        if lr < 0 or momentum < 0 or weight_decay < 0:
            raise ConfigError(f"lr, momentum, weight_decay must be >= 0, got "
                              f"{lr}, {momentum}, {weight_decay}")
        if nesterov and momentum <= 0:
            raise ConfigError("nesterov needs momentum > 0 (as in torch)")
        self.size = int(size)
        self.lr = float(lr)  # may be changed between steps (a schedule)
        self.momentum = float(momentum)
        self.weight_decay = float(weight_decay)
        self.nesterov = bool(nesterov)
        self.velocity: np.ndarray = np.zeros(self.size, dtype=np.float32)  # (n,) momentum buffer v
        self.steps = 0  # updates applied so far
        self._d = np.empty(self.size, dtype=np.float32)  # (n,) scratch: g + wd * w

    def step(self, weights: np.ndarray, grad: np.ndarray | SparseLike) -> None:
        """Apply one update to ``weights`` ``(n,) float32`` in place."""
        if weights.shape != (self.size,) or weights.dtype != np.float32:
            raise ConfigError(f"weights must be ({self.size},) float32, "
                              f"got {weights.shape} {weights.dtype}")
        if self.momentum == 0 and self.weight_decay == 0:
            self._plain_step(weights, grad)
            return
        d = self._decayed_grad(weights, grad)  # (n,) float32, aliases self._d
        if self.momentum == 0:
            weights -= self.lr * d
        else:
            v = self.velocity
            v *= self.momentum
            v += d
            if self.nesterov:
                d += self.momentum * v
                weights -= self.lr * d
            else:
                weights -= np.multiply(v, self.lr, out=d)  # reuse the scratch: no (n,) temporary
        self.steps += 1

    def _plain_step(self, weights: np.ndarray, grad: np.ndarray | SparseLike) -> None:
        """``w -= lr * g`` on the entries ``g`` names (no decay, no momentum: nothing else
        moves)."""
        if isinstance(grad, np.ndarray):
            if grad.shape != (self.size,):
                raise ConfigError(f"dense gradient must be ({self.size},), got {grad.shape}")
            weights -= np.multiply(grad, self.lr, out=self._d)
        else:
            idx = self._indices(grad)  # (k,) int64
            values = np.asarray(grad.values, dtype=np.float32)  # (k,)
            np.add.at(weights, idx, values * -np.float32(self.lr))
        self.steps += 1

    def _indices(self, grad: SparseLike) -> np.ndarray:
        """``grad.indices`` as (k,) int64, checked against the vector's length."""
        if int(grad.size) != self.size:
            raise ConfigError(f"sparse gradient size {grad.size} != {self.size}")
        idx = np.asarray(grad.indices, dtype=np.int64)  # (k,)
        if idx.size and (idx.min() < 0 or idx.max() >= self.size):
            raise ConfigError(f"sparse gradient index out of range [0, {self.size})")
        return idx

    def _decayed_grad(self, weights: np.ndarray, grad: np.ndarray | SparseLike) -> np.ndarray:
        d = np.multiply(weights, self.weight_decay, out=self._d)  # (n,) float32
        if isinstance(grad, np.ndarray):
            if grad.shape != (self.size,):
                raise ConfigError(f"dense gradient must be ({self.size},), got {grad.shape}")
            d += grad
            return d
        idx = self._indices(grad)  # (k,) int64
        np.add.at(d, idx, np.asarray(grad.values, dtype=np.float32))  # sums repeated indices
        return d

    def state_dict(self) -> dict[str, Any]:
        """The optimizer state as plain values and one ``(n,) float32`` array (a copy)."""
        return {"size": self.size, "lr": self.lr, "momentum": self.momentum,
                "weight_decay": self.weight_decay, "nesterov": self.nesterov,
                "steps": self.steps, "velocity": self.velocity.copy()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned; a different vector size is a ``ConfigError``."""
        velocity = np.asarray(state["velocity"], dtype=np.float32)
        if int(state["size"]) != self.size or velocity.shape != (self.size,):
            raise ConfigError(f"optimizer state is for size {state['size']}, not {self.size}")
        self.lr = float(state["lr"])
        self.momentum = float(state["momentum"])
        self.weight_decay = float(state["weight_decay"])
        self.nesterov = bool(state["nesterov"])
        self.steps = int(state["steps"])
        self.velocity = velocity.copy()


def warmup_factor(samples: float, ramp_samples: float) -> float:
    """Linear learning-rate warm-up: the fraction of lr to use once ``samples`` have been seen,
    reaching 1 at ``ramp_samples`` (no warm-up when ``ramp_samples`` <= 0). Asynchronous pushes
    on stale weights with momentum blow up early in training; a ramp keeps them small."""
    if ramp_samples <= 0:
        return 1.0
    return min(1.0, samples / ramp_samples)


def decay_factor(schedule: str, progress: float) -> float:
    """The fraction of lr to use at ``progress`` (0 = start, 1 = budget spent) of the run:
    1 throughout for ``constant``; ``cosine`` goes from 1 to 0 along half a cosine wave, so the
    last updates are small and the final weights settle instead of jumping around."""
    if schedule == "constant":
        return 1.0
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, max(0.0, progress))))
    raise ConfigError(f"lr schedule must be one of {SCHEDULES}, got {schedule!r}")


def decay_at(schedule: str, seen: float, budget: float) -> float:
    """``decay_factor`` once ``seen`` of the run's ``budget`` samples were trained on (1 for
    ``constant``, whatever the budget)."""
    return 1.0 if schedule == "constant" else decay_factor(schedule, seen / budget)


def lr_factor(schedule: str, *, seen: float, step: float, ramp: float, budget: float) -> float:
    """The fraction of lr for one update of ``step`` samples after ``seen`` samples of the run:
    the warm-up counts this update's samples (so the first update is not wasted), the decay
    is taken before them (so the last update still moves); ``budget`` samples = the end of the
    schedule. Synchronous SGD's step t of S samples has ``seen = t * S``, ``step = S``; the
    group servers and ``reference.train`` both call this."""
    return warmup_factor(seen + step, ramp) * decay_at(schedule, seen, budget)
