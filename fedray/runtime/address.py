"""A Ray address parsed and checked before Ray sees it: Ray retries an address where nothing answers (or a port out of
range) forever, and refuses other malformed ones with a traceback."""

from __future__ import annotations

import ipaddress
import os
import re
import shlex
import socket

from fedray.core.errors import FedrayError
from fedray.runtime.ray_start import ray_is_up

CONNECT_TIMEOUT_S = 10.0
RAY_CLIENT_PORT = 10001
AUTO, LOCAL = "auto", "local"
"""``auto``: the cluster ``ray start`` left on this machine, which Ray finds; ``local``: a new embedded one."""
FORMS = "HOST:PORT, ray://HOST[:PORT], auto or local"
LOCATION = re.compile(r"(\[(?P<ipv6>[^]]*)\]|(?P<host>[^:/?#\[\]@]*))(:(?P<port>[^/?#@]*))?(?P<rest>.*)", re.DOTALL)
"""``HOST[:PORT]`` or ``[IPv6][:PORT]``, and whatever follows."""
HOST_NAME = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_.-]*[A-Za-z0-9_])?")


def endpoint(address: str, source: str = "--address") -> tuple[str, int] | None:
    """The host and port that joining ``address`` connects to first (the GCS, or the Ray Client server of ``ray://``);
    None for ``auto`` and ``local``, which Ray resolves.

    Anything else is refused in one line naming the address (``source`` says
    where it came from: ``--address`` or ``RAY_ADDRESS``) and what is wrong.
    """
    if address in (AUTO, LOCAL):
        return None

    def wrong(what: str) -> FedrayError:
        shown = shlex.quote(address) if address.isprintable() else repr(address)  # as typed; a newline shown as \n: one line
        return FedrayError(f"{source} {shown}: {what}")

    if not address or not address.isprintable() or any(character.isspace() for character in address):
        raise wrong(f"not an address ({FORMS})")
    scheme, separator, location = address.partition("://")
    if not separator:
        scheme, location = "", address
    elif scheme in ("http", "https"):
        raise wrong("a dashboard's address, which `ray job submit` takes; fedray joins a cluster at HOST:6379 "
                    f"(the head's GCS) or ray://HOST:{RAY_CLIENT_PORT} (Ray Client)")
    elif scheme != "ray":
        raise wrong(f"unknown scheme {scheme + '://'!r} ({FORMS})")
    parts = LOCATION.fullmatch(location)
    host, port = parts["host"], parts["port"]
    if parts["ipv6"] is not None:
        try:
            host = str(ipaddress.IPv6Address(parts["ipv6"]))
        except ValueError:
            raise wrong(f"{parts['ipv6']!r} is not an IPv6 address") from None
    elif port is not None and ":" in port:
        raise wrong("an IPv6 host goes in brackets: [HOST]:PORT")
    elif not host:
        raise wrong(f"no host ({FORMS})")
    elif not HOST_NAME.fullmatch(host):
        raise wrong(f"{host!r} is not a host name or IP address")
    if parts["rest"]:
        raise wrong(f"{parts['rest']!r} after the host{'' if port is None else ' and port'} ({FORMS})")
    if not port:
        if scheme == "ray":
            return host, RAY_CLIENT_PORT
        raise wrong("no port (HOST:PORT; a head's GCS listens on 6379 unless `ray start --port` says otherwise)")
    if not (port.isascii() and port.isdigit()):
        raise wrong(f"port {port!r} is not a number")
    if not 1 <= int(port) <= 65535:
        raise wrong(f"port {int(port)} is out of range (1 to 65535)")
    return host, int(port)


def cluster_address(address: str | None) -> tuple[str, str] | None:
    """The address to join and where it came from (``--address``, else $RAY_ADDRESS); None for an embedded Ray
    (neither set, or set to ``local``)."""
    for given, source in ((address, "--address"), (os.environ.get("RAY_ADDRESS"), "RAY_ADDRESS")):
        if given:
            return None if given == LOCAL else (given, source)
    return None


def check_address(address: str | None = None) -> None:
    """Before any work: a one-line error within seconds when the cluster to join does not answer (none to join when
    this process is connected to Ray already)."""
    given = None if ray_is_up() else cluster_address(address)
    if given is not None:
        check_reachable(*given)


def check_reachable(address: str, source: str, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """``address`` parsed (:func:`endpoint`), then a one-line error within about ``timeout_s`` (twice, at most) when
    nothing accepts a connection there, or what accepts it does not answer as a gRPC server does.

    ``source`` says where the address came from (``--address`` or ``RAY_ADDRESS``).
    """
    target = endpoint(address, source)
    if target is None:
        return
    try:
        with socket.create_connection(target, timeout=timeout_s) as connection:
            answered = _answers_http2(connection)
    except TimeoutError:
        raise FedrayError(f"{source} {address}: no answer from {target[0]}:{target[1]} in {timeout_s:.0f} s; "
                          "is the Ray head running and reachable from here?") from None
    except OSError as error:
        raise FedrayError(f"{source} {address}: no Ray cluster at {target[0]}:{target[1]} "
                          f"({error.strerror or error}); is the Ray head running there?") from None
    if not answered:
        raise FedrayError(f"{source} {address}: something at {target[0]}:{target[1]} accepts connections but did not "
                          f"answer in {timeout_s:.0f} s as a Ray head (or Ray Client server) would; is that port "
                          "Ray's?")


HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
"""What a gRPC client sends first: HTTP/2's connection preface and an empty SETTINGS frame."""


def _answers_http2(connection: socket.socket) -> bool:
    """Whether the server at ``connection`` says anything (or closes) within its timeout after a gRPC client's first
    bytes: Ray's GCS and Ray Client server (gRPC) answer with their SETTINGS at once; ``ray.init`` would wait on a
    silent one forever."""
    connection.sendall(HTTP2_PREFACE)
    try:
        connection.recv(1)
    except TimeoutError:
        return False
    return True
