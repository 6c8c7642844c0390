"""Whether the actor running this code is one that Ray restarted after a failure (its clients' states are lost)."""

from __future__ import annotations

import warnings

import ray
from ray.util.annotations import RayDeprecationWarning


def this_actor_was_restarted() -> bool:
    """Ray's ``was_current_actor_reconstructed``, without the deprecation warning Ray raises inside it (it reads its
    own deprecated ``actor_id``), which a ``--verbose`` run printed under every shard's name."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RayDeprecationWarning)
        return bool(ray.get_runtime_context().was_current_actor_reconstructed)
