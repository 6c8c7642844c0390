"""A Ray address is checked before joining it: refused or silent addresses fail in one line within the timeout."""

import socket
import time

import pytest

from fedray.errors import FedrayError
from fedray.runtime.address import check_reachable, endpoint
from tests.local_cluster import free_port


@pytest.mark.parametrize("address, expected", [
    ("10.0.0.5:6379", ("10.0.0.5", 6379)),
    ("head.example:6380", ("head.example", 6380)),
    ("ray://head.example", ("head.example", 10001)),
    ("ray://10.0.0.5:10002", ("10.0.0.5", 10002)),
    ("[::1]:6379", ("::1", 6379)),
    ("auto", None),
    ("local", None),
    ("http://head.example:8265", None),  # not an address ray.init takes: Ray says so itself
    ("head.example", None),
])
def test_endpoint(address, expected):
    assert endpoint(address) == expected


def test_nothing_listening_fails_at_once():
    port = free_port()
    start = time.monotonic()
    with pytest.raises(FedrayError, match=rf"--address 127.0.0.1:{port}: no Ray cluster at 127.0.0.1:{port} \(Connection refused\)"):
        check_reachable(f"127.0.0.1:{port}", "--address")
    assert time.monotonic() - start < 2


def test_a_silent_address_fails_after_the_timeout():
    """A listener whose backlog is full drops new connection attempts on Linux, like a firewalled host."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(0)
        port = server.getsockname()[1]
        pending = [socket.socket() for _ in range(3)]
        for client in pending:
            client.setblocking(False)
            client.connect_ex(("127.0.0.1", port))
        try:
            start = time.monotonic()
            with pytest.raises(FedrayError, match=rf"RAY_ADDRESS 127.0.0.1:{port}: no answer from 127.0.0.1:{port} in 1 s"):
                check_reachable(f"127.0.0.1:{port}", "RAY_ADDRESS", timeout_s=1.0)
            assert 0.9 < time.monotonic() - start < 5
        finally:
            for client in pending:
                client.close()


def test_a_listening_address_passes():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        check_reachable(f"127.0.0.1:{server.getsockname()[1]}", "--address")
