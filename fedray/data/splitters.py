"""Label-skew splitters for any labelled set (the CIFAR / ImageNet-R / CUB / Cars protocols).

Each splitter returns an int64 array giving the client index of every sample
and is deterministic given its seed. :func:`resplit` turns such an assignment
into a new :class:`Federation` over the same samples.
"""

from __future__ import annotations

import time

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from fedray.core.federation import TRAIN, Federation
from fedray.core.errors import FedrayError

MAX_DIRICHLET_ATTEMPTS = 1000
DIRICHLET_TIME_LIMIT_S = 60.0
"""Draws stop at whichever comes first: a large split takes about a second per draw."""
PROBE_DRAWS = 5
HOPELESS_SHORT = 10
"""After PROBE_DRAWS draws that each left ≥ HOPELESS_SHORT clients short, the split is refused as infeasible.

If the number of clients left short were Poisson with a mean λ small enough
for a draw to succeed once in 1000 (λ ≤ 7), five draws in a row would all
leave ten or more short with probability below 10⁻³; at λ ≥ 10 a draw succeeds
less than once in 20,000.
"""
UNASSIGNED = -1
"""Assignment of a sample no client holds (#C protocol with fewer slots than classes)."""


def dirichlet_split(
    labels: np.ndarray, num_clients: int, alpha: float, seed: int, min_client_size: int = 1
) -> np.ndarray:
    """Split each class among clients in proportions drawn from Dirichlet(alpha * 1_K) (``split=dirichlet_per_class``).

    Not the protocol of the FedCOF and FedNCM papers (see
    :func:`hsu_dirichlet_split`): clients get unequal sizes, and on
    CIFAR-100-shaped data about 25% more (client, class) pairs.

    The whole split is redrawn (from the same generator) until every client has
    at least ``min_client_size`` samples, for at most :data:`MAX_DIRICHLET_ATTEMPTS`
    draws or :data:`DIRICHLET_TIME_LIMIT_S` seconds; when the first
    :data:`PROBE_DRAWS` draws all leave many clients short, it stops there and
    says so. Small ``alpha`` gives each class to few clients; large ``alpha``
    gives nearly IID clients. With very small ``alpha`` and more clients than
    classes, many clients get no sample at all: pass ``min_client_size=0`` to
    accept that.
    """
    codes = _class_codes(labels)
    num_samples = len(codes)
    _check_num_clients(num_clients, num_samples)
    if not (alpha > 0 and np.isfinite(alpha)):
        raise FedrayError(f"alpha must be a finite number > 0, got {alpha}")
    if min_client_size < 0 or min_client_size * num_clients > num_samples:
        raise FedrayError(
            f"min_client_size={min_client_size} is impossible for {num_clients} clients and {num_samples} samples"
        )
    rng = np.random.default_rng(seed)
    by_class = _samples_by_class(codes)
    start = time.monotonic()
    fewest_short = num_clients
    for attempt in range(1, MAX_DIRICHLET_ATTEMPTS + 1):
        assignment = _dirichlet_draw(by_class, num_samples, num_clients, alpha, rng)
        short = int((np.bincount(assignment, minlength=num_clients) < min_client_size).sum())
        if short == 0:
            return assignment
        fewest_short = min(fewest_short, short)
        if attempt == PROBE_DRAWS and fewest_short >= HOPELESS_SHORT:
            raise FedrayError(
                f"alpha={alpha}: no Dirichlet split of {num_samples} samples of {len(by_class)} classes is likely to give "
                f"every one of {num_clients} clients ≥ {min_client_size} samples: each of the first {attempt} draws left "
                f"at least {fewest_short} short (a small alpha gives each class to few clients); raise alpha, lower "
                f"clients, or set min_client_size=0 to drop the empty clients"
            )
        if time.monotonic() - start > DIRICHLET_TIME_LIMIT_S:
            break
    raise FedrayError(
        f"alpha={alpha}: no Dirichlet split in {attempt} attempts ({time.monotonic() - start:.0f} s) "
        f"gives every one of {num_clients} clients ≥ {min_client_size} samples (the best left {fewest_short} short); "
        f"lower min_client_size or num_clients, or raise alpha"
    )


def hsu_dirichlet_split(labels: np.ndarray, num_clients: int, alpha: float, seed: int) -> np.ndarray:
    """The Dirichlet protocol of Hsu et al. (2019) as the FedCOF and FedNCM code implements it.

    Each client k draws class proportions q_k ~ Dir(alpha · 1_C); clients are
    filled one after another with ⌊N/K⌋ samples each, each sample's class drawn
    from q_k (then the next unused sample of that class, in a seeded shuffled
    order). When a class runs out, its proportion is set to 0 for every client
    and the proportions renormalized; the N − K⌊N/K⌋ samples left over get
    :data:`UNASSIGNED` (dropped, as in ``partition_dataset_by_dirichlet`` of
    dipamgoswami/FedCOF). Draws are taken in batches from the renormalized
    proportions and a draw of a class that ran out within the batch is drawn
    again: conditioning on an available class is exactly the renormalization,
    so the split has the protocol's distribution (not the authors' random
    stream, which depends on their dataset order). A client whose remaining
    proportions underflow to 0 (possible for α ≲ 0.01) draws uniformly among
    the classes left.
    """
    codes = _class_codes(labels)
    num_samples = len(codes)
    _check_num_clients(num_clients, num_samples)
    if not (alpha > 0 and np.isfinite(alpha)):
        raise FedrayError(f"alpha must be a finite number > 0, got {alpha}")
    num_classes = int(codes.max()) + 1
    rng = np.random.default_rng(seed)
    proportions = rng.dirichlet(np.full(num_classes, alpha), size=num_clients)
    remaining = np.bincount(codes, minlength=num_classes)
    taken = np.zeros((num_clients, num_classes), dtype=np.int64)
    per_client = num_samples // num_clients
    for client in range(num_clients):
        need = per_client
        while need:
            available = remaining > 0
            weights = np.where(available, proportions[client], 0.0)
            if weights.sum() <= 0:
                weights = available.astype(np.float64)
            draws = rng.choice(num_classes, size=need, p=weights / weights.sum())
            accepted = np.bincount(draws[_within_remaining(draws, remaining)], minlength=num_classes)
            taken[client] += accepted
            remaining -= accepted
            need -= int(accepted.sum())
    assignment = np.full(num_samples, UNASSIGNED, dtype=np.int64)
    for c, samples in enumerate(_samples_by_class(codes)):
        holders = np.repeat(np.arange(num_clients), taken[:, c])
        assignment[rng.permutation(samples)[: len(holders)]] = holders
    return assignment


def _within_remaining(draws: np.ndarray, remaining: np.ndarray) -> np.ndarray:
    """Which draws, in order, a class still has a sample for: the i-th draw of class c iff i < remaining[c]."""
    order = np.argsort(draws, kind="stable")
    ranked = draws[order]
    rank = np.arange(len(draws)) - np.searchsorted(ranked, ranked, side="left")
    keep = np.empty(len(draws), dtype=bool)
    keep[order] = rank < remaining[ranked]
    return keep


def classes_per_client_split(
    labels: np.ndarray, num_clients: int, classes_per_client: int, seed: int
) -> np.ndarray:
    """The "#C classes per client" protocol: each client holds ``classes_per_client`` distinct classes.

    Classes are dealt round-robin over a seeded permutation, so every class is
    held when ``num_clients * classes_per_client >= C``; the remaining slots get
    random classes the client does not hold yet. Each class's shuffled samples
    are split as evenly as possible among its holders. When there are fewer
    slots than classes, samples of the classes nobody holds get
    :data:`UNASSIGNED` (-1).
    """
    codes = _class_codes(labels)
    _check_num_clients(num_clients, len(codes))
    num_classes = int(codes.max()) + 1
    if not 1 <= classes_per_client <= num_classes:
        raise FedrayError(
            f"classes_per_client must be between 1 and {num_classes} (the classes present), got {classes_per_client}"
        )
    rng = np.random.default_rng(seed)
    held = _deal_classes(num_clients, num_classes, classes_per_client, rng)
    assignment = np.full(len(codes), UNASSIGNED, dtype=np.int64)
    for c, samples in enumerate(_samples_by_class(codes)):
        holders = np.flatnonzero(held[:, c])
        if holders.size:
            assignment[rng.permutation(samples)] = np.repeat(holders, _even_counts(len(samples), holders.size))
    sizes = np.bincount(assignment[assignment != UNASSIGNED], minlength=num_clients)
    if sizes.min() == 0:
        empty = int(np.argmin(sizes))
        raise FedrayError(
            f"classes_per_client={classes_per_client}: client {empty} gets no sample "
            f"(its classes have fewer samples than clients holding them); use fewer clients"
        )
    return assignment


def resplit(federation: Federation, assignment: np.ndarray, name: str) -> Federation:
    """``federation`` with its train rows given to clients ``str(assignment[i])``.

    ``assignment`` has one entry per train row, in ``federation.table`` order.
    Train rows come out sorted (stably) by client, so client ``k`` is
    ``Federation`` client index ``k`` when no client is empty; rows assigned
    :data:`UNASSIGNED` are dropped. Test rows, labels and every other column
    are kept as they are.
    """
    table = federation.table
    is_train = pc.equal(table.column("split"), TRAIN).to_numpy(zero_copy_only=False)
    train_rows = np.flatnonzero(is_train)
    assignment = np.asarray(assignment)
    if assignment.shape != train_rows.shape or not np.issubdtype(assignment.dtype, np.integer):
        raise FedrayError(
            f"{name}: the assignment must be {len(train_rows)} integers (one per train row of "
            f"{federation.name}), got shape {assignment.shape} of {assignment.dtype}"
        )
    kept = assignment != UNASSIGNED
    if (assignment[kept] < 0).any():
        raise FedrayError(f"{name}: negative client index {assignment[kept].min()} in the assignment")
    order = np.argsort(assignment[kept], kind="stable")
    train = table.take(train_rows[kept][order])
    client_id = pa.array(assignment[kept][order].astype(str), pa.string())
    train = train.set_column(train.schema.get_field_index("client_id"), "client_id", client_id)
    test = table.filter(pa.array(~is_train))
    return Federation(name, federation.num_classes, pa.concat_tables([train, test]), source=federation.source)


def _class_codes(labels: np.ndarray) -> np.ndarray:
    """``labels`` renumbered 0..C-1 (the classes present, in sorted order)."""
    labels = np.asarray(labels)
    if labels.ndim != 1:
        raise FedrayError(f"labels must be one-dimensional, got shape {labels.shape}")
    return np.unique(labels, return_inverse=True)[1].astype(np.int64)


def _check_num_clients(num_clients: int, num_samples: int) -> None:
    if not 1 <= num_clients <= num_samples:
        raise FedrayError(f"num_clients must be between 1 and {num_samples} (the number of samples), got {num_clients}")


def _samples_by_class(codes: np.ndarray) -> list[np.ndarray]:
    """Sample indices of each class 0..C-1, each in increasing order."""
    order = np.argsort(codes, kind="stable")
    bounds = np.cumsum(np.bincount(codes))[:-1]
    return np.split(order, bounds)


def _dirichlet_draw(
    by_class: list[np.ndarray], num_samples: int, num_clients: int, alpha: float, rng: np.random.Generator
) -> np.ndarray:
    assignment = np.empty(num_samples, dtype=np.int64)
    for samples in by_class:
        proportions = rng.dirichlet(np.full(num_clients, alpha))
        cuts = np.floor(np.cumsum(proportions)[:-1] * len(samples)).astype(np.int64)
        counts = np.diff(np.concatenate([[0], cuts, [len(samples)]]))
        assignment[rng.permutation(samples)] = np.repeat(np.arange(num_clients), counts)
    return assignment


def _deal_classes(num_clients: int, num_classes: int, per_client: int, rng: np.random.Generator) -> np.ndarray:
    """A (clients × classes) boolean matrix with ``per_client`` classes in every row."""
    held = np.zeros((num_clients, num_classes), dtype=bool)
    dealt = rng.permutation(num_classes)[: num_clients * per_client]
    held[np.arange(len(dealt)) % num_clients, dealt] = True
    for client in range(num_clients):
        missing = per_client - int(held[client].sum())
        if missing:
            held[client, rng.choice(np.flatnonzero(~held[client]), missing, replace=False)] = True
    return held


def _even_counts(total: int, parts: int) -> np.ndarray:
    """``total`` split into ``parts`` counts differing by at most one."""
    return total // parts + (np.arange(parts) < total % parts)
