"""The optimizer on the worker (``RunConfig.optimizer_at`` ``worker``): what a worker pushes for
one gradient, and the pieces of Deep Gradient Compression that need the optimizer there.

With the optimizer on the servers (the default) a worker pushes its (compressed) gradient and
its group server runs SGD with momentum. With the optimizer on the worker, each worker keeps
its own velocity ``u`` (n,) float32 and pushes the *update* ``Δ`` its SGD would apply; the
group server subtracts what arrives as it is (``optim.SGD`` at lr 1, no momentum, no decay:
``group_core._server_sgd``). One step of worker k, in this order (``WorkerSGD.update``, then
``Upload.packet``)::

    g ← g · min(1, c / |g|₂)          local gradient clipping, c = grad_clip / sqrt(workers)
    d ← g + weight_decay · w          w: the weights the gradient was computed at
    u ← momentum · u + d              the worker's velocity
    Δ ← lr · f · u                    f: the lr factor the group server sent (WEIGHTS.lr_factor)
    packet ← compressor(Δ)            error feedback: r ← r + Δ, send top-k of r, r[sent] ← 0
    u[sent] ← 0                       momentum-factor masking (momentum_masking)

That is DGC's momentum correction: the residual ``r`` accumulates velocity (times the lr) and
the selection is made on that accumulation, not on the gradient. BSP with one group, the
optimizer here and no compression is synchronous SGD exactly: the mean of the workers' ``Δ``
is ``lr · f · (momentum · mean(u) + mean(g) + weight_decay · w)``, the reference loop's step
(``reference.train``; tests/test_worker.py), float32 rounding of the mean aside.

Local steps (a worker runs H optimizer steps on its local weights, then pushes the change;
``LocalSteps`` in core/local_steps.py) build on ``WorkerSGD.update``: it returns ``Δ`` and
leaves ``w`` alone, so such a worker applies ``w ← w − Δ`` on its local weights H times and sends
the sum of the H updates through ``Upload.send``.

A worker's optimizer state (``u``, and the compressor's residual ``r``) lives only in its
process: a worker that restarts starts both at zero (a momentum restart; what ``r`` held was
never sent and is lost), one that only reconnects (its group server or the global server
restarted) keeps them.

Sans-IO numpy; ``Upload.packet`` and ``WorkerSGD.update`` take a numpy array or a torch
tensor (copied to the host, a view on the CPU).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from minips.compress.base import Compressor, as_float32
from minips.core.config import RunConfig
from minips.errors import ConfigError
from minips.sparse import SparseVector

__all__ = ["WorkerSGD", "clip_scale", "Upload"]


def clip_scale(g: np.ndarray, max_norm: float) -> float:
    """The factor that brings ``g``'s L2 norm down to ``max_norm`` (1 when it is under it, or
    ``max_norm`` is 0: no clipping). The norm is that of the whole flat vector, all layers
    together, as ``torch.nn.utils.clip_grad_norm_`` over every parameter."""
    if max_norm <= 0:
        return 1.0
    norm = math.sqrt(float(np.dot(g, g)))
    return max_norm / norm if norm > max_norm else 1.0


class WorkerSGD:
    """One worker's SGD with momentum, weight decay and local clipping on a flat vector of
    ``size`` float32; ``update`` gives the step to push (the module docstring)."""

    def __init__(self, size: int, *, lr: float, momentum: float, weight_decay: float,
                 clip: float = 0.0) -> None:
        if lr <= 0 or not 0 <= momentum < 1 or weight_decay < 0 or clip < 0:
            raise ConfigError(f"lr > 0, momentum in [0, 1), weight_decay >= 0, clip >= 0; got "
                              f"{lr}, {momentum}, {weight_decay}, {clip}")
        self.size = int(size)
        self.lr, self.momentum, self.weight_decay = float(lr), float(momentum), float(weight_decay)
        self.clip = float(clip)  # max L2 norm of one gradient; 0: no clipping
        self.velocity: np.ndarray = np.zeros(self.size, np.float32)  # (n,) u
        self.steps = 0  # updates computed so far
        self.last_scale = 1.0  # the clipping factor of the last update (1: not clipped)
        self._d = np.empty(self.size, np.float32)  # (n,) scratch: clipped g + decay
        self._delta = np.empty(self.size, np.float32)  # (n,) the update returned

    def update(self, weights: np.ndarray, grad: Any, lr_factor: float = 1.0) -> np.ndarray:
        """The update ``Δ`` (n,) float32 for ``grad`` computed at ``weights`` (both (n,)
        float32; ``grad`` may be a torch tensor): the pusher subtracts it from the weights.
        The array is reused by the next call; ``weights`` is not changed."""
        grad = as_float32(grad)  # no copy for a float32 numpy array
        if weights.shape != (self.size,) or grad.shape != (self.size,):
            raise ConfigError(f"weights and gradient must be ({self.size},), got "
                              f"{weights.shape} and {grad.shape}")
        self.last_scale = clip_scale(grad, self.clip)
        d = np.multiply(weights, self.weight_decay, out=self._d)  # (n,) float32
        if self.last_scale < 1.0:
            d += np.multiply(grad, np.float32(self.last_scale), out=self._delta)
        else:
            d += grad
        u = self.velocity
        u *= self.momentum
        u += d
        self.steps += 1
        return np.multiply(u, self.lr * lr_factor, out=self._delta)

    def mask(self, sent: SparseVector | np.ndarray) -> None:
        """Momentum-factor masking: clear the velocity where ``sent`` (a sparse packet) has
        entries, so a coordinate just sent does not keep pushing with its old momentum. A
        dense packet is not masked (every coordinate is sent every step)."""
        if isinstance(sent, SparseVector):
            self.velocity[np.asarray(sent.indices, dtype=np.int64)] = 0.0

    def state_dict(self) -> dict[str, Any]:
        """The state as plain values and one (n,) float32 array (a copy)."""
        return {"size": self.size, "steps": self.steps, "velocity": self.velocity.copy()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take back what ``state_dict`` gave; another size is a ``ConfigError``."""
        velocity = np.asarray(state["velocity"], dtype=np.float32)
        if int(state["size"]) != self.size or velocity.shape != (self.size,):
            raise ConfigError(f"optimizer state is for size {state['size']}, not {self.size}")
        self.steps, self.velocity = int(state["steps"]), velocity.copy()


class Upload:
    """What one worker pushes for each gradient: the compressed gradient (optimizer on the
    servers), or the compressed update of its ``WorkerSGD`` with the velocity masked where
    the packet sent (optimizer on the worker). worker.py and the simulator both use it."""

    def __init__(self, run: RunConfig, compressor: Compressor) -> None:
        self.compressor = compressor
        self.masking = run.momentum_masking
        self.lr_factor = 1.0  # of the last update (``record``)
        self.opt = (WorkerSGD(compressor.size, lr=run.lr, momentum=run.momentum,
                              weight_decay=run.weight_decay,
                              clip=run.grad_clip / math.sqrt(run.workers))
                    if run.optimizer_on_worker else None)

    def record(self) -> dict[str, float]:
        """What a worker's step record says of its optimizer: the lr factor and the clipping
        factor of its last update (1: not clipped); nothing with the optimizer on the servers."""
        if self.opt is None:
            return {}
        return {"lr_factor": self.lr_factor, "clip_scale": self.opt.last_scale}

    def packet(self, grad: Any, weights: np.ndarray | None, *, lr_factor: float = 1.0,
               progress: float = 0.0) -> SparseVector | np.ndarray:
        """The packet to push for ``grad`` (n,) computed at ``weights`` (the worker's copy;
        only read with the optimizer here), ``lr_factor`` and ``progress`` as the last
        WEIGHTS said."""
        self.compressor.set_progress(progress)
        self.lr_factor = float(lr_factor)
        if self.opt is None:
            return self.compressor.compress(grad)
        assert weights is not None, "the optimizer on the worker needs the weights it holds"
        return self.send(self.opt.update(weights, grad, lr_factor), progress)

    def send(self, update: np.ndarray, progress: float = 0.0) -> SparseVector | np.ndarray:
        """The packet for ``update`` (n,) float32 (one step's, or H local steps' sum:
        core/local_steps.py): compressed with error feedback, the velocity masked where it
        sent (optimizer on the worker only)."""
        assert self.opt is not None, "an update to send needs the optimizer on the worker"
        self.compressor.set_progress(progress)
        packet = self.compressor.compress(update)
        if self.masking:
            self.opt.mask(packet)
        return packet

