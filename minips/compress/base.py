"""What every compressor is: error feedback and the wire encoding it declares.

A compressor is built once per worker (``registry.make_compressor``) and called every step:
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

Where the arrays live is one seam, ``arrays``: a compressor asks it for the gradient in its
array type, a zero residual, the top-k selector, float16 rounding and the packet it returns, and
does the rest of the error-feedback arithmetic with operators numpy and torch share
(``r += g``, ``acc[idx]``, ``r[idx] -= v``). ``HostArrays`` (numpy, the default) is here;
``compress.device_compress.DeviceArrays`` is its torch twin, which ``place`` installs for the
compressors that say ``device_ready``.

A compressor may also bring a server-side part: ``ratio_policy(target, ...)`` returns the object
the global server asks for per-group ratios (GDTopK, ``compress.ratios.RatioPolicy``), or None.

A new compressor is one file that subclasses ``Compressor`` (dense) or ``SparseCompressor``
(implement ``_select``) and one line in ``compress/registry.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from minips.compress.selection import TopKSelector, kept_count
from minips.errors import ConfigError, LocalProtocolError
from minips.sparse import SparseVector, encode_vector
from minips.wire.fields import VALUE_TYPES, Payload

if TYPE_CHECKING:
    from minips.compress.ratios import RatioPolicy

__all__ = ["FP16_MAX", "WireSpec", "as_float32", "Arrays", "HostArrays", "Compressor",
           "SparseCompressor"]

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


class Arrays(Protocol):
    """Where a compressor keeps and computes its (n,) arrays (the module docstring's seam)."""

    on_device: bool  # True: the gradient stays where it is, only the packet crosses

    def gradient(self, grad: Any) -> tuple[Any, int]:
        """``grad`` as this side's (n,) float32 array, and the bytes copied to get it."""
        ...

    def zeros(self, n: int) -> Any:
        """A (n,) float32 residual of zeros."""
        ...

    def selector(self, size: int, seed: int, tolerance: float) -> TopKSelector:
        """The top-k by magnitude (``selection.TopKSelector`` or its twin) for these arrays."""
        ...

    def half(self, values: Any) -> Any:
        """``values`` (k,) float32 rounded through float16, clipped to +-FP16_MAX."""
        ...

    def packet(self, idx: Any, values: Any, size: int, dtype: str) -> tuple[SparseVector, int]:
        """The host ``SparseVector`` of ``idx`` (k,) int64 sorted and ``values`` (k,) float32
        (``dtype`` ``f16``: already rounded), and the bytes copied to the host to make it."""
        ...


class HostArrays:
    """``Arrays`` in numpy on the host: a torch gradient is copied there (a view on the CPU)."""

    on_device = False

    def gradient(self, grad: Any) -> tuple[np.ndarray, int]:
        out = as_float32(grad)
        device = getattr(getattr(grad, "device", None), "type", "cpu")  # numpy 2 says "cpu"
        return out, 0 if device == "cpu" else out.nbytes

    def zeros(self, n: int) -> np.ndarray:
        return np.zeros(n, np.float32)

    def selector(self, size: int, seed: int, tolerance: float) -> TopKSelector:
        return TopKSelector(size, seed, tolerance=tolerance)

    def half(self, values: np.ndarray) -> np.ndarray:
        return np.clip(values, -FP16_MAX, FP16_MAX).astype(np.float16).astype(np.float32)

    def packet(self, idx: np.ndarray, values: np.ndarray, size: int,
               dtype: str) -> tuple[SparseVector, int]:
        return SparseVector(idx.astype(np.uint32), values, size), 0


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
        self.arrays: Arrays = HostArrays()  # where the residual lives and selection runs
        self.residual = self.arrays.zeros(size) if error_feedback else None  # (n,) float32
        self.ratio = 1.0
        self.set_ratio(ratio)
        self.epoch = 0.0
        self.progress = 0.0  # fraction of the run's samples budget done (from the server)
        self.kept_fraction = 1.0  # fraction of coordinates sent by the last compress()
        self.host_bytes = 0  # bytes the last compress() copied from a device to the host

    @property
    def device_ready(self) -> bool:
        """Whether every array step of ``compress`` goes through ``arrays`` (then ``place``
        may move them to a device); a compressor that computes in numpy itself says False."""
        return False

    @property
    def on_device(self) -> bool:
        """Whether the residual and the selection are on a device (``place``)."""
        return self.arrays.on_device

    def place(self, arrays: Arrays) -> None:
        """Keep the residual and run the selection with ``arrays`` from now on: called once,
        before the first ``compress`` (the residual starts at zeros there)."""
        if self.residual is not None and self.residual.any():
            raise RuntimeError("place() moves a compressor before its first compress()")
        self.arrays = arrays
        if self.residual is not None:
            self.residual = arrays.zeros(self.size)

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

    def set_progress(self, p: float) -> None:
        """The fraction (0..1) of the run's samples budget done, as the worker's group server
        said (WEIGHTS.progress), for a warm-up over a fraction of the run."""
        self.progress = float(p)

    def observe_loss(self, loss: float) -> None:
        """The training loss of the step about to be compressed (LossComp uses it)."""

    def compress(self, grad: Any) -> SparseVector | np.ndarray:
        """Compress one (n,) float32 gradient (numpy or torch); error feedback keeps what is
        not sent."""
        grad, self.host_bytes = self.arrays.gradient(grad)  # (n,) float32 where we compute
        if tuple(grad.shape) != (self.size,):
            raise LocalProtocolError("gradient has the wrong shape", expected=self.size,
                                     got=tuple(grad.shape))
        if self.residual is None:
            return self._compress(grad)
        self.residual += grad
        return self._compress(self.residual)

    def encode(self, packet: SparseVector | np.ndarray) -> Payload:
        """The payload ``(encoding, codec, buffers)`` of a packet ``compress`` returned, in
        ``self.wire``."""
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
        idx = self._select(acc, k)  # (k',) int64, strictly increasing, beside acc
        values = acc[idx]  # (k',) float32, a copy
        if self.value_dtype == "f16":
            values = self.arrays.half(values)
        self._keep_back(values, idx)
        packet, copied = self.arrays.packet(idx, values, self.size, self.value_dtype)
        self.host_bytes += copied
        self.kept_fraction = packet.nnz / self.size if self.size else 0.0
        self._sent(packet)
        return packet

    def _select(self, acc: np.ndarray, k: int) -> np.ndarray:
        raise NotImplementedError

    def _sent(self, packet: SparseVector) -> None:
        """Told what this step sends (host arrays), once it is made; LossComp books it."""
