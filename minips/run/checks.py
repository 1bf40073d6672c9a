"""Checks of command-line values, run before any server listens or any child starts (no torch).

Two kinds: argparse *types* (``port``, ``finite``, ``on_off``, ``local_steps_arg``,
``int_at_least`` ...), for which
argparse names the option itself, and *start checks* (``check_run``, ``check_init``,
``check_tls_server`` ...) that look at files, names and combinations and raise
``ConfigError``. Every message reads "OPTION VALUE: what is wrong; what is allowed", so
`minips` prints one line and exits 2 instead of failing later in a child process, a worker's
join or a traceback.

``speaks_tls`` tells a plain client why a server hung up on it: it answers a TLS handshake.
"""

from __future__ import annotations

import argparse
import json
import math
import socket
import ssl
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from minips.compress.registry import COMPRESSORS, make_compressor
from minips.core.config import MODEL_NAMES, PARAM_COUNTS, RunConfig
from minips.core.slowdown import parse_schedule, parse_schedules, parse_throttle
from minips.errors import ConfigError
from minips.ml.data_files import DATASET_NAMES
from minips.net.endpoints import client_ssl, parse_address, server_ssl
from minips.net.links import parse_link_changes, parse_profile

__all__ = [
    "finite",
    "argtype",
    "checked_text",
    "on_off",
    "local_steps_arg",
    "at_least",
    "int_at_least",
    "port",
    "ports",
    "load_run_config",
    "check_run",
    "check_dir",
    "check_init",
    "check_checkpoint",
    "check_tls_server",
    "check_tls_client",
    "check_address",
    "check_host",
    "check_link",
    "speaks_tls",
]


T = TypeVar("T")

TLS_PROBE_S = 3.0  # how long ``speaks_tls`` waits for a server's TLS handshake


# -- argparse types (argparse prefixes "argument --flag: ") -----------------------------------


def finite(text: str) -> float:
    """A float that is a number (not nan, inf)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text} is not allowed: expected a finite number")
    return value


def on_off(text: str) -> bool:
    """A switch: on | off (also true | false, yes | no, 1 | 0)."""
    value = {"on": True, "true": True, "yes": True, "1": True,
             "off": False, "false": False, "no": False, "0": False}.get(text.lower())
    if value is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not allowed: expected on or off")
    return value


def local_steps_arg(text: str) -> int:
    """--local-steps: an int >= 1, or ``auto`` (0: each group's H from its speed)."""
    if text.strip().lower() == "auto":
        return 0
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not allowed: expected an int >= 1 "
                                         "or auto") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not allowed: expected >= 1 or auto")
    return value


def at_least(low: float, *, strict: bool = False) -> Callable[[str], float]:
    """Type of a finite float >= ``low`` (> ``low`` when ``strict``)."""
    def check(text: str) -> float:
        value = finite(text)
        if value < low or (strict and value == low):
            raise argparse.ArgumentTypeError(
                f"{text} is not allowed: expected a number {'>' if strict else '>='} {low:g}")
        return value
    return check


def int_at_least(low: int) -> Callable[[str], int]:
    """Type of an integer >= ``low``."""
    def check(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{text} is not allowed: expected an integer "
                                             f">= {low}")
        return value
    return check


def argtype(parse: Callable[[str], T]) -> Callable[[str], T]:
    """An argparse type from a parser of minips' own: its ``ConfigError`` becomes the one-line
    reason argparse prints after "argument --flag: "."""
    def check(text: str) -> T:
        try:
            return parse(text)
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    check.__doc__ = parse.__doc__
    return check


def checked_text(parse: Callable[[str], object]) -> Callable[[str], str]:
    """``parse`` run for its checks only; the flag keeps its text."""
    def keep(text: str) -> str:
        parse(text)
        return text
    return keep


# --link-change W:RATE@T,... kept as text; `minips local --slowdown` a schedule per worker
# (1,1,2x2,4@0,1@60s); `minips worker --slowdown` F or F@T,F@T; --throttle P,MIN-MAX,SECONDS
# kept as its canonical text ("" is none)
link_changes = argtype(checked_text(parse_link_changes))
slowdown_schedules = argtype(parse_schedules)
worker_slowdown = argtype(parse_schedule)
throttle_spec = argtype(lambda text: parse_throttle(text).text() if text else "")


def port(text: str) -> int:
    """A TCP port, 0 (any free one) to 65535."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{text} is not a port: expected 0..65535")
    return value


def ports(text: str) -> list[int]:
    """Type of a list of ports: '7071,7072' or a range '7071-7074' (each 1..65535, distinct)."""
    out: list[int] = []
    for part in (p.strip() for p in text.split(",")):
        low, sep, high = part.partition("-")
        try:
            first, last = int(low), int(high if sep else low)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: expected ports P,P,... or a range "
                                             "P-Q") from None
        out += range(first, last + 1)
    if not out or not all(1 <= p <= 65535 for p in out) or len(set(out)) != len(out):
        raise argparse.ArgumentTypeError(f"{text!r}: expected distinct ports in 1..65535")
    return out


# -- start checks ------------------------------------------------------------------------------


def load_run_config(path: str) -> dict[str, Any]:
    """The JSON object in ``--run-config`` ``path``."""
    try:
        with open(path, encoding="utf-8") as f:
            values = json.load(f)
    except OSError as exc:
        raise ConfigError(f"--run-config {path}: cannot read it ({exc.strerror})") from None
    except ValueError as exc:
        raise ConfigError(f"--run-config {path}: not valid JSON ({exc})") from None
    if not isinstance(values, dict):
        raise ConfigError(f"--run-config {path}: expected a JSON object of run settings, got "
                          f"{type(values).__name__}")
    return values


def check_run(run: RunConfig) -> None:
    """What ``RunConfig.validate`` cannot see without the registries: names and options."""
    if run.model not in MODEL_NAMES:
        raise ConfigError(f"--model {run.model}: unknown model; expected one of "
                          f"{', '.join(MODEL_NAMES)}")
    if run.dataset not in DATASET_NAMES:
        raise ConfigError(f"--dataset {run.dataset}: unknown data set; expected one of "
                          f"{', '.join(DATASET_NAMES)}")
    if run.compressor not in COMPRESSORS:
        raise ConfigError(f"--compressor {run.compressor}: unknown compressor; expected one of "
                          f"{', '.join(COMPRESSORS)}")
    _check_compressor_options(run)


def _check_compressor_options(run: RunConfig) -> None:
    """Build the compressor on a tiny vector: an option it does not take, or a bad value, is
    refused here rather than by every worker at its join."""
    def build(**opts: Any) -> None:
        make_compressor(run.compressor, 64, ratio=run.ratio, seed=0, **opts)

    for key, value in run.compressor_opts.items():
        try:
            build(**{key: value})
        except (ConfigError, TypeError, ValueError) as exc:
            why = (f"compressor {run.compressor} has no option {key!r}"
                   if "unexpected keyword" in str(exc) else str(exc))
            raise ConfigError(f"--copt {key}={value}: {why}") from None
    try:
        build(**run.compressor_opts)
    except (ConfigError, TypeError, ValueError) as exc:
        raise ConfigError(f"--copt {run.compressor_opts}: {exc}") from None


def check_dir(option: str, path: str | None) -> None:
    """``path`` (when given) is an existing directory."""
    if path is not None and not Path(path).is_dir():
        raise ConfigError(f"{option} {path}: no such directory")


def check_init(path: str | None, model: str) -> None:
    """``--init`` is a .npy file of one flat float vector of the model's size."""
    if path is None:
        return
    try:
        w = np.load(path, allow_pickle=False, mmap_mode="r")
    except FileNotFoundError:
        raise ConfigError(f"--init {path}: no such file") from None
    except (OSError, ValueError):  # not the .npy magic: np.load takes it for a pickle
        raise ConfigError(f"--init {path}: not a .npy array file (np.save writes one)") from None
    if not isinstance(w, np.ndarray) or w.ndim != 1 or w.dtype.kind != "f":
        raise ConfigError(f"--init {path}: expected a 1-D float array (flat weights), got "
                          f"{getattr(w, 'dtype', '?')} of shape {getattr(w, 'shape', '?')}")
    if model in PARAM_COUNTS and w.size != PARAM_COUNTS[model]:
        raise ConfigError(f"--init {path}: {w.size} weights, but model {model} has "
                          f"{PARAM_COUNTS[model]}")


def _check_file(option: str, path: str) -> None:
    if not Path(path).is_file():
        raise ConfigError(f"{option} {path}: no such file")


def check_checkpoint(path: str | None, *, force: bool) -> None:
    """A fresh run's ``--checkpoint`` file must not exist: it would overwrite a resumable run's
    (``--resume`` continues that run; ``--force`` lets the new run replace it)."""
    if path is not None and Path(path).exists() and not force:
        raise ConfigError(f"--checkpoint {path}: the file exists (an earlier run's); pass "
                          "--resume to continue that run, or --force to overwrite it")


def check_tls_server(cert: str | None, key: str | None) -> None:
    """``--tls-cert`` / ``--tls-key`` exist and load as a PEM certificate and its key."""
    if key is not None and cert is None:
        raise ConfigError(f"--tls-key {key}: given without --tls-cert")
    if cert is None:
        return
    _check_file("--tls-cert", cert)
    if key is not None:
        _check_file("--tls-key", key)
    try:
        server_ssl(cert, key)
    except ssl.SSLError as exc:
        if key is None:
            raise ConfigError(f"--tls-cert {cert}: no private key loads from it ({_why(exc)}); "
                              f"give the key file with --tls-key") from None
        raise ConfigError(f"--tls-cert {cert} --tls-key {key}: not a PEM certificate and its "
                          f"private key ({_why(exc)})") from None


def check_tls_client(ca: str | None) -> None:
    """``--tls-ca`` exists and loads as PEM certificates."""
    if ca is None:
        return
    _check_file("--tls-ca", ca)
    try:
        client_ssl(ca)
    except ssl.SSLError as exc:
        raise ConfigError(f"--tls-ca {ca}: not a PEM CA certificate ({_why(exc)})") from None


def _why(exc: ssl.SSLError) -> str:
    return str(exc.reason or exc.strerror or exc)


def check_address(option: str, text: str, default_port: int, *,
                  listen: bool = False) -> tuple[str, int]:
    """``HOST:PORT`` with a port in range; a ``listen`` host must resolve on this machine."""
    try:
        host, number = parse_address(text, default_port)
    except ConfigError:
        raise ConfigError(f"{option} {text}: expected HOST:PORT (port 0..65535)") from None
    if ":" in host and not text.startswith("["):  # 'host:7070:1': no host has a colon
        raise ConfigError(f"{option} {text}: expected HOST:PORT with one ':' (an IPv6 host "
                          "goes in brackets: [::1]:7070)")
    if not 0 <= number <= 65535 or (number == 0 and not listen):
        raise ConfigError(f"{option} {text}: port {number} out of range, expected "
                          f"{0 if listen else 1}..65535")
    if listen:
        check_host(option, host, text)
    return host, number


def check_host(option: str, host: str, shown: str | None = None) -> None:
    """A host to listen on resolves on this machine (a wildcard "" or 0.0.0.0 does)."""
    try:
        socket.getaddrinfo(host or None, 0, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise ConfigError(f"{option} {shown or host}: host {host!r} is not an address of this "
                          f"machine ({exc})") from None


def speaks_tls(host: str, port: int, timeout: float = TLS_PROBE_S) -> bool:
    """True when ``host:port`` completes a TLS handshake (certificate not checked: this only
    explains a refusal, it trusts nothing)."""
    ctx = ssl.create_default_context()
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    try:
        with socket.create_connection((host, port), timeout=timeout) as raw, \
                ctx.wrap_socket(raw, server_hostname=host):
            return True
    except (OSError, ValueError):
        return False


def check_link(link: str | None, bandwidth: float, latency: float, workers: int) -> str:
    """`minips local`'s link profile ("" = none), checked: ``--link``, or the older
    ``--bandwidth`` (bytes/s, both directions) and ``--latency`` (s) turned into one."""
    if link and (bandwidth or latency):
        raise ConfigError(f"--link {link} with --bandwidth/--latency: give the link once, e.g. "
                          f"--link 80mbit+5ms")
    if not link:
        link = (f"{round(8 * bandwidth)}bit" if bandwidth else "") + \
            (f"+{latency:g}s" if latency else "")
        if not link:
            return ""
    profile = parse_profile(link)
    if len(profile.rates) > workers:
        raise ConfigError(f"--link {link}: {len(profile.rates)} rates for {workers} workers; "
                          f"give at most one per worker (the last one repeats)")
    return link
