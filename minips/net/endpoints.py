"""Where the roles listen and connect, and how safely: addresses, TLS contexts, the bind check.

``parse_address`` / ``format_address`` / ``reachable`` read and write 'host:port' (IPv6 in
brackets; a wildcard host is replaced by one that reaches the machine). ``server_ssl`` /
``client_ssl`` make TLS contexts (``ssl`` is imported only then) and ``issuing_ca`` finds the
file clients trust a server's certificate with; ``tls_mismatch`` says why a
group server cannot join (it must serve TLS exactly when the global server does: HELLO
capability ``tls``). ``check_port`` refuses a listen address that is taken, naming its flag
(``port_error``), before anything is created; ``check_bind`` refuses to listen beyond loopback
without a long enough shared secret, and ``shared_secret`` finds it ($MINIPS_TOKEN unless
given); ``dashboard_secret`` finds the dashboard's own, read-only token
($MINIPS_DASHBOARD_TOKEN), which is never the cluster's secret, and ``run_dashboard_token``
makes one that a resumed run makes again.
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import os
from pathlib import Path
from typing import TYPE_CHECKING

from minips.errors import AuthError, ConfigError

if TYPE_CHECKING:  # ssl (and with it socket) only where a TLS context is made
    import ssl

__all__ = [
    "WILDCARD_HOSTS", "check_group_address", "parse_address", "format_address", "reachable",
    "reachable_url",
    "local_addresses",
    "server_ssl",
    "client_ssl", "is_loopback", "MIN_SECRET_BYTES", "check_bind", "TOKEN_ENV", "shared_secret",
    "DASHBOARD_TOKEN_ENV", "DASHBOARD_TOKEN_BYTES", "dashboard_secret", "TLS_CAPABILITY",
    "tls_mismatch", "port_error", "check_port", "verifies", "issuing_ca", "run_dashboard_token",
]

TOKEN_ENV = "MINIPS_TOKEN"  # environment variable holding the shared secret


def shared_secret(token: str | bytes | None) -> str | bytes | None:
    """``token``, or $MINIPS_TOKEN when it is None (None when that is unset too)."""
    return os.environ.get(TOKEN_ENV) if token is None else token


DASHBOARD_TOKEN_ENV = "MINIPS_DASHBOARD_TOKEN"  # the dashboard's own read-only token
DASHBOARD_TOKEN_BYTES = 24  # random bytes of a dashboard token made at start (32 characters)


def dashboard_secret() -> str:
    """$MINIPS_DASHBOARD_TOKEN ("" when unset); ``ConfigError`` when it is the cluster's secret,
    which would let whoever sees the dashboard's link join the cluster."""
    token = os.environ.get(DASHBOARD_TOKEN_ENV, "")
    if token and token == os.environ.get(TOKEN_ENV):
        raise ConfigError(f"{DASHBOARD_TOKEN_ENV} is the cluster's secret ({TOKEN_ENV}): "
                          "whoever opens the dashboard could join as a worker; give the "
                          "dashboard a token of its own, or unset it to have one made")
    return token


def run_dashboard_token(secret: str, t0: float) -> str:
    """The dashboard token a live server makes when none is given: HMAC-SHA256 of the run's
    start time ``t0`` keyed with the cluster's ``secret``, ``DASHBOARD_TOKEN_BYTES`` of it
    url-safe. A resumed run (the checkpoint keeps ``t0``) gets the same token, so an open tab
    keeps working, with nothing written to the run directory; it does not reveal the secret."""
    import base64
    import hashlib
    import hmac

    mac = hmac.new(secret.encode(), f"minips dashboard {t0!r}".encode(), hashlib.sha256)
    return base64.urlsafe_b64encode(mac.digest()[:DASHBOARD_TOKEN_BYTES]).decode().rstrip("=")


# HELLO capability of a group server that serves its workers TLS: in a cluster every hop is TLS
# or none is (a worker reaches its group server with the context it reached the global one with)
TLS_CAPABILITY = "tls"


def tls_mismatch(server_tls: bool, hello_capabilities: tuple[str, ...]) -> str:
    """Why a group server cannot serve a global server's workers ("" when it can): it must
    speak TLS to them exactly when the global server does."""
    group_tls = TLS_CAPABILITY in hello_capabilities
    if server_tls and not group_tls:
        return ("this global server speaks TLS and this group server would serve its workers in "
                "plain text: start `minips group` with --tls-cert and --tls-key")
    if group_tls and not server_tls:
        return ("this global server speaks plain TCP and its workers would reach this group "
                "server without TLS: start `minips group` without --tls-cert, or the global "
                "server with one")
    return ""


WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::"})  # every interface: an address to listen on only


def check_group_address(address: str) -> None:
    """A group process's HELLO ``address``, where its workers are to connect: HOST:PORT, port
    1..65535 (a wildcard host is replaced later by the host it connects from:
    ``sessions.group_address``). ``AuthError`` (REFUSE ``refused``) naming the field."""
    host, sep, port = address.rpartition(":")
    bracketed = host.startswith("[") and host.endswith("]")
    bare = host.removeprefix("[").removesuffix("]") if bracketed else host
    ok = (sep and port.isascii() and port.isdigit() and 1 <= int(port) <= 65535 and bare
          and not any(c.isspace() for c in bare)
          and (bracketed or ":" not in host or host in WILDCARD_HOSTS))  # IPv6 in brackets
    if not ok:
        raise AuthError(f"HELLO address {address!r} of a group server must be HOST:PORT (port "
                        "1..65535), the address its workers connect to (minips group --listen "
                        "/ --advertise)")


def _split_address(text: str, default_port: int) -> tuple[str, str]:
    """'host:port', 'host', ':port' or '[v6]:port' → (host without brackets, '' if none; port
    text)."""
    host, sep, port = text.rpartition(":")
    if not sep or (text.startswith("[") and not host.endswith("]")):  # 'host' or '[v6]'
        host, port = text, str(default_port)
    return host.removeprefix("[").removesuffix("]"), port


def parse_address(text: str, default_port: int = 7070) -> tuple[str, int]:
    """'host:port', 'host', ':port' or '[v6]:port' → (host, port), no host meaning 127.0.0.1;
    raises ConfigError when malformed."""
    host, port = _split_address(text, default_port)
    try:
        return host or "127.0.0.1", int(port)
    except ValueError:
        raise ConfigError(f"bad address {text!r}, expected HOST:PORT") from None


def format_address(host: str, port: int) -> str:
    """'host:port', with an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def reachable(address: str, host: str) -> str:
    """``address`` ('host:port') with an empty or wildcard host replaced by ``host``, a host
    that is known to reach that machine."""
    own = _split_address(address, 0)[0]
    return format_address(host, parse_address(address)[1]) if own in WILDCARD_HOSTS else address


def local_addresses() -> list[str]:
    """This machine's addresses another machine may reach it at, best first: the one its
    default route leaves from, then those its host name resolves to, then the IPv4 address of
    each network interface (a machine on a LAN with no default route); 127.0.0.1 when there is
    nothing else. No packet is sent."""
    import socket

    found: list[str] = []
    for family, probe in ((socket.AF_INET, "192.0.2.1"), (socket.AF_INET6, "2001:db8::1")):
        with contextlib.suppress(OSError), socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((probe, 9))  # a UDP "connection": picks the route's source address
            found.append(s.getsockname()[0])
    with contextlib.suppress(OSError):
        for *_, addr in socket.getaddrinfo(socket.gethostname(), None, type=socket.SOCK_STREAM):
            found.append(str(addr[0]))
    found += _interface_addresses()
    unique = list(dict.fromkeys(a for a in found if not a.startswith("fe80")))
    return [a for a in unique if not is_loopback(a)] or ["127.0.0.1"]


def _interface_addresses() -> list[str]:
    """The IPv4 address of every network interface that has one (Linux: SIOCGIFADDR), in
    interface order; [] where the call is not there."""
    import socket

    try:
        import fcntl
        import struct

        names = [name for _, name in socket.if_nameindex()]
    except (ImportError, OSError):
        return []
    out = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for name in names:
            with contextlib.suppress(OSError):
                req = struct.pack("256s", name.encode()[:15])
                out.append(socket.inet_ntoa(fcntl.ioctl(s.fileno(), 0x8915, req)[20:24]))
    return out


def reachable_url(url: str, host: str) -> str:
    """``url`` ('http://0.0.0.0:8080/...') with a wildcard host replaced by ``host``: an
    address to listen on is not one to open."""
    scheme, sep, rest = url.partition("//")
    address, slash, path = rest.partition("/")
    if not sep or _split_address(address, 0)[0] not in WILDCARD_HOSTS:
        return url
    return f"{scheme}//{reachable(address, host)}{slash}{path}"


def server_ssl(cert: str | None, key: str | None) -> ssl.SSLContext | None:
    """TLS context for a listening server, or None for plain TCP."""
    if not cert:
        return None
    import ssl

    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert, key)
    return ctx


def verifies(cert: str, key: str | None, ca: str) -> bool:
    """True when a client that trusts ``ca`` accepts ``cert`` (with its ``key``): a TLS
    handshake run in memory, the certificate chain checked, not the name (no socket)."""
    import ssl

    try:
        server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        server.load_cert_chain(cert, key)
        client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        client.check_hostname = False
        client.load_verify_locations(ca)
    except (OSError, ValueError, ssl.SSLError):
        return False  # not a certificate (a key file, garbage): it verifies nothing
    to_server, to_client = ssl.MemoryBIO(), ssl.MemoryBIO()
    c = client.wrap_bio(to_client, to_server)
    s = server.wrap_bio(to_server, to_client, server_side=True)
    for _ in range(8):  # a TLS 1.3 handshake takes 2 rounds; 8 bounds a broken one
        for end in (c, s):
            try:
                end.do_handshake()
            except ssl.SSLWantReadError:
                continue
            except ssl.SSLError:
                return False
            if end is c:
                return True
    return False


def issuing_ca(cert: str, key: str | None) -> str | None:
    """The file a client passes as ``--tls-ca`` to trust ``cert``: the certificate itself when
    it is self-signed, else the CA that signed it among the PEM files beside it (the recipe of
    docs/operations.md keeps ca.pem there); an absolute path, or None when none is found."""
    own = Path(cert).resolve()
    beside = sorted(p for p in own.parent.iterdir()
                    if p.suffix in (".pem", ".crt") and p != own and p.is_file())
    return next((str(c) for c in (own, *beside) if verifies(cert, key, str(c))), None)


def client_ssl(ca: str | None) -> ssl.SSLContext | None:
    """TLS context that verifies the server against ``ca``, or None for plain TCP."""
    if not ca:
        return None
    import ssl

    return ssl.create_default_context(cafile=ca)


def is_loopback(host: str) -> bool:
    """True for addresses only this machine can reach (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def port_error(flag: str, host: str, port: int, exc: OSError) -> ConfigError:
    """A failed bind of ``host:port`` said as one line naming the ``flag`` that chose it."""
    where = format_address(host or "0.0.0.0", port)
    if exc.errno == errno.EADDRINUSE:
        why = "is already in use (another minips, or another program)"
    elif exc.errno == errno.EACCES:
        why = "needs privileges (a port under 1024)"
    elif exc.errno == errno.EADDRNOTAVAIL:
        why = "is not an address of this machine"
    else:
        why = f"cannot be listened on ({exc.strerror or exc})"
    return ConfigError(f"{flag}: {where} {why}; pick another with {flag} (port 0: any free one)")


def check_port(flag: str, host: str, port: int) -> None:
    """Refuse now, before anything is created, a listen address that is taken (``port_error``):
    bind it as asyncio would (SO_REUSEADDR, every address ``host`` resolves to) and let go.
    Port 0 is always free."""
    import socket

    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except socket.gaierror:
        return  # the bind itself will say so
    for family, kind, proto, _, addr in infos:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)  # as asyncio binds it
            try:
                s.bind(addr)
            except OSError as exc:
                raise port_error(flag, host, port, exc) from None


MIN_SECRET_BYTES = 16  # a shorter secret on a reachable address could be guessed


def check_bind(host: str, token: str, insecure: bool) -> None:
    """Refuse to listen beyond this machine without a shared secret (unless ``insecure``) or
    with one shorter than ``MIN_SECRET_BYTES``."""
    if is_loopback(host):
        return
    if not token and not insecure:
        raise ConfigError(f"refusing to listen on {host} without a secret: set MINIPS_TOKEN "
                          f"(or pass --insecure to accept anyone who can reach this address)")
    if token and len(token.encode()) < MIN_SECRET_BYTES:
        raise ConfigError(
            f"refusing to listen on {host} with a {len(token.encode())}-byte MINIPS_TOKEN: a "
            f"secret for a non-loopback address needs at least {MIN_SECRET_BYTES} bytes; make "
            "one with: python3 -c 'import secrets; print(secrets.token_hex(16))'")
