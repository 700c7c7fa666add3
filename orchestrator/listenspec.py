"""A pool's listening-socket addresses (``--socket ADDR``, key ``sockets``): parsed and checked.

    tcp://HOST:PORT      HOST an IPv4 literal or a bracketed IPv6 one (``tcp://[::1]:8000``)
    unix:/ABS/PATH       a stream socket on a file path (``unix:@NAME``: Linux's abstract namespace)
    fd:NAME              a socket systemd passed to the daemon (its ``FileDescriptorName=``)

Only the text is checked here (every process may import this module); the daemon binds
them (daemon/sockets.py). Host names are refused rather than resolved: a DNS lookup would
block the daemon's loop, and a listener's address should not change with a resolver.
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass
from typing import Any

from .errors import InvalidSpec

MAX_SOCKETS = 32  # per pool; each is one more fd sent with every replica's plan
_SUN_PATH_MAX = 107  # sockaddr_un's sun_path holds 108 bytes, the last one a NUL
_FDNAME_MAX = 255  # systemd's fdname_is_valid()


@dataclass(frozen=True, slots=True)
class ListenAddress:
    text: str  # normalised: what the policy stores and compares
    kind: str  # tcp | unix | fd
    host: str = ""
    port: int = 0
    path: str = ""  # unix: a file path, or "\0name" for an abstract socket
    name: str = ""  # fd: the name systemd gave it


def fdname_ok(name: str) -> bool:
    """A name systemd accepts in ``LISTEN_FDNAMES``: printable ASCII, no ':', 1..255 chars."""
    return 0 < len(name) <= _FDNAME_MAX and all(" " <= c <= "~" and c != ":" for c in name)


def parse(text: Any) -> ListenAddress:
    """One address; InvalidSpec (one line naming it) if it is not one."""
    if not isinstance(text, str):
        raise InvalidSpec(f"a socket address is a string, got {text!r}")
    if text.startswith("tcp://"):
        return _tcp(text)
    if text.startswith("unix:"):
        path = text[len("unix:"):]
        if path.startswith("@") and len(path) > 1 and "\0" not in path:
            if len(path.encode()) > _SUN_PATH_MAX:
                raise InvalidSpec(f"socket {text!r}: name longer than {_SUN_PATH_MAX} bytes")
            return ListenAddress(text, "unix", path="\0" + path[1:])
        if not path.startswith("/") or "\0" in path or path.endswith("/"):
            raise InvalidSpec(f"socket {text!r}: unix:PATH takes an absolute file path")
        path = os.path.normpath(path)
        if len(path.encode()) > _SUN_PATH_MAX:
            raise InvalidSpec(f"socket {text!r}: path longer than {_SUN_PATH_MAX} bytes")
        return ListenAddress("unix:" + path, "unix", path=path)
    if text.startswith("fd:"):
        name = text[len("fd:"):]
        if not fdname_ok(name):
            raise InvalidSpec(f"socket {text!r}: fd:NAME takes a systemd FileDescriptorName "
                              "(printable ASCII, no ':')")
        return ListenAddress(text, "fd", name=name)
    raise InvalidSpec(f"socket {text!r}: expected tcp://HOST:PORT, unix:/PATH or fd:NAME")


def _tcp(text: str) -> ListenAddress:
    rest = text[len("tcp://"):]
    host, sep, port_text = rest.rpartition(":")
    bracketed = host.startswith("[") and host.endswith("]")
    if bracketed:
        host = host[1:-1]
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        raise InvalidSpec(f"socket {text!r}: tcp://HOST:PORT takes an IP address as HOST "
                          "(IPv6 in brackets), not a host name") from None
    if (ip.version == 6) != bracketed or not sep:
        raise InvalidSpec(f"socket {text!r}: tcp://HOST:PORT takes an IP address as HOST "
                          "(IPv6 in brackets)")
    if not (port_text.isascii() and port_text.isdigit()) or not 1 <= int(port_text) <= 65535:
        raise InvalidSpec(f"socket {text!r}: the port must be 1..65535")
    port = int(port_text)
    shown = f"[{ip}]" if ip.version == 6 else str(ip)
    return ListenAddress(f"tcp://{shown}:{port}", "tcp", host=str(ip), port=port)


def parse_all(value: Any) -> tuple[str, ...]:
    """A pool's list of addresses, normalised, in order; InvalidSpec if one is bad, one is
    given twice, or there are more than MAX_SOCKETS."""
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise InvalidSpec(f"sockets must be a list of addresses, got {value!r}")
    out = tuple(parse(v).text for v in value)
    if len(set(out)) != len(out):
        raise InvalidSpec(f"sockets: an address is given twice: {', '.join(out)}")
    if len(out) > MAX_SOCKETS:
        raise InvalidSpec(f"sockets: at most {MAX_SOCKETS} per pool, got {len(out)}")
    return out
