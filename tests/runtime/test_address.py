"""A Ray address is parsed and checked before joining it: malformed addresses are refused in one line saying what is
wrong, refused or silent ones fail in one line within the timeout."""

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from fedray.core.errors import FedrayError
from fedray.runtime.address import HTTP2_PREFACE, check_reachable, endpoint
from tests.local_cluster import free_port


@pytest.mark.parametrize("address, expected", [
    ("10.0.0.5:6379", ("10.0.0.5", 6379)),
    ("head.example:6380", ("head.example", 6380)),
    ("ray://head.example", ("head.example", 10001)),
    ("ray://10.0.0.5:10002", ("10.0.0.5", 10002)),
    ("[::1]:6379", ("::1", 6379)),
    ("ray://[0:0::1]", ("::1", 10001)),
    ("head_1.example:1", ("head_1.example", 1)),
    ("10.0.0.5:65535", ("10.0.0.5", 65535)),
    ("auto", None),
    ("local", None),
])
def test_endpoint(address, expected):
    assert endpoint(address) == expected


FORMS = "(HOST:PORT, ray://HOST[:PORT], auto or local)"


@pytest.mark.parametrize("address, error", [
    ("127.0.0.1:99999", "127.0.0.1:99999: port 99999 is out of range (1 to 65535)"),
    ("127.0.0.1:0", "127.0.0.1:0: port 0 is out of range (1 to 65535)"),
    ("head:http", "head:http: port 'http' is not a number"),
    ("head:６３７９", "'head:６３７９': port '６３７９' is not a number"),  # full-width digits: str.isdigit says yes
    ("not an address", f"'not an address': not an address {FORMS}"),
    ("", f"'': not an address {FORMS}"),
    ("head\n:6379", f"'head\\n:6379': not an address {FORMS}"),
    ("garbage", "garbage: no port (HOST:PORT; a head's GCS listens on 6379 unless `ray start --port` says otherwise)"),
    ("head:", "head:: no port (HOST:PORT; a head's GCS listens on 6379 unless `ray start --port` says otherwise)"),
    (":6379", f":6379: no host {FORMS}"),
    ("ray://", f"ray://: no host {FORMS}"),
    ("http://head:8265", "http://head:8265: a dashboard's address, which `ray job submit` takes; fedray joins a cluster "
                         "at HOST:6379 (the head's GCS) or ray://HOST:10001 (Ray Client)"),
    ("https://head", "https://head: a dashboard's address, which `ray job submit` takes; fedray joins a cluster "
                     "at HOST:6379 (the head's GCS) or ray://HOST:10001 (Ray Client)"),
    ("grpc://head:6379", f"grpc://head:6379: unknown scheme 'grpc://' {FORMS}"),
    ("::1:6379", "::1:6379: an IPv6 host goes in brackets: [HOST]:PORT"),
    ("[::g]:6379", "'[::g]:6379': '::g' is not an IPv6 address"),
    ("-head:6379", "-head:6379: '-head' is not a host name or IP address"),
    ("head:6379/jobs", f"head:6379/jobs: '/jobs' after the host and port {FORMS}"),
    ("user@head:6379", f"user@head:6379: '@head:6379' after the host {FORMS}"),
])
@pytest.mark.parametrize("source", ["--address", "RAY_ADDRESS"])
def test_a_malformed_address_is_refused_in_one_line(address, error, source):
    with pytest.raises(FedrayError) as refused:
        check_reachable(address, source)
    assert str(refused.value) == f"{source} {error}"


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


@contextmanager
def answering_head() -> Iterator[str]:
    """A loopback server that answers every gRPC client's first bytes as Ray's GCS does (its SETTINGS frame): its
    address."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)

    def answer() -> None:
        while True:
            try:
                connection, _ = server.accept()
            except OSError:  # closed: the block ended
                return
            with connection:
                connection.recv(len(HTTP2_PREFACE))
                connection.sendall(bytes([0, 0, 0, 4, 0, 0, 0, 0, 0]))

    answering = threading.Thread(target=answer, daemon=True)
    answering.start()
    try:
        yield f"127.0.0.1:{server.getsockname()[1]}"
    finally:
        server.shutdown(socket.SHUT_RDWR)
        server.close()
        answering.join()


def test_an_address_that_answers_passes():
    with answering_head() as address:
        check_reachable(address, "--address", timeout_s=30.0)


def test_an_address_that_accepts_and_never_answers_is_refused_after_the_timeout():
    """ray.init waited on such a listener until it was killed (560 s observed)."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)  # the kernel completes the connection; nothing ever reads or writes
        port = server.getsockname()[1]
        with pytest.raises(FedrayError) as refused:
            check_reachable(f"127.0.0.1:{port}", "--address", timeout_s=1.0)
    assert str(refused.value) == (f"--address 127.0.0.1:{port}: something at 127.0.0.1:{port} accepts connections but "
                                  "did not answer in 1 s as a Ray head (or Ray Client server) would; is that port Ray's?")
