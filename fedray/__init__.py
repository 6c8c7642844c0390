"""fedray: a Ray simulator of very large federations on frozen features.

The public interface, for a researcher's own methods and for notebooks::

    import fedray

    class MyMethod(fedray.ClosedFormMethod): ...        # client_statistics, combine, solve
    class MyServer(fedray.ServerOptimizer): ...          # step(params, delta) -> params
    class MyClient(fedray.ClientAlgorithm): ...          # loss, correct, new_control: the clients' local objective
    result = fedray.run(method=MyMethod, dataset="synthetic:inat-geo-100", out="results/mine")
    result.metrics, result.classifier                    # a polars DataFrame, the final fedray.Classifier
    table = fedray.sweep("jobs/sweeps/participation.yaml", out="results/sweeps")
    federation = fedray.load_federation("synthetic:inat-user-120k")

Names are imported on first use, so ``import fedray`` (and the command line)
stays light until one of them is needed.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "ClosedFormMethod": "fedray.methods.base",
    "ClientBatch": "fedray.methods.base",
    "Classifier": "fedray.methods.base",
    "ServerOptimizer": "fedray.gradient.server",
    "ClientAlgorithm": "fedray.gradient.client_sgd",
    "FedrayError": "fedray.errors",
    "load_federation": "fedray.data.registry",
    "run": "fedray.api",
    "RunResult": "fedray.api",
    "sweep": "fedray.api",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> object:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'fedray' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
