"""Check the edge path on arm64: an aarch64 Debian root run under qemu-user-static on this machine.

docs/edge.md says how a worker installs on an aarch64 board (Raspberry Pi, Jetson's CPU, an
ARM server). This script checks it end to end without a board, as root:

1. **root**: ``debootstrap --arch=arm64`` builds a Debian bookworm root (Python 3.11) in
   ``--cache`` (default ``~/.cache/minips-arm64``); the kernel runs its binaries through
   qemu-user-static (binfmt_misc). Built once: later runs reuse it.
2. **core**: a venv ``/opt/minips-core`` in that root with minips' core dependencies from binary
   wheels only (``pip install --only-binary=:all:``, the bounds of pyproject.toml) and the test
   tools, then minips itself from this checkout (``--no-deps``): no compiler, no torch.
3. **tests**: the codec, sparse, compressor and protocol tests (they need no torch) run there.
4. **torch**: the worker-only torch route of docs/edge.md in ``/opt/minips-torch``
   (``--torch-spec``, default the newest torch whose PyPI aarch64 wheel is a CPU build).
5. **worker**: ``minips server`` here (x86, 127.0.0.1, port chosen by the kernel) with two
   workers here and one aarch64 worker inside the root (an emulated Cortex-A76, which has
   no bfloat16, started with ``--amp``), GSSP in two groups, a few steps; every role must exit
   0, the server must group the emulated worker apart, and its console must hold no C++
   warning or trace (but oneDNN's line about MIDR_EL1's sysfs entry, which only emulation
   causes).

Each step prints one line with its time (and sizes); ``--json FILE`` writes them all. Where
qemu-user-static, binfmt_misc or debootstrap cannot be had (or not as root) it prints one line
``check_arm64: skipped: <why>`` and exits 0 (``--strict``: exit 3). It ends everything it
started: the roles (by process group), and it unmounts what it mounted in the root (/proc,
/sys, /dev) and binfmt_misc if it mounted that.

Needs network access to Debian's archive (first run) and PyPI. Slow under emulation (the first
run builds the root: minutes); it is not part of the test suite (``make check-arm64``).

Usage: sudo python scripts/check_arm64.py [--cache DIR] [--steps root,core,tests,torch,worker]
       [--tests FILE,...] [--torch-spec SPEC] [--worker-steps N] [--json FILE] [--strict]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # the project's own fallback (pyproject.toml: tomli below 3.11)
    import tomli as tomllib

__all__ = ["STEPS", "build_parser", "missing_tools", "main"]

REPO = Path(__file__).resolve().parent.parent
STEPS = ("root", "core", "tests", "torch", "worker")
SUITE = "bookworm"  # Python 3.11, glibc 2.36: Raspberry Pi OS's base
MIRROR = "http://deb.debian.org/debian"
PACKAGES = "python3,python3-venv,ca-certificates"
TESTS = ("tests/test_sparse.py", "tests/test_protocol.py", "tests/test_conversation.py",
         "tests/test_compressors.py", "tests/test_decoders.py", "tests/test_gdtopk.py",
         "tests/test_protocol_fuzz.py")
BUILD_TOOLS = ("setuptools>=64", "wheel")  # minips is built in the venv, without isolation
# the one test of those files that needs torch (it runs scripts/bench_sparse.py, which imports it)
DESELECT = ("tests/test_sparse.py::test_bench_script_prints_one_json_object",)
TEST_TOOLS = ("pytest>=8", "pytest-asyncio>=0.23", "hypothesis>=6", "pytest-timeout>=2.2")
# torch 2.11 on is a CUDA 13 build on PyPI's aarch64 (2.85 GB of NVIDIA wheels with 2.13);
# 2.10.0's aarch64 wheel is the newest CPU build there (140 MB). docs/edge.md says the same.
TORCH_SPEC = "torch==2.10.0"
CHROOT_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
              "HOME": "/root", "LANG": "C.UTF-8", "PIP_DISABLE_PIP_VERSION_CHECK": "1",
              "PIP_CERT": "/etc/ssl/certs/host-ca.crt",
              "SSL_CERT_FILE": "/etc/ssl/certs/host-ca.crt",
              "PIP_DEFAULT_TIMEOUT": "180", "PYTHONDONTWRITEBYTECODE": "1"}
BINFMT = Path("/proc/sys/fs/binfmt_misc")
# The Raspberry Pi 5's core, ARMv8.2 without bfloat16 like the Jetson Orin's Cortex-A78AE (which
# this qemu does not model); qemu's default "max" would offer bfloat16 and SVE no board has.
QEMU_CPU = "cortex-a76"
# lines a C++ library writes to the console (torch's warnings, oneDNN and its xbyak_aarch64)
CPP_MARKS = ("Triggered internally", "frame #", "mkldnn", "mkl-dnn", "oneDNN", "xbyak", ".h, ")
# ... except what only emulation causes: qemu-user on an x86 kernel has no aarch64 sysfs entries
EMULATION_ONLY = ("Can't open MIDR_EL1 sysfs entry",)
VENVS = ("/opt/minips-core", "/opt/minips-torch")  # in the root: without torch, with it
ARM_RUN_DIR = "/tmp/minips-arm64-worker"  # the emulated worker's run directory, in the root
ROLE_TIMEOUT_S = 900.0  # the emulated worker: torch's import alone takes ~1 min under qemu


class Skip(Exception):
    """This machine cannot run the check (no qemu, binfmt_misc, debootstrap or root)."""


class Failed(Exception):
    """A step ran and failed; the message says which and why."""


# -- what the machine has -----------------------------------------------------------------------

def missing_tools(which: Any = shutil.which, euid: int | None = None) -> str | None:
    """Why this machine cannot build and run an arm64 root, or None when it can."""
    if (os.geteuid() if euid is None else euid) != 0:
        return "needs root (debootstrap, chroot and mounts)"
    for tool, package in (("qemu-aarch64-static", "qemu-user-static"),
                          ("debootstrap", "debootstrap"), ("chroot", "coreutils")):
        if which(tool) is None:
            return f"{tool} not found (apt-get install -y {package} binfmt-support)"
    return None


def binfmt_ready(mounted: list[Path]) -> None:
    """Make sure the kernel runs aarch64 ELF files through qemu (mounting binfmt_misc if needed)."""
    if not (BINFMT / "status").exists():
        done = subprocess.run(["mount", "-t", "binfmt_misc", "binfmt_misc", str(BINFMT)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise Skip(f"binfmt_misc cannot be mounted: {done.stderr.strip()}")
        mounted.append(BINFMT)
    if not (BINFMT / "qemu-aarch64").exists() and shutil.which("update-binfmts"):
        subprocess.run(["update-binfmts", "--enable", "qemu-aarch64"], capture_output=True)
    entry = BINFMT / "qemu-aarch64"
    if not entry.exists() or "enabled" not in entry.read_text():
        raise Skip("binfmt_misc has no enabled qemu-aarch64 entry (apt-get install -y "
                   "binfmt-support qemu-user-static)")


# -- running things -----------------------------------------------------------------------------

def run(cmd: list[str], what: str, timeout: float = 3600, **kw: Any) -> str:
    """Run ``cmd`` nicely (niceness 10: this machine's cores are shared); its output, or Failed."""
    try:
        done = subprocess.run(["nice", "-n", "10", *cmd], capture_output=True, text=True,
                              timeout=timeout, **kw)
    except subprocess.TimeoutExpired as e:
        raise Failed(f"{what}: no answer within {timeout:.0f} s") from e
    if done.returncode != 0:
        tail = (done.stdout + done.stderr).strip().splitlines()[-15:]
        raise Failed(f"{what}: exit {done.returncode}\n    " + "\n    ".join(tail))
    return done.stdout


def inside(root: Path, argv: list[str], **env: str) -> list[str]:
    """The command line that runs ``argv`` in ``root`` with a clean environment, on the emulated
    CPU QEMU_CPU names (each aarch64 program started in there is a new qemu: it reads it)."""
    pairs = [f"{k}={v}" for k, v in {**CHROOT_ENV, "QEMU_CPU": QEMU_CPU, **env}.items()]
    return ["chroot", str(root), "/usr/bin/env", "-i", *pairs, *argv]


@contextlib.contextmanager
def mounts(root: Path, mounted: list[Path]) -> Iterator[None]:
    """/proc, /sys and /dev inside ``root`` for the duration; unmounted in reverse order after."""
    mine: list[Path] = []
    try:
        for src, args in (("/proc", ["-t", "proc", "proc"]), ("/sys", ["--rbind", "/sys"]),
                          ("/dev", ["--rbind", "/dev"])):
            target = root / src.lstrip("/")
            if not os.path.ismount(target):
                subprocess.run(["mount", *args, str(target)], check=True)
                if args[0] == "--rbind":
                    subprocess.run(["mount", "--make-rslave", str(target)], check=True)
                mine.append(target)
        mounted.extend(mine)
        yield
    finally:
        for target in reversed(mine):
            subprocess.run(["umount", "-R", "-l", str(target)], capture_output=True)
            if target in mounted:
                mounted.remove(target)


def du_mb(path: Path) -> float:
    """Disk use of ``path`` in MB (du's apparent size of the files)."""
    out = subprocess.run(["du", "-sk", str(path)], capture_output=True, text=True).stdout
    return round(int(out.split()[0]) / 1024, 1) if out else 0.0


# -- the steps ----------------------------------------------------------------------------------

def step_root(root: Path) -> dict[str, Any]:
    """debootstrap an arm64 bookworm root once; reused while its marker file is there."""
    marker = root / ".minips-root-ok"
    if marker.exists():
        return {"reused": True, "size_mb": du_mb(root)}
    building = root.with_name(root.name + ".partial")
    shutil.rmtree(building, ignore_errors=True)
    building.parent.mkdir(parents=True, exist_ok=True)
    run(["debootstrap", "--arch=arm64", "--variant=minbase", f"--include={PACKAGES}", SUITE,
         str(building), MIRROR], "debootstrap", timeout=5400)
    shutil.rmtree(root, ignore_errors=True)
    building.rename(root)
    marker.write_text(f"{SUITE} arm64 {time.strftime('%Y-%m-%d')}\n")
    return {"reused": False, "size_mb": du_mb(root)}


def stage_source(root: Path) -> None:
    """This checkout's package, tests and metadata copied to /opt/minips-src (fresh each run),
    and the host's CA bundle, so pip in the root trusts what pip here trusts."""
    src = root / "opt/minips-src"
    shutil.rmtree(src, ignore_errors=True)
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build")
    for name in ("minips", "tests", "docs", "scripts"):  # tests read docs/ and run scripts/
        shutil.copytree(REPO / name, src / name, ignore=skip)
    for name in ("pyproject.toml", "README.md", "constraints.txt"):
        shutil.copy2(REPO / name, src / name)
    bundle = os.environ.get("SSL_CERT_FILE") or "/etc/ssl/certs/ca-certificates.crt"
    shutil.copy2(bundle, root / "etc/ssl/certs/host-ca.crt")
    shutil.copy2("/etc/resolv.conf", root / "etc/resolv.conf")


def core_requirements() -> list[str]:
    """pyproject.toml's core dependencies (their bounds as the project states them)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return list(project["dependencies"])


def make_venv(root: Path, venv: str) -> None:
    """A venv at ``venv`` in the root (kept across runs; pip skips what it already has)."""
    if not (root / venv.lstrip("/") / "bin/python").exists():
        run(inside(root, ["python3", "-m", "venv", venv]), f"venv {venv}", timeout=900)


def installed(root: Path, venv: str) -> dict[str, str]:
    """name -> version of what the venv holds."""
    out = run(inside(root, [f"{venv}/bin/python", "-m", "pip", "list", "--format=json"]),
              "pip list", timeout=900)
    return {p["name"].lower(): p["version"] for p in json.loads(out)}


def install_minips(root: Path, venv: str) -> None:
    """minips from /opt/minips-src, no dependencies, no build isolation (setuptools of the venv)."""
    run(inside(root, [f"{venv}/bin/python", "-m", "pip", "install", "-q", "--no-deps",
                      "--no-build-isolation", "/opt/minips-src"]), "pip install minips",
        timeout=1800)
    shutil.rmtree(root / "opt/minips-src/build", ignore_errors=True)


def step_core(root: Path) -> dict[str, Any]:
    """The torch-free install: binary wheels only for every dependency, then minips."""
    venv = VENVS[0]
    make_venv(root, venv)
    t = time.monotonic()
    run(inside(root, [f"{venv}/bin/python", "-m", "pip", "install", "-q",
                      "--only-binary=:all:", *core_requirements(), *BUILD_TOOLS, *TEST_TOOLS]),
        "pip install --only-binary=:all: (core)", timeout=3600)
    deps_s = time.monotonic() - t
    install_minips(root, venv)
    have = installed(root, venv)
    return {"deps_s": round(deps_s, 1), "venv_mb": du_mb(root / venv.lstrip("/")),
            "versions": {k: have[k] for k in ("numpy", "msgpack", "lz4", "uvloop", "minips")
                         if k in have}, "torch": have.get("torch")}


def step_tests(root: Path, tests: list[str]) -> dict[str, Any]:
    """The torch-free tests inside the root, under the core venv (no torch there)."""
    report = "/opt/minips-src/.pytest-report.txt"
    cmd = ["/opt/minips-core/bin/python", "-m", "pytest", "-q", "-p", "no:cacheprovider",
           "-o", "addopts=-m 'not slow'", "--timeout", "600",
           *(arg for t in DESELECT for arg in ("--deselect", t)), *tests]
    out = run(inside(root, ["sh", "-c", f"cd /opt/minips-src && {' '.join(map(_q, cmd))}"
                            f" > {report} 2>&1; rc=$?; cat {report}; exit $rc"]),
              "pytest (arm64)", timeout=5400)
    summary = [ln for ln in out.splitlines() if " passed" in ln or " failed" in ln]
    return {"files": tests, "summary": (summary or ["?"])[-1].strip("= ")}


def _q(s: str) -> str:
    """``s`` quoted for sh."""
    return "'" + s.replace("'", "'\"'\"'") + "'"


def step_torch(root: Path, spec: str) -> dict[str, Any]:
    """The worker-only torch route: ``spec`` from PyPI, then minips without the torch extra."""
    venv = VENVS[1]
    make_venv(root, venv)
    t = time.monotonic()
    run(inside(root, [f"{venv}/bin/python", "-m", "pip", "install", "-q", "--only-binary=:all:",
                      spec, *core_requirements(), *BUILD_TOOLS]), f"pip install {spec}",
        timeout=3600)
    install_s = time.monotonic() - t
    install_minips(root, venv)
    have = installed(root, venv)
    heavy = sorted(k for k in have if k.startswith(("nvidia-", "cuda-", "triton")))
    if heavy:
        raise Failed(f"{spec} pulled CUDA packages on aarch64: {', '.join(heavy)}")
    t = time.monotonic()
    probe = run(inside(root, [f"{venv}/bin/python", "-c",
                              "import torch; print(torch.__version__, torch.cuda.is_available(),"
                              " torch.backends.mkldnn.is_available())"]), "import torch",
                timeout=1800).split()
    return {"spec": spec, "install_s": round(install_s, 1), "import_s":
            round(time.monotonic() - t, 1), "torch": probe[0], "cuda": probe[1] == "True",
            "venv_mb": du_mb(root / venv.lstrip("/")), "versions": {
                k: have[k] for k in ("torch", "numpy", "minips") if k in have}}


# -- the worker run -----------------------------------------------------------------------------

class Roles:
    """The processes of the worker run, each in its own process group; all ended on exit."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.procs: dict[str, tuple[subprocess.Popen[bytes], IO[bytes]]] = {}

    def start(self, name: str, argv: list[str], **kw: Any) -> subprocess.Popen[bytes]:
        log = open(self.logs / f"{name}.log", "wb")  # noqa: SIM115 (closed with the process)
        proc = subprocess.Popen(["nice", "-n", "10", *argv], stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True, **kw)
        self.procs[name] = (proc, log)
        return proc

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text(errors="replace")

    def wait(self, deadline: float) -> dict[str, int | None]:
        """Each role's exit status, waiting until ``deadline`` (None: still running then)."""
        codes: dict[str, int | None] = {}
        for name, (proc, _) in self.procs.items():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            codes[name] = proc.returncode
        return codes

    def end(self) -> None:
        """SIGTERM to each group still running, SIGKILL after 10 s; logs closed."""
        for sig, grace in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
            for proc, _ in self.procs.values():
                if proc.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, sig)
            for proc, _ in self.procs.values():
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=grace)
        for _, log in self.procs.values():
            log.close()


def wait_for_file(path: Path, proc: subprocess.Popen[bytes], timeout: float) -> str:
    """The text of ``path`` once written (polled), or Failed if ``proc`` ends first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip():
            return path.read_text()
        if proc.poll() is not None:
            raise Failed(f"the server exited {proc.returncode} before listening")
        time.sleep(0.2)  # polling a file the server writes once it listens
    raise Failed(f"the server wrote no ready file within {timeout:.0f} s")


def grouping(run_dir: Path) -> dict[str, Any]:
    """The server's first grouping (global.jsonl's ``groups`` record): worker id -> group, and
    the speeds it grouped by."""
    for line in (run_dir / "global.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec.get("event") == "groups":
            return {k: rec.get(k) for k in ("assignment", "iteration_s", "compute_s")}
    return {}


def step_worker(root: Path, steps: int, data: str) -> dict[str, Any]:
    """An x86 server and two workers here, an aarch64 worker in the root, GSSP in two groups."""
    minips = shutil.which("minips", path=str(Path(sys.executable).parent)) or "minips"
    with tempfile.TemporaryDirectory(prefix="arm64-run-") as tmp:
        tmp_path = Path(tmp)
        run_dir, ready = tmp_path / "server", tmp_path / "ready"
        roles = Roles(tmp_path)
        shutil.rmtree(root / ARM_RUN_DIR.lstrip("/"), ignore_errors=True)  # an earlier run's
        common = ["--data", data]
        try:
            t = time.monotonic()
            server = roles.start("server", [
                minips, "server", "--host", "127.0.0.1", "--port", "0", "--workers", "3",
                "--mode", "gssp", "--groups", "2", "--max-steps", str(steps), "--compressor",
                "topk", "--calib-timeout", str(ROLE_TIMEOUT_S), "--run-dir", str(run_dir),
                "--ready-file", str(ready)])
            port = wait_for_file(ready, server, 120).split()[1]
            address = f"127.0.0.1:{port}"
            for i in range(2):  # two quick x86 workers: one group; the slow arm64 one: the other
                roles.start(f"worker-x86-{i}", [
                    minips, "worker", "--connect", address, "--device", "cpu", "--run-dir",
                    str(tmp_path / f"w-x86-{i}"), *common])
            roles.start("worker-arm64", inside(root, [
                "/opt/minips-torch/bin/minips", "worker", "--connect", address, "--device", "cpu",
                "--run-dir", ARM_RUN_DIR, "--timeout", "600", "--amp",
                *common]))
            codes = roles.wait(time.monotonic() + ROLE_TIMEOUT_S)
            wall = time.monotonic() - t
            result = {"exit": codes, "wall_s": round(wall, 1), **grouping(run_dir),
                      **arm_worker_facts(root, roles.log("worker-arm64"))}
            if any(c != 0 for c in codes.values()):
                tails = {n: roles.log(n).strip().splitlines()[-6:] for n in codes}
                raise Failed(f"worker run: exit codes {codes}; last lines {tails}")
            apart = apart_from_the_rest(result)
            if apart:
                raise Failed(f"worker run: {apart}")
            if result["cpp_trace_lines"]:
                raise Failed("the arm64 worker's console holds a C++ warning or trace: "
                             f"{result['cpp_trace_lines'][:3]}")
            return result
        finally:
            roles.end()


def apart_from_the_rest(result: dict[str, Any]) -> str | None:
    """Why the emulated worker is not alone in its group (None when it is)."""
    assignment, arm = result.get("assignment") or {}, result.get("worker_id")
    if str(arm) not in assignment:
        return f"no grouping of the arm64 worker ({arm}) in global.jsonl: {assignment}"
    mates = [w for w, g in assignment.items() if g == assignment[str(arm)] and w != str(arm)]
    return f"the arm64 worker {arm} shares its group with {mates}" if mates else None


def arm_worker_facts(root: Path, log: str) -> dict[str, Any]:
    """What the emulated worker said about itself (its device line and step times)."""
    lines = log.splitlines()
    facts: dict[str, Any] = {
        "device_line": next((ln.strip() for ln in lines if ": device " in ln), None),
        "amp_line": next((ln.strip() for ln in lines if "--amp:" in ln), None),
        "console": [ln.strip() for ln in lines[:40]],
        "cpp_trace_lines": [ln.strip() for ln in lines if any(mark in ln for mark in CPP_MARKS)
                            and not any(known in ln for known in EMULATION_ONLY)]}
    records = sorted((root / ARM_RUN_DIR.lstrip("/")).glob("worker-*.jsonl"))
    if records:
        facts["worker_id"] = int(records[-1].stem.split("-")[1])
        with contextlib.suppress(OSError, ValueError):  # its resident memory, as it recorded it
            info = json.loads(records[-1].with_suffix(".device.json").read_text())
            facts.update({k: info.get(k) for k in ("rss_mb", "max_rss_mb", "amp_dtype")})
        steps = [json.loads(ln) for ln in records[-1].read_text().splitlines() if ln.strip()]
        times = sorted(r["step_time"] for r in steps if "step_time" in r)
        facts["steps"] = len(times)
        facts["median_step_ms"] = round(1000 * times[len(times) // 2], 1) if times else None
    return facts


# -- main ---------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache/minips-arm64",
                    help="where the arm64 root is built and kept (default %(default)s)")
    ap.add_argument("--steps", default=",".join(STEPS),
                    help="which steps, comma-separated, in order (default %(default)s)")
    ap.add_argument("--tests", default=",".join(TESTS), help="test files run in the root")
    ap.add_argument("--torch-spec", default=TORCH_SPEC,
                    help="the torch requirement of the worker route (default %(default)s)")
    ap.add_argument("--worker-steps", type=int, default=6,
                    help="steps of the worker run (default %(default)s)")
    ap.add_argument("--data", default="synthetic", choices=("synthetic", "real"),
                    help="the workers' data (default %(default)s)")
    ap.add_argument("--fresh", action="store_true",
                    help="rebuild the two venvs, pip's cache emptied (the root is kept): "
                    "installs timed from scratch")
    ap.add_argument("--json", type=Path, help="write every step's figures here")
    ap.add_argument("--strict", action="store_true", help="exit 3 when the check is skipped")
    return ap


def parse_steps(text: str) -> list[str]:
    """The steps asked for, checked against STEPS (ValueError names an unknown one)."""
    steps = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in steps if s not in STEPS]
    if unknown or not steps:
        raise ValueError(f"--steps {text!r}: unknown step {unknown[0] if unknown else '(none)'}"
                         f"; choose from {', '.join(STEPS)}")
    return steps


def run_steps(args: argparse.Namespace, steps: list[str], mounted: list[Path]) -> dict[str, Any]:
    """Each step in order, printing one line per step; the figures of all of them."""
    root, out = args.cache / "root", {}
    binfmt_ready(mounted)
    if "root" in steps or not (root / ".minips-root-ok").exists():
        out["root"] = timed("root", lambda: step_root(root))
    with mounts(root, mounted):
        stage_source(root)
        for venv in (VENVS + ("/root/.cache/pip",) if args.fresh else ()):
            shutil.rmtree(root / venv.lstrip("/"), ignore_errors=True)
        table = {"core": lambda: step_core(root),
                 "tests": lambda: step_tests(root, args.tests.split(",")),
                 "torch": lambda: step_torch(root, args.torch_spec),
                 "worker": lambda: step_worker(root, args.worker_steps, args.data)}
        for name in (s for s in STEPS if s in steps and s != "root"):
            out[name] = timed(name, table[name])
    return out


def timed(name: str, fn: Any) -> dict[str, Any]:
    """Run one step, print its line (figures and seconds) and return its figures."""
    print(f"check_arm64: {name} ...", flush=True)
    t = time.monotonic()
    result = fn()
    result["seconds"] = round(time.monotonic() - t, 1)
    print(f"check_arm64: {name} ok  {json.dumps(result)}", flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        steps = parse_steps(args.steps)
    except ValueError as e:
        print(f"check_arm64: {e}", file=sys.stderr)
        return 2
    why = missing_tools()
    if why:
        print(f"check_arm64: skipped: {why}")
        return 3 if args.strict else 0
    mounted: list[Path] = []
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # finally-blocks clean up
    try:
        out = run_steps(args, steps, mounted)
    except Skip as e:
        print(f"check_arm64: skipped: {e}")
        return 3 if args.strict else 0
    except Failed as e:
        print(f"check_arm64: FAILED {e}", file=sys.stderr)
        return 1
    finally:
        for target in reversed(mounted):  # binfmt_misc, if this run mounted it
            subprocess.run(["umount", str(target)], capture_output=True)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    print(f"check_arm64: all {len(out)} steps passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
