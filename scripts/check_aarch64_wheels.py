"""Check with pip that every core dependency has a Linux aarch64 wheel for Python 3.10 and 3.11.

Edge boards (Jetson with JetPack 6: Ubuntu 22.04, glibc 2.35, Python 3.10; Raspberry Pi OS
bookworm: glibc 2.36, Python 3.11) should install minips without a compiler. For each package
and Python version this asks pip to resolve a binary wheel for aarch64 (``pip install --dry-run
--only-binary=:all: --platform ... --python-version ... --no-deps --report``; pip reads the
wheel's metadata, it installs nothing) and prints the wheel it would take, or why none fits.

``--platform`` takes manylinux tags up to glibc 2.31 by default, so a wheel that passes also
installs on JetPack 5's Ubuntu 20.04 base; ``--glibc 2.35`` allows newer ones. torch is checked
too (``--with-torch``), and a wheel that depends on NVIDIA's CUDA packages is flagged: PyPI's
aarch64 torch is such a CUDA build (for aarch64 servers); a Raspberry Pi takes the CPU build from
PyTorch's own index and a Jetson NVIDIA's wheel (docs/edge.md).

Needs network access to the package index. Prints a table, or JSON with ``--json``; exits 1 when
a package has no wheel for some Python version.

Usage: python scripts/check_aarch64_wheels.py [--python 3.10,3.11] [--glibc 2.31]
       [--with-torch] [--json]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

# pyproject.toml's [project] dependencies with their bounds (numpy<2.3: 2.2.6, not the newest)
_DEPS = re.findall(r'^\s+"((?:numpy|msgpack|lz4|uvloop)[^";]*)', (
    Path(__file__).resolve().parents[1] / "pyproject.toml").read_text(), re.M)
CORE = tuple(_DEPS) or ("numpy", "msgpack", "lz4", "uvloop")


def platforms(glibc_minor: int) -> list[str]:
    """manylinux tags for aarch64 from glibc 2.17 up to 2.<glibc_minor>."""
    tags = ["manylinux2014_aarch64"]
    tags += [f"manylinux_2_{m}_aarch64" for m in range(17, glibc_minor + 1)]
    return tags


def resolve(package: str, python: str, tags: list[str]) -> dict[str, Any]:
    """{"ok", "wheel" or "error"} for ``package`` on aarch64 / ``python``."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet",
               "--ignore-installed", "--only-binary=:all:", "--no-deps", "--python-version",
               python, "--report", str(report), "--target", tmp,
               *(arg for tag in tags for arg in ("--platform", tag)), package]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            lines = [ln for ln in done.stderr.splitlines() if ln.startswith("ERROR")]
            return {"ok": False, "error": (lines or [done.stderr.strip()[-200:]])[0]}
        item = json.loads(report.read_text())["install"][0]
        wheel = item["download_info"]["url"].rsplit("/", 1)[-1]
        needs = item["metadata"].get("requires_dist") or []
        cuda = sorted({d.split("[")[0].split("=")[0].split("<")[0].split(">")[0].strip()
                       for d in needs if d.startswith(("nvidia-", "cuda-"))})
        return {"ok": True, "wheel": wheel, "cuda_deps": cuda}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--python", default="3.10,3.11", help="versions (default %(default)s)")
    ap.add_argument("--glibc", default="2.31", help="newest glibc allowed (default %(default)s)")
    ap.add_argument("--with-torch", action="store_true", help="check torch as well")
    ap.add_argument("--json", action="store_true", help="print JSON")
    args = ap.parse_args()
    tags = platforms(int(args.glibc.split(".")[1]))
    packages = CORE + (("torch",) if args.with_torch else ())
    results = {f"{pkg.split('>')[0]} py{py}": resolve(pkg, py, tags)
               for pkg in packages for py in args.python.split(",")}
    if args.json:
        print(json.dumps(results, indent=1))
    else:
        for key, r in results.items():
            print(f"{key:22} {'ok ' if r['ok'] else 'NO '} {r.get('wheel') or r.get('error')}")
            if r.get("cuda_deps"):
                print(f"{'':26} a CUDA build: it pulls {', '.join(r['cuda_deps'])}")
    return 0 if all(r["ok"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
