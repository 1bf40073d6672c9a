"""The networks of the paper, as torch modules, and ``NETS``, name -> class.

``models.py`` builds them by name (``build_model``) and gives the flat-parameter view; the table
of names, parameter counts and default data sets is in its docstring.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from minips.ml.synthetic import PAD, VOCAB

__all__ = ["LeNet5", "ResNet18", "VGG19", "ResNet9", "Seq2Seq", "NETS", "net_name"]


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 3, 32, 32) -> (B, classes)
        x = self.blocks(self.stem(x))  # (B, 512, 4, 4)
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 3, 32, 32) -> (B, classes)
        return self.fc(self.features(x).flatten(1))  # features: (B, 512, 1, 1)


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 3, 32, 32) -> (B, classes)
        return self.fc(self.net(x)) * 0.125  # the reference net's fixed output scale


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
