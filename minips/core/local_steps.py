"""Local steps: a worker runs H optimizer steps on its local weights and pushes their change;
its group server applies what arrives with an *outer* optimizer. Sans-IO numpy.

Needs the optimizer on the worker (``RunConfig.optimizer_at`` ``worker``; ``validate``
refuses ``local_steps`` != 1, an outer optimizer other than ``avg`` and an ``outer_lr`` other
than 1 otherwise: the optimizer's place never moves without being asked). Three parts, one
per role:

**The worker** (``LocalSteps``; core/worker_core.py drives it for worker.py and the
simulator). From the weights ``w₀`` it pulled, with ``WorkerSGD`` (core/worker_opt.py:
clipping, weight decay, its own velocity ``u`` kept across pushes) and the lr factor ``f`` of
that pull, held for the H steps::

    for i in 1..H:   gᵢ = ∇L(wᵢ₋₁; batch i)      Δᵢ = WorkerSGD.update(wᵢ₋₁, gᵢ, f)
                     wᵢ = wᵢ₋₁ − Δᵢ
    D = Σᵢ Δᵢ = w₀ − w_H                            the pseudo-gradient, (n,) float32
    packet = compressor(D)                          error feedback on D (r ← r + D, send
                                                    top-k of r, r[sent] ← 0); then
    u[sent] ← 0                                     momentum-factor masking, if on

One push per H steps: the SSP clock counts pushes, the push's ``samples`` are the H batches'
(the lr schedule and the budget count samples as before), ``max_steps`` caps pushes. H = 1
is the worker of core/worker_opt.py exactly (the worker core takes ``Upload.packet`` then).

**The group server** (``outer_sgd``; group_core.py). The pseudo-gradients of the group's m
live workers are combined as every update is in minips: in rounds (staleness 0) their mean
``D̄ = (1/m) Σₖ Dₖ`` is one outer step; otherwise each push is one outer step on ``Dₖ / m``,
as it arrives, so one round of m pushes moves as far as one step on the mean. The outer step
on a combined pseudo-gradient ``D``, lr ``η`` (``outer_lr``), momentum ``μ``
(``outer_momentum``)::

    avg        w ← w − η · D                          η = 1: the mean of the workers' changes
                                                      (FedAvg / local SGD), as pushed
    nesterov   v ← μ · v + D                          DiLoCo's outer step: Nesterov momentum
               w ← w − η · (D + μ · v)                 on the averaged pseudo-gradient

(``optim.SGD`` with ``nesterov``, no weight decay: the workers decay already.) Without rounds
the momentum is per push, so over one round of m pushes it decays as ``μᵐ``: pick μ with the
group's size in mind. ``v`` is the group server's optimizer state: checkpointed with the
group (``GroupCore.state_dict``) and kept by a resume.

The exchange with the global server is unchanged: a group sends the change of its weights
since its last exchange, the global server adds it (``--merge`` mean over the groups: an
asynchronous average of the groups' changes, GSSP's outer loop already). No second momentum
there: it would act on changes the groups' outer steps have already accelerated.

**The global server** (``auto_local_steps``; roster.py) with ``local_steps`` 0 (auto): every
group gets its own H, so the groups push at a similar wall-clock cadence (as DyLU's dynamic
local updates do per worker; with GSSP's speed groups it is one number per group)::

    H_g = clamp(round(H_max · t_fastest / t_g), 1, H_max)

``t_g``: the mean of the group's workers' reported step times (STATS: the median time of one
local step, compute and the emulated slowdown, no communication), ``t_fastest`` the least of
them, ``H_max`` = ``local_steps_max``. So H_g · t_g ≈ H_max · t_fastest. H_g is recomputed
whenever the groups' step times are (every STATS) and changes only once the exact value is
more than ``HYSTERESIS`` (0.75) from the current H; a change is sent on (ASSIGN to the
group's server and workers; every WEIGHTS carries the group's H to its workers).

What a restart loses: a worker that restarts (or reconnects) drops the steps of the push it
had not sent (at most H − 1 batches); its velocity and residual are lost on a restart as
core/worker_opt.py says. Per-group H comes back with the next STATS after a resume.

``LocalSteps`` names the worker's optimizer (core/worker_opt.py) only for type checking and
gets it from the ``Upload`` it is given, so the servers' cores, which import this module for
``outer_sgd`` and ``auto_local_steps``, load nothing of the worker's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from minips.core import optim
from minips.core.config import RunConfig
from minips.errors import ConfigError

if TYPE_CHECKING:  # the servers' cores import this module: the worker's optimizer stays out
    from minips.core.worker_opt import Upload
    from minips.sparse import SparseVector

__all__ = ["LocalSteps", "outer_sgd", "auto_local_steps", "HYSTERESIS"]

HYSTERESIS = 0.75  # local steps: a group's H changes once the exact value is this far from it


class LocalSteps:
    """One worker's inner loop over ``Upload``'s ``WorkerSGD``: ``start`` from the pulled
    weights, ``step`` once per batch (it returns the weights to compute the next gradient at),
    ``packet`` once ``finished`` (the module docstring)."""

    def __init__(self, upload: Upload) -> None:
        if upload.opt is None:
            raise ConfigError("local steps need the optimizer on the worker "
                              "(--optimizer-at worker)")
        self.upload, self.opt = upload, upload.opt
        size = upload.compressor.size
        self.local = np.zeros(size, np.float32)  # (n,) w_i, the local weights the steps move
        self.total = np.zeros(size, np.float32)  # (n,) D = sum of the updates so far
        self.steps = 1  # H of the current push
        self.done = 0  # steps taken since ``start``
        self.lr_factor = 1.0  # f of the pull the steps started from

    def start(self, weights: np.ndarray, steps: int, lr_factor: float = 1.0) -> np.ndarray:
        """Begin ``steps`` local steps from ``weights`` (n,) (copied, not changed); returns
        the local weights to compute the first gradient at."""
        self.local[:] = weights
        self.total[:] = 0.0
        self.steps, self.done, self.lr_factor = max(1, int(steps)), 0, float(lr_factor)
        return self.local

    def step(self, grad: Any) -> np.ndarray:
        """One optimizer step for ``grad`` (n,) computed at the local weights (numpy or torch):
        ``w ← w − Δ``, ``D ← D + Δ``; returns the local weights (the same array, moved)."""
        delta = self.opt.update(self.local, grad, self.lr_factor)
        self.local -= delta
        self.total += delta
        self.done += 1
        return self.local

    @property
    def finished(self) -> bool:
        """The H steps of this push are done: time to push ``packet``."""
        return self.done >= self.steps

    def packet(self, progress: float = 0.0) -> SparseVector | np.ndarray:
        """The pseudo-gradient D through the compressor (error feedback), the velocity
        masked where it sent."""
        self.upload.lr_factor = self.lr_factor
        return self.upload.send(self.total, progress)


def outer_sgd(run: RunConfig, size: int) -> optim.SGD:
    """The group server's outer optimizer for pushed updates (optimizer on the workers):
    ``avg`` is SGD at ``outer_lr`` with no momentum (O(k) for a sparse push), ``nesterov``
    adds ``outer_momentum`` the Nesterov way; never weight decay."""
    if run.outer_optimizer == "nesterov":
        return optim.SGD(size, lr=run.outer_lr, momentum=run.outer_momentum, weight_decay=0.0,
                         nesterov=True)
    return optim.SGD(size, lr=run.outer_lr, momentum=0.0, weight_decay=0.0)


def auto_local_steps(step_times: Mapping[int, float], h_max: int,
                     current: Mapping[int, int] | None = None) -> dict[int, int]:
    """``{group: H_g}`` from each group's step time (seconds; groups without one left out):
    ``clamp(round(h_max · t_fastest / t_g), 1, h_max)``; a group's ``current`` H (> 0) stays
    while the exact value is within ``HYSTERESIS`` of it (speeds near a rounding boundary do
    not flip H at every report)."""
    times = {g: float(t) for g, t in step_times.items() if t and t > 0 and np.isfinite(t)}
    if not times:
        return {}
    fastest, current = min(times.values()), current or {}
    out = {}
    for g, t in times.items():
        exact = min(float(h_max), max(1.0, h_max * fastest / t))
        held = current.get(g, 0)
        out[g] = held if held > 0 and abs(exact - held) <= HYSTERESIS else int(round(exact))
    return out
