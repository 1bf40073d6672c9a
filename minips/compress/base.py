"""What every compressor is: error feedback and the wire encoding it declares.

A compressor is built once per worker (``compress.make_compressor``) and called every step:
``compress(grad (n,) float32) -> SparseVector | np.ndarray``. ``grad`` may be a numpy array or a
torch tensor (anything with ``.detach().cpu().numpy()``; this module never imports torch), so a
user can call a compressor from their own training loop. With error feedback (the default) it
keeps a residual r (n,) float32: ``acc = r + grad``; it sends part of ``acc`` and keeps the rest,
``r = acc - sent``. Hence the invariant the tests check: the sum over steps of what was sent plus
the final residual equals the sum of the gradients (up to float32 rounding).

Each compressor declares its wire encoding, ``wire = WireSpec(sparse, dtype)``: dense or sparse,
float32 or float16 values. ``encode(packet)`` turns what ``compress`` returned into the PUSH's
``(encoding, codec, buffers)`` with that encoding (the worker sends exactly this; the receiver
decodes it with ``sparse.decode_vector``). A sparse compressor with ``value_dtype="f16"`` rounds
its values to float16 before it sends them and keeps the rounding error in the residual, so
sending them as 2-byte floats loses nothing.

A compressor may also bring a server-side part: ``ratio_policy(target, ...)`` returns the object
the global server asks for per-group ratios (GDTopK, ``compress.ratios.RatioPolicy``), or None.

A new compressor is one file that subclasses ``Compressor`` (dense) or ``SparseCompressor``
(implement ``_select``) and one line in ``compress/registry.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from minips.errors import ConfigError, LocalProtocolError
from minips.sparse import SparseVector, encode_vector, kept_count
from minips.wire.messages import VALUE_TYPES

if TYPE_CHECKING:
    from minips.compress.ratios import RatioPolicy

__all__ = ["FP16_MAX", "WireSpec", "Compressor", "SparseCompressor", "as_float32"]

FP16_MAX = 65504.0  # largest finite float16


@dataclass(frozen=True)
class WireSpec:
    """The encoding a compressor's packets travel in: sparse (indices + values) or dense, and
    the values' type on the wire (``f32``: 4 bytes, ``f16``: 2 bytes)."""

    sparse: bool
    dtype: str = "f32"

    def __post_init__(self) -> None:
        if self.dtype not in VALUE_TYPES:  # the wire's value types
            raise ConfigError(f"value_dtype must be 'f32' or 'f16', got {self.dtype!r}")

    @property
    def encoding(self) -> str:
        """The PUSH encoding name: ``sparse-v1``, ``dense-f32`` or ``dense-f16``."""
        return "sparse-v1" if self.sparse else f"dense-{self.dtype}"


def as_float32(grad: Any) -> np.ndarray:
    """A numpy float32 array of ``grad``: a numpy array, a torch tensor on any device (copied to
    the host; on the CPU a view) or any array-like."""
    if hasattr(grad, "detach"):
        grad = grad.detach().cpu().numpy()
    return np.asarray(grad, dtype=np.float32)


class Compressor:
    """Base class: error-feedback memory, the common knobs and the wire encoding; subclasses
    choose what to send (``_compress``)."""

    name = "base"
    wire = WireSpec(sparse=False)

    def __init__(self, size: int, *, ratio: float = 1.0, seed: int = 0,
                 error_feedback: bool = True) -> None:
        self.size = size
        self.seed = seed
        self.error_feedback = error_feedback
        self.residual = np.zeros(size, np.float32) if error_feedback else None  # (n,) float32
        self.ratio = 1.0
        self.set_ratio(ratio)
        self.epoch = 0.0
        self.kept_fraction = 1.0  # fraction of coordinates sent by the last compress()

    @classmethod
    def ratio_policy(cls, target: float, *, direction: str, alpha: float) -> RatioPolicy | None:
        """The global server's per-group ratio policy for this compressor (None: no such part)."""
        return None

    def set_ratio(self, r: float) -> None:
        """Target kept fraction (GDTopK: from the server; a dense compressor ignores it)."""
        if not 0.0 < r <= 1.0:
            raise ConfigError(f"ratio must be in (0, 1], got {r}")
        self.ratio = float(r)

    def set_epoch(self, e: float) -> None:
        """Training progress in epochs (fractional), for warm-up and vote decay."""
        self.epoch = float(e)

    def observe_loss(self, loss: float) -> None:
        """The training loss of the step about to be compressed (LossComp uses it)."""

    def compress(self, grad: Any) -> SparseVector | np.ndarray:
        """Compress one (n,) float32 gradient (numpy or torch); error feedback keeps what is
        not sent."""
        if not isinstance(grad, np.ndarray):
            grad = as_float32(grad)
        if grad.shape != (self.size,):
            raise LocalProtocolError("gradient has the wrong shape", expected=self.size,
                                     got=grad.shape)
        if self.residual is None:
            return self._compress(np.asarray(grad, dtype=np.float32))
        self.residual += grad
        return self._compress(self.residual)

    def encode(self, packet: SparseVector | np.ndarray) -> tuple[str, dict[str, Any], list[Any]]:
        """``(encoding, codec, buffers)`` of a packet ``compress`` returned, in ``self.wire``."""
        return encode_vector(packet, value_dtype=self.wire.dtype)

    def _compress(self, acc: np.ndarray) -> SparseVector | np.ndarray:
        raise NotImplementedError

    def _keep_back(self, sent: np.ndarray, where: Any = slice(None)) -> None:
        """Remove what was sent from the residual (no-op without error feedback)."""
        if self.residual is not None:
            self.residual[where] -= sent


class SparseCompressor(Compressor):
    """Shared part of the sparse compressors: pick indices, send ``acc`` there, keep the rest;
    ``value_dtype`` (``f32`` / ``f16``) is the values' type on the wire."""

    wire = WireSpec(sparse=True)  # each instance sets its value type

    def __init__(self, size: int, *, ratio: float = 0.01, seed: int = 0,
                 error_feedback: bool = True, value_dtype: str = "f32") -> None:
        super().__init__(size, ratio=ratio, seed=seed, error_feedback=error_feedback)
        self.wire = WireSpec(sparse=True, dtype=value_dtype)

    @property
    def value_dtype(self) -> str:
        """``f32`` or ``f16``: the values' type on the wire (``wire.dtype``)."""
        return self.wire.dtype

    def current_ratio(self) -> float:
        """The kept fraction the next compress() will use."""
        return self.ratio

    def _compress(self, acc: np.ndarray) -> SparseVector:
        k = kept_count(self.current_ratio(), self.size)
        idx = self._select(acc, k)  # (k',) int64, strictly increasing
        values = acc[idx]  # (k',) float32, a copy
        if self.value_dtype == "f16":
            values = np.clip(values, -FP16_MAX, FP16_MAX).astype(np.float16).astype(np.float32)
        self._keep_back(values, idx)
        self.kept_fraction = idx.size / self.size if self.size else 0.0
        return SparseVector(idx.astype(np.uint32), values, self.size)

    def _select(self, acc: np.ndarray, k: int) -> np.ndarray:
        raise NotImplementedError
