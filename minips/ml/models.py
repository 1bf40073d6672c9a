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

The file holds, in order: the networks as torch modules and ``NETS`` (name -> class); building
them by name (``build_model``, ``param_count``); the flat parameters; loss and evaluation.

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
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from minips.core.config import MODEL_NAMES, PARAM_COUNTS
from minips.errors import ConfigError
from minips.ml import data
from minips.ml.data import PAD, VOCAB

__all__ = [
    "LeNet5",
    "ResNet18",
    "VGG19",
    "ResNet9",
    "Seq2Seq",
    "NETS",
    "net_name",
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


# -- the networks of the paper, as torch modules ---------------------------------------------------

class LeNet5(nn.Module):
    """LeNet-5 on 1x32x32 input (28x28 sets are padded by ``data.load_dataset``)."""

    def __init__(self, num_classes: int = 10, in_channels: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 6, 5)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 1, 32, 32) -> (B, classes)
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)  # (B, 6, 14, 14)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)  # (B, 16, 5, 5)
        x = F.relu(self.fc1(x.flatten(1)))
        return self.fc3(F.relu(self.fc2(x)))


def _conv_bn(c_in: int, c_out: int, stride: int = 1, bias: bool = False) -> list[nn.Module]:
    return [nn.Conv2d(c_in, c_out, 3, stride, 1, bias=bias), nn.BatchNorm2d(c_out)]


class _BasicBlock(nn.Module):
    """Two 3x3 conv-BN layers plus the identity (or a 1x1 conv-BN when the shape changes)."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.body = nn.Sequential(*_conv_bn(c_in, c_out, stride), nn.ReLU(),
                                  *_conv_bn(c_out, c_out))
        self.shortcut = nn.Sequential()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False),
                                          nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.body(x) + self.shortcut(x))


def _rgb(x: torch.Tensor) -> torch.Tensor:
    """(B, 1, H, W) grey images as (B, 3, H, W), one channel three times (a view), so the
    CIFAR models train on Fashion-MNIST (padded to 32x32 by ``data.load_dataset``) unchanged;
    colour input passes as it is."""
    return x.expand(-1, 3, -1, -1) if x.shape[1] == 1 else x


class ResNet18(nn.Module):
    """ResNet-18, CIFAR variant: 3x3 stem without max-pool, widths 64-128-256-512."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(*_conv_bn(3, 64), nn.ReLU())
        blocks, c_in = [], 64
        for c_out, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            blocks += [_BasicBlock(c_in, c_out, stride), _BasicBlock(c_out, c_out, 1)]
            c_in = c_out
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(512, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 1|3, 32, 32) -> (B, classes)
        x = self.blocks(self.stem(_rgb(x)))  # (B, 512, 4, 4)
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


_VGG19_CFG = (64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M",
              512, 512, 512, 512, "M", 512, 512, 512, 512, "M")


class VGG19(nn.Module):
    """VGG-19 with batch norm after every conv, CIFAR head (512 -> classes)."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        c_in = 3
        for v in _VGG19_CFG:
            if v == "M":
                layers.append(nn.MaxPool2d(2))
            else:
                layers += [*_conv_bn(c_in, int(v), bias=True), nn.ReLU()]
                c_in = int(v)
        self.features = nn.Sequential(*layers)
        self.fc = nn.Linear(512, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 1|3, 32, 32) -> (B, classes)
        return self.fc(self.features(_rgb(x)).flatten(1))  # features: (B, 512, 1, 1)


class _Residual(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.body = nn.Sequential(*_conv_bn(channels, channels), nn.ReLU(),
                                  *_conv_bn(channels, channels), nn.ReLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x)


class ResNet9(nn.Module):
    """The ResNet-9 of "cifar10-fast" (D. Page): conv-BN-ReLU blocks, logits scaled by 1/8."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()

        def block(c_in: int, c_out: int, pool: bool) -> list[nn.Module]:
            return [*_conv_bn(c_in, c_out), nn.ReLU()] + ([nn.MaxPool2d(2)] if pool else [])

        self.net = nn.Sequential(
            *block(3, 64, False), *block(64, 128, True), _Residual(128),
            *block(128, 256, True), *block(256, 512, True), _Residual(512),
            nn.AdaptiveMaxPool2d(1), nn.Flatten())
        self.fc = nn.Linear(512, num_classes, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 1|3, 32, 32) -> (B, classes)
        return self.fc(self.net(_rgb(x))) * 0.125  # the reference net's fixed output scale


class Seq2Seq(nn.Module):
    """GRU encoder-decoder with Bahdanau (additive) attention, trained with teacher forcing.

    ``forward(src (B, S) int64, tgt_in (B, T) int64) -> logits (B, T, tgt_vocab)``; ``pad``
    source positions are masked out of the attention. Corpus-agnostic: only vocab sizes.
    """

    def __init__(self, src_vocab: int = VOCAB, tgt_vocab: int = VOCAB,
                 emb: int = 32, hidden: int = 64, pad: int = PAD) -> None:
        super().__init__()
        self.pad = pad
        self.src_emb = nn.Embedding(src_vocab, emb, padding_idx=pad)
        self.encoder = nn.GRU(emb, hidden, batch_first=True, bidirectional=True)
        self.bridge = nn.Linear(2 * hidden, hidden)  # final encoder states -> decoder state
        self.tgt_emb = nn.Embedding(tgt_vocab, emb, padding_idx=pad)
        self.att_keys = nn.Linear(2 * hidden, hidden, bias=False)  # W_h h_j
        self.att_query = nn.Linear(hidden, hidden)  # W_s s_{t-1}
        self.att_v = nn.Linear(hidden, 1, bias=False)  # v^T tanh(...)
        self.decoder = nn.GRUCell(emb + 2 * hidden, hidden)
        self.out = nn.Linear(hidden + 2 * hidden + emb, tgt_vocab)

    def _encode(self, src: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Packed so that each direction's final state ignores the padding after a sentence."""
        lengths = mask.sum(dim=1).clamp(min=1).cpu()  # (B,) int64
        packed = nn.utils.rnn.pack_padded_sequence(self.src_emb(src), lengths, batch_first=True,
                                                   enforce_sorted=False)
        out, h_n = self.encoder(packed)
        enc, _ = nn.utils.rnn.pad_packed_sequence(out, batch_first=True, total_length=src.shape[1])
        return enc, h_n

    def _attend(self, keys: torch.Tensor, enc: torch.Tensor, mask: torch.Tensor,
                s: torch.Tensor) -> torch.Tensor:
        """Context (B, 2H) for decoder state s (B, H) over encoder outputs enc (B, S, 2H)."""
        score = self.att_v(torch.tanh(keys + self.att_query(s)[:, None])).squeeze(-1)  # (B, S)
        weights = torch.softmax(score.masked_fill(~mask, float("-inf")), dim=-1)
        return torch.bmm(weights[:, None], enc).squeeze(1)

    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor) -> torch.Tensor:
        mask = src != self.pad  # (B, S) bool
        enc, h_n = self._encode(src, mask)  # (B, S, 2H), (2, B, H)
        s = torch.tanh(self.bridge(torch.cat([h_n[0], h_n[1]], dim=-1)))  # (B, H)
        keys = self.att_keys(enc)  # (B, S, H), computed once per sentence
        emb = self.tgt_emb(tgt_in)  # (B, T, E)
        logits = []
        for t in range(emb.shape[1]):
            ctx = self._attend(keys, enc, mask, s)
            s = self.decoder(torch.cat([emb[:, t], ctx], dim=-1), s)
            logits.append(self.out(torch.cat([s, ctx, emb[:, t]], dim=-1)))
        return torch.stack(logits, dim=1)


NETS: dict[str, Callable[..., nn.Module]] = {
    "lenet5": LeNet5, "resnet18": ResNet18, "vgg19": VGG19, "resnet9": ResNet9,
    "seq2seq": Seq2Seq,
}


def net_name(model: nn.Module) -> str | None:
    """The name ``model``'s class is built under (None for a class not in ``NETS``)."""
    for name, cls in NETS.items():
        if type(model) is cls:
            return name
    return None


# -- the models by name, and their flat parameters -------------------------------------------------

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
