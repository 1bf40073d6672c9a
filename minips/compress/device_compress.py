"""Compression on the worker's device: selection and error feedback where the gradient is.

``device_compressor(compressor, device)`` returns the compressor a worker on ``device`` uses:
the one ``make_compressor`` built, with its ``arrays`` replaced by ``DeviceArrays`` when it is
``device_ready`` (``topk``, ``dgc``, ``gdtopk``, and ``losscomp`` with its default
``vote_weight=0``, where votes do not steer the selection). Its ``compress`` is the same code
then (``base.SparseCompressor``); only the arrays differ: the error-feedback residual (n,)
float32 stays on the device, selection runs there with ``TorchTopK``, and only the k' indices
(int32) and values (float32; float16 with ``value_dtype="f16"``, which sends no more) cross to
the host: ``8 k'`` (or ``6 k'``) bytes per step instead of ``4 n``.

``TorchTopK`` is ``selection.TopKSelector`` with each array step in torch (gather, k-th value,
``>=`` mask, nonzero); the algorithm, and the numpy generator that draws the sample positions,
are the numpy selector's own. So on the same vector and seed it returns the same indices as the
numpy one, exact and sampled (DGC) alike, and a compressor on the device sends the same packets
as on the host, bit for bit.

Every other compressor (``none``, ``fp16``, ``randomk``, ``losscomp`` with steering votes, whose
(n,) vote arrays live on the host) keeps ``base.HostArrays``: the gradient is copied to the host
(on the CPU that copy is a view: no bytes move). Either way the compressor's invariant holds:
everything sent plus the residual equals the sum of the gradients (float32 rounding aside).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from minips.compress.base import FP16_MAX, Compressor
from minips.compress.selection import TopKSelector
from minips.sparse import SparseVector

__all__ = ["TorchTopK", "DeviceArrays", "device_compressor"]


class TorchTopK(TopKSelector):
    """``TopKSelector`` on (n,) float32 torch tensors: (k',) int64 sorted indices on the device."""

    def __init__(self, size: int, device: torch.device, seed: int = 0, *,
                 tolerance: float = 0.0) -> None:
        self.device = device  # before the base class asks for its scratch
        super().__init__(size, seed, tolerance=tolerance)

    def _scratch(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(n,) bool mask and (n,) float32 |x|, on the device."""
        return (torch.empty(size, dtype=torch.bool, device=self.device),
                torch.empty(size, dtype=torch.float32, device=self.device))

    def _arange(self, n: int) -> torch.Tensor:
        return torch.arange(n, device=self.device)

    def _magnitude(self, score: torch.Tensor) -> torch.Tensor:
        return torch.abs(score, out=self._mag)  # once: the steps below read |x|

    def _positions(self, at: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(at).to(self.device)

    def _abs_at(self, score: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
        return score[at]  # ``score`` is |x| already

    def _kth(self, v: torch.Tensor, pos: int) -> torch.Tensor:
        if v.device.type == "mps":  # kthvalue is not implemented there
            return torch.sort(v).values[pos]
        return torch.kthvalue(v, pos + 1).values

    def _nonzero(self, mask: torch.Tensor) -> torch.Tensor:
        return torch.nonzero(mask).flatten()

    def _above(self, score: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
        return self._nonzero(torch.ge(score, threshold, out=self._mask))  # (c,) sorted


class DeviceArrays:
    """``base.Arrays`` in torch on ``device``: the gradient is used where it is."""

    on_device = True

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def gradient(self, grad: Any) -> tuple[torch.Tensor, int]:
        return torch.as_tensor(grad, dtype=torch.float32, device=self.device), 0

    def zeros(self, n: int) -> torch.Tensor:
        return torch.zeros(n, dtype=torch.float32, device=self.device)

    def selector(self, size: int, seed: int, tolerance: float) -> TorchTopK:
        return TorchTopK(size, self.device, seed, tolerance=tolerance)

    def half(self, values: torch.Tensor) -> torch.Tensor:
        return values.clamp(-FP16_MAX, FP16_MAX).half().float()

    def packet(self, idx: torch.Tensor, values: torch.Tensor, size: int,
               dtype: str) -> tuple[SparseVector, int]:
        wire = values.half() if dtype == "f16" else values  # exact: rounded by ``half`` already
        out = SparseVector(idx.to(torch.int32).cpu().numpy().view(np.uint32),
                           wire.cpu().numpy().astype(np.float32, copy=False), size)
        return out, (4 + wire.element_size()) * out.nnz


def device_compressor(compressor: Compressor, device: torch.device, *,
                      on_device: bool | None = None) -> Compressor:
    """``compressor``, placed on ``device`` where it can be (``on_device`` None: off the CPU
    only; True: also on the CPU, as the tests do); otherwise it stays on the host."""
    wanted = device.type != "cpu" if on_device is None else on_device
    if wanted and compressor.device_ready:
        compressor.place(DeviceArrays(device))
    return compressor
