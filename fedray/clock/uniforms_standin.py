"""A stand-in for ``fedray.clock.streams.uniforms`` (the devices branch owns that helper): at merge, availability
imports the shared one instead and this file goes.

A counter-based hash: each uniform is a pure function of (seed, stream, client, counter), splitmix64's finalizer
applied word by word, so a client's draws never depend on which other clients are looked up with it, in what order,
or on which shard.
"""

from __future__ import annotations

import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX_1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX_2 = np.uint64(0x94D049BB133111EB)


def _mix(words: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer, a bijection of uint64."""
    words = (words ^ (words >> np.uint64(30))) * _MIX_1
    words = (words ^ (words >> np.uint64(27))) * _MIX_2
    return words ^ (words >> np.uint64(31))


def uniforms(seed: int, stream: int, clients: np.ndarray, round: int | np.ndarray = 0) -> np.ndarray:
    """Float64 uniforms in [0, 1), one per client (``round`` a number or an array like ``clients``): the same for
    the same (seed, stream, client, round) whatever else is drawn."""
    with np.errstate(over="ignore"):
        key = _mix(np.uint64(seed) * _GOLDEN + np.uint64(stream))
        words = _mix(np.asarray(clients).astype(np.uint64) + key)
        words = _mix(words ^ (np.asarray(round).astype(np.uint64) * _GOLDEN + _GOLDEN))
    return (words >> np.uint64(11)).astype(np.float64) * 2.0**-53
