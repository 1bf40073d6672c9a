"""data_files.py: downloads are kept only whole and verified; archives yield only the named
members."""

from __future__ import annotations

import hashlib
import io
import tarfile
from pathlib import Path

import pytest

from minips.errors import DataError
from minips.ml import data_files


def make_tar_gz(path: Path, members: dict[str, bytes]) -> None:
    with tarfile.open(path, "w:gz") as tar:
        for name, payload in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))


def test_extract_writes_only_the_named_members(tmp_path: Path) -> None:
    archive = tmp_path / "a.tar.gz"
    make_tar_gz(archive, {"set/batch_1.bin": b"one", "set/readme.txt": b"not wanted",
                          "../escape.bin": b"outside", "set/../../up.bin": b"outside too"})
    dest = tmp_path / "out"
    data_files.extract_members(archive, dest, {"set/batch_1.bin"})
    written = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    assert written == ["a.tar.gz", "out/set/batch_1.bin"]  # nothing else, no .part left
    assert (dest / "set" / "batch_1.bin").read_bytes() == b"one"


def test_extract_refuses_a_truncated_archive(tmp_path: Path) -> None:
    archive = tmp_path / "a.tar.gz"
    make_tar_gz(archive, {"x.bin": bytes(range(256)) * 64})
    archive.write_bytes(archive.read_bytes()[:60])
    with pytest.raises(DataError, match="a.tar.gz: corrupt or truncated archive"):
        data_files.extract_members(archive, tmp_path / "out", {"x.bin"})


def test_fetch_keeps_a_verified_file(tmp_path: Path, http_dir: tuple[Path, str]) -> None:
    root, url = http_dir
    (root / "f.bin").write_bytes(b"payload" * 1000)
    digest = hashlib.sha256(b"payload" * 1000).hexdigest()
    got = data_files.fetch_file(url + "f.bin", tmp_path / "dl" / "f.bin", digest, timeout=10)
    assert got.read_bytes() == b"payload" * 1000
    assert [p.name for p in (tmp_path / "dl").iterdir()] == ["f.bin"]


def test_fetch_refuses_a_file_over_the_cap(tmp_path: Path, http_dir: tuple[Path, str],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    root, url = http_dir
    (root / "big.bin").write_bytes(b"x" * 5000)
    monkeypatch.setattr(data_files, "MAX_DOWNLOAD_BYTES", 4096)
    monkeypatch.setattr(data_files, "CHUNK_BYTES", 1024)
    with pytest.raises(DataError, match="larger than 4096 bytes, refused"):
        data_files.fetch_file(url + "big.bin", tmp_path / "dl" / "big.bin",
                         hashlib.sha256(b"x" * 5000).hexdigest(), timeout=10)
    assert list((tmp_path / "dl").iterdir()) == []  # neither the file nor its .part
