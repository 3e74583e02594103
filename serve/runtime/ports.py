"""`check_port`: whether a server could listen on a port, asked before the slow part of its start.

`vit-serve` loads and warms its models up, and `vit-train review` scores a whole run, before their web servers bind;
a port another program holds was found only then. Each asks here first. The answer can change before the server
binds (another program may take the port in between): the server's own error still says so then.
"""

from __future__ import annotations

import errno
import socket


def check_port(host: str, port: int, flag: str = "--port") -> None:
    """Refuse a port that something listens on, or a `host` that is no address of this machine. Bound as uvicorn
    binds (SO_REUSEADDR), so a port whose last connections are closing counts as free.

    Args:
        flag: the option that chose `port`, named in the message.

    Raises:
        ValueError: what is wrong and which option to change.
    """
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(address)
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            raise ValueError(
                f"port {port} on {host} is in use: stop what listens there, or give {flag} another"
            ) from None
        raise ValueError(f"cannot listen on {host} port {port} ({e.strerror}): give a --host of this machine") from None
