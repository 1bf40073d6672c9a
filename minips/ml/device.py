"""Where a worker computes: device choice, weights and gradients as flat tensors, mixed precision.

``pick_device(spec)`` turns ``auto | cpu | cuda | cuda:N | mps`` into a ``torch.device``
(``auto``: CUDA, then MPS, then the CPU) or raises ``ConfigError`` naming what is missing.
``Trainer(model, name, device, amp=False)`` moves the model there and binds every parameter and
its gradient to a view of one flat (n,) float32 tensor in ``models.layout`` order, so that:

- ``load(weights)`` is one host copy of the arriving vector into a pinned staging buffer
  (CUDA; reused every step) and one asynchronous DMA straight into the parameters; on the CPU the
  parameters are host memory already and ``load`` is a single copy;
- ``gradient(xb, yb)`` returns ``(loss, grads)`` with ``grads`` the flat (n,) float32 tensor on
  the device that backward accumulated into: no per-step concatenation. The tensor is reused by
  the next step, so a caller consumes it (compresses it) before computing again.

Invariants: the flat vectors equal ``models.get_flat`` / ``models.get_flat_grad`` of the same
model bit for bit (tests check it against a plain model). Batch-norm buffers stay outside the
vectors and move to the device with the model, as on the CPU. ``amp=True`` runs the forward
pass under autocast: bfloat16 where the device has it (a CPU with bfloat16 instructions, CUDA
from Ampere on, so Jetson Orin's GPU), else float16 with dynamic loss scaling (a step whose
scaled gradient overflows is sent as zeros and halves the scale). A CPU without bfloat16
(ARMv8.2 cores such as the Cortex-A76 and A78AE, x86 without AVX-512) keeps the forward pass
in float32 and says so in one line: bfloat16 would gain nothing there (generic kernels with
conversions around them; some torch builds print oneDNN's fallback warning with a C++ trace).
Weights, gradients and the optimizer's view stay float32.
"""

from __future__ import annotations

import contextlib
import math
import os
import resource
import sys
from typing import Any

import numpy as np
import torch
from torch import nn

from minips.errors import ConfigError
from minips.ml import models

__all__ = ["DEVICE_CHOICES", "pick_device", "describe", "amp_dtype", "cpu_has_bf16", "bind_flat",
           "Trainer", "rss_mb"]

DEVICE_CHOICES = "auto | cpu | cuda | cuda:N | mps"
SCALE_START = 2.0**16  # float16 loss scale to start from (torch.amp.GradScaler's default)
SCALE_GROW_EVERY = 2000  # good float16 steps before the scale doubles again


def pick_device(spec: str = "auto") -> torch.device:
    """The ``torch.device`` for ``spec`` (see DEVICE_CHOICES); ConfigError if it is not here."""
    spec = spec.strip().lower()
    if spec == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("mps") if _mps_available() else torch.device("cpu")
    try:
        dev = torch.device(spec)
    except RuntimeError:
        raise ConfigError(f"unknown device {spec!r}; expected {DEVICE_CHOICES}") from None
    if dev.type == "cpu":
        return dev
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ConfigError(f"--device {spec}: this torch build sees no CUDA device "
                              f"(torch {torch.__version__}, CUDA {torch.version.cuda})")
        index = 0 if dev.index is None else dev.index
        if index >= count:
            raise ConfigError(f"--device {spec}: only {count} CUDA device(s) here")
        return torch.device("cuda", index)
    if dev.type == "mps" and _mps_available():
        return dev
    raise ConfigError(f"--device {spec}: not available here; expected {DEVICE_CHOICES}")


def _mps_available() -> bool:
    mps = getattr(torch.backends, "mps", None)
    return bool(mps is not None and mps.is_available())


def describe(device: torch.device, amp: bool = False) -> dict[str, Any]:
    """What a worker prints and records about where it computes."""
    dtype = amp_dtype(device) if amp else None
    info: dict[str, Any] = {"device": str(device), "amp": bool(amp),
                            "amp_dtype": str(dtype or torch.float32).replace("torch.", "")
                            if amp else None, "torch": torch.__version__}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(name=props.name, memory_gb=round(props.total_memory / 2**30, 1),
                    cuda=torch.version.cuda)
    elif device.type == "cpu":
        info.update(name=os.uname().machine, threads=torch.get_num_threads())
    return info


def rss_mb() -> dict[str, float]:
    """This process's resident memory now and at its peak, MiB, from /proc/self/status (VmRSS,
    VmHWM). Not ru_maxrss: Linux carries a spawning parent's peak into a child's."""
    kib = {"VmRSS:": 0.0, "VmHWM:": 0.0}
    with contextlib.suppress(OSError, ValueError), open("/proc/self/status") as f:
        for line in f:
            if line.split(":")[0] + ":" in kib:
                kib[line.split()[0]] = float(line.split()[1])
    if not kib["VmHWM:"]:  # no /proc (not Linux): the peak as getrusage has it, in KiB on Linux
        kib["VmHWM:"] = float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    return {"rss_mb": round(kib["VmRSS:"] / 1024, 1), "max_rss_mb": round(kib["VmHWM:"] / 1024, 1)}


def amp_dtype(device: torch.device) -> torch.dtype | None:
    """The autocast dtype ``--amp`` uses on ``device``: bfloat16 where supported, else float16 on
    a GPU; None on a CPU without bfloat16 instructions (the forward pass stays float32)."""
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return torch.float16
    if device.type == "cpu" and not cpu_has_bf16():
        return None
    return torch.float16 if device.type == "mps" else torch.bfloat16


AT_HWCAP2, HWCAP2_BF16 = 26, 1 << 14  # getauxval(3) key; aarch64's bfloat16 bit (asm/hwcap.h)
X86_BF16 = ({"avx512bw", "avx512vl", "avx512dq"}, {"avx_ne_convert"}, {"amx_bf16"})


def cpu_has_bf16() -> bool:
    """Whether this CPU runs bfloat16 in hardware, as oneDNN decides it (torch's own check where
    the build has it; else the kernel's aarch64 HWCAP2 bit or x86's /proc/cpuinfo flags).
    Under qemu-user the emulated CPU's features count (QEMU_CPU=cortex-a76: none)."""
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    with contextlib.suppress(Exception):  # an op a build may lack: the fallbacks below
        if check is not None:
            return bool(check())
    machine = os.uname().machine
    if machine in ("aarch64", "arm64"):
        with contextlib.suppress(Exception):  # not glibc: the cpuinfo flags below
            import ctypes
            return bool(ctypes.CDLL(None).getauxval(AT_HWCAP2) & HWCAP2_BF16)
    flags: set[str] = set()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.lower().startswith(("flags", "features")):
                flags.update(line.split(":", 1)[1].split())
    if machine in ("aarch64", "arm64"):
        return "bf16" in flags
    return any(need <= flags for need in X86_BF16)


def bind_flat(model: nn.Module, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Move ``model`` to ``device`` and make each parameter and its gradient a view of one flat
    tensor; returns (weights, grads), (n,) float32 each on ``device``, grads zeroed."""
    model.to(device)
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    weights = torch.empty(n, dtype=torch.float32, device=device)
    grads = torch.zeros(n, dtype=torch.float32, device=device)
    offset = 0
    with torch.no_grad():
        for p in params:
            view = weights[offset:offset + p.numel()].view_as(p)
            view.copy_(p.detach())
            p.data = view
            p.grad = grads[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
    return weights, grads


class Trainer:
    """A model bound to flat weight / gradient tensors on one device; see the module docstring."""

    def __init__(self, model: nn.Module, name: str, device: torch.device, *,
                 amp: bool = False) -> None:
        self.model, self.name, self.device, self.amp = model, name, device, amp
        self.weights, self.grads = bind_flat(model, device)  # (n,) float32 each, on device
        self._params = list(model.parameters())
        self._grad_ptrs = [p.grad.data_ptr() for p in self._params if p.grad is not None]
        self.staging: torch.Tensor | None = None  # (n,) float32 pinned host buffer (CUDA only)
        if device.type == "cuda":
            self.staging = torch.empty(self.weights.numel(), dtype=torch.float32,
                                       pin_memory=True)
        self.dtype = amp_dtype(device) if amp else None
        if amp and self.dtype is None:  # one line of ours, not a C++ warning of oneDNN's
            print(f"minips: --amp: this CPU ({os.uname().machine}) has no bfloat16 instructions;"
                  " the forward pass stays float32", file=sys.stderr, flush=True)
        self.scale = SCALE_START if self.dtype == torch.float16 else 1.0
        self._good_steps = 0

    @property
    def size(self) -> int:
        return int(self.weights.numel())

    def load(self, weights: np.ndarray) -> None:
        """Copy a (n,) float32 host vector into the parameters (see the module docstring)."""
        if weights.shape != (self.size,):
            raise ConfigError(f"flat vector has shape {weights.shape}, model needs "
                              f"({self.size},)")
        if self.device.type == "cpu":  # the parameters are host memory: one copy
            np.copyto(self.weights.numpy(), weights, casting="same_kind")
        elif self.staging is None:  # MPS: unified memory, one copy either way
            self.weights.copy_(torch.from_numpy(np.array(weights, np.float32)))
        else:
            # The previous step's DMA out of the staging buffer finished: its gradient was read.
            np.copyto(self.staging.numpy(), weights, casting="same_kind")
            self.weights.copy_(self.staging, non_blocking=True)

    def host_weights(self) -> np.ndarray:
        """The weights as a new (n,) float32 host vector."""
        return self.weights.detach().cpu().numpy().copy()

    def gradient(self, xb: np.ndarray, yb: np.ndarray) -> tuple[float, torch.Tensor]:
        """(loss, grads): the mean batch loss and its flat (n,) float32 gradient on the device."""
        self.grads.zero_()
        x = torch.from_numpy(xb).to(self.device, non_blocking=True)
        y = torch.from_numpy(yb).to(self.device, non_blocking=True)
        if self.dtype is None:
            loss = models.batch_loss(self.name, self.model, x, y)
            loss.backward()
        else:
            with torch.autocast(self.device.type, dtype=self.dtype):
                loss = models.batch_loss(self.name, self.model, x, y)
            (loss.float() * self.scale).backward()
        self._rebind()
        if self.scale != 1.0:
            self._unscale()
        return float(loss.detach()), self.grads

    def _rebind(self) -> None:
        """Autograd adds into an existing ``.grad`` in place; should anything have replaced
        one (a hook, a layer that sets its own), copy it back into the flat buffer."""
        offset = 0
        for p, ptr in zip(self._params, self._grad_ptrs, strict=True):
            view = self.grads[offset:offset + p.numel()]
            if p.grad is None or p.grad.data_ptr() != ptr:
                if p.grad is not None:
                    view.copy_(p.grad.detach().reshape(-1))
                p.grad = view.view_as(p)
            offset += p.numel()

    def _unscale(self) -> None:
        """float16 loss scaling: divide it out; on overflow send zeros and halve the scale."""
        self.grads.mul_(1.0 / self.scale)
        if not math.isfinite(float(self.grads.sum())):
            self.grads.zero_()
            self.scale /= 2.0
            self._good_steps = 0
            return
        self._good_steps += 1
        if self._good_steps % SCALE_GROW_EVERY == 0:
            self.scale *= 2.0
