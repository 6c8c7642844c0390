"""Joining a Ray cluster (``--address`` or $RAY_ADDRESS), or starting an embedded one that ends with this process.

The embedded Ray is started with ``address="local"``: a bare ``ray.init()``
would join a cluster that ``ray start`` left running on the machine instead.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager

import ray

from fedray.core.errors import FedrayError
from fedray.core.interrupts import keeping_sigterm_handler
from fedray.runtime import tensor_transfer, watchdog
from fedray.runtime.address import LOCAL, check_reachable


def _cluster_address(address: str | None) -> tuple[str, str] | None:
    """The address to join and where it came from (``--address``, else $RAY_ADDRESS); None for an embedded Ray
    (neither set, or set to ``local``)."""
    for given, source in ((address, "--address"), (os.environ.get("RAY_ADDRESS"), "RAY_ADDRESS")):
        if given:
            return None if given == LOCAL else (given, source)
    return None


def check_address(address: str | None = None) -> None:
    """Before any work: a one-line error within seconds when the cluster to join does not answer."""
    given = None if ray.is_initialized() else _cluster_address(address)
    if given is not None:
        check_reachable(*given)


TOKEN_AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"
TOKEN_AUTH_NOTICE = "Token authentication is enabled for this Ray cluster"


@contextmanager
def _without_token_auth_notice() -> Iterator[None]:
    """Token authentication stays on, as Ray enables it for a new local cluster; only its notice on every run is dropped
    (that one message: every other warning and error of Ray still shows)."""
    logger = logging.getLogger(TOKEN_AUTH_LOGGER)
    notice = _DropMessage(TOKEN_AUTH_NOTICE)
    logger.addFilter(notice)
    try:
        yield
    finally:
        logger.removeFilter(notice)


class _DropMessage(logging.Filter):
    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefix)


def init_ray(address: str | None = None) -> None:
    """Join ``address`` (or $RAY_ADDRESS); with neither (or ``local``), start an embedded Ray, which ends with this
    process: a new one, never a cluster that ``ray start`` left on the machine.

    The caller's SIGTERM handler stays (``ray.init`` would replace it). Either way, this process then sends its
    tensors through the object store as numpy buffers (:mod:`fedray.runtime.tensor_transfer`).
    """
    if not ray.is_initialized():
        _start_or_join(address)
    tensor_transfer.register()


def _start_or_join(address: str | None) -> None:
    given = _cluster_address(address)
    options = {"log_to_driver": False, "logging_level": logging.WARNING}
    if given is None:
        with _without_token_auth_notice(), keeping_sigterm_handler():
            ray.init(address=LOCAL, include_dashboard=False, **options)
        watchdog.start()
        return
    check_reachable(*given)
    try:
        with keeping_sigterm_handler():
            ray.init(address=given[0], **options)
    except ConnectionError as error:  # e.g. "auto" on a machine without a cluster
        raise FedrayError(f"{given[1]} {given[0]}: {str(error).splitlines()[0]}") from None
