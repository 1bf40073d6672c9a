"""ml.device and compress.device_compress: device choice, flat-bound training, on-device top-k
(the torch twin of ``selection.TopKSelector``, bit for bit) and compression.

Every check runs on the CPU through the same code a CUDA worker uses (the device is a
``torch.device`` argument); ``test_cuda_*`` repeat the key ones on a GPU when one is present.
"""

from __future__ import annotations

import asyncio
import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from minips.compress import registry
from minips.compress.base import Compressor
from minips.compress.device_compress import TorchTopK, device_compressor
from minips.compress.selection import TopKSelector, kept_count
from minips.core.config import RunConfig, WorkerConfig
from minips.errors import ConfigError
from minips.ml import models
from minips.ml.device import Trainer, bind_flat, pick_device
from minips.run.launch import LaunchConfig
from minips.server import GlobalServer, ServerConfig
from minips.sparse import SparseVector
from minips.worker import Worker

CPU = torch.device("cpu")
CUDA = pytest.mark.skipif(not torch.cuda.is_available(),
                          reason="no CUDA device visible to this torch build")


def tiny_bn_net() -> nn.Module:
    """A small CNN with batch norm, so the BN buffers travel with the model."""
    torch.manual_seed(3)
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                         nn.Linear(4 * 6 * 6, 10))


def batches(n: int, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((8, 1, 8, 8)).astype(np.float32),
             rng.integers(0, 10, 8).astype(np.int64)) for _ in range(n)]


# ------------------------------------------------------------------ device choice


def test_pick_device_cpu_auto_and_errors() -> None:
    assert pick_device("cpu") == CPU
    assert pick_device(" CPU ") == CPU
    if not torch.cuda.is_available():
        assert pick_device("auto").type in ("cpu", "mps")
        with pytest.raises(ConfigError, match="no CUDA device"):
            pick_device("cuda:0")
    with pytest.raises(ConfigError, match="unknown device 'gpu'"):
        pick_device("gpu")


@pytest.mark.parametrize("argv", [["worker", "--connect", "127.0.0.1:9", "--device", "cuda:7"],
                                  ["local", "--workers", "2", "--device", "cpu,cuda:7"]])
def test_cli_refuses_a_missing_device_before_starting(argv: list[str]) -> None:
    if torch.cuda.device_count() > 7:
        pytest.skip("this machine has a cuda:7")
    out = subprocess.run([sys.executable, "-m", "minips", *argv], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and "cuda:7" in out.stderr


def test_local_gives_each_worker_its_device_and_repeats_the_last() -> None:
    cfg = LaunchConfig(devices=["cuda:0", "cuda:1", "cpu"])
    assert [cfg.device(i) for i in range(5)] == ["cuda:0", "cuda:1", "cpu", "cpu", "cpu"]
    assert LaunchConfig().device(3) == "auto"


# ------------------------------------------------------------------ flat-bound training


def plain_step(model: nn.Module, xb: np.ndarray, yb: np.ndarray) -> tuple[float, np.ndarray]:
    model.zero_grad(set_to_none=True)
    loss = models.batch_loss("tiny", model, torch.from_numpy(xb), torch.from_numpy(yb))
    loss.backward()
    return float(loss.detach()), models.get_flat_grad(model)


def check_trainer_matches_plain(device: torch.device, tol: float = 1e-5) -> None:
    plain = tiny_bn_net()
    bound = copy.deepcopy(plain)
    trainer = Trainer(bound, "tiny", device)
    np.testing.assert_array_equal(trainer.host_weights(), models.get_flat(plain))
    w = models.get_flat(plain)
    for xb, yb in batches(3):
        w = w - 0.1 * np.sign(w)  # new weights each step, as a pull brings
        models.set_flat(plain, w)
        trainer.load(w)
        loss, grad = trainer.gradient(xb, yb)
        ref_loss, ref_grad = plain_step(plain, xb, yb)
        assert grad.device.type == device.type and grad.shape == ref_grad.shape
        np.testing.assert_allclose(grad.cpu().numpy(), ref_grad, rtol=tol, atol=tol / 10)
        assert abs(loss - ref_loss) < tol
    for a, b in zip(plain.buffers(), bound.buffers(), strict=True):  # BN running statistics
        np.testing.assert_allclose(a.numpy(), b.cpu().numpy(), rtol=tol, atol=tol / 10)


def test_trainer_matches_a_plain_model_on_cpu() -> None:
    check_trainer_matches_plain(CPU)


def test_gradients_land_in_the_flat_buffer() -> None:
    model = tiny_bn_net()
    weights, grads = bind_flat(model, CPU)
    trainer_like = [p for p in model.parameters()]
    loss = models.batch_loss("tiny", model, *map(torch.from_numpy, batches(1)[0]))
    loss.backward()
    offset = 0
    for p in trainer_like:
        assert p.data_ptr() == weights[offset:].data_ptr()
        assert p.grad is not None and p.grad.data_ptr() == grads[offset:].data_ptr()
        offset += p.numel()
    assert float(grads.abs().sum()) > 0


def test_amp_on_cpu_gives_a_close_gradient() -> None:
    plain, fast = tiny_bn_net(), tiny_bn_net()
    ref = Trainer(plain, "tiny", CPU)
    amp = Trainer(fast, "tiny", CPU, amp=True)
    assert amp.dtype == torch.bfloat16 and amp.scale == 1.0
    xb, yb = batches(1)[0]
    _, g_ref = ref.gradient(xb, yb)
    loss, g_amp = amp.gradient(xb, yb)
    assert np.isfinite(loss)
    cos = float(torch.dot(g_ref, g_amp) / (g_ref.norm() * g_amp.norm()))
    assert cos > 0.99


def test_float16_loss_scaling_drops_an_overflowing_step() -> None:
    trainer = Trainer(tiny_bn_net(), "tiny", CPU, amp=True)
    trainer.dtype, trainer.scale = torch.float16, 1e38  # as on a GPU without bfloat16
    xb, yb = batches(1)[0]
    _, grad = trainer.gradient(xb, yb)
    assert float(grad.abs().sum()) == 0.0 and trainer.scale == 5e37
    trainer.scale = 1024.0
    _, grad = trainer.gradient(xb, yb)
    assert float(grad.abs().sum()) > 0


# ------------------------------------------------------------------ on-device compression


def grads(n: int, steps: int, seed: int = 1) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(n).astype(np.float32) * rng.uniform(0.1, 2) for _ in range(steps)]


def on_host(t: Any) -> np.ndarray:
    """(n,) float32 numpy copy of a residual, wherever it lives."""
    assert t is not None
    return t.cpu().numpy().copy() if isinstance(t, torch.Tensor) else np.array(t)


def check_torch_topk_equals_numpy(device: torch.device) -> None:
    """Same vector, seed and k: the same indices (so the same values), in both modes."""
    rng = np.random.default_rng(11)
    for n in (5000, 200_000):  # a full partition, and the sampled threshold
        for tolerance in (0.0, 0.1):
            ours = TopKSelector(n, 3, tolerance=tolerance)
            twin = TorchTopK(n, device, 3, tolerance=tolerance)
            for density, kind in [(0.01, "laplace"), (0.001, "ties"), (0.1, "zeros")] * 2:
                x = rng.laplace(size=n).astype(np.float32)
                if kind == "ties":
                    x = rng.integers(-3, 4, size=n).astype(np.float32)
                elif kind == "zeros":
                    x[rng.random(n) < 0.995] = 0.0
                k = kept_count(density, n)
                want = ours.select(x, k)
                got = twin.select(torch.from_numpy(x).to(device), k)
                assert got.dtype == torch.int64 and got.device.type == device.type
                np.testing.assert_array_equal(got.cpu().numpy(), want)
                assert twin.refines == ours.refines


def test_torch_topk_equals_the_numpy_one_bit_for_bit() -> None:
    check_torch_topk_equals_numpy(CPU)


def twins(name: str, n: int, device: torch.device, **opts: Any) -> tuple[Compressor, Compressor]:
    host = registry.make_compressor(name, n, ratio=0.01, seed=5, **opts)
    dev = device_compressor(registry.make_compressor(name, n, ratio=0.01, seed=5, **opts),
                            device, on_device=True)
    assert dev.on_device and not host.on_device
    return host, dev


def check_device_equals_numpy(device: torch.device, name: str, **opts: Any) -> None:
    for n in (5000, 200_000):  # a full partition, and the sampled threshold
        host, dev = twins(name, n, device, **opts)
        for step, g in enumerate(grads(n, 6)):
            host.observe_loss(1.0 / (step + 1))
            dev.observe_loss(1.0 / (step + 1))
            a = host.compress(g)
            b = dev.compress(torch.from_numpy(g).to(device))
            assert isinstance(a, SparseVector) and isinstance(b, SparseVector)
            np.testing.assert_array_equal(a.indices, b.indices)
            np.testing.assert_array_equal(a.values, b.values)
            per_entry = 6 if opts.get("value_dtype") == "f16" else 8
            assert dev.host_bytes == per_entry * b.nnz and dev.kept_fraction == host.kept_fraction
        np.testing.assert_array_equal(on_host(host.residual), on_host(dev.residual))


@pytest.mark.parametrize("name,opts", [("topk", {}), ("topk", {"value_dtype": "f16"}),
                                       ("losscomp", {}), ("dgc", {}),
                                       ("gdtopk", {"warmup_epochs": 0})])
def test_selection_on_device_equals_numpy(name: str, opts: dict[str, Any]) -> None:
    check_device_equals_numpy(CPU, name, **opts)


@pytest.mark.parametrize("name", ["dgc", "gdtopk"])
def test_dgc_on_device_keeps_the_largest_and_the_feedback_invariant(name: str) -> None:
    n = 300_000
    _, dev = twins(name, n, CPU, tolerance=0.1, warmup_epochs=0)
    dev.set_ratio(0.01)
    total_sent, total_grad = np.zeros(n), np.zeros(n)
    for g in grads(n, 8):
        acc = on_host(dev.residual) + g
        out = dev.compress(torch.from_numpy(g))
        assert isinstance(out, SparseVector)
        k = round(0.01 * n)
        assert k <= out.nnz <= 1.1 * k
        assert np.all(np.diff(out.indices.astype(np.int64)) > 0)
        rest = np.delete(np.abs(acc), out.indices)
        assert np.abs(out.values).min() >= rest.max()  # the largest magnitudes
        np.testing.assert_array_equal(out.values, acc[out.indices])
        np.add.at(total_sent, out.indices, out.values)
        total_grad += g
    np.testing.assert_allclose(total_sent + on_host(dev.residual), total_grad, atol=1e-4)


def test_gdtopk_ratio_and_warmup_reach_the_device_selection() -> None:
    n = 100_000
    _, dev = twins("gdtopk", n, CPU)  # warm-up on: 25% in epoch 0
    out = dev.compress(torch.zeros(n).normal_())
    assert isinstance(out, SparseVector) and out.nnz >= 0.25 * n
    dev.set_epoch(10.0)
    dev.set_ratio(0.002)
    out = dev.compress(torch.zeros(n).normal_())
    assert isinstance(out, SparseVector) and 200 <= out.nnz <= 220
    assert dev.ratio == 0.002


def test_compressors_without_a_device_twin_run_on_the_host() -> None:
    n = 1000
    table: list[tuple[str, dict[str, Any]]] = [("none", {}), ("fp16", {}), ("randomk", {}),
                                               ("losscomp", {"vote_weight": 0.3})]
    for name, opts in table:
        host = registry.make_compressor(name, n, ratio=0.1, seed=2, **opts)
        twin = registry.make_compressor(name, n, ratio=0.1, seed=2, **opts)
        placed = device_compressor(twin, CPU, on_device=True)
        assert placed is twin and not placed.on_device
        for g in grads(n, 3):
            a, b = host.compress(g), placed.compress(torch.from_numpy(g))
            if isinstance(a, SparseVector):
                assert isinstance(b, SparseVector)
                np.testing.assert_array_equal(a.indices, b.indices)
                a, b = a.values, b.values
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert placed.host_bytes == 0  # on the CPU the gradient is shared, not copied


def test_default_is_on_device_only_off_the_cpu() -> None:
    host = registry.make_compressor("topk", 100, ratio=0.1)
    assert not device_compressor(host, CPU).on_device


def test_a_compressor_moves_to_the_device_only_before_it_compresses() -> None:
    c = registry.make_compressor("topk", 100, ratio=0.1)
    c.compress(np.ones(100, np.float32))
    with pytest.raises(RuntimeError, match="before its first compress"):
        device_compressor(c, CPU, on_device=True)


def test_torch_topk_ties_go_to_the_lowest_index() -> None:
    x = torch.tensor([1.0, -3.0, 2.0, 3.0, 2.0, 2.0, 0.5])
    sel = TorchTopK(7, CPU)
    assert sel.select(x, 3).tolist() == [1, 2, 3]
    assert sel.select(x, 0).tolist() == [] and sel.select(x, 9).tolist() == list(range(7))


# ------------------------------------------------------------------ a worker on the device path


async def train(tmp_path: Path, on_device: bool) -> np.ndarray:
    """Final global weights of a 1-worker BSP top-k run with the worker's compressor on the
    device (torch) or on the host (numpy)."""
    run = RunConfig(mode="bsp", compressor="topk", ratio=0.01, workers=1, max_steps=8,
                    base_step_s=0.0, calib_steps=1, lr=0.05, lr_warmup=0.0)
    init = models.get_flat(models.build_model(run.model, run.seed))
    srv = GlobalServer(ServerConfig(run=run, port=0, token="t", run_dir=str(tmp_path)), init)
    port = await srv.start()
    wcfg = WorkerConfig(server_port=port, token="t", worker_id=0, run_dir=str(tmp_path),
                        device="cpu", compress_on_device=on_device)
    try:
        await asyncio.wait_for(Worker(wcfg).run(), 120)
        await asyncio.wait_for(srv.wait_finished(), 30)
    finally:
        await srv.close()
    assert srv.core.weights is not None
    return np.array(srv.core.weights)


@pytest.mark.timeout(180)
async def test_a_worker_compressing_on_the_device_trains_as_on_the_host(tmp_path: Path) -> None:
    on_dev = await train(tmp_path / "dev", True)
    on_host = await train(tmp_path / "host", False)
    np.testing.assert_array_equal(on_dev, on_host)  # exact top-k: the same bits
    info = json.loads((tmp_path / "dev" / "worker-0.device.json").read_text())
    assert info["device"] == "cpu" and info["compress_on_device"] is True
    assert info["steps"] == 8 and info["max_rss_mb"] >= info["rss_mb"] > 50
    recs = [json.loads(line) for line in (tmp_path / "dev" / "worker-0.jsonl").open()]
    assert len(recs) == 8
    for r in recs:
        assert r["host_bytes"] == 8 * round(0.01 * models.param_count("lenet5"))
        assert all(r[k] >= 0 for k in ("decode_s", "compute_s", "compress_s", "encode_s",
                                       "push_s"))


# ------------------------------------------------------------------ lean worker import


def test_worker_import_stays_lean() -> None:
    code = ("import sys, minips.worker; print(' '.join(sorted(m for m in sys.modules "
            "if m.split('.')[0] in ('matplotlib', 'minips', 'ray', 'pandas', 'scipy'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True, cwd=Path(__file__).parent.parent)
    loaded = set(out.stdout.split())
    heavy = {m for m in loaded if not m.startswith("minips")}
    servers = loaded & {"minips.server", "minips.serve.group", "minips.serve.group_process",
                        "minips.core.ssp", "minips.grouping", "minips.run.launch",
                        "minips.record.plot", "minips.record.checkpoint",
                        "minips.serve.sessions", "minips.core.roster"}
    assert not heavy and not servers, (heavy, servers)


# ------------------------------------------------------------------ on a GPU, when there is one


@CUDA
def test_cuda_trainer_matches_a_plain_model(monkeypatch: pytest.MonkeyPatch) -> None:
    # full float32 convolutions (cuDNN's TF32 default rounds inputs to 10 bits); other kernels
    # still sum in another order than the CPU's, hence the looser tolerance
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    check_trainer_matches_plain(torch.device("cuda"), tol=1e-4)


@CUDA
def test_cuda_topk_equals_the_numpy_one_bit_for_bit() -> None:
    check_torch_topk_equals_numpy(torch.device("cuda"))


@CUDA
@pytest.mark.parametrize("name", ["topk", "dgc"])
def test_cuda_selection_equals_numpy(name: str) -> None:
    check_device_equals_numpy(torch.device("cuda"), name)


@CUDA
def test_cuda_trainer_uses_pinned_staging_and_amp() -> None:
    trainer = Trainer(tiny_bn_net(), "tiny", torch.device("cuda"), amp=True)
    assert trainer.staging is not None and trainer.staging.is_pinned()
    loss, grad = trainer.gradient(*batches(1)[0])
    assert np.isfinite(loss) and grad.is_cuda and float(grad.abs().sum()) > 0
