"""Tests for minips.sparse: encoding, validation, apply helpers and the one top-k selection
(exact and sampled), against hand-computed values and known statistics."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minips import sparse
from minips.compress import registry
from minips.compress.selection import TopKSelector, kept_count, top_among
from minips.errors import LocalProtocolError, RemoteProtocolError
from minips.sparse import SparseVector, add_into, decode_vector, encode_vector
from minips.wire import frames, messages, varint
from minips.wire.fields import Payload


def sg(indices: list[int], values: list[float], size: int) -> SparseVector:
    return SparseVector(np.array(indices, np.uint32), np.array(values, np.float32), size)


# ---------------------------------------------------------------------------- SparseVector


def test_sparsegrad_checks_dtypes_and_shapes() -> None:
    with pytest.raises(LocalProtocolError):
        SparseVector(np.array([1], np.int64), np.array([1.0], np.float32), 4)
    with pytest.raises(LocalProtocolError):
        SparseVector(np.array([1, 2], np.uint32), np.array([1.0], np.float32), 4)
    with pytest.raises(LocalProtocolError):
        sg([0, 1, 2], [1, 2, 3], 2)
    with pytest.raises(LocalProtocolError):
        sg([2, 1], [1, 2], 4).check()
    assert sg([1, 3], [5, -2], 4).to_dense().tolist() == [0, 5, 0, -2]


# ---------------------------------------------------------------------------- varint


def test_varint_hand_computed_bytes() -> None:
    # gaps: 0, 1-0-1=0, 130-1-1=128, 20000-130-1=19869 = 29 + 27*128 + 1*128^2
    data = varint.varint_encode(np.array([0, 1, 130, 20000], np.uint32))
    assert data.tolist() == [0x00, 0x00, 0x80, 0x01, 0x80 | 29, 0x80 | 27, 0x01]
    assert varint.varint_decode(data, 4, 20001).tolist() == [0, 1, 130, 20000]


def test_varint_largest_uint32_uses_five_bytes() -> None:
    data = varint.varint_encode(np.array([2**32 - 1], np.uint32))
    assert data.tolist() == [0xFF, 0xFF, 0xFF, 0xFF, 0x0F]
    assert varint.varint_decode(data, 1, 2**32).tolist() == [2**32 - 1]


def test_varint_bytes_per_index_at_one_percent() -> None:
    rng = np.random.default_rng(0)
    idx = np.flatnonzero(rng.random(1_000_000) < 0.01).astype(np.uint32)
    # Geometric gaps with mean 100: P(gap >= 128) = 0.99^128 = 0.276 -> ~1.28 bytes per index.
    assert varint.varint_encode(idx).size / idx.size == pytest.approx(1 + 0.99**128, abs=0.02)


def test_varint_same_bytes_for_short_and_long_index_sets() -> None:
    # a first index of 5 bytes, then gaps of 1, 2 and 3 bytes, past VARINT_TABLE_MAX indices:
    # short sets are laid out as a table, long ones by subsets; a prefix codes the same either way
    gaps = np.tile(np.array([0, 200, 20000], np.int64), varint.VARINT_TABLE_MAX // 3 + 10)
    idx = (2**28 + 5 + np.cumsum(gaps + 1) - 1).astype(np.uint32)
    assert idx.size > varint.VARINT_TABLE_MAX and int(idx[-1]) < 2**32
    whole = varint.varint_encode(idx)
    assert whole.size == 5 + idx.size // 3 * (1 + 2 + 3) - 1  # the first gap is the 5-byte one
    for m in (1, 2, 7, 300):
        short = varint.varint_encode(idx[:m])
        assert short.tolist() == whole[:short.size].tolist()
    assert varint.varint_decode(whole, idx.size, 2**32).tolist() == idx.tolist()


def test_varint_few_long_gaps_code_as_the_table_does() -> None:
    # past VARINT_TABLE_MAX with one gap in 50 over a byte (2, 3 and 4 bytes in turn, and a
    # first index of 5): the few-long layout; every prefix of it codes as the table does
    rng = np.random.default_rng(3)
    gaps = rng.integers(0, 128, size=3 * varint.VARINT_TABLE_MAX).astype(np.int64)
    gaps[::50] = np.resize([200, 20_000, 3_000_000], gaps[::50].size)
    gaps[0] = 2**28 + 5
    idx = np.cumsum(gaps + 1) - 1
    assert int(idx[-1]) < 2**32 and np.count_nonzero(gaps >= 128) * varint.FEW_LONG < idx.size
    idx = idx.astype(np.uint32)
    whole = varint.varint_encode(idx)
    long = gaps[::50][1:]
    assert whole.size == idx.size + 4 + int(np.sum(np.select([long < 2**14, long < 2**21],
                                                             [1, 2], 3)))
    for m in (1, 2, 51, 101, 151, varint.VARINT_TABLE_MAX):
        short = varint.varint_encode(idx[:m])
        assert short.tolist() == whole[:short.size].tolist()
    assert varint.varint_decode(whole, idx.size, 2**32).tolist() == idx.tolist()


# ---------------------------------------------------------------------------- round trips


@st.composite
def sparse_grads(draw: st.DrawFn) -> SparseVector:
    size = draw(st.integers(0, 3000))
    mode = draw(st.sampled_from(["empty", "full", "random"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    if mode == "empty" or size == 0:
        idx: np.ndarray = np.empty(0, np.int64)
    elif mode == "full":
        idx = np.arange(size)
    else:
        idx = np.flatnonzero(rng.random(size) < draw(st.floats(0.0, 1.0)))
    vals = rng.laplace(size=idx.size).astype(np.float32)
    return SparseVector(idx.astype(np.uint32), vals, size)


@settings(max_examples=150, deadline=None)
@given(
    g=sparse_grads(),
    value_dtype=st.sampled_from(["f32", "f16"]),
    index=st.sampled_from(["varint", "u32"]),
)
def test_sparse_round_trip(g: SparseVector, value_dtype: str, index: str) -> None:
    enc, codec, bufs = encode_vector(g, value_dtype=value_dtype, index=index)
    assert enc == "sparse-v1"
    back = decode_vector(Payload(enc, codec, tuple(bytes(memoryview(b)) for b in bufs)), g.size)
    assert isinstance(back, SparseVector) and back.size == g.size
    assert np.array_equal(back.indices, g.indices)
    want = g.values.astype(np.float16).astype(np.float32) if value_dtype == "f16" else g.values
    assert np.array_equal(back.values, want)


def test_dense_round_trips() -> None:
    x = np.random.default_rng(1).normal(size=1000).astype(np.float32)
    enc, codec, bufs = encode_vector(x)
    assert enc == "dense-f32"
    dense = decode_vector(Payload(enc, codec, bufs), 1000)
    assert isinstance(dense, np.ndarray) and np.array_equal(dense, x)
    enc, codec, bufs = encode_vector(x.astype(np.float16))
    assert enc == "dense-f16"
    out = decode_vector(Payload(enc, codec, bufs), 1000)
    assert isinstance(out, np.ndarray) and out.dtype == np.float32
    assert np.array_equal(out, x.astype(np.float16).astype(np.float32))
    assert encode_vector(x, value_dtype="f16")[0] == "dense-f16"


@pytest.mark.parametrize("name", ["topk", "dgc", "randomk"])
def test_a_compressor_with_f16_values_sends_two_bytes_per_value(name: str) -> None:
    """A compressor's declared value type is what travels: 1,000 values take 2,000 bytes with
    value_dtype="f16" (4,000 with f32), and decode to the rounded values."""
    n = 100_000
    grad = np.random.default_rng(3).normal(size=n).astype(np.float32)
    sizes = {}
    for dtype in ("f32", "f16"):
        comp = registry.make_compressor(name, n, ratio=0.01, seed=0, value_dtype=dtype)
        packet = comp.compress(grad)
        assert isinstance(packet, SparseVector) and packet.nnz == 1000
        enc, codec, bufs = comp.encode(packet)
        sizes[dtype] = memoryview(bufs[1]).nbytes
        out = decode_vector(Payload(enc, codec, bufs), n)
        assert isinstance(out, SparseVector) and codec["value"] == dtype
        np.testing.assert_array_equal(out.values, packet.values)  # f16 rounding is exact
    assert sizes == {"f32": 4000, "f16": 2000}


def test_codec_keys_and_types_are_checked_in_one_place() -> None:
    g = sg([1, 2], [1.0, 2.0], 10)
    enc, codec, bufs = encode_vector(g)
    for bad in ({**codec, "size": 10}, {**codec, "value": "f64"}, {**codec, "k": -1},
                {**codec, "lz4": [8]}, {**codec, "index": 7}):
        with pytest.raises(RemoteProtocolError, match="codec"):
            decode_vector(Payload(enc, bad, bufs), 10)
        with pytest.raises(LocalProtocolError, match="codec"):
            messages.Push(clock=1, payload=Payload(enc, bad, tuple(bufs)))


def test_the_frames_lz4_layer_shrinks_a_run_of_neighbours() -> None:
    """lz4 is one layer, the frame's: 5,000 neighbours' zero gap bytes shrink to a few."""
    g = SparseVector(np.arange(5000, dtype=np.uint32), np.zeros(5000, np.float32), 10000)
    enc, codec, bufs = encode_vector(g)
    push = messages.Push(clock=1, payload=Payload(enc, codec, tuple(bufs)))
    packed = sum(memoryview(b).nbytes for b in frames.encode(push, compress=True))
    assert packed < 400 < sum(memoryview(b).nbytes for b in frames.encode(push))
    [back] = frames.FrameDecoder().feed(b"".join(frames.encode(push, compress=True)))
    out = decode_vector(back.payload, 10000)  # type: ignore[attr-defined]
    assert isinstance(out, SparseVector) and np.array_equal(out.indices, g.indices)


# ---------------------------------------------------------------------------- malformed packets


def good(size: int = 100) -> tuple[str, dict, list]:
    enc, codec, bufs = encode_vector(sg([3, 10, 99], [1.0, -2.0, 0.5], size))
    return enc, codec, [bytes(memoryview(b)) for b in bufs]


def u32_packet(indices: list[int], k: int | None = None) -> tuple[str, dict, list]:
    idx = np.array(indices, "<u4")
    codec = {"k": len(indices) if k is None else k, "index": "u32", "value": "f32"}
    return "sparse-v1", codec, [idx.tobytes(), np.ones(len(indices), "<f4").tobytes()]


# (encoding, codec, buffers) of a bad packet; the codec may even be of a wrong type
BAD_PACKETS: dict[str, Callable[[], tuple[str, Any, Sequence[Any]]]] = {
    "index out of range (varint)": lambda: encode_vector(sg([3, 100], [1.0, 2.0], 101)),
    "index out of range (u32)": lambda: u32_packet([1, 100]),
    "unsorted (u32)": lambda: u32_packet([5, 3]),
    "duplicate (u32)": lambda: u32_packet([5, 5]),
    "u32 wrong length": lambda: ("sparse-v1", u32_packet([1, 2])[1], [b"\0" * 7, b"\0" * 8]),
    "truncated varint": lambda: (good()[0], good()[1], [good()[2][0][:-1], good()[2][1]]),
    "trailing varint byte": lambda: (good()[0], good()[1], [good()[2][0] + b"\x00", good()[2][1]]),
    "truncated values": lambda: (good()[0], good()[1], [good()[2][0], good()[2][1][:-1]]),
    "six-byte varint": lambda: ("sparse-v1", {"k": 1, "index": "varint", "value": "f32"},
                                [b"\x80" * 5 + b"\x00", b"\0" * 4]),
    "varint over 32 bits": lambda: ("sparse-v1", {"k": 1, "index": "varint", "value": "f32"},
                                    [b"\xff\xff\xff\xff\x1f", b"\0" * 4]),
    "k larger than size": lambda: ("sparse-v1", {**good()[1], "k": 101}, good()[2]),
    "k not an int": lambda: ("sparse-v1", {**good()[1], "k": "3"}, good()[2]),
    "k is a bool": lambda: ("sparse-v1", {**good()[1], "k": True}, good()[2]),
    "k disagrees": lambda: ("sparse-v1", {**good()[1], "k": 2}, good()[2]),
    "unknown index scheme": lambda: ("sparse-v1", {**good()[1], "index": "bitmap"}, good()[2]),
    "unknown value dtype": lambda: ("sparse-v1", {**good()[1], "value": "f64"}, good()[2]),
    "unknown encoding": lambda: ("sparse-v9", good()[1], good()[2]),
    "codec not a map": lambda: ("sparse-v1", [3], good()[2]),
    "one buffer missing": lambda: ("sparse-v1", good()[1], good()[2][:1]),
    "buffer not bytes": lambda: ("sparse-v1", good()[1], [good()[2][0], 12345]),
    "dense wrong length": lambda: ("dense-f32", {}, [b"\0" * 399]),
    "dense f16 wrong length": lambda: ("dense-f16", {}, [b"\0" * 400]),
    "a second lz4 layer": lambda: ("dense-f32", {"lz4": [400]}, [b"\0" * 400]),
}


@pytest.mark.parametrize("case", sorted(BAD_PACKETS))
def test_malformed_packets_raise_remote_error(case: str) -> None:
    enc, codec, bufs = BAD_PACKETS[case]()
    with pytest.raises(RemoteProtocolError):
        decode_vector(Payload(enc, codec, tuple(bufs)), 100)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_nonfinite_values_refused_unless_allowed(bad: float) -> None:
    g = sg([1, 2], [1.0, bad], 10)
    for value_dtype in ("f32", "f16"):
        enc, codec, bufs = encode_vector(g, value_dtype=value_dtype)
        with pytest.raises(RemoteProtocolError, match="NaN or inf"):
            decode_vector(Payload(enc, codec, bufs), 10)
        out = decode_vector(Payload(enc, codec, bufs), 10, allow_nonfinite=True)
        assert isinstance(out, SparseVector) and not np.isfinite(out.values[1])
    enc, codec, bufs = encode_vector(g.to_dense())
    with pytest.raises(RemoteProtocolError):
        decode_vector(Payload(enc, codec, bufs), 10)


@settings(max_examples=300, deadline=None)
@given(
    data=st.lists(st.binary(max_size=40), max_size=3),
    k=st.integers(-2, 60),
    index=st.sampled_from(["varint", "u32", "x"]),
    value=st.sampled_from(["f32", "f16"]),
    encoding=st.sampled_from(["sparse-v1", "dense-f32", "dense-f16"]),
)
def test_any_bytes_give_a_gradient_or_a_remote_error(
    data: list[bytes], k: int, index: str, value: str, encoding: str
) -> None:
    codec = {"k": k, "index": index, "value": value}
    try:
        out = decode_vector(Payload(encoding, codec, tuple(data)), 50, allow_nonfinite=True)
    except RemoteProtocolError:
        return
    if isinstance(out, SparseVector):
        out.check()
    else:
        assert out.shape == (50,)


# ---------------------------------------------------------------------------- apply


def test_scatter_add_hand_computed() -> None:
    target = np.array([1, 1, 1, 1, 1], np.float32)
    add_into(target, sg([0, 3], [2.0, -4.0], 5), scale=0.5)
    assert target.tolist() == [2, 1, 1, -1, 1]
    add_into(target, np.ones(5, np.float32))
    assert target.tolist() == [3, 2, 2, 0, 2]
    with pytest.raises(LocalProtocolError):
        add_into(target, sg([0], [1.0], 6))


# ---------------------------------------------------------------------------- selection


def test_kept_count() -> None:
    assert kept_count(0.01, 1000) == 10
    assert kept_count(1e-9, 1000) == 1
    assert kept_count(0.0, 1000) == 0
    assert kept_count(2.0, 1000) == 1000


def test_small_vector_selection_hand_computed() -> None:
    score = np.array([0.5, 3.0, 0.0, 3.0, 2.0, 0.1], np.float32)
    sel = TopKSelector(6)
    assert sel.select(score, 3).tolist() == [1, 3, 4]
    assert sel.select(score, 1).tolist() == [1]  # tie at 3.0: lowest index first
    assert sel.select(score, 0).tolist() == []
    assert sel.select(score, 6).tolist() == list(range(6))
    assert sel.select(-score, 3).tolist() == [1, 3, 4]  # by magnitude


@pytest.fixture(scope="module")
def laplace() -> np.ndarray:
    return np.abs(np.random.default_rng(7).laplace(size=2_000_000)).astype(np.float32)


@pytest.mark.parametrize("density", [0.01, 0.001])
def test_exact_selection_equals_full_partition(laplace: np.ndarray, density: float) -> None:
    k = kept_count(density, laplace.size)
    signed = np.where(np.arange(laplace.size) % 3 == 0, -laplace, laplace)  # ranks by magnitude
    got = TopKSelector(laplace.size, seed=1).select(signed, k)
    want = np.sort(np.argpartition(laplace, laplace.size - k)[laplace.size - k :])
    assert np.array_equal(got, want)


def test_exact_top_one_percent_keeps_known_energy(laplace: np.ndarray) -> None:
    # |Laplace(1)| is Exp(1): the top p fraction lies above t = -ln p and holds
    # p (t^2 + 2t + 2) / 2 of E[x^2] = 2; for p = 1% that is 16.2% of the energy.
    p, t = 0.01, -math.log(0.01)
    idx = TopKSelector(laplace.size).select(laplace, kept_count(p, laplace.size))
    energy = np.square(laplace, dtype=np.float64)
    kept = energy[idx].sum() / energy.sum()
    assert kept == pytest.approx(p * (t * t + 2 * t + 2) / 2, abs=0.005)


def test_dgc_tolerance_keeps_near_k_and_the_energy(laplace: np.ndarray) -> None:
    k = kept_count(0.01, laplace.size)
    energy = np.square(laplace, dtype=np.float64)
    exact = energy[TopKSelector(laplace.size).select(laplace, k)].sum()
    for seed in range(5):
        idx = TopKSelector(laplace.size, seed, tolerance=0.1).select(laplace, k)
        assert k <= idx.size <= 1.1 * k and np.all(np.diff(idx) > 0)
        assert energy[idx].sum() >= exact  # never less than the exact top-k
        assert np.min(laplace[idx]) >= np.max(np.delete(laplace, idx))  # the largest ones


def test_ties_and_zeros_fall_back_correctly() -> None:
    score = np.zeros(500_000, np.float32)
    score[[7, 70_000, 400_000]] = [5.0, 1.0, 2.0]
    sel = TopKSelector(score.size, tolerance=0.0)
    idx = sel.select(score, 1000)  # threshold 0 is tied 500k times: exact k, lowest ties first
    assert idx.size == 1000 and {7, 70_000, 400_000} <= set(idx.tolist())
    assert idx[:3].tolist() == [0, 1, 2]
    spike = np.zeros(500_000, np.float32)
    spike[::997] = 1.0  # 502 ones; a sample rarely sees them -> refine or fall back
    idx = TopKSelector(spike.size, seed=3).select(spike, 400)
    assert idx.size == 400 and np.all(spike[idx] == 1.0)


def _old_exact_top(x: np.ndarray, k: int) -> np.ndarray:
    """The exact top-k by a full stable sort: largest magnitudes, ties by lowest index."""
    order = np.argsort(-np.abs(x), kind="stable")[:k]
    return np.sort(order)


@pytest.mark.parametrize("nnz", [0, 1, 37, 999, 1000, 1500])
def test_a_mostly_zero_vector_is_selected_among_its_nonzeros(nnz: int) -> None:
    # GroupMirror.answer's path in every single-group run: fewer non-zeros than k. The candidates
    # the selector trims are the non-zeros only (never a partition of all n), and the result
    # is the partition's: the non-zeros, then the lowest-index zeros.
    n, k = 2_000_000, 1000
    rng = np.random.default_rng(nnz)
    x = np.zeros(n, np.float32)
    at = rng.choice(n, nnz, replace=False)
    x[at] = rng.laplace(size=nnz).astype(np.float32) + 0.5
    trimmed: list[int] = []

    class Spy(TopKSelector):
        def _trim(self, score: Any, cand: Any, k: int) -> Any:
            trimmed.append(len(cand))
            return super()._trim(score, cand, k)

    sel = Spy(n, seed=nnz)
    idx = sel.select(x, k)
    if nnz <= k:  # (more than k: the sample may see them and take the sampled path)
        assert sel.path == "nonzero" and all(c <= nnz for c in trimmed)
    assert np.array_equal(idx, _old_exact_top(x, k))
    if nnz <= k:  # sampled mode (DGC) too: the same k as the full partition it replaced
        assert np.array_equal(Spy(n, seed=nnz, tolerance=0.1).select(x, k), idx)


def test_top_among_is_the_exact_top_k_of_the_whole_vector() -> None:
    rng = np.random.default_rng(5)
    for _ in range(200):
        n = int(rng.integers(1, 300))
        m = int(rng.integers(0, n + 1))
        idx = np.sort(rng.choice(n, m, replace=False)).astype(np.uint32)
        vals = rng.integers(-3, 4, size=m).astype(np.float32)  # ties and zeros
        x = np.zeros(n, np.float32)
        x[idx] = vals
        k = int(rng.integers(0, n + 1))
        want = _old_exact_top(x, k)
        want = want[x[want] != 0]
        assert np.array_equal(top_among(idx, vals, k), want)


def test_top_among_never_touches_the_vectors_length() -> None:
    # 2^40 coordinates would take 4 TiB dense: only the m candidates are read
    idx = np.array([3, 2**39, 2**40 - 1], np.int64)
    vals = np.array([0.5, -2.0, 0.0], np.float32)
    assert top_among(idx, vals, 1).tolist() == [2**39]
    assert top_among(idx, vals, 5).tolist() == [3, 2**39]  # fewer than k: the non-zeros


def test_unique_sorted_equals_np_unique() -> None:
    rng = np.random.default_rng(9)
    for size in (0, 1, 2, 17, 5000):
        a = rng.integers(0, 50, size=size).astype(np.uint32)
        got = sparse.unique_sorted(a)
        assert got.dtype == a.dtype and np.array_equal(got, np.unique(a))


@pytest.mark.timeout(120)
def test_bench_script_prints_one_json_object() -> None:
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "bench_sparse.py"
    done = subprocess.run([sys.executable, str(script), "--json", "--size", "200000",
                           "--repeats", "1"], capture_output=True, text=True, timeout=110)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    one = out["fractions"]["0.01"]
    assert one["k"] == 2000 and one["topk_exact_k"] and 1.0 <= one["dgc_kept_over_k"] <= 1.1
    assert one["bytes_per_index"] < 1.5 and one["energy_kept"] >= 1.0
    assert set(out["acceptance_at_1pct"]) >= {"speedup_dgc>=8", "energy_kept>=0.97"}


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(40_000, 120_000),
    density=st.sampled_from([1e-4, 1e-3, 0.01, 0.1, 0.5]),
    kind=st.sampled_from(["laplace", "few-values", "mostly-zero", "negative"]),
    tolerance=st.sampled_from([0.0, 0.1]),
    seed=st.integers(0, 2**16),
)
def test_selection_property(n: int, density: float, kind: str, tolerance: float, seed: int) -> None:
    rng = np.random.default_rng(seed)
    x = rng.laplace(size=n).astype(np.float32)
    if kind == "few-values":
        x = rng.integers(-3, 4, size=n).astype(np.float32)  # massive ties
    elif kind == "mostly-zero":
        x[rng.random(n) < 0.995] = 0.0
    elif kind == "negative":
        x = -np.abs(x)
    k = kept_count(density, n)
    idx = TopKSelector(n, seed, tolerance=tolerance).select(x, k)
    assert k <= idx.size <= k * (1 + tolerance) and np.all(np.diff(idx) > 0)
    if tolerance == 0.0:
        assert idx.size == k
    rest = np.delete(np.abs(x), idx)
    assert rest.size == 0 or np.abs(x[idx]).min() >= rest.max()  # the largest magnitudes


def test_average_of_a_round_mixes_dense_and_sparse() -> None:
    dense = np.array([1.0, 2.0, 3.0, 4.0], np.float32)
    sg = sparse.SparseVector(np.array([1, 3], np.uint32), np.array([4.0, -2.0], np.float32), 4)
    np.testing.assert_array_equal(sparse.average([dense, sg], 4), [0.5, 3.0, 1.5, 1.0])
    assert sparse.average([sg], 4) is sg  # a round of one is applied as it came


def test_union_of_sorts_few_and_masks_many() -> None:
    rng = np.random.default_rng(4)
    for size, count in ((10_000, 3), (10_000, 400), (64, 50)):  # few: sorted; many: the mask
        parts = [rng.integers(0, size, count).astype(np.uint32) for _ in range(5)]
        got = sparse.union_of(parts, size)
        assert got.dtype == np.uint32
        assert np.array_equal(got, np.unique(np.concatenate(parts)))
    assert sparse.union_of([], 10).size == 0
    # far fewer indices than the length: no (size,) mask is made (2^32 bools would be 4 GiB)
    huge = sparse.union_of([np.array([2**32 - 1, 5], np.uint32), np.array([5], np.uint32)],
                           2**32)
    assert huge.tolist() == [5, 2**32 - 1]


def test_the_mean_of_sparse_gradients_is_sparse_with_the_dense_means_values() -> None:
    rng = np.random.default_rng(3)
    n = 5000
    for seed in range(20):
        grads = []
        for _ in range(int(rng.integers(2, 6))):
            idx = np.sort(rng.choice(n, int(rng.integers(0, 300)), replace=False))
            grads.append(SparseVector(idx.astype(np.uint32),
                                      rng.standard_normal(idx.size).astype(np.float32), n))
        weights = None if seed % 2 else [float(rng.integers(1, 64)) for _ in grads]
        got = sparse.average(grads, n, weights)
        assert isinstance(got, SparseVector)
        got.check()
        dense = sparse.average([g.to_dense() for g in grads], n, weights)
        assert isinstance(dense, np.ndarray)
        assert np.array_equal(got.to_dense(), dense)  # the same float32 operations
