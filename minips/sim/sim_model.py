"""The simulator's real-model objective: the run's model on its data set, as real workers
train it (the only simulator module that imports torch; the role cores never do).

Worker ``k`` of ``W`` reads the batch stream a real worker reads (``reference.worker_streams``:
its shard of ``data.shard_indices``, epochs in ``data.batch_stream`` order) and computes its
gradient with ``device.Trainer`` on the CPU, as ``worker.py`` does; the initial weights are
``models.build_model(model, seed)``'s, as ``minips local`` writes them to init.npy. An
evaluation is ``models.evaluate`` on the test set's first ``eval_limit`` samples, as the
evaluator's.
"""

from __future__ import annotations

import numpy as np
import torch

from minips.core.config import RunConfig
from minips.ml import data, device, models, reference

__all__ = ["ModelObjective"]


class ModelObjective:
    """Gradients and evaluations of ``run.model`` on ``run.dataset`` (or the sets given)."""

    def __init__(self, run: RunConfig, *, train: data.Dataset | None = None,
                 test: data.Dataset | None = None, threads: int = 1) -> None:
        torch.set_num_threads(threads)
        self.name = run.model
        model = models.build_model(run.model, run.seed)
        model.train()
        self.trainer = device.Trainer(model, run.model, torch.device("cpu"))
        self.start = models.get_flat(model)  # (n,) float32
        self.size = int(self.start.size)
        train = train if train is not None else data.load_dataset(run.dataset, "train",
                                                                  run.data_dir)
        self.streams, _ = reference.worker_streams(train, run.workers, run.batch_size,
                                                   run.seed, run.val_size)
        if test is None:  # the evaluator's set: the test split or the held-out validation
            test = data.evaluation_set(run.dataset, run.data_dir, val_size=run.val_size,
                                       limit=run.eval_limit)
        self.test = test

    def initial(self) -> np.ndarray:
        return self.start.copy()

    def gradient(self, worker: int, w: np.ndarray, rng: np.random.Generator
                 ) -> tuple[np.ndarray, float]:
        """Worker ``worker``'s next batch at weights ``w``: (grad (n,) float32, loss)."""
        _, xb, yb = next(self.streams[worker])
        self.trainer.load(w)
        loss, grad = self.trainer.gradient(xb, yb)
        return grad.numpy().copy(), loss

    def evaluate(self, w: np.ndarray) -> dict[str, float]:
        acc, loss = models.evaluate(self.name, w, self.test)
        return {"accuracy": acc, "loss": loss}
