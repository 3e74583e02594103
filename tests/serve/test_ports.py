"""`check_port`: a port another program holds is refused before a server's slow start, and only such a port."""

from __future__ import annotations

import os
import socket

import pytest

from serve.runtime.ports import check_port


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.fixture
def held_port():
    """A port another program listens on, on 127.0.0.1."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        yield taken.getsockname()[1]


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "0.0.0.0", ""])
def test_a_port_held_on_an_address_the_server_would_bind_is_refused_naming_the_option(held_port, host):
    with pytest.raises(ValueError, match=f"port {held_port} on .* is in use: .* give --probe-port another"):
        check_port(host, held_port, "--probe-port")


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 here")
def test_ipv6_hosts_bind_ipv6_alone_as_uvicorn_does_and_brackets_are_taken_off(held_port):
    """`--host ::` was refused for a port held on IPv4 alone, where uvicorn starts (its IPv6 socket is IPv6 only);
    `--host [::1]`, which Gradio takes, was no address at all."""
    check_port("::", held_port)
    check_port("[::1]", held_port)
    with pytest.raises(ValueError, match="in use"):  # grpcio's "[::]" takes IPv4 too
        check_port("::", held_port, "--grpc-port", dual_stack=True)


def test_a_host_of_no_address_here_says_so_and_no_socket_is_left_open():
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(50):
        with pytest.raises(ValueError, match="cannot listen on 192.0.2.1 port 9 .*: give a --host of this machine"):
            check_port("192.0.2.1", 9)  # TEST-NET-1: never this machine's
    check_port("127.0.0.1", 0)
    # a socket left by each try would be 50 more; the worker's other threads may hold a few of their own meanwhile
    assert len(os.listdir("/proc/self/fd")) - before < 10


@pytest.mark.parametrize("port", [65536, 99999, -1])
def test_a_port_out_of_range_is_refused_naming_the_range(port):
    """`vit-train review --port 99999` ended in an OverflowError traceback; -1 blamed the host."""
    with pytest.raises(ValueError, match=rf"^--port must be 0-65535, got {port}$"):
        check_port("127.0.0.1", port)
