"""The plain single-process training loop that minips results are checked against.

What ``train`` does, exactly, so that N minips workers in BSP mode can reproduce it:

1. ``model = models.build_model(name, seed)``; ``w = models.get_flat(model)`` (n,) float32;
   momentum buffer ``v = 0`` (n,) float32.
2. Worker k of W (``workers=W``) owns ``shard_k = shard_indices(len(ds), k, W, seed)``
   and reads the endless stream ``batch_stream(ds, shard_k, batch_size, seed)``: epoch 0's
   batches in ``iterate_batches`` order, then epoch 1's, ... (each worker counts its own epochs).
3. Step t: every worker takes its next batch and computes ``g_k``, the gradient of
   ``models.batch_loss`` (mean over its batch) at ``w``; ``g = (g_0 + ... + g_{W-1}) / W``.
4. SGD, torch.optim.SGD semantics (dampening 0, no Nesterov), in float32 numpy:
   ``d = g + weight_decay * w``; ``v = momentum * v + d``; ``w = w - lr_t * v``.
5. ``steps`` steps, or ``epochs * min_k(len(shard_k) // batch_size)`` when ``epochs`` is given.
6. The learning rate of step t (0, 1, ...), as the group servers set it:
   ``lr_t = lr * optim.lr_factor(lr_schedule, seen=t*S, step=S, ramp=lr_warmup*train_size,
   budget=total*S)`` with ``S = W * batch_size`` samples per step and ``total`` the number of
   steps: a linear warm-up over ``lr_warmup`` epochs of ``train_size`` samples (default
   ``len(dataset)``), then ``constant`` or a ``cosine`` decay to 0 at the end of the run.

Batch-norm running statistics are not part of ``w`` (see models.py); the loop keeps the
model's own, as a worker would.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch import nn

from minips.core import optim
from minips.errors import ConfigError
from minips.ml import data, models
from minips.ml.data import batch_stream, num_batches, shard_indices
from minips.ml.models import net_name

__all__ = ["train", "sgd_step", "worker_streams"]


def sgd_step(w: np.ndarray, v: np.ndarray, g: np.ndarray, *, lr: float, momentum: float,
             weight_decay: float) -> None:
    """One SGD step on (n,) float32 vectors, in place: v = m*v + (g + wd*w); w -= lr*v."""
    d = g + np.float32(weight_decay) * w
    v *= np.float32(momentum)
    v += d
    w -= np.float32(lr) * v


def worker_streams(ds: data.Dataset, workers: int, batch_size: int, seed: int,
                   val_size: int = 0
                   ) -> tuple[list[Iterator[tuple[int, np.ndarray, np.ndarray]]], int]:
    """Each worker's batch stream and the number of steps in one epoch (smallest shard), less
    ``val_size`` held-out validation samples (data.validation_split)."""
    shards = [shard_indices(len(ds), k, workers, seed, val_size=val_size)
              for k in range(workers)]
    streams = [batch_stream(ds, s, batch_size, seed) for s in shards]
    return streams, min(num_batches(len(s), batch_size) for s in shards)


def _model_name(model: nn.Module) -> str:
    name = net_name(model)
    if name is not None:
        return name
    raise ConfigError(f"cannot tell the loss of {type(model).__name__}; pass name=")


def _step_gradient(name: str, model: nn.Module, batches: list[tuple[Any, Any]]
                   ) -> tuple[np.ndarray, float]:
    """Mean of the per-batch gradients (n,) float32, and the mean of the batch losses."""
    total, losses = None, []
    for xb, yb in batches:
        model.zero_grad(set_to_none=True)
        loss = models.batch_loss(name, model, torch.from_numpy(xb), torch.from_numpy(yb))
        loss.backward()
        g = models.get_flat_grad(model)
        total = g if total is None else total + g
        losses.append(float(loss.detach()))
    assert total is not None
    return total / np.float32(len(batches)), float(np.mean(losses))


def train(
    model: str | nn.Module,
    dataset: data.Dataset,
    *,
    lr: float,
    seed: int,
    epochs: int | None = None,
    steps: int | None = None,
    batch_size: int = 64,
    momentum: float = 0.9,
    weight_decay: float = 5e-4,
    workers: int = 1,
    test: data.Dataset | None = None,
    name: str | None = None,
    lr_warmup: float = 0.0,
    lr_schedule: str = "constant",
    train_size: int = 0,
) -> tuple[np.ndarray, list[dict[str, Any]]]:
    """Train and return (final flat weights (n,) float32, history).

    ``model`` is a model name (built with ``seed``) or a module (``name`` gives its loss when
    its class is not one of ``models``'). Give ``epochs`` or ``steps``. History has one record
    per epoch (and one at the end of a ``steps`` run that stops mid-epoch): epoch, step, mean
    training loss since the previous record, elapsed seconds, and test accuracy / loss when
    ``test`` is given. ``lr_warmup`` (epochs of ``train_size`` samples, 0 = ``len(dataset)``)
    and ``lr_schedule`` set each step's lr as in item 6 of the module docstring.
    """
    if (epochs is None) == (steps is None):
        raise ConfigError("give exactly one of epochs= and steps=")
    if isinstance(model, str):
        name, model = model, models.build_model(model, seed)
    name = name or _model_name(model)
    streams, per_epoch = worker_streams(dataset, workers, batch_size, seed)
    total = steps if steps is not None else int(epochs or 0) * per_epoch
    per_step = workers * batch_size  # S: samples in one step, all workers together
    ramp = lr_warmup * (train_size or len(dataset))  # warm-up length in samples
    w = models.get_flat(model)  # (n,) float32, the weights a server would hold
    v = np.zeros_like(w)  # (n,) float32 momentum buffer
    history: list[dict[str, Any]] = []
    losses: list[float] = []
    t0, eval_s = time.perf_counter(), 0.0
    model.train()
    for step in range(1, total + 1):
        models.set_flat(model, w)
        g, loss = _step_gradient(name, model, [next(s)[1:] for s in streams])
        factor = optim.lr_factor(lr_schedule, seen=(step - 1) * per_step, step=per_step,
                                 ramp=ramp, budget=total * per_step)
        sgd_step(w, v, g, lr=lr * factor, momentum=momentum, weight_decay=weight_decay)
        losses.append(loss)
        if step % per_epoch == 0 or step == total:
            rec = {"epoch": step / per_epoch, "step": step, "train_loss": float(np.mean(losses)),
                   "time_s": time.perf_counter() - t0 - eval_s}  # training time only
            t_eval = time.perf_counter()
            if test is not None:
                rec["test_accuracy"], rec["test_loss"] = models.evaluate(name, w, test)
            eval_s += time.perf_counter() - t_eval
            history.append(rec)
            losses = []
    return w, history

