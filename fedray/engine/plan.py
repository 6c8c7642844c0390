"""A run's plan: what a validated configuration builds once, before any work."""

from __future__ import annotations

from fedray.core.federation import Federation
from fedray.engine.config import RunConfig
from fedray.methods.algorithm import FederatedAlgorithm
from fedray.runtime.footprint import Footprint, closed_form_footprint, largest_clients, training_footprint


def footprints(config: RunConfig, federation: Federation, algorithm: FederatedAlgorithm | None) -> list[Footprint]:
    """The memory each stage of ``config`` (resolved) needs on ``federation``'s features, ``algorithm`` the training
    algorithm it trains with (None: a closed-form run); none for runs on images (not estimated)."""
    if config.finetune:
        return []
    per_round = config.per_round(federation.num_clients)
    block = largest_clients(federation, per_round * config.eval_every)
    options = {"bias": config.bias, "rf_dim": config.rf_dim, "means_per_class": config.means_per_class}
    if algorithm is None:
        return [closed_form_footprint(config.method, config.method, federation, federation.dim, block, **options)]
    width = config.sphere_dim or federation.dim
    stages = [(f"{config.init} (--init)", config.init, federation.dim)] if config.init != "random" else []
    if config.probe_ridge:
        stages.append(("fed3r (--probe-ridge)", "fed3r", federation.dim))
    if config.head == "sphere":
        stages.append(("ffc (SphereFed's calibration)", "ffc", width))
    kept = federation.num_clients if config.rounds is None else min(federation.num_clients, config.rounds * per_round)
    sphere_dim = width if config.head == "sphere" else None
    return [*(closed_form_footprint(label, method, federation, dim, block, **options) for label, method, dim in stages),
            training_footprint(config.method, federation, algorithm, sphere_dim, kept,
                               largest_clients(federation, per_round))]
