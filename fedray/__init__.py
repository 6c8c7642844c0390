"""fedray: a Ray simulator of very large federations on frozen features.

The public interface, for a researcher's own methods and for notebooks::

    import fedray

    class MyMethod(fedray.ClosedFormMethod): ...        # client_statistics, combine, solve
    class MyServer(fedray.ServerOptimizer): ...          # step(params, delta) -> params
    class MyAlgorithm(fedray.FederatedAlgorithm): ...   # a training algorithm: client half, server half, client state
    class MyNoise(fedray.Postprocessor): ...             # start(stages), client(upload, context), aggregate(total, context)
    class MySelector(fedray.Selector): ...               # select(round context) -> the round's clients
    fedray.report(eta_g=1.7)                             # in a server-side hook: a column of metrics.parquet
    result = fedray.run(method=MyMethod, dataset="synthetic:inat-geo-100", out="results/mine")
    result.metrics, result.classifier                    # a polars DataFrame, the final fedray.Classifier
    class Stop(fedray.Callback): ...                     # on_start, on_evaluation, after_round (True: stop), on_end
    fedray.run(method="fedavg", callbacks=[Stop()])
    table = fedray.sweep("jobs/sweeps/participation.yaml", out="results/sweeps")
    federation = fedray.load_federation("synthetic:inat-user-120k")
    mine = fedray.Federation.from_arrays(features, labels, clients, split)   # or .from_table(a polars/pyarrow table)
    result = fedray.run(method="fed3r", dataset=fedray.resplit(mine, split="dirichlet", alpha=0.1, clients=100))

Names are imported on first use, so ``import fedray`` (and the command line)
stays light until one of them is needed.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "ClosedFormMethod": "fedray.methods.base",
    "ClientBatch": "fedray.methods.base",
    "Classifier": "fedray.methods.base",
    "ServerOptimizer": "fedray.methods.training.server",
    "FederatedAlgorithm": "fedray.methods.algorithm",
    "ClientRound": "fedray.methods.algorithm",
    "Upload": "fedray.methods.algorithm",
    "UploadParts": "fedray.methods.upload_parts",
    "SampleSum": "fedray.methods.upload_parts",
    "ClientRows": "fedray.methods.upload_parts",
    "Aggregate": "fedray.methods.algorithm",
    "Population": "fedray.methods.algorithm",
    "Params": "fedray.methods.algorithm",
    "Postprocessor": "fedray.methods.postprocessor",
    "UploadContext": "fedray.methods.postprocessor",
    "StageUploads": "fedray.methods.postprocessor",
    "Sampling": "fedray.methods.postprocessor",
    "Selector": "fedray.clock.selector",
    "RoundContext": "fedray.clock.selector",
    "ClientHistory": "fedray.clock.selector",
    "TaskCost": "fedray.clock.costs",
    "report": "fedray.core.reports",
    "Callback": "fedray.engine.callbacks",
    "FedrayError": "fedray.core.errors",
    "Federation": "fedray.core.federation",
    "load_federation": "fedray.data.registry",
    "resplit": "fedray.data.registry",
    "run": "fedray.app.api",
    "RunResult": "fedray.app.api",
    "sweep": "fedray.app.api",
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
