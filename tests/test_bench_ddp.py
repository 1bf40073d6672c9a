"""scripts/bench_ddp.py, the DDP rows' baseline: with the hook ``none`` its ranks make the
updates of synchronous SGD, the same as ``reference.train`` on the same shards, batches, initial
weights, optimizer and lr schedule, its warm-up included (so DDP and minips BSP rows differ in
communication only); the fp16 hook rounds the gradients it sends, and its weights stay close."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_ddp.py"
STEPS = 6
WARMUP = 0.005  # epochs: 300 samples, a ramp over the first 3 steps of 2 x 64 (minips' shape)


def bench(tmp: Path, hook: str) -> tuple[dict[str, object], np.ndarray]:
    final = tmp / f"{hook}.npy"
    out = subprocess.run([sys.executable, str(SCRIPT), "--profile", "1,1", "--base-step", "0",
                          "--steps", str(STEPS), "--hook", hook, "--save-final", str(final),
                          "--lr-warmup", str(WARMUP),
                          "--eval-limit", "500"], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1]), np.load(final)


@pytest.mark.timeout(600)
def test_ddp_without_a_hook_is_reference_sgd_and_fp16_stays_close(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from minips.ml import data, reference

    ds = data.load_dataset("fashion-mnist", "train", fallback=False)
    want, _ = reference.train("lenet5", ds, lr=0.05, seed=0, steps=STEPS, batch_size=64,
                              momentum=0.9, weight_decay=5e-4, workers=2,
                              lr_schedule="cosine", lr_warmup=WARMUP)
    res, got = bench(tmp_path, "none")
    assert res["steps"] == STEPS and res["ranks"] == 2
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    _, half = bench(tmp_path, "fp16")
    assert not np.array_equal(half, got)  # the hook did round what it sent
    np.testing.assert_allclose(half, want, rtol=1e-2, atol=1e-3)
