"""What a worker builds from the run config before it trains: the model bound to its device
(``device.Trainer``), its data shard and endless batch stream (in ``reference.train``'s order),
its compressor (top-k selection on the device where it runs off the CPU), its metrics writer,
and ``worker-<id>.device.json`` (where it computes; its resident memory once it leaves).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from minips.compress.device_compress import DeviceCompressor, HostCompressor, device_compressor
from minips.ml import data, device, models
from minips.run import provenance
from minips.run.config import RunConfig, WorkerConfig
from minips.run.metrics import JsonlWriter, RunDir

__all__ = ["Parts", "build"]


@dataclass
class Parts:
    """A worker's model, data and compressor, and the files it writes."""

    trainer: device.Trainer
    stream: Iterator[tuple[int, np.ndarray, np.ndarray]]  # (epoch, x, y) batches, endless
    first_batch: tuple[np.ndarray, np.ndarray]  # what calibration times (stream untouched)
    shard_size: int  # samples in the worker's shard
    compressor: HostCompressor | DeviceCompressor
    writer: JsonlWriter  # worker-<id>.jsonl
    device_file: Path  # worker-<id>.device.json
    device_info: dict[str, Any]

    def save_device_info(self, **more: Any) -> None:
        """Write worker-<id>.device.json with ``more`` added (resident memory at the end)."""
        self.device_info.update(more)
        self.device_file.write_text(json.dumps(self.device_info) + "\n")


def build(cfg: WorkerConfig, run: RunConfig, worker_id: int) -> Parts:
    """Build worker ``worker_id``'s parts, print where it computes and write that down."""
    torch.set_num_threads(cfg.torch_threads)
    dev = device.pick_device(cfg.device)
    model = models.build_model(run.model, run.seed)
    model.train()
    trainer = device.Trainer(model, run.model, dev, amp=cfg.amp)
    ds = data.load_dataset(run.dataset, "train", cfg.data_dir or run.data_dir)
    provenance.record(cfg.run_dir, f"worker-{worker_id}", ds.meta)
    shard = data.shard_indices(len(ds), worker_id, run.workers, run.seed)
    compressor = device_compressor(run.worker_compressor(trainer.size, worker_id), dev,
                                   on_device=cfg.compress_on_device)
    run_dir = RunDir(cfg.run_dir, t0=run.t0)
    info = {"worker": worker_id, **device.describe(dev, cfg.amp),
            "compress_on_device": compressor.on_device}
    parts = Parts(
        trainer=trainer, stream=data.batch_stream(ds, shard, run.batch_size, run.seed),
        first_batch=(ds.x[shard[: run.batch_size]], ds.y[shard[: run.batch_size]]),
        shard_size=len(shard), compressor=compressor,
        writer=run_dir.writer(f"worker-{worker_id}"),
        device_file=run_dir.file(f"worker-{worker_id}.device.json"), device_info=info)
    print(f"minips worker {worker_id}: " + ", ".join(
        f"{k} {v}" for k, v in info.items() if k != "worker"), file=sys.stderr, flush=True)
    parts.save_device_info()
    return parts
