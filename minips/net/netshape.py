"""Kernel link shaping for `minips local --link`: one network namespace per worker, joined to
this machine by a veth pair whose two ends are rate-limited by ``tc`` token-bucket filters.

    this machine (servers, evaluator)           namespace minips-link-<pid>-<i> (worker i)
    ml<pid>h<i>  10.214.S.(4i+1)/30  ═══ veth ═══  ml<pid>i<i>  10.214.S.(4i+2)/30
    egress: tbf at the downlink rate             egress: tbf at the uplink rate
                                                 default route via 10.214.S.(4i+1)

The servers listen on worker 0's host-side address (``Namespaces.server_host``); Linux accepts
a packet for any local address on any interface, so every namespace reaches it through its own
veth, and every byte a worker sends or receives crosses its shaped pair. Latency is not shaped
here (no ``netem`` needed): the worker adds it to each send (``worker.EmulatedLink``).

Needs Linux, root (CAP_NET_ADMIN) and iproute2's ``ip`` and ``tc``; ``unavailable()`` says why
not. Names carry the launcher's pid: ``remove()`` deletes what ``create`` made (the launcher
calls it in a ``finally``), and ``remove_stale()`` deletes what a launcher killed by SIGKILL
left (its pid is gone), before a new run creates its own. Workers run under
``ip netns exec`` (which execs the command: the worker stays the launcher's child, so
``lifeline`` still ends it with the launcher).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

from minips.errors import ConfigError, MiniPSError
from minips.net.links import LinkProfile, Rate

__all__ = ["ShapingError", "Namespaces", "unavailable", "create", "remove_stale", "leftovers",
           "plan", "NS_PREFIX", "VETH_PREFIX", "MAX_WORKERS"]

NS_PREFIX = "minips-link-"  # namespaces: minips-link-<launcher pid>-<worker>
VETH_PREFIX = "ml"  # host ends ml<pid>h<worker>, namespace ends ml<pid>i<worker> (<= 15 chars)
NET = "10.214"  # the /16 the /24s of runs are taken from
MAX_WORKERS = 64  # /30 per worker in one /24
TBF_LATENCY = "100ms"  # longest a packet may queue in a tbf before it is dropped
CMD_TIMEOUT_S = 10.0


class ShapingError(MiniPSError):
    """Kernel shaping could not be set up (the reason is the message)."""


def unavailable() -> str | None:
    """Why kernel shaping cannot run here, or None when it can be tried."""
    if not sys.platform.startswith("linux"):
        return "kernel shaping needs Linux network namespaces"
    if os.geteuid() != 0:
        return "kernel shaping needs root (CAP_NET_ADMIN) to create network namespaces"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"kernel shaping needs iproute2's {' and '.join(missing)}"
    return None


def _run(*argv: str) -> str:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=CMD_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ShapingError(f"{' '.join(argv)}: {exc}") from None
    if done.returncode != 0:
        raise ShapingError(f"{' '.join(argv)}: {done.stderr.strip() or done.returncode}")
    return done.stdout


def _quiet(*argv: str) -> None:
    """A clean-up command whose failure (already gone) does not matter."""
    try:
        subprocess.run(argv, capture_output=True, timeout=CMD_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        pass


@dataclass
class Namespaces:
    """The namespaces and veth pairs of one run: worker ``i`` in ``names[i]``."""

    owner: int  # the launcher's pid, part of every name
    subnet: int  # S of 10.214.S.0/24
    names: list[str] = field(default_factory=list)

    def host_ip(self, i: int) -> str:
        return f"{NET}.{self.subnet}.{4 * i + 1}"

    def inside_ip(self, i: int) -> str:
        return f"{NET}.{self.subnet}.{4 * i + 2}"

    @property
    def server_host(self) -> str:
        """Where the servers listen: every namespace reaches it through its own veth."""
        return self.host_ip(0)

    def command(self, i: int, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside worker ``i``'s namespace."""
        return ["ip", "netns", "exec", self.names[i], *argv]

    def veths(self, i: int) -> tuple[str, str]:
        """(host end, namespace end) of worker ``i``'s pair."""
        return f"{VETH_PREFIX}{self.owner}h{i}", f"{VETH_PREFIX}{self.owner}i{i}"

    def set_rate(self, i: int, rate: Rate) -> None:
        """Change worker ``i``'s link to ``rate`` now (``tc qdisc change`` of both tbfs; the
        connections stay up, the next bytes pass at the new rate)."""
        host, inside = self.veths(i)
        _run("tc", "-n", self.names[i], *_tbf(inside, rate.up_bps, "change"))
        _run("tc", *_tbf(host, rate.down_bps, "change"))

    def remove(self) -> None:
        """Delete every veth pair and namespace of this run (what is gone already is fine)."""
        for i, name in enumerate(self.names):
            _quiet("ip", "link", "del", self.veths(i)[0])  # the pair goes at once, not later
            _quiet("ip", "netns", "del", name)
        self.names = []


def create(rates: Sequence[Rate], owner: int | None = None) -> Namespaces:
    """One shaped namespace per rate (worker); ``ShapingError`` (after removing what was
    made) when the kernel or the tools refuse."""
    if len(rates) > MAX_WORKERS:
        raise ShapingError(f"kernel shaping handles up to {MAX_WORKERS} workers, not "
                           f"{len(rates)}")
    owner = os.getpid() if owner is None else owner
    ns = Namespaces(owner, _free_subnet(owner))
    try:
        for i, rate in enumerate(rates):
            _add(ns, i, rate)
    except BaseException:
        ns.remove()
        raise
    return ns


def _add(ns: Namespaces, i: int, rate: Rate) -> None:
    name = f"{NS_PREFIX}{ns.owner}-{i}"
    host, inside = ns.veths(i)
    _run("ip", "netns", "add", name)
    ns.names.append(name)
    _run("ip", "link", "add", host, "type", "veth", "peer", "name", inside, "netns", name)
    _run("ip", "addr", "add", f"{ns.host_ip(i)}/30", "dev", host)
    _run("ip", "link", "set", host, "up")
    _run("ip", "-n", name, "addr", "add", f"{ns.inside_ip(i)}/30", "dev", inside)
    _run("ip", "-n", name, "link", "set", inside, "up")
    _run("ip", "-n", name, "link", "set", "lo", "up")
    _run("ip", "-n", name, "route", "add", "default", "via", ns.host_ip(i))
    _run("tc", "-n", name, *_tbf(inside, rate.up_bps))  # uplink: the worker's egress
    _run("tc", *_tbf(host, rate.down_bps))  # downlink: this machine's egress to the worker


def _tbf(dev: str, bps: float, verb: str = "add") -> list[str]:
    """A token-bucket filter at ``bps`` bits/s (``verb`` add, or change a live one); the bucket
    holds 10 ms of the rate (at least 32 KiB: a segmentation-offloaded packet larger than it
    would be cut up or dropped)."""
    burst = max(32 << 10, int(bps / 8 / 100))
    return ["qdisc", verb, "dev", dev, "root", "tbf", "rate", f"{round(bps)}bit",
            "burst", str(burst), "latency", TBF_LATENCY]


def _free_subnet(owner: int) -> int:
    """A 10.214.S.0/24 no interface of this machine uses (a concurrent run, a test)."""
    used = {int(s) for s in re.findall(rf"inet {re.escape(NET)}\.(\d+)\.",
                                       _run("ip", "-4", "-o", "addr", "show"))}
    for k in range(256):
        s = (owner + k) % 256
        if s not in used:
            return s
    raise ShapingError(f"no free {NET}.S.0/24 for the veth pairs")


def _owners() -> tuple[dict[int, list[str]], dict[int, list[str]]]:
    """Namespaces and host-side veths of every run, by launcher pid."""
    spaces: dict[int, list[str]] = {}
    for line in _run("ip", "netns", "list").splitlines():
        m = re.match(rf"{re.escape(NS_PREFIX)}(\d+)-\d+\b", line.strip())
        if m:
            spaces.setdefault(int(m.group(1)), []).append(m.group(0))
    veths: dict[int, list[str]] = {}
    for m in re.finditer(rf"^\d+: ({VETH_PREFIX}(\d+)h\d+)[@:]",
                         _run("ip", "-o", "link", "show"), re.M):
        veths.setdefault(int(m.group(2)), []).append(m.group(1))
    return spaces, veths


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale() -> list[str]:
    """Delete the namespaces and veths of runs whose launcher is gone; return their names."""
    spaces, veths = _owners()
    gone: list[str] = []
    for pid in sorted(set(spaces) | set(veths)):
        if _alive(pid):
            continue
        for veth in veths.get(pid, []):
            _quiet("ip", "link", "del", veth)
        for name in spaces.get(pid, []):
            _quiet("ip", "netns", "del", name)
        gone += veths.get(pid, []) + spaces.get(pid, [])
    return gone


def leftovers(owner: int) -> list[str]:
    """The namespaces and host-side veths launcher ``owner`` still has (for tests)."""
    spaces, veths = _owners()
    return spaces.get(owner, []) + veths.get(owner, [])


def plan(profile: LinkProfile | None, workers: int, wanted: str) -> tuple[str, Namespaces | None]:
    """How a local run shapes its workers' links: ("none" | "pacer" | "kernel", the namespaces
    when kernel). ``wanted`` is --link-shaping: ``auto`` takes kernel shaping when it can be set
    up here and falls back to the pacer (saying why); ``kernel`` refuses to fall back."""
    if profile is None or not profile.rates:
        return "none", None  # no rate to shape (a latency alone is added by the workers)
    if wanted == "pacer":
        return "pacer", None
    why = unavailable()
    if why is None:
        remove_stale()
        try:
            return "kernel", create([profile.rate(i) for i in range(workers)])
        except ShapingError as exc:
            why = str(exc)
    if wanted == "kernel":
        raise ConfigError(f"--link-shaping kernel: {why}")
    print(f"minips local: {why}; the workers pace their links themselves (--link-shaping "
          f"pacer)", file=sys.stderr, flush=True)
    return "pacer", None
