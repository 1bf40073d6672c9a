"""Download and verify: files fetched over HTTP(S) are kept only if their SHA-256 matches.

Invariants:
- A file appears under its name only whole and verified: bytes go to ``<name>.<pid>.part`` and
  are renamed once the digest matches; a mismatch, a network error or a file over
  ``MAX_DOWNLOAD_BYTES`` leaves nothing behind and raises (``DataError`` for what we refuse).
- Archives are never extracted by their own member paths: only members we name are written.

Public API: ``fetch_file(url, dest, sha256, timeout=...)``, ``extract_members(archive, dest,
wanted)``, ``DOWNLOAD_TIMEOUT_S``, ``MAX_DOWNLOAD_BYTES``, ``CHUNK_BYTES``.
"""

from __future__ import annotations

import hashlib
import os
import tarfile
import urllib.request
import zlib
from pathlib import Path
from typing import Any

from minips.errors import DataError

__all__ = ["DOWNLOAD_TIMEOUT_S", "MAX_DOWNLOAD_BYTES", "CHUNK_BYTES", "fetch_file",
           "extract_members"]

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
