"""The paper's models, built by name, and the flat-parameter view servers and workers share.

Models (parameter counts with the default options; ``param_count`` and the tests check them):

========  ==========  ===============================================================
name      params      architecture (default data set)
========  ==========  ===============================================================
lenet5    61,706      1x32x32 -> conv 6@5x5 -> pool -> conv 16@5x5 -> pool ->
                      FC 400-120-84-10, ReLU (fashion-mnist)
resnet18  11,173,962  CIFAR ResNet-18: 3x3 stem, 4 stages of 2 basic blocks (cifar10)
vgg19     20,040,522  VGG-19 with batch norm, 512 -> 10 linear head (cifar10)
resnet9   6,573,120   "cifar10-fast" ResNet-9: prep, 3 layers, 2 residuals, x1/8 (cifar10)
seq2seq   109,499     bidirectional GRU encoder, Bahdanau attention, GRU decoder
                      (translation, the synthetic task in data.py)
========  ==========  ===============================================================

The modules themselves are in ``model_nets.py`` (re-exported here).

Flat layout: ``layout(model)`` lists the *parameters* (``model.named_parameters()`` order, which
the code fixes) as (name, shape, offset, size); ``get_flat`` / ``set_flat`` / ``get_flat_grad``
convert to and from one float32 vector in that order, bit-exactly. Servers only ever see that
vector, so they need numpy, not torch.

Batch-norm buffers (running mean / variance) are NOT in the vector: each worker keeps its own,
since training-mode BN uses batch statistics and never reads them. ``evaluate`` therefore
re-estimates them for the weights it tests: from a few batches of ``train_for_bn`` when given,
otherwise each test batch is normalised with its own statistics (batch 1000, close to the
population's).
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from minips.errors import ConfigError
from minips.ml import data
from minips.ml.model_nets import NETS, VGG19, LeNet5, ResNet9, ResNet18, Seq2Seq
from minips.ml.model_table import DEFAULT_DATASET, MODEL_NAMES, PARAM_COUNTS

__all__ = [
    "MODEL_NAMES",
    "PARAM_COUNTS",
    "DEFAULT_DATASET",
    "LeNet5",
    "ResNet18",
    "VGG19",
    "ResNet9",
    "Seq2Seq",
    "build_model",
    "param_count",
    "layout",
    "layout_digest",
    "get_flat",
    "set_flat",
    "get_flat_grad",
    "batch_loss",
    "evaluate",
    "recalibrate_bn",
]


def build_model(name: str, seed: int, **opts: Any) -> nn.Module:
    """A freshly initialised model; same (name, seed, opts, torch version) -> same weights.

    The global torch RNG is left untouched (initialisation runs in a forked RNG).
    """
    if name not in NETS:
        raise ConfigError(f"unknown model {name!r}; known: {', '.join(MODEL_NAMES)}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = NETS[name](**opts)
    return model.float()


def param_count(name: str, **opts: Any) -> int:
    """Number of trainable parameters = length of the flat vector."""
    if not opts and name in PARAM_COUNTS:
        return PARAM_COUNTS[name]
    return sum(p.numel() for p in build_model(name, 0, **opts).parameters())


# ---------------------------------------------------------------- flat parameters


def layout(model: nn.Module) -> list[tuple[str, tuple[int, ...], int, int]]:
    """(name, shape, offset, size) of each parameter in flat-vector order."""
    rows, offset = [], 0
    for pname, p in model.named_parameters():
        rows.append((pname, tuple(p.shape), offset, p.numel()))
        offset += p.numel()
    return rows


def layout_digest(model: nn.Module) -> str:
    """SHA-256 hex of the layout: equal digests <=> servers and workers agree on the vector."""
    text = ";".join(f"{n}:{'x'.join(map(str, s))}" for n, s, _, _ in layout(model))
    return hashlib.sha256(text.encode()).hexdigest()


def get_flat(model: nn.Module) -> np.ndarray:
    """All parameters as one new (n,) float32 vector, in ``layout`` order."""
    with torch.no_grad():
        flat = torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])
    return flat.numpy()


def set_flat(model: nn.Module, vec: np.ndarray) -> None:
    """Copy a (n,) float32 vector into the parameters (the inverse of ``get_flat``)."""
    n = sum(p.numel() for p in model.parameters())
    if vec.shape != (n,):
        raise ConfigError(f"flat vector has shape {vec.shape}, model needs ({n},)")
    vec = np.ascontiguousarray(vec, dtype=np.float32)
    if not vec.flags.writeable:  # e.g. a view of a received frame; torch wants writable memory
        vec = vec.copy()
    src = torch.from_numpy(vec)
    offset = 0
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(src[offset:offset + p.numel()].view_as(p))
            offset += p.numel()


def get_flat_grad(model: nn.Module) -> np.ndarray:
    """All gradients as one new (n,) float32 vector; zeros where a parameter has no grad."""
    parts = [torch.zeros(p.numel()) if p.grad is None else p.grad.detach().reshape(-1).float()
             for p in model.parameters()]
    return torch.cat(parts).numpy()


# ---------------------------------------------------------------- loss and evaluation


def _outputs(name: str, model: nn.Module, x: Any, y: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits (M, classes), targets (M,)) for a batch; seq2seq is flattened over tokens."""
    x, y = torch.as_tensor(x), torch.as_tensor(y)
    if name == "seq2seq":
        logits = model(x, y[:, :-1])  # teacher forcing: predict token t+1 from tokens <= t
        return logits.reshape(-1, logits.shape[-1]), y[:, 1:].reshape(-1)
    return model(x), y


def _ignore_index(name: str) -> int:
    """Target value the loss skips: PAD tokens for seq2seq, none (torch's -100) otherwise."""
    return data.PAD if name == "seq2seq" else -100


def batch_loss(name: str, model: nn.Module, x: Any, y: Any) -> torch.Tensor:
    """Mean loss of a batch (numpy or torch): cross entropy; seq2seq: per non-PAD token."""
    logits, target = _outputs(name, model, x, y)
    return F.cross_entropy(logits, target, ignore_index=_ignore_index(name))


def _has_bn(model: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


def recalibrate_bn(model: nn.Module, ds: data.Dataset, *, batches: int = 10,
                   batch_size: int = 200, seed: int = 0) -> None:
    """Re-estimate BN running statistics from ``batches`` fixed random batches of ``ds``."""
    bns = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    idx = np.random.default_rng(seed).permutation(len(ds))[:batches * batch_size]
    for bn in bns:
        bn.reset_running_stats()
        bn.momentum = None  # cumulative average over the calibration batches
    model.train()
    with torch.no_grad():
        for start in range(0, len(idx), batch_size):
            model(torch.from_numpy(ds.x[idx[start:start + batch_size]]))
    for bn in bns:
        bn.momentum = 0.1


_EVAL_MODELS: dict[str, nn.Module] = {}  # one model per name, reused across evaluate() calls


def evaluate(name: str, flat: np.ndarray, dataset: data.Dataset, *, batch_size: int = 1000,
             train_for_bn: data.Dataset | None = None) -> tuple[float, float]:
    """(accuracy, mean loss) of weights ``flat`` on ``dataset`` (seq2seq: per target token).

    BN models: statistics from ``train_for_bn`` (``recalibrate_bn``) when given, else from
    each test batch (see the module docstring).
    """
    if name not in _EVAL_MODELS:
        _EVAL_MODELS[name] = build_model(name, 0)
    model = _EVAL_MODELS[name]
    set_flat(model, flat)
    if _has_bn(model) and train_for_bn is not None:
        recalibrate_bn(model, train_for_bn)
    model.train(_has_bn(model) and train_for_bn is None)  # eval mode unless batch-stat BN
    loss_sum, correct, count = 0.0, 0, 0
    with torch.no_grad():
        for start in range(0, len(dataset), batch_size):
            sl = slice(start, start + batch_size)
            logits, target = _outputs(name, model, dataset.x[sl], dataset.y[sl])
            keep = target != _ignore_index(name)  # (M,) bool: real tokens / every sample
            loss_sum += float(F.cross_entropy(logits[keep], target[keep], reduction="sum"))
            correct += int((logits[keep].argmax(-1) == target[keep]).sum())
            count += int(keep.sum())
    return correct / max(count, 1), loss_sum / max(count, 1)

