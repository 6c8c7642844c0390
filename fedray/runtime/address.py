"""A Ray address checked before joining it: Ray retries an address where nothing answers forever."""

from __future__ import annotations

import socket
from urllib.parse import urlsplit

from fedray.errors import FedrayError

CONNECT_TIMEOUT_S = 10.0
RAY_CLIENT_PORT = 10001
RESOLVED_BY_RAY = ("auto", "local")
"""``auto`` (the cluster this machine last started) and ``local`` (a new one) are Ray's to find."""


def endpoint(address: str) -> tuple[str, int] | None:
    """The host and port that joining ``address`` connects to first (the GCS, or the Ray Client server of ``ray://``).

    None where Ray resolves the address itself, or where it is not ``HOST:PORT`` /
    ``ray://HOST[:PORT]`` (Ray then refuses it with its own message).
    """
    if address in RESOLVED_BY_RAY:
        return None
    parts = urlsplit(address if "://" in address else f"//{address}")
    try:
        port = parts.port or (RAY_CLIENT_PORT if parts.scheme == "ray" else None)
    except ValueError:
        return None
    if parts.scheme not in ("", "ray") or not parts.hostname or port is None:
        return None
    return parts.hostname, port


def check_reachable(address: str, source: str, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """A one-line error within ``timeout_s`` when nothing accepts a connection at ``address``.

    ``source`` says where the address came from (``--address`` or ``RAY_ADDRESS``).
    """
    target = endpoint(address)
    if target is None:
        return
    try:
        with socket.create_connection(target, timeout=timeout_s):
            pass
    except TimeoutError:
        raise FedrayError(f"{source} {address}: no answer from {target[0]}:{target[1]} in {timeout_s:.0f} s; "
                          "is the Ray head running and reachable from here?") from None
    except OSError as error:
        raise FedrayError(f"{source} {address}: no Ray cluster at {target[0]}:{target[1]} "
                          f"({error.strerror or error}); is the Ray head running there?") from None
