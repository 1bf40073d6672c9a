"""Where the real data sets' files are, how they are read, and how they are fetched.

The file holds, in order: download and verify (``fetch_file``, ``extract_members``): files
fetched over HTTP(S) are kept only if their SHA-256 matches; then the real sets. ``SPECS`` pins
each real set: its files per split, shape, normalisation, base URL and SHA-256 digests.
``find_or_download`` looks in ``data_dir``, then ``cache_dir(name)``, then the system
directories, and downloads into the first (verified by ``fetch_file``) when allowed; ``decode``
reads IDX (gzip or raw) or CIFAR-10 binary batches into checked uint8 images and int64 labels.
``data.py`` builds ``Dataset``s from them.

Invariants:
- A file appears under its name only whole and verified: bytes go to ``<name>.<pid>.part`` and
  are renamed once the digest matches; a mismatch, a network error or a file over
  ``MAX_DOWNLOAD_BYTES`` leaves nothing behind and raises (``DataError`` for what we refuse).
- Archives are never extracted by their own member paths: only members we name are written.
"""

from __future__ import annotations

import gzip
import hashlib
import logging
import os
import tarfile
import urllib.request
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from minips.errors import ConfigError, DataError

__all__ = [
    "DOWNLOAD_TIMEOUT_S",
    "MAX_DOWNLOAD_BYTES",
    "CHUNK_BYTES",
    "fetch_file",
    "extract_members",
    "Spec",
    "SPECS",
    "CIFAR_SUBDIR",
    "DATASET_NAMES",
    "read_idx",
    "read_cifar_batch",
    "cache_dir",
    "download",
    "spec_of",
    "find_or_download",
    "decode",
]


# -- download and verify: a file is kept only if its SHA-256 matches -------------------------------

DOWNLOAD_TIMEOUT_S = 30.0  # per socket operation: an unreachable network fails fast
MAX_DOWNLOAD_BYTES = 256 * 2**20  # largest pinned file is the 170 MB CIFAR-10 archive
CHUNK_BYTES = 1 << 20  # download read size


def _copy_hashed(resp: Any, out: Any, digest: Any, url: str) -> None:
    """Stream ``resp`` into ``out`` and ``digest``, refusing more than MAX_DOWNLOAD_BYTES."""
    total = 0
    while chunk := resp.read(CHUNK_BYTES):
        total += len(chunk)
        if total > MAX_DOWNLOAD_BYTES:
            raise DataError(f"{url}: larger than {MAX_DOWNLOAD_BYTES} bytes, refused")
        digest.update(chunk)
        out.write(chunk)


def fetch_file(url: str, dest: Path, sha256: str, *, timeout: float = DOWNLOAD_TIMEOUT_S) -> Path:
    """Download ``url`` to ``dest``, keeping it only if its SHA-256 is ``sha256``."""
    part = dest.with_name(f"{dest.name}.{os.getpid()}.part")  # workers may fetch at once
    digest = hashlib.sha256()
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            dest.parent.mkdir(parents=True, exist_ok=True)  # only once a server answered
            with open(part, "wb") as out:
                _copy_hashed(resp, out, digest, url)
        if digest.hexdigest() != sha256:
            raise DataError(f"{url}: SHA-256 mismatch, file refused (expected {sha256}, "
                            f"got {digest.hexdigest()})")
        part.replace(dest)
    finally:
        part.unlink(missing_ok=True)
    return dest


def extract_members(archive: Path, dest: Path, wanted: set[str]) -> None:
    """Copy the members named in ``wanted`` out of a .tar.gz into ``dest`` (never trusting
    member paths: only names we listed are written)."""
    for name in wanted:
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
    try:
        with tarfile.open(archive, "r:gz") as tar:
            for member in tar.getmembers():
                src = tar.extractfile(member) if member.name in wanted else None
                if src is not None:  # write aside, then rename: readers never see half a file
                    tmp = dest / f"{member.name}.{os.getpid()}.part"
                    tmp.write_bytes(src.read())
                    tmp.replace(dest / member.name)
    except (tarfile.TarError, EOFError, OSError, zlib.error) as exc:
        raise DataError(f"{archive}: corrupt or truncated archive ({exc})") from exc


# -- the real data sets: specs, file formats, locating and downloading -----------------------------

log = logging.getLogger("minips.ml.data")


@dataclass(frozen=True)
class Spec:
    """How one real data set is stored, normalised and downloaded."""

    kind: str  # "idx" or "cifar"
    shape: tuple[int, int, int]  # (C, H, W) as stored
    mean: tuple[float, ...]  # per channel, of pixel/255 over the training set
    std: tuple[float, ...]
    files: dict[str, tuple[str, ...]]  # split -> file names (IDX names without .gz)
    url: str  # base URL of the pinned files
    sha256: dict[str, str]  # downloaded file name -> digest
    system_dirs: tuple[str, ...] = ()


_IDX_FILES: dict[str, tuple[str, ...]] = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}


def _idx_spec(mean: float, std: float, url: str, sha256: tuple[str, str, str, str],
              system_dir: str) -> Spec:
    """An MNIST-format set: 1x28x28, the four _IDX_FILES gzipped, digests in that order."""
    gz_names = [f"{f}.gz" for split in ("train", "test") for f in _IDX_FILES[split]]
    return Spec("idx", (1, 28, 28), (mean,), (std,), _IDX_FILES, url,
                 dict(zip(gz_names, sha256, strict=True)), (system_dir,))


SPECS: dict[str, Spec] = {
    "fashion-mnist": _idx_spec(
        0.2860, 0.3530, "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",
        ("b0564c3eedabfbf835052cff8503ea422014ce006caf5b757f851416ee8300c7",
         "0ae29f65d86684f32d1b9c85147786c547b9c6aebcaf235f0400a0cce308b056",
         "cc1d090a38ace84dfa1aa66e3ada7c336ef481a96936906477e6dd344da56eaa",
         "8d3605d196f4be44669e46906da9733c8131fef761fdbfec72c424d5222f1a05"),
        "/usr/share/datasets/fashion-mnist",
    ),
    "mnist": _idx_spec(
        0.1307, 0.3081, "https://ossci-datasets.s3.amazonaws.com/mnist/",
        ("440fcabf73cc546fa21475e81ea370265605f56be210a4024d2ca8f203523609",
         "3552534a0a558bbed6aed32b30c495cca23d567ec52cac8be1a0730e8010255c",
         "8d422c7b0a1c1c79245a5bcf07fe86e33eeafee792b84584aec276f5a2dbc4e6",
         "f7ae60f92e00ec6debd23a6088c31dbd2371eca3ffa0defaefb259924204aec6"),
        "/usr/share/datasets/mnist",
    ),
    "cifar10": Spec(
        "cifar", (3, 32, 32), (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616),
        {"train": tuple(f"data_batch_{i}.bin" for i in range(1, 6)), "test": ("test_batch.bin",)},
        "https://www.cs.toronto.edu/~kriz/",
        {"cifar-10-binary.tar.gz": "c4a38c50a1bc5f3a1c5537f2155ab9d68f9f25eb1ed8d9ddda3db29a59bca1dd"},  # noqa: E501
    ),
}
CIFAR_SUBDIR = "cifar-10-batches-bin"  # the archive's top folder; also searched for
DATASET_NAMES = ("fashion-mnist", "mnist", "cifar10", "synthetic", "translation")


# ---------------------------------------------------------------- file formats

_IDX_DTYPE = 0x08  # unsigned byte: the only element type MNIST-format files use


def _read_bytes(path: Path) -> bytes:
    """File contents, gunzipped when the file starts with the gzip magic."""
    raw = path.read_bytes()
    if raw[:2] != b"\x1f\x8b":
        return raw
    try:
        return gzip.decompress(raw)
    except (EOFError, OSError, zlib.error) as exc:
        raise DataError(f"{path}: corrupt or truncated gzip data ({exc})") from exc


def read_idx(path: str | Path, ndim: int) -> np.ndarray:
    """Decode an IDX file (gzip or raw) of unsigned bytes with ``ndim`` dimensions -> uint8."""
    path = Path(path)
    data = _read_bytes(path)
    if len(data) < 4 or data[:2] != b"\0\0" or data[2] != _IDX_DTYPE or data[3] != ndim:
        raise DataError(
            f"{path}: not an IDX file of {ndim}-D unsigned bytes "
            f"(header {data[:4].hex() or 'empty'}, expected 0000080{ndim})"
        )
    head = 4 + 4 * ndim
    if len(data) < head:
        raise DataError(f"{path}: truncated IDX header ({len(data)} of {head} bytes)")
    dims = tuple(int(d) for d in np.frombuffer(data, ">u4", ndim, 4))
    need = head + int(np.prod(dims))
    if len(data) != need:
        raise DataError(f"{path}: IDX dims {dims} need {need} bytes, file has {len(data)}")
    return np.frombuffer(data, np.uint8, offset=head).reshape(dims)


_CIFAR_RECORD = 1 + 3 * 32 * 32  # label byte, then R, G, B planes of 32x32 row-major


def read_cifar_batch(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """Decode one CIFAR-10 binary batch -> (images (N, 3, 32, 32) uint8, labels (N,) uint8)."""
    path = Path(path)
    raw = path.read_bytes()
    if not raw or len(raw) % _CIFAR_RECORD:
        raise DataError(
            f"{path}: size {len(raw)} is not a positive multiple of the "
            f"{_CIFAR_RECORD}-byte CIFAR-10 record (truncated or not a CIFAR-10 batch)"
        )
    rec = np.frombuffer(raw, np.uint8).reshape(-1, _CIFAR_RECORD)
    labels = rec[:, 0]
    if labels.max() > 9:
        raise DataError(f"{path}: label {int(labels.max())} outside 0..9 (corrupt record)")
    return rec[:, 1:].reshape(-1, 3, 32, 32), labels


# ---------------------------------------------------------------- locating and downloading


def cache_dir(name: str) -> Path:
    """Where downloads for ``name`` go: ``$MINIPS_CACHE_DIR/<name>`` or ~/.cache/minips/<name>."""
    root = os.environ.get("MINIPS_CACHE_DIR") or Path.home() / ".cache" / "minips"
    return Path(root) / name


def _split_paths(spec: Spec, split: str, folder: Path) -> list[Path] | None:
    """Paths of a split's files in ``folder`` (IDX: .gz or raw), or None if any is missing."""
    if spec.kind == "cifar" and not (folder / spec.files[split][0]).exists():
        folder = folder / CIFAR_SUBDIR
    found = []
    for fname in spec.files[split]:
        options = [folder / (fname + ".gz"), folder / fname] if spec.kind == "idx" else [
            folder / fname]
        hit = next((p for p in options if p.is_file()), None)
        if hit is None:
            return None
        found.append(hit)
    return found


def _search_dirs(name: str, spec: Spec, data_dir: str | Path | None) -> list[Path]:
    dirs = [Path(data_dir)] if data_dir is not None else []
    return dirs + [cache_dir(name)] + [Path(d) for d in spec.system_dirs]


def download(name: str, dest: str | Path, *, mirror: str | None = None,
             checksums: dict[str, str] | None = None) -> Path:
    """Fetch the pinned files of ``name`` into ``dest``, verifying each SHA-256.

    ``mirror`` replaces the official base URL (e.g. a local HTTP server); ``checksums``
    replaces the pinned digests (tests serving their own files). Returns ``dest``.
    """
    spec = spec_of(name)
    dest = Path(dest)
    for fname, digest in (checksums or spec.sha256).items():
        url = (mirror or spec.url).rstrip("/") + "/" + fname
        log.info("downloading %s -> %s", url, dest / fname)
        fetch_file(url, dest / fname, digest)
        if fname.endswith(".tar.gz"):  # CIFAR-10: keep only the known batch files
            files = spec.files
            wanted = {f"{CIFAR_SUBDIR}/{f}" for f in (*files["train"], *files["test"])}
            extract_members(dest / fname, dest, wanted)
            (dest / fname).unlink()
    return dest


def spec_of(name: str) -> Spec:
    if name not in SPECS:
        raise ConfigError(f"unknown data set {name!r}; known: {', '.join(DATASET_NAMES)}")
    return SPECS[name]


def find_or_download(name: str, split: str, data_dir: str | Path | None, do_download: bool,
                      mirror: str | None) -> list[Path]:
    spec = spec_of(name)
    dirs = _search_dirs(name, spec, data_dir)
    for folder in dirs:
        if (paths := _split_paths(spec, split, folder)) is not None:
            return paths
    target = dirs[0]
    why = "downloads disabled"
    base = mirror or os.environ.get("MINIPS_DATA_MIRROR") or spec.url
    if do_download:
        try:
            download(name, target, mirror=base)
            if (paths := _split_paths(spec, split, target)) is not None:
                return paths
            why = "download did not produce the files"
        except (OSError, DataError) as exc:
            why = f"download from {base} failed: {exc}"
    names = ", ".join(spec.files[split]) + (
        " (.gz or raw IDX)" if spec.kind == "idx" else f" (from {', '.join(spec.sha256)})")
    raise DataError(
        f"{name}: no {split} files found in {', '.join(map(str, dirs))}; {why}. "
        f"Put {names} into {target} (or pass --data-dir DIR)."
    )


def decode(spec: Spec, paths: list[Path]) -> tuple[np.ndarray, np.ndarray]:
    """Files of one split -> (images (N, C, H, W) uint8, labels (N,) int64), checked."""
    if spec.kind == "idx":
        images, labels = read_idx(paths[0], 3)[:, None], read_idx(paths[1], 1)
        if len(images) != len(labels):
            raise DataError(f"{paths[0]}: {len(images)} images but {paths[1]} has {len(labels)}")
        if images.shape[1:] != spec.shape:
            raise DataError(f"{paths[0]}: images are {images.shape[1:]}, expected {spec.shape}")
        if labels.max(initial=0) > 9:
            raise DataError(f"{paths[1]}: label {int(labels.max())} outside 0..9")
    else:
        parts = [read_cifar_batch(p) for p in paths]
        images = np.concatenate([p[0] for p in parts])
        labels = np.concatenate([p[1] for p in parts])
    return images, labels.astype(np.int64)
