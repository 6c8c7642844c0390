"""Which clients take part in which round, deterministically from the run's seed.

Without replacement every client takes part exactly once: ⌈K/κ⌉ rounds over a
seeded permutation. With replacement (the FedAvg convention) every round draws
κ distinct clients uniformly at random, independently of earlier rounds, so a
closed-form run needs a coupon-collector number of rounds to see every client.
Poisson sampling (the setting of the subsampled-Gaussian privacy analyses)
takes each client into each round independently with probability q = κ/K: κ
clients a round on average, and a round may be empty.
A schedule is drawn as it is read (:mod:`fedray.runtime.schedules`), bitwise
the rounds it had when it was built whole; finding where every client was seen,
here and in :func:`coverage`, takes O(κ) work a round.
"""

from __future__ import annotations

from functools import partial

import numpy as np

from fedray.core.errors import FedrayError
from fedray.runtime.schedules import Blocks, Schedule

CHUNK_ROUNDS = 1024


def check_per_round(num_clients: int, per_round: int, option: str = "--clients-per-round", default: bool = False) -> None:
    """κ is 1..K; ``option`` is how the user gave κ, ``default`` says they did not (κ = 10 on a smaller federation)."""
    if not 1 <= per_round <= num_clients:
        got = f"its default {per_round} (give {option} or --participation)" if default else str(per_round)
        raise FedrayError(f"{option} must be between 1 and the {num_clients} clients, got {got}")


MAX_ROUNDS = 2**63 - 1
"""The most rounds a schedule has (a Python sequence's length is at most this)."""


def check_rounds(rounds: int, option: str = "--rounds") -> None:
    """Refuse a schedule of more rounds than a sequence can count (the rounds themselves are made as they are read)."""
    if rounds > MAX_ROUNDS:
        raise FedrayError(f"{option} must be at most 2^63 - 1, got {rounds}")


def distinct_draws(rng: np.random.Generator, num_clients: int, per_round: int, num_rounds: int) -> np.ndarray:
    """``num_rounds`` rows of ``per_round`` distinct clients each, uniform over such rows.

    When κ² ≤ K a row rarely repeats a client, so all rows are drawn at once and
    the few with a repeat are redrawn; otherwise each row is drawn without
    replacement on its own.
    """
    if per_round * per_round > num_clients:
        return np.stack([rng.choice(num_clients, per_round, replace=False) for _ in range(num_rounds)])
    rounds = rng.integers(num_clients, size=(num_rounds, per_round))
    while True:
        ordered = np.sort(rounds, axis=1)
        clash = np.flatnonzero((ordered[:, 1:] == ordered[:, :-1]).any(axis=1))
        if len(clash) == 0:
            return rounds
        rounds[clash] = rng.integers(num_clients, size=(len(clash), per_round))


class FirstSeen:
    """The round (0-based) in which each client was first drawn, told the rounds chunk after chunk: O(κ) work a
    round, whatever K (only the entries not seen before a chunk are sorted)."""

    def __init__(self, num_clients: int) -> None:
        self.rounds = np.full(num_clients, -1, dtype=np.int64)
        self.unseen = num_clients
        self.told = 0
        """Rounds told so far."""
        self.last = -1
        """The round in which the last client seen so far was first drawn: the round every client was seen by, once
        ``unseen`` is 0."""

    def tell(self, chunk: np.ndarray) -> None:
        """The next ``len(chunk)`` rounds, one a row."""
        flat = chunk.ravel()
        fresh = np.flatnonzero(self.rounds[flat] < 0)
        clients, first = np.unique(flat[fresh], return_index=True)
        if len(clients):
            rounds = self.told + fresh[first] // chunk.shape[1]
            self.rounds[clients] = rounds
            self.unseen -= len(clients)
            self.last = int(rounds.max())
        self.told += len(chunk)


def first_seen_rounds(num_clients: int, per_round: int, rng: np.random.Generator) -> np.ndarray:
    """Round (0-based) in which each client is first drawn, sampling with replacement until all are seen."""
    first = FirstSeen(num_clients)
    while first.unseen:
        first.tell(distinct_draws(rng, num_clients, per_round, CHUNK_ROUNDS))
    return first.rounds


def permutation(rng: np.random.Generator, num_clients: int) -> np.ndarray:
    """One pass over the clients without replacement: a seeded permutation."""
    return rng.permutation(num_clients)


class PassRounds:
    """Without replacement: pass p is the p-th seeded permutation of the clients, cut into rounds of κ (the last one
    of a pass shorter when κ does not divide K)."""

    def __init__(self, rng: np.random.Generator, num_clients: int, per_round: int) -> None:
        self.passes = Blocks(rng, partial(permutation, num_clients=num_clients))
        self.per_round = per_round
        self.per_pass = -(-num_clients // per_round)

    def __getitem__(self, index: int) -> np.ndarray:
        number, within = divmod(index, self.per_pass)
        return self.passes[number][within * self.per_round : (within + 1) * self.per_round]


class DrawnRounds:
    """With replacement: every round κ distinct clients, drawn in chunks of ``CHUNK_ROUNDS`` rounds."""

    def __init__(self, rng: np.random.Generator, num_clients: int, per_round: int) -> None:
        self.num_clients = num_clients
        self.chunks = Blocks(rng, partial(distinct_draws, num_clients=num_clients, per_round=per_round,
                                          num_rounds=CHUNK_ROUNDS))

    def __getitem__(self, index: int) -> np.ndarray:
        chunk, within = divmod(index, CHUNK_ROUNDS)
        return self.chunks[chunk][within]

    def until_seen(self, most: int | None) -> int:
        """The rounds until every client was seen, or ``most`` if fewer: one pass over the chunks, each drawn once."""
        first = FirstSeen(self.num_clients)
        while first.unseen and (most is None or first.told < most):
            first.tell(self.chunks[first.told // CHUNK_ROUNDS])
        needed = first.last + 1 if first.unseen == 0 else first.told
        return needed if most is None else min(needed, most)


class PoissonRounds:
    """Poisson sampling: in every round each client takes part independently with probability q = κ/K, drawn in chunks
    of ``CHUNK_ROUNDS`` rounds.

    A round draws its size m ~ Binomial(K, q), then a uniform m-subset of the clients (sorted): exactly independent
    Bernoulli(q) draws per client, since under those P(S) = q^|S| (1 − q)^(K − |S|) depends on S only through |S|,
    so |S| is Binomial(K, q) and, given |S|, S is uniform among the subsets of that size. O(κ) expected work a round
    (one binomial and a subset of expected size κ), where a coin per client would be O(K)."""

    def __init__(self, rng: np.random.Generator, num_clients: int, per_round: int) -> None:
        self.num_clients = num_clients
        self.chunks = Blocks(rng, partial(poisson_chunk, num_clients=num_clients, rate=per_round / num_clients))

    def __getitem__(self, index: int) -> np.ndarray:
        chunk, within = divmod(index, CHUNK_ROUNDS)
        packed = self.chunks[chunk]
        start, end = packed[within], packed[within + 1]
        return packed[CHUNK_ROUNDS + 1 + start : CHUNK_ROUNDS + 1 + end]

    def first_seen(self, most: int | None = None) -> FirstSeen:
        """The rounds told round by round (their sizes differ) until every client was seen, or ``most`` were told."""
        first = FirstSeen(self.num_clients)
        while first.unseen and (most is None or first.told < most):
            first.tell(self[first.told][None, :])
        return first

    def until_seen(self, most: int | None) -> int:
        """The rounds until every client was seen, or ``most`` if fewer."""
        first = self.first_seen(most)
        needed = first.last + 1 if first.unseen == 0 else first.told
        return needed if most is None else min(needed, most)


def poisson_chunk(rng: np.random.Generator, num_clients: int, rate: float) -> np.ndarray:
    """``CHUNK_ROUNDS`` Poisson-sampled rounds packed in one array: the rounds' ``CHUNK_ROUNDS + 1`` offsets, then
    their clients one round after another (each round's sorted)."""
    sizes = rng.binomial(num_clients, rate, size=CHUNK_ROUNDS)
    rounds = [np.sort(rng.choice(num_clients, int(size), replace=False)) for size in sizes]
    offsets = np.concatenate(([0], np.cumsum(sizes)))
    return np.concatenate([offsets, *rounds]).astype(np.int64)


def schedule(
    num_clients: int, per_round: int, replacement: bool, seed: int, max_rounds: int | None = None,
    past_coverage: bool = False, poisson: bool = False,
) -> Schedule:
    """Clients of each round, until every client was seen (or ``max_rounds``).

    With ``past_coverage`` (training) the schedule goes on to exactly
    ``max_rounds`` rounds: without replacement in passes over fresh
    permutations. Either way a shorter schedule is a prefix of a longer one.
    ``poisson`` (``replacement`` then does not matter): :class:`PoissonRounds`, κ/K the rate.
    The rounds are drawn as they are read (:class:`~fedray.runtime.schedules.Schedule`): a schedule holds a
    permutation of the clients or a chunk of rounds, and with replacement the generator's state at each chunk's
    start, recorded in the one pass that finds where every client was seen.
    """
    check_per_round(num_clients, per_round)
    rng = np.random.default_rng([seed, 21])
    more = past_coverage and max_rounds is not None
    if poisson:
        poisson_rounds = PoissonRounds(np.random.default_rng([seed, 23]), num_clients, per_round)
        return Schedule(poisson_rounds, range(max_rounds if more else poisson_rounds.until_seen(max_rounds)))
    if not replacement:
        rounds = PassRounds(rng, num_clients, per_round)
        return Schedule(rounds, range(max_rounds if more else rounds.per_pass)[:max_rounds])
    drawn = DrawnRounds(rng, num_clients, per_round)
    return Schedule(drawn, range(max_rounds if more else drawn.until_seen(max_rounds)))


def coverage(
    num_clients: int, per_round: int, replacement: bool, trials: int, seed: int, fractions=(0.25, 0.5, 0.75, 1.0),
    poisson: bool = False,
) -> dict[float, tuple[float, float]]:
    """Mean and std over ``trials`` of the rounds needed to have seen each fraction of the clients (``poisson``:
    sampled as :class:`PoissonRounds`)."""
    check_per_round(num_clients, per_round)
    if trials < 1:
        raise FedrayError(f"--trials must be ≥ 1, got {trials}")
    needed = np.ceil(np.asarray(fractions) * num_clients).astype(np.int64)
    results = np.empty((trials, len(fractions)))
    for trial in range(trials):
        rng = np.random.default_rng([seed, 22, trial])
        if poisson:
            first = PoissonRounds(rng, num_clients, per_round).first_seen()
            results[trial] = np.sort(first.rounds)[needed - 1] + 1
        elif replacement:
            rounds_seen = np.sort(first_seen_rounds(num_clients, per_round, rng)) + 1
            results[trial] = rounds_seen[needed - 1]
        else:
            results[trial] = np.ceil(needed / per_round)
    return {f: (float(results[:, i].mean()), float(results[:, i].std(ddof=1) if trials > 1 else 0.0)) for i, f in enumerate(fractions)}
