"""What a probe is: ``parse`` a probe's text into a ``ProbeSpec``, checked as a whole.

A probe spec is one of ``tcp:HOST:PORT``, ``http://127.0.0.1:PORT/PATH``, ``exec:CMD`` or
``notify``; ``{slot}`` and ``{port}`` make it a template, filled in per replica
(``ProbeSpec.expand``). Anything else is ``InvalidSpec`` with one line saying why.

Hosts are IP literals or ``localhost``: a name would need a DNS lookup, which would block
the daemon's loop. http probes are loopback only: a probe checks a replica on this host.

Data and validation only, so that any process may import it (the pool policy checks a
probe's text with it); running a probe is probes.py's, in the daemon.
"""

from __future__ import annotations

import ipaddress
import shlex
from dataclasses import dataclass

from .errors import InvalidSpec

KINDS = ("tcp", "http", "exec", "notify")
_PLACEHOLDERS = ("{slot}", "{port}")
_LOOPBACK_NAMES = ("localhost",)


@dataclass(frozen=True, slots=True)
class ProbeSpec:
    """One parsed probe. ``text`` is what it was parsed from (``parse(spec.text) == spec``).
    A spec whose text holds ``{slot}``/``{port}`` is a template: its address fields are
    filled (and validated) by ``expand``."""

    kind: str  # tcp, http, exec, notify
    text: str
    host: str = ""  # tcp/http: the host as written (brackets stripped)
    ip: str = ""  # tcp/http: the address connected to (localhost -> 127.0.0.1)
    port: int | None = None
    path: str = ""  # http: path (and query) sent in the request line
    argv: tuple[str, ...] = ()  # exec

    def __str__(self) -> str:
        return self.text

    @property
    def templated(self) -> bool:
        return any(p in self.text for p in _PLACEHOLDERS)

    @property
    def passive(self) -> bool:
        """True for ``notify``: the replica reports, nothing is polled."""
        return self.kind == "notify"

    @property
    def label(self) -> str:
        """How reasons name this probe: ``tcp 127.0.0.1:8100``, the url, ``exec 'cmd'``."""
        if self.kind == "tcp":
            host = f"[{self.host}]" if ":" in self.host else self.host
            return f"tcp {host}:{self.port}"
        if self.kind == "exec":
            return f"exec '{self.text[len('exec:'):].strip()}'"
        return self.text

    def expand(self, slot: int, port: int | None) -> ProbeSpec:
        """The spec with ``{slot}`` and ``{port}`` substituted, validated as a whole."""
        if not self.templated:
            return self
        if "{port}" in self.text and port is None:
            raise InvalidSpec(f"probe {self.text!r} uses {{port}} but the pool has no port base")
        text = self.text.replace("{slot}", str(slot))
        if port is not None:
            text = text.replace("{port}", str(port))
        return parse(text)


def parse(text: str, has_port: bool = True) -> ProbeSpec:
    """A ``ProbeSpec`` from its text; ``InvalidSpec`` (one line) for anything else.
    ``has_port=False``: the pool has no port base, so ``{port}`` is refused."""
    if not isinstance(text, str) or not text.strip():
        raise InvalidSpec("empty probe: expected tcp:HOST:PORT, http://127.0.0.1:PORT/PATH, exec:CMD or notify")
    if any(c in text for c in "\r\n\0"):
        raise InvalidSpec(f"probe {text!r}: control characters are not allowed")
    if "{port}" in text and not has_port:
        raise InvalidSpec(f"probe {text!r} uses {{port}} but the pool has no --port-base")
    templated = any(p in text for p in _PLACEHOLDERS)
    if text == "notify":
        return ProbeSpec("notify", text)
    if text.startswith("tcp:"):
        host, port = _split_host_port(text, text[len("tcp:"):], default_port=None)
        # Literal parts are checked now; parts with a placeholder once expanded.
        ip = _address(text, host) if _literal(host) else ""
        num = _port(text, port) if _literal(port) else None
        if templated:
            return ProbeSpec("tcp", text)
        return ProbeSpec("tcp", text, host=host, ip=ip, port=num)
    if text.startswith("http://"):
        rest = text[len("http://"):]
        netloc, slash, path = rest.partition("/")
        path = slash + path if slash else "/"
        if any(c <= " " or c == "\x7f" for c in path):
            raise InvalidSpec(f"probe {text!r}: the path must not contain spaces or control characters")
        if "@" in netloc:
            raise InvalidSpec(f"probe {text!r}: http probes are loopback only (no user info)")
        host, port = _split_host_port(text, netloc, default_port="80")
        ip = ""
        if _literal(host):
            ip = _address(text, host, loopback_only=True)
            if not _is_loopback(ip):
                raise InvalidSpec(
                    f"probe {text!r}: http probes are loopback only (127.0.0.0/8, localhost, [::1])"
                )
        num = _port(text, port) if _literal(port) else None
        if templated:
            return ProbeSpec("http", text)
        return ProbeSpec("http", text, host=host, ip=ip, port=num, path=path)
    if text.startswith("exec:"):
        try:
            argv = tuple(shlex.split(text[len("exec:"):]))
        except ValueError as err:
            raise InvalidSpec(f"probe {text!r}: {err}") from None
        if not argv:
            raise InvalidSpec(f"probe {text!r}: no command after exec:")
        return ProbeSpec("exec", text, argv=() if templated else argv)
    if text.startswith(("https://", "http:")):
        raise InvalidSpec(f"probe {text!r}: only plain http://127.0.0.1:PORT/PATH is supported")
    raise InvalidSpec(
        f"unknown probe {text!r}: expected tcp:HOST:PORT, http://127.0.0.1:PORT/PATH, exec:CMD or notify"
    )


def _split_host_port(text: str, netloc: str, default_port: str | None) -> tuple[str, str]:
    """(host without brackets, port text) of ``HOST:PORT``, ``[V6]:PORT`` or, with a
    default port, a bare host."""
    if netloc.startswith("["):
        host, bracket, after = netloc[1:].partition("]")
        if not bracket or (after and not after.startswith(":")):
            raise InvalidSpec(f"probe {text!r}: bad address {netloc!r}")
        port = after[1:] if after else default_port
    elif ":" in netloc:
        host, _, port = netloc.rpartition(":")
        if default_port is not None and ":" in host:
            raise InvalidSpec(f"probe {text!r}: an IPv6 address needs brackets, as in [::1]")
    else:
        host, port = netloc, default_port
    if not host or port is None or port == "":
        raise InvalidSpec(f"probe {text!r}: expected HOST:PORT")
    if _strip_placeholders(port) and not _strip_placeholders(port).isdigit():
        raise InvalidSpec(f"probe {text!r}: port {port!r} is not a number")
    return host, port


def _strip_placeholders(s: str) -> str:
    for p in _PLACEHOLDERS:
        s = s.replace(p, "")
    return s


def _literal(s: str) -> bool:
    return not any(p in s for p in _PLACEHOLDERS)


def _port(text: str, port: str) -> int:
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise InvalidSpec(f"probe {text!r}: port must be 1..65535, not {port}")
    return int(port)


def _address(text: str, host: str, loopback_only: bool = False) -> str:
    """The IP to connect to: an IP literal, or localhost. No DNS (it would block)."""
    if host in _LOOPBACK_NAMES:
        return "127.0.0.1"
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        if loopback_only:
            raise InvalidSpec(
                f"probe {text!r}: http probes are loopback only (127.0.0.0/8, localhost, [::1])"
            ) from None
        raise InvalidSpec(
            f"probe {text!r}: host must be an IP address or localhost (the control loop does no DNS lookups)"
        ) from None


def _is_loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip)
    if addr.version == 4:
        return addr in ipaddress.ip_network("127.0.0.0/8")
    return addr == ipaddress.ip_address("::1")
