"""Tests for the compressor package's plug-in contract: the wire encoding each compressor
declares (and that its ``encode`` sends values in 2 bytes for f16, which ``decode_vector``
reads back), torch tensors as input, the registry (a user's own compressor in one class) and
the server-side hook."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from minips.compress.base import SparseCompressor, WireSpec
from minips.compress.ratios import RatioPolicy
from minips.compress.registry import COMPRESSORS, is_sparse, make_compressor, ratio_policy, register
from minips.errors import ConfigError
from minips.sparse import SparseVector, add_into, decode_vector, encode_vector
from minips.wire.fields import Payload

N = 1000
EXPECTED_WIRE = {
    "none": WireSpec(sparse=False, dtype="f32"),
    "fp16": WireSpec(sparse=False, dtype="f16"),
    **{name: WireSpec(sparse=True, dtype="f32")
       for name in ("topk", "dgc", "randomk", "gdtopk", "losscomp")},
}


def grad(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(N).astype(np.float32)


def test_every_registered_compressor_declares_its_wire_encoding() -> None:
    assert set(COMPRESSORS) == set(EXPECTED_WIRE)
    for name, want in EXPECTED_WIRE.items():
        c = make_compressor(name, N, ratio=0.1)
        assert c.wire == want, name
        enc, _, _ = c.encode(c.compress(grad()))
        assert enc == want.encoding
        assert is_sparse(name) == want.sparse  # the exchange and downlink follow (replica, config)
    with pytest.raises(ConfigError, match="unknown compressor"):
        is_sparse("nope")


@pytest.mark.parametrize("name", ["topk", "dgc", "randomk", "gdtopk", "losscomp"])
def test_f16_sparse_values_travel_in_two_bytes_and_decode_back(name: str) -> None:
    c = make_compressor(name, N, ratio=0.1, value_dtype="f16")
    assert c.wire == WireSpec(sparse=True, dtype="f16")
    packet = c.compress(grad())
    assert isinstance(packet, SparseVector)
    enc, codec, bufs = c.encode(packet)
    assert memoryview(bufs[1]).nbytes == 2 * packet.nnz  # values: float16 on the wire
    assert (enc, codec) == encode_vector(packet, value_dtype="f16")[:2]
    back = decode_vector(Payload(enc, codec, bufs), N)
    assert isinstance(back, SparseVector)
    np.testing.assert_array_equal(back.indices, packet.indices)
    np.testing.assert_array_equal(back.values, packet.values)  # already rounded: exact


def test_bad_value_dtype_is_refused() -> None:
    with pytest.raises(ConfigError, match="value_dtype"):
        make_compressor("topk", N, ratio=0.1, value_dtype="f8")


@pytest.mark.parametrize("name", sorted(EXPECTED_WIRE))
def test_torch_tensor_gives_the_same_packets_as_numpy(name: str) -> None:
    """A user's own loop hands a torch gradient (with requires_grad history) straight in."""
    from_np = make_compressor(name, N, ratio=0.05, seed=4)
    from_torch = make_compressor(name, N, ratio=0.05, seed=4)
    w = torch.zeros(N, requires_grad=True)
    for step in range(3):
        g = grad(step)
        t = (w * torch.from_numpy(g)).sum()
        t.backward()
        assert w.grad is not None
        a, b = from_np.compress(g), from_torch.compress(w.grad.clone())
        w.grad = None
        if isinstance(a, SparseVector):
            assert isinstance(b, SparseVector)
            np.testing.assert_array_equal(a.indices, b.indices)
            np.testing.assert_array_equal(a.values, b.values)
        else:
            np.testing.assert_array_equal(a, b)
    assert from_np.residual is not None and from_torch.residual is not None
    np.testing.assert_array_equal(from_np.residual, from_torch.residual)


def test_torch_loop_sum_sent_plus_residual_is_sum_of_gradients() -> None:
    """The docs' example: compress a torch model's flat gradient each step, apply what came."""
    model = torch.nn.Linear(10, 3)
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    comp = make_compressor("topk", flat.numel(), ratio=0.1, value_dtype="f16")
    applied = np.zeros(flat.numel(), np.float32)
    total = np.zeros(flat.numel(), np.float32)
    for step in range(5):
        model.zero_grad()
        x = torch.randn(4, 10, generator=torch.Generator().manual_seed(step))
        model(x).square().mean().backward()
        g = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        total += g.numpy()
        packet = decode_vector(comp.encode(comp.compress(g)), flat.numel())
        add_into(applied, packet)
    assert comp.residual is not None
    np.testing.assert_allclose(applied + comp.residual, total, atol=1e-5)


class EveryOther(SparseCompressor):
    """A user's compressor: the even coordinates one step, the odd ones the next."""

    name = "every-other-test"

    def __init__(self, size: int, **kw: Any) -> None:
        super().__init__(size, **kw)
        self.flip = 0

    def _select(self, acc: np.ndarray, k: int) -> np.ndarray:
        self.flip ^= 1
        return np.arange(1 - self.flip, self.size, 2, dtype=np.int64)


def test_a_user_compressor_is_one_class_and_one_register_call() -> None:
    register(EveryOther)
    try:
        c = make_compressor("every-other-test", 6, ratio=0.5)
        first = c.compress(np.arange(6, dtype=np.float32))
        assert isinstance(first, SparseVector)
        np.testing.assert_array_equal(first.indices, [0, 2, 4])
        assert c.residual is not None
        np.testing.assert_array_equal(c.residual, [0, 1, 0, 3, 0, 5])  # error feedback
        assert c.encode(first)[0] == "sparse-v1"
        with pytest.raises(ConfigError, match="taken"):
            register(type("Clash", (EveryOther,), {}))
    finally:
        del COMPRESSORS["every-other-test"]


def test_only_gdtopk_brings_a_server_side_ratio_policy() -> None:
    policy = ratio_policy("gdtopk", 0.01, direction="slower-less", alpha=0.5)
    assert isinstance(policy, RatioPolicy)
    assert (policy.target, policy.direction, policy.alpha) == (0.01, "slower-less", 0.5)
    assert all(ratio_policy(name, 0.01) is None for name in COMPRESSORS if name != "gdtopk")
    with pytest.raises(ConfigError, match="unknown compressor"):
        ratio_policy("nope", 0.01)
