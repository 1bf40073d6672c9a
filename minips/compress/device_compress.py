"""Compression on the worker's device: selection and error feedback where the gradient is.

``device_compressor(host, device)`` wraps a compressor built by ``make_compressor`` (the
*host* compressor, which keeps the ratio, warm-up, GDTopK and LossComp bookkeeping) into one that
takes the flat gradient as a torch tensor on ``device``:

- ``topk``, ``dgc``, ``gdtopk`` and ``losscomp`` (with its default ``vote_weight=0``, where votes
  do not steer the selection) select on the device with ``TorchTopK``, a line-by-line port of
  ``sparse_select.TopKSelector`` (sampled threshold, chunk-free mask, exact trim with ties to the
  lowest index), and keep the error-feedback residual (n,) float32 on the device. Only the k'
  indices (int32) and values (float32; float16 with ``value_dtype="f16"``, which sends no more)
  cross to the host: ``8 k'`` (or ``6 k'``) bytes per step instead of ``4 n``. Exact top-k
  (``topk``, ``losscomp``) sends the same indices and values as the numpy compressor; the DGC
  flavours draw their threshold sample from a torch generator, so their set differs from
  numpy's but keeps the same guarantee (the k' largest, k <= k' <= k (1 + tol)).
- every other compressor (``none``, ``fp16``, ``randomk``, ``losscomp`` with steering votes,
  whose (n,) vote arrays live on the host) runs on the host: ``HostCompressor`` copies the
  gradient to the host and calls it unchanged (on the CPU that copy is a view: no bytes move).

Both keep the host compressor's invariant: the sum of everything sent plus the residual equals
the sum of the gradients (float32 rounding aside).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from minips.compress.base import FP16_MAX, Compressor, WireSpec
from minips.compress.losscomp import LossCompCompressor
from minips.compress.topk import TopKCompressor
from minips.sparse import (
    APPROX_MARGIN_STDS,
    EXACT_MARGIN_STDS,
    MAX_REFINES,
    MAX_SAMPLE,
    MIN_SAMPLE,
    SAMPLE_PER_DENSITY,
    SparseVector,
    kept_count,
)

__all__ = ["TorchTopK", "DeviceCompressor", "HostCompressor", "device_compressor",
           "runs_on_device"]


class TorchTopK:
    """``TopKSelector`` on torch tensors: (k',) int64 sorted indices of the largest |x|."""

    def __init__(self, size: int, device: torch.device, seed: int = 0, *,
                 tolerance: float = 0.0) -> None:
        self.size, self.device, self.tolerance = size, device, tolerance
        self.gen = torch.Generator(device=device)
        self.gen.manual_seed(seed)
        self._abs = torch.empty(size, dtype=torch.float32, device=device)  # (n,) |x| scratch
        self._mask = torch.empty(size, dtype=torch.bool, device=device)  # (n,) |x| >= t scratch
        self.refines = 0

    def select(self, x: torch.Tensor, k: int) -> torch.Tensor:
        n = x.numel()
        self.refines = 0
        if k <= 0:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        if k >= n:
            return torch.arange(n, device=self.device)
        score = torch.abs(x, out=self._abs)
        if n <= 8 * MIN_SAMPLE:
            return self._trim(score, torch.arange(n, device=self.device), k)
        return self._sampled(score, k)

    def _sampled(self, score: torch.Tensor, k: int) -> torch.Tensor:
        n = score.numel()
        p = k / n
        s = int(min(MAX_SAMPLE, n // 8, max(MIN_SAMPLE, SAMPLE_PER_DENSITY / p)))
        at = torch.randint(0, n, (s,), generator=self.gen, device=self.device)
        sample = score[at]  # (s,) float32
        std = 1.0 / np.sqrt(p * s)
        if self.tolerance > 0.0:
            margin = max(self.tolerance / 2, APPROX_MARGIN_STDS * std)
        else:
            margin = EXACT_MARGIN_STDS * std + 0.02
        want = k * (1.0 + margin)
        for _ in range(MAX_REFINES + 1):
            pos = int(np.clip(s - round(want / n * s), 0, s - 1))
            threshold = _kth_smallest(sample, pos)
            cand = torch.nonzero(torch.ge(score, threshold, out=self._mask)).flatten()  # sorted
            c = cand.numel()
            if c >= k:
                return cand if c <= k * (1.0 + self.tolerance) else self._trim(score, cand, k)
            self.refines += 1
            want *= (1.0 + margin) * k / max(c, 1)
        return self._trim(score, torch.arange(n, device=self.device), k)

    @staticmethod
    def _trim(score: torch.Tensor, cand: torch.Tensor, k: int) -> torch.Tensor:
        """Exactly the k largest among sorted candidates, ties to the lowest index."""
        vals = score[cand]  # (c,) float32
        kth = _kth_smallest(vals, vals.numel() - k)  # the k-th largest value
        keep = vals > kth
        ties = torch.nonzero(vals == kth).flatten()[: k - int(keep.sum())]
        keep[ties] = True
        return cand[keep]


def _kth_smallest(v: torch.Tensor, pos: int) -> torch.Tensor:
    """The value at 0-based position ``pos`` of sorted ``v`` (a 0-d tensor, on v's device)."""
    if v.device.type == "mps":  # kthvalue is not implemented there
        return torch.sort(v).values[pos]
    return torch.kthvalue(v, pos + 1).values


def runs_on_device(host: Compressor) -> bool:
    """Whether ``host`` has an on-device twin (see the module docstring)."""
    if isinstance(host, LossCompCompressor):
        return host.p["vote_weight"] == 0.0
    return isinstance(host, TopKCompressor)


class _Wrapper:
    """What the worker calls on any compressor; the host one keeps the schedule state."""

    def __init__(self, host: Compressor) -> None:
        self.host = host
        self.size = host.size
        self.host_bytes = 0  # bytes copied device -> host by the last compress()

    @property
    def ratio(self) -> float:
        return self.host.ratio

    @property
    def kept_fraction(self) -> float:
        return self.host.kept_fraction

    @property
    def wire(self) -> WireSpec:
        """The host compressor's wire encoding: what the worker sends."""
        return self.host.wire

    def encode(self, packet: SparseVector | np.ndarray) -> tuple[str, dict[str, Any], list[Any]]:
        """The host compressor's ``encode`` (the packet is on the host already)."""
        return self.host.encode(packet)

    def set_ratio(self, r: float) -> None:
        self.host.set_ratio(r)

    def set_epoch(self, e: float) -> None:
        self.host.set_epoch(e)

    def observe_loss(self, loss: float) -> None:
        self.host.observe_loss(loss)


class HostCompressor(_Wrapper):
    """Any compressor, run on the host: the whole gradient is copied there first."""

    on_device = False

    def compress(self, grad: torch.Tensor) -> SparseVector | np.ndarray:
        host = grad.detach().cpu()  # a view on the CPU; a copy from an accelerator
        self.host_bytes = 0 if grad.device.type == "cpu" else 4 * grad.numel()
        return self.host.compress(host.numpy())


class DeviceCompressor(_Wrapper):
    """Top-K / DGC / GDTopK / LossComp selection and residual on the device."""

    on_device = True

    def __init__(self, host: Compressor, device: torch.device) -> None:
        if not isinstance(host, TopKCompressor) or not runs_on_device(host):
            raise TypeError(f"{host.name} has no on-device twin; use HostCompressor")
        super().__init__(host)
        self.device = device
        self.top: TopKCompressor = host
        self.selector = TorchTopK(host.size, device, host.seed, tolerance=host.tolerance)
        self.residual: torch.Tensor | None = None  # (n,) float32 on device
        if host.error_feedback:
            self.residual = torch.zeros(host.size, dtype=torch.float32, device=device)
            host.residual = None  # the host copy would only go stale

    def compress(self, grad: torch.Tensor) -> SparseVector:
        """Select from ``residual + grad`` (n,) float32 on the device; return host arrays."""
        if grad.shape != (self.size,):
            raise ValueError(f"gradient has shape {tuple(grad.shape)}, expected ({self.size},)")
        acc = grad if self.residual is None else self.residual.add_(grad)
        k = kept_count(self.top.current_ratio(), self.size)
        idx = self.selector.select(acc, k)  # (k',) int64 sorted, on device
        values = acc[idx]  # (k',) float32, a copy
        wire = values  # what crosses to the host: float32, or float16 when that is all we send
        if self.top.value_dtype == "f16":
            wire = values.clamp(-FP16_MAX, FP16_MAX).half()
            values = wire.float()
        if self.residual is not None:
            self.residual.index_put_((idx,), -values, accumulate=True)
        out = SparseVector(idx.to(torch.int32).cpu().numpy().view(np.uint32),
                         wire.cpu().numpy().astype(np.float32, copy=False), self.size)
        self.host_bytes = (4 + wire.element_size()) * out.nnz
        self.top.kept_fraction = out.nnz / self.size if self.size else 0.0
        if isinstance(self.top, LossCompCompressor):
            self.top.remember_sent(out.indices.astype(np.int64))
        return out

    def residual_host(self) -> np.ndarray:
        """(n,) float32 copy of the residual (zeros without error feedback), for tests."""
        if self.residual is None:
            return np.zeros(self.size, np.float32)
        return self.residual.cpu().numpy().copy()


def device_compressor(host: Compressor, device: torch.device, *,
                      on_device: bool | None = None) -> Any:
    """The compressor a worker on ``device`` uses: on the device where it can (``on_device``
    None: off the CPU only; True: also on the CPU, as the tests do), else on the host."""
    wanted = device.type != "cpu" if on_device is None else on_device
    if wanted and runs_on_device(host):
        return DeviceCompressor(host, device)
    return HostCompressor(host)
