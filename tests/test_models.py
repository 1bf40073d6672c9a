"""Tests for minips.ml.models: each model's shape and count, flat-vector layout, loss, evaluate."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from minips.core import config
from minips.errors import ConfigError
from minips.ml import data, models, reference


def small_batch(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of 2 in the model's input format."""
    gen = torch.Generator().manual_seed(0)
    if name == "seq2seq":
        src = torch.randint(3, data.VOCAB, (2, data.SRC_LEN), generator=gen)
        src[1, 6:] = data.PAD  # a shorter sentence: padding must be masked
        tgt = torch.randint(3, data.VOCAB, (2, data.TGT_LEN), generator=gen)
        tgt[:, 0] = data.BOS
        return src, tgt
    channels = 1 if name == "lenet5" else 3
    return torch.randn(2, channels, 32, 32, generator=gen), torch.tensor([3, 7])


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread: None) -> None:
    """Every test here runs with one torch thread (conftest.one_torch_thread)."""


@pytest.fixture(scope="module")
def built() -> dict[str, torch.nn.Module]:
    return {name: models.build_model(name, seed=0) for name in config.MODEL_NAMES}


def test_lenet5_is_the_classic_61706() -> None:
    assert models.param_count("lenet5") == 61_706
    shapes = [shape for _, shape, _, _ in models.layout(models.build_model("lenet5", 0))]
    assert shapes == [(6, 1, 5, 5), (6,), (16, 6, 5, 5), (16,), (120, 400), (120,),
                      (84, 120), (84,), (10, 84), (10,)]


@pytest.mark.parametrize("name", config.MODEL_NAMES)
def test_parameter_count_as_documented(name: str, built: dict[str, torch.nn.Module]) -> None:
    count = sum(p.numel() for p in built[name].parameters())
    assert count == config.PARAM_COUNTS[name] == models.param_count(name)
    assert f"{count:,}" in models.__doc__  # the table in the module docstring


@pytest.mark.parametrize("name", config.MODEL_NAMES)
def test_forward_backward_small_batch(name: str, built: dict[str, torch.nn.Module]) -> None:
    model = built[name]
    model.train()
    model.zero_grad(set_to_none=True)
    x, y = small_batch(name)
    loss = models.batch_loss(name, model, x, y)
    loss.backward()
    assert loss.ndim == 0 and torch.isfinite(loss)
    grad = models.get_flat_grad(model)
    assert grad.dtype == np.float32 and grad.shape == (config.PARAM_COUNTS[name],)
    assert np.all(np.isfinite(grad))
    for pname, _, offset, size in models.layout(model):  # every tensor receives gradient
        assert np.any(grad[offset:offset + size]), pname
    if name != "seq2seq":
        assert model(x).shape == (2, 10)


@pytest.mark.parametrize("name", config.MODEL_NAMES)
def test_flat_round_trip_is_exact(name: str, built: dict[str, torch.nn.Module]) -> None:
    model = built[name]
    rows = models.layout(model)
    assert [r[2] for r in rows] == list(np.cumsum([0] + [r[3] for r in rows[:-1]]))
    flat = models.get_flat(model)
    assert flat.dtype == np.float32 and flat.shape == (rows[-1][2] + rows[-1][3],)
    new = np.random.default_rng(1).standard_normal(flat.shape).astype(np.float32)
    models.set_flat(model, new)
    assert np.array_equal(models.get_flat(model), new)  # bit-exact, not just close
    name0, shape0, _, size0 = rows[0]
    first = dict(model.named_parameters())[name0].detach().numpy()
    np.testing.assert_array_equal(first, new[:size0].reshape(shape0))
    models.set_flat(model, flat)
    assert np.array_equal(models.get_flat(model), flat)


def test_set_flat_accepts_read_only_buffers() -> None:
    model = models.build_model("lenet5", 0)
    flat = models.get_flat(model)
    frozen = np.frombuffer((flat + 1).tobytes(), np.float32)  # read-only, like a received frame
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        models.set_flat(model, frozen)
    assert np.array_equal(models.get_flat(model), flat + 1)


def test_set_flat_rejects_wrong_size() -> None:
    model = models.build_model("lenet5", 0)
    with pytest.raises(ConfigError, match="needs"):
        models.set_flat(model, np.zeros(10, np.float32))


def test_build_is_deterministic_and_leaves_global_rng_alone() -> None:
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a = models.get_flat(models.build_model("lenet5", seed=5))
    after = torch.rand(1)
    b = models.get_flat(models.build_model("lenet5", seed=5))
    c = models.get_flat(models.build_model("lenet5", seed=6))
    assert torch.equal(before, after)
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    with pytest.raises(ConfigError, match="unknown model"):
        models.build_model("alexnet", 0)


def test_layout_digest_identifies_the_layout() -> None:
    d1 = models.layout_digest(models.build_model("lenet5", 0))
    assert d1 == models.layout_digest(models.build_model("lenet5", 9))
    assert d1 != models.layout_digest(models.build_model("lenet5", 0, num_classes=11))


def test_seq2seq_loss_ignores_padding() -> None:
    model = models.build_model("seq2seq", 0)
    src, tgt = small_batch("seq2seq")
    tgt[0, 8:] = data.PAD
    logits = model(src, tgt[:, :-1])  # (2, T-1, V)
    target = tgt[:, 1:]
    keep = target != data.PAD
    manual = torch.nn.functional.cross_entropy(logits[keep], target[keep])
    # tolerances, not ==: MKL and OpenBLAS on Intel and AMD reduce in different orders
    torch.testing.assert_close(models.batch_loss("seq2seq", model, src, tgt), manual,
                               rtol=1e-5, atol=1e-6)
    # padding on the source side must not change the prediction for that sentence
    longer = src.clone()
    longer[1, 6:] = 5
    with torch.no_grad():
        out_a = model(src, tgt[:, :-1])[0]
        src_b = src.clone()
        src_b[1] = longer[1]
        out_b = model(src_b, tgt[:, :-1])[0]
    # row 0 is independent of row 1 (a batch of another shape may take another kernel path)
    torch.testing.assert_close(out_a, out_b, rtol=1e-5, atol=1e-6)


def test_seq2seq_output_does_not_depend_on_padding_length() -> None:
    model = models.build_model("seq2seq", 0)
    src, tgt = small_batch("seq2seq")
    wider = torch.cat([src, torch.full((2, 4), data.PAD)], dim=1)  # (2, S + 4)
    with torch.no_grad():
        np.testing.assert_allclose(model(src, tgt).numpy(), model(wider, tgt).numpy(),
                                   rtol=1e-5, atol=1e-6)


def test_evaluate_classification_counts_and_loss() -> None:
    x, y = data.make_synthetic_images(300, (1, 32, 32), seed=3)
    ds = data.Dataset(x, y)
    model = models.build_model("lenet5", 0)
    model.eval()
    with torch.no_grad():
        logits = model(torch.from_numpy(x))
    acc, loss = models.evaluate("lenet5", models.get_flat(model), ds, batch_size=128)
    assert acc == pytest.approx(float((logits.argmax(1).numpy() == y).mean()))
    assert loss == pytest.approx(float(torch.nn.functional.cross_entropy(
        logits, torch.from_numpy(y))), rel=1e-5)


def test_evaluate_bn_model_with_recalibration() -> None:
    x, y = data.make_synthetic_images(16, (3, 32, 32), seed=4)
    ds = data.Dataset(x, y)
    flat = models.get_flat(models.build_model("resnet9", 1))
    acc_batch, loss_batch = models.evaluate("resnet9", flat, ds, batch_size=8)
    acc_cal, loss_cal = models.evaluate("resnet9", flat, ds, batch_size=8, train_for_bn=ds)
    # by hand: without train_for_bn each batch of 8 is normalised with its own statistics ...
    model = models.build_model("resnet9", 1)
    model.train()
    with torch.no_grad():
        logits = torch.cat([model(torch.from_numpy(x[i:i + 8])) for i in (0, 8)])
    assert acc_batch == float((logits.argmax(1).numpy() == y).mean())
    assert loss_batch == pytest.approx(float(torch.nn.functional.cross_entropy(
        logits, torch.from_numpy(y))), rel=1e-5)
    # ... with it, by running statistics re-estimated on ds (one batch of all 16), eval mode
    model = models.build_model("resnet9", 1)
    models.recalibrate_bn(model, ds)
    model.eval()
    with torch.no_grad():
        logits = model(torch.from_numpy(x))
    assert acc_cal == float((logits.argmax(1).numpy() == y).mean())
    assert loss_cal == pytest.approx(float(torch.nn.functional.cross_entropy(
        logits, torch.from_numpy(y))), rel=1e-5)
    model = models.build_model("resnet9", 1)
    models.recalibrate_bn(model, ds, batches=2, batch_size=8)
    bn = next(m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d))
    mean, tracked = bn.running_mean, bn.num_batches_tracked
    assert mean is not None and tracked is not None
    assert int(tracked) == 2 and not torch.allclose(mean, torch.zeros_like(mean))


@pytest.mark.timeout(120)
def test_seq2seq_learns_the_translation_task() -> None:
    train = data.load_dataset("translation", "train")
    test = data.load_dataset("translation", "test")
    flat, _ = reference.train("seq2seq", train, lr=0.1, seed=0, steps=200, weight_decay=0.0)
    acc, loss = models.evaluate("seq2seq", flat, test)
    # token accuracy with teacher forcing; chance is 1/24 and 600 steps reach > 0.99
    assert acc > 0.3 and loss < 2.5


@pytest.mark.parametrize("name", ["resnet18", "vgg19", "resnet9"])
def test_a_cifar_model_takes_grey_images_as_three_equal_channels(
        name: str, built: dict[str, torch.nn.Module]) -> None:
    """Fashion-MNIST (1 channel, padded to 32x32) trains the CIFAR models unchanged: a grey batch
    gives what its three-channel copy gives."""
    model = built[name].eval()
    grey = torch.randn(2, 1, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(grey), model(grey.repeat(1, 3, 1, 1)))
