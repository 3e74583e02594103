"""`check_port`: whether a server could listen on a port, asked before the slow part of its start (`free_port`: one
that is free); `check_reachable`: whether anything answers at a cluster's address, asked before Ray retries it for
minutes.

`vit-serve` loads and warms its models up, and `vit-train review` scores a whole run, before their web servers bind;
a port another program holds was found only then. Each asks here first. The answer can change before the server
binds (another program may take the port in between): the server's own error still says so then.
"""

from __future__ import annotations

import errno
import socket
from contextlib import ExitStack


def check_port(host: str, port: int, flag: str = "--port", dual_stack: bool = False) -> None:
    """Refuse a port that something listens on, or a `host` that is no address of this machine.

    Bound as asyncio's `create_server` (so uvicorn and Gradio) binds: every address `host` names ("" : every
    interface; IPv6 in brackets or not), with SO_REUSEADDR, so that a port whose last connections are closing counts
    as free, and IPv6 sockets for IPv6 alone (`dual_stack`: also IPv4, as grpcio binds "[::]").

    Args:
        flag: the option that chose `port`, named in the message.

    Raises:
        ValueError: what is wrong and which option to change.
    """
    if not 0 <= port <= 65535:  # bind's OverflowError, or a host blamed for -1
        raise ValueError(f"{flag} must be 0-65535, got {port}")
    try:
        found = socket.getaddrinfo(host.strip("[]") or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        with ExitStack() as held:  # all at once, as the server holds them
            for family, kind, proto, _, address in dict.fromkeys(found):
                s = held.enter_context(socket.socket(family, kind, proto))
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, not dual_stack)
                s.bind(address)
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            raise ValueError(
                f"port {port} on {host} is in use: stop what listens there, or give {flag} another"
            ) from None
        raise ValueError(f"cannot listen on {host} port {port} ({e.strerror}): give a --host of this machine") from None


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on at `host` right now (another program may take it before it is used)."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host.strip("[]") or None, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    with socket.socket(family, kind, proto) as s:
        s.bind(address)
        return s.getsockname()[1]


def check_reachable(address: str | None, flag: str = "--ray-address", timeout_s: float = 5.0) -> None:
    """Refuse a cluster address `HOST:PORT` (or `ray://HOST:PORT`) that nothing answers at within `timeout_s`: a
    typo or a cluster that is down, which `ray.init` retries for minutes. None, "auto" and an address without a port
    are Ray's to resolve.

    Raises:
        ValueError: what is wrong and what to check.
    """
    host, _, port = (address or "").split("://", 1)[-1].rpartition(":")
    if not host or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise ValueError(
            f"cannot reach a Ray cluster at {address} ({e.strerror or e}): is `ray start --head` running there, and "
            f"is {flag} its address?"
        ) from None
