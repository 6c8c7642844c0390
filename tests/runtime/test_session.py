"""Which Ray a command uses: with no address (nor ``local``) a new embedded one, never a cluster that ``ray start`` left
on the machine; with one, that cluster. ``ray.init`` is replaced by a recorder: no Ray starts and none is joined."""

import logging
import socket

import pytest
import ray
from ray._common.utils import get_ray_address_file
from ray._private import services

from fedray.runtime import session


@pytest.fixture
def ray_init_calls(monkeypatch):
    """Each ``ray.init`` call's keyword arguments, and whether the embedded Ray's watchdog was started after it."""
    calls = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **options: calls.append(options))
    monkeypatch.setattr(session.watchdog, "start", lambda: calls.append("watchdog"))
    monkeypatch.setattr(session.tensor_transfer, "register", lambda: None)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    return calls


EMBEDDED = [{"address": "local", "include_dashboard": False, "log_to_driver": False, "logging_level": logging.WARNING}, "watchdog"]


@pytest.mark.parametrize("address, environment", [(None, None), (None, ""), ("local", None), (None, "local"),
                                                  ("local", "10.0.0.5:6379")],
                         ids=["neither", "empty-RAY_ADDRESS", "--address-local", "RAY_ADDRESS-local", "--address-wins"])
def test_no_address_starts_a_new_embedded_ray(ray_init_calls, monkeypatch, address, environment):
    if environment is not None:
        monkeypatch.setenv("RAY_ADDRESS", environment)
    session.init_ray(address)
    assert ray_init_calls == EMBEDDED


@pytest.mark.parametrize("how", ["--address", "RAY_ADDRESS"])
def test_an_address_joins_that_cluster(ray_init_calls, monkeypatch, how):
    with socket.socket() as head:
        head.bind(("127.0.0.1", 0))
        head.listen(8)
        address = f"127.0.0.1:{head.getsockname()[1]}"
        if how == "RAY_ADDRESS":
            monkeypatch.setenv("RAY_ADDRESS", address)
        session.init_ray(address if how == "--address" else None)
    assert ray_init_calls == [{"address": address, "log_to_driver": False, "logging_level": logging.WARNING}]


def test_auto_is_left_to_ray(ray_init_calls):
    session.init_ray("auto")
    assert ray_init_calls == [{"address": "auto", "log_to_driver": False, "logging_level": logging.WARNING}]


def test_ray_joins_the_cluster_ray_start_left_unless_told_local(tmp_path, monkeypatch):
    """Why ``address="local"``: Ray resolves no address to the cluster recorded by the last ``ray start``
    (TEMP_DIR/ray_current_cluster), and ``local`` to none (a new one)."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with open(get_ray_address_file(str(tmp_path)), "w") as recorded:
        recorded.write("10.0.0.5:6379")
    assert services.canonicalize_bootstrap_address(None, str(tmp_path)) == "10.0.0.5:6379"
    assert services.canonicalize_bootstrap_address("local", str(tmp_path)) is None
