from pathlib import Path

import numpy as np
import pytest
import ray
import torch

from fedray.data import synthetic
from fedray.methods.base import ClientBatch
from fedray.runtime.session import QUICK_STORE_CONNECT

E2E = Path(__file__).resolve().parent / "e2e"
COLLECTED = pytest.StashKey[list[pytest.Item]]()
"""Every test this session collected, before ``-m`` deselected any (see :func:`collected_tests`)."""


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Every test under tests/e2e/ (whole processes, clusters, full-size runs) is slow: ``pytest -m "not slow"`` skips
    them. Runs before ``-m`` deselects, so that the collected tests can be kept whole."""
    for item in items:
        if E2E in item.path.parents:
            item.add_marker(pytest.mark.slow)
    config.stash[COLLECTED] = list(items)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """With pytest-xdist's ``--dist loadfile`` (pyproject.toml's default), the files of tests/e2e/ are one unit: they
    run one after another on one worker while the other takes the rest. Each of their whole processes and clusters
    keeps both cores busy; two at once would double the load that their timed assertions see (a signal's moment, a
    refusal's timeout, a killed run's cleanup)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    e2e = E2E.relative_to(config.rootpath).as_posix() + "/"

    class E2ETogether(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return e2e if nodeid.startswith(e2e) else super()._split_scope(nodeid)

    return E2ETogether(config, log)


@pytest.fixture
def collected_tests(request) -> list[pytest.Item]:
    """Every test this session collected, slow or not, whatever ``-m`` selected."""
    return request.config.stash[COLLECTED]


OBJECT_STORE_BYTES = 2 * 1024**3
"""Each test process's object store: the tests' federations need a few MB; Ray's default (30 % of the machine's
memory) for each of pytest-xdist's two workers would promise /dev/shm more than half the machine."""


@pytest.fixture(scope="session")
def ray_session():
    """One embedded Ray for the whole test session, one per pytest-xdist worker (2 logical CPUs each: the tests size
    their shards by them; no dashboard), a new one even where ``ray start`` left a cluster on the machine (a bare
    ``ray.init()`` would join it)."""
    ray.init(address="local", num_cpus=2, object_store_memory=OBJECT_STORE_BYTES, include_dashboard=False,
             log_to_driver=False, _system_config=dict(QUICK_STORE_CONNECT))
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def small_inat():
    """A 4% iNat-User-120K stand-in: 371 clients of the real size shape, d = 24, 60 classes."""
    return synthetic.build("inat-user-120k", dim=24, scale=0.04, classes=60, seed=3)


def all_clients_batch(federation) -> ClientBatch:
    sample_ids, labels, offsets = federation.train_arrays(0, federation.num_clients)
    return ClientBatch(
        federation.source.features("train", sample_ids),
        torch.from_numpy(labels.astype(np.int64)),
        offsets,
        np.arange(federation.num_clients),
    )
