"""The clock's random numbers: pure functions of (the run's seed, a stream number, client ids, a round), vectorised.

A counter-based generator: no state and no generator object per client. A client's number depends on nothing but
(seed, stream, client, round, draw), so it is the same whichever other clients are in the call, in whatever order,
on whatever shard layout, and 10⁶ clients cost a few passes of numpy's uint64 arithmetic (tens of milliseconds).

The hash absorbs its inputs one after the other, each through SplitMix64's finalizer (Stafford's "mix13", the output
function of Steele, Lea and Flood's SplitMix64, 2014: a bijection of 64-bit words with full avalanche). Each step is
a bijection of the word it absorbs, so for a fixed (seed, stream, draw, round) two clients never share a word.

Stream numbers: 11–30 are the data's and sampling's; the clock takes 40–49 (devices 40–41, availability 42–44,
selectors 45–46, rounds 47–49). ``draw`` numbers the independent values one (client, round) needs from one stream
(a device's three jitter factors: draws 0, 1, 2).
"""

from __future__ import annotations

import functools

import numpy as np

from fedray.core.errors import FedrayError
from fedray.core.lazy_modules import lazy_module
from fedray.core.numeric_options import MAX_SEED

special = lazy_module("scipy.special", globals())  # a second to import; only normal draws use it

GOLDEN = np.uint64(0x9E3779B97F4A7C15)
"""2⁶⁴ / φ, odd: SplitMix64's increment, here the multiplier that spreads an absorbed counter over the word."""
_MIX1, _MIX2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_SHIFTS = (np.uint64(30), np.uint64(27), np.uint64(31))
_MANTISSA = 52


def _mixed(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer, elementwise on uint64 (wrapping arithmetic)."""
    x = (x ^ (x >> _SHIFTS[0])) * _MIX1
    x = (x ^ (x >> _SHIFTS[1])) * _MIX2
    return x ^ (x >> _SHIFTS[2])


def _absorbed(word: np.ndarray, values: np.ndarray) -> np.ndarray:
    """The hash ``word`` after absorbing ``values`` (broadcast): injective in ``values`` for a fixed ``word``."""
    return _mixed((word ^ values) * GOLDEN + GOLDEN)


def _counters(name: str, values: object) -> np.ndarray:
    """``values`` (an integer or an array of them, each ≥ 0) as uint64, or a one-line error naming ``name``."""
    array = np.asarray(values)
    if array.size == 0:  # np.asarray([]) is float64
        return array.astype(np.uint64)
    if array.dtype.kind not in "iu":
        raise FedrayError(f"clock streams: {name} must be integers, got an array of {array.dtype}")
    if array.dtype.kind == "i" and array.min() < 0:
        raise FedrayError(f"clock streams: {name} must be ≥ 0, got {array.min()}")
    return array.astype(np.uint64)


def uniforms(seed: int, stream: int, clients: np.ndarray, round: int | np.ndarray = 0,
             draw: int | tuple[int, ...] = 0) -> np.ndarray:
    """One uniform number per client (float64, of the shape of ``clients`` broadcast with ``round``), in the open
    interval (0, 1): (k + ½)·2⁻⁵² for k uniform on 0 .. 2⁵² − 1, so that no transform meets 0 or 1. ``draw`` a tuple:
    each draw's numbers in one call, stacked along a first axis (the same numbers as one call a draw)."""
    if not isinstance(seed, (int, np.integer)) or not 0 <= seed <= MAX_SEED:
        raise FedrayError(f"clock streams: the seed must be an integer from 0 to 2^63 - 1, got {seed!r}")
    if isinstance(draw, tuple):
        key = np.array([_stream_key(int(seed), stream, one) for one in draw], dtype=np.uint64)
        key = key.reshape(len(draw), *(1,) * np.ndim(clients))
    else:
        key = _stream_key(int(seed), stream, draw)
    with np.errstate(over="ignore"):
        for name, values in (("the client ids", clients), ("the round", round)):
            key = _absorbed(key, _counters(name, values))
    return ((key >> np.uint64(64 - _MANTISSA)).astype(np.float64) + 0.5) * 2.0**-_MANTISSA


@functools.lru_cache(maxsize=1024)
def _stream_key(seed: int, stream: int, draw: int) -> np.uint64:
    """The hash after absorbing (seed, stream, draw): the same for every call of a stream's draw, so made once (an
    asynchronous run asks for a handful of numbers tens of thousands of times)."""
    key = np.uint64(0)
    with np.errstate(over="ignore"):
        for name, values in (("the seed", seed), ("the stream", stream), ("the draw", draw)):
            key = _absorbed(key, _counters(name, values))
    return key


def normals(seed: int, stream: int, clients: np.ndarray, round: int | np.ndarray = 0,
            draw: int | tuple[int, ...] = 0) -> np.ndarray:
    """Standard normal numbers, the inverse normal CDF of :func:`uniforms` (one uniform each: any client alone)."""
    return special.ndtri(uniforms(seed, stream, clients, round, draw))


def lognormal_factors(sigma: float | np.ndarray, seed: int, stream: int, clients: np.ndarray,
                      round: int | np.ndarray = 0, draw: int | tuple[int, ...] = 0) -> np.ndarray:
    """exp(σ·z) for z of :func:`normals`: lognormal factors of median 1 (σ per client or one for all; with a tuple of
    draws, one row of σ a draw). A σ of 0 gives exactly 1."""
    return np.exp(np.asarray(sigma, dtype=np.float64) * normals(seed, stream, clients, round, draw))
