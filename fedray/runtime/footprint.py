"""The memory a run on features needs, estimated from its shapes before any shard starts.

What it counts: the large arrays the code allocates, in bytes (statistics in
float64, features in float32), with d the feature dimension, C the classes,
M the client-class pairs, N_s a shard's training samples, B the samples of one
block (the clients a shard serves in one evaluation block, or in one round
when training: at most N_s, and at most the largest such set of clients):

  every shard   its features and labels (N_s × (4d + 8); N_s × 16 for a federation
                that streams its features, whose block is then at most
                STREAMED_ROWS samples plus a client); the block's rows gathered
                (B × (4d + 8)) and their float64 design (B × 8p, plus the float32
                output of the method's feature map); five statistics objects at
                once (a partial received in the tree reduction, its own, their sum,
                the copy Ray pickles to return it, the root the first shard makes);
                its test rows (T_s × (4d + 8), T_s its whole chunks of 8,192 test
                rows) and their feature map's output; one chunk of test scores
                (8192 × 4C);
  the driver    three statistics objects (the running total, a block's, their
                sum); the solver's workspace.

Statistics: fedncm C × d; fed3r and ffc p × p + p × C with p = d (+ 1 with
--bias); fed3r-rf the same with p = D (plus the d × D random map everywhere);
fedcof C × d and the received means, at most M × --means-per-class × d, which
stay in the shards that computed them, each keeping at most its budget
(:mod:`fedray.runtime.kept`; the rest is computed again at each solve);
fedcof-oracle d × d + C × d; ccvr C × d × d (each class's Σ zzᵀ: C·d² floats, 16 GB
in float64 at iNat's C = 1,203 and d = 1,280, in every statistics object) + C × d,
and on the driver the class covariances and the C × V virtual features.
A gradient method on features adds its trained parameters P (C(d + 1); with
--head sphere, l(d + 1) + lC) four times everywhere, its round's logits in a
shard (5 × B × 4C), and its clients' states in the shards: SCAFFOLD's gradient
rows on a linear head (N_s × 4C), else what the algorithm's
``init_client_state`` makes for one client times the clients a shard holds
(K N_s / N, at most the clients --rounds samples), at most --client-state-memory
a shard (the rest spill to disk); each closed-form stage it runs (--init,
--probe-ridge, SphereFed's calibration) is estimated as a stage of its own.
Measured against shards' peak memory growth past their features (iNat-User-120K
stand-ins, 2 shards; fed3r, fed3r-rf with D = 1,000 and 3,000, ffc, fedcof,
fedncm), the estimate was at or above it, within a few MB where the random
features' design dominates, and never more than 0.5 GB above.

Not counted: each process's Python, torch and Ray (a few hundred MB), the object
store (a block's total waits there until the driver reads it; Ray spills it to
disk when full), runs that fine-tune on images, and TCT.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from fedray.core.federation import STREAMED_ROWS, Federation
from fedray.methods.evaluation import CHUNK
from fedray.methods.algorithm import FederatedAlgorithm
from fedray.methods.training.dual_form import dual_form
from fedray.runtime.client_states import meta_client_state
from fedray.runtime.kept import default_budget

FLOAT32, FLOAT64, INT64 = 4, 8, 8
SHARD_COPIES = 5
"""Statistics objects alive at once in a shard: a partial received in the tree reduction,
its own, their sum, the copy Ray pickles to return the sum, and, in the shard that makes
the tree's root, the root it returns (as measured)."""
DRIVER_COPIES = 3
"""On the driver: the running total, a block's total, their sum."""
TRAINING_COPIES = 4
"""Copies of the trained parameters: the head, a local copy, its gradient, the update."""
LOGIT_COPIES = 5


@dataclass(frozen=True)
class Term:
    """Bytes of one kind of array; ``what`` it is and the ``remedy``, for a message."""

    what: str
    remedy: str
    per_sample: float = 0.0
    """In a shard, per training sample it holds."""
    per_block_sample: float = 0.0
    """In a shard, per sample of its largest block."""
    per_shard: float = 0.0
    per_test_sample: float = 0.0
    """In a shard, per test row it holds."""
    driver: float = 0.0
    shard_cap: float = float("inf")
    """The most it weighs in one shard (the clients' states a shard keeps in memory)."""

    def in_shard(self, samples: int, block: int, test_samples: int) -> float:
        """Bytes in a shard of ``samples`` training rows, a block of ``block`` and ``test_samples`` test rows."""
        return min(self.shard_cap, self.per_shard + self.per_sample * samples + self.per_block_sample * block
                   + self.per_test_sample * test_samples)


@dataclass(frozen=True)
class Footprint:
    """One stage of a run: its terms and the bound on a block's samples."""

    stage: str
    terms: tuple[Term, ...]
    block_samples: int

    def shard(self, samples: int, test_samples: int) -> float:
        """Bytes of a shard holding ``samples`` training rows and ``test_samples`` test rows."""
        block = min(samples, self.block_samples)
        return sum(t.in_shard(samples, block, test_samples) for t in self.terms)

    @property
    def driver(self) -> float:
        return sum(t.driver for t in self.terms)

    def largest(self, shard_samples: np.ndarray, test_samples: int) -> Term:
        """The term that weighs most in the whole run, over the shards holding ``shard_samples`` and the test rows."""
        tests = test_samples / len(shard_samples)
        return max(self.terms, key=lambda t: t.driver + sum(t.in_shard(int(samples), min(int(samples), self.block_samples),
                                                                       tests) for samples in shard_samples))


def closed_form_footprint(stage: str, method: str, federation: Federation, dim: int, block_samples: int, *,
                          bias: bool = False, rf_dim: int = 0, means_per_class: int = 1,
                          covariance: str = "full", virtual_per_class: int = 100,
                          kept_budget: int | None = None) -> Footprint:
    """The footprint of the built-in closed-form ``method`` (its options ``bias``, ``rf_dim``, ``means_per_class``,
    ``covariance``, ``virtual_per_class``) on ``federation``'s features mapped to ``dim``, in blocks of at most
    ``block_samples``; ``kept_budget``: the bytes of received means a shard keeps (None: a shard alone on the
    machine's, :func:`~fedray.runtime.kept.default_budget`)."""
    kept_budget = default_budget() if kept_budget is None else kept_budget
    terms = _closed_form(method, federation, dim, bias, rf_dim, means_per_class, covariance, virtual_per_class,
                         kept_budget)
    if federation.streams_features:  # a block's statistics are computed in runs of about STREAMED_ROWS samples
        block_samples = min(block_samples, STREAMED_ROWS + largest_clients(federation, 1))
    return Footprint(stage, _data_terms(federation) + terms, block_samples)


FOOTPRINT_OPTIONS = ("bias", "rf_dim", "means_per_class", "covariance", "virtual_per_class")
"""The built-in closed-form methods' options that change what they hold in memory (:func:`closed_form_footprint`)."""


def method_footprint(stage: str, method: str, options: Mapping[str, object], federation: Federation, dim: int,
                     block_samples: int, kept_budget: int | None = None) -> Footprint:
    """:func:`closed_form_footprint` of ``method`` with the run's ``options`` of it (those of
    :data:`FOOTPRINT_OPTIONS` among them; the others' defaults where it has none)."""
    shaping = {name: options[name] for name in FOOTPRINT_OPTIONS if name in options}
    return closed_form_footprint(stage, method, federation, dim, block_samples, **shaping, kept_budget=kept_budget)


def training_footprint(stage: str, federation: Federation, algorithm: FederatedAlgorithm, sphere_dim: int | None,
                       kept_clients: int, round_samples: int, state_budget: float = float("inf")) -> Footprint:
    """The footprint of training a linear head (or SphereFed's l × d projection, ``sphere_dim`` = l) on
    ``federation``'s features with ``algorithm``, whose path (the dual form's compact SCAFFOLD states, or autograd's)
    decides what its clients' states weigh; ``kept_clients``: the most clients whose states the shards hold;
    ``round_samples``: the most samples a round gathers; ``state_budget``: the bytes of clients' states a shard keeps in
    memory (the rest spill to disk)."""
    terms = _training_terms(federation, sphere_dim, algorithm, kept_clients, state_budget)
    return Footprint(stage, _data_terms(federation) + terms, round_samples)


def largest_clients(federation: Federation, count: int) -> int:
    """Samples of the ``count`` largest clients: the most one block (or round) can gather."""
    sizes = np.sort(federation.client_sizes)[::-1]
    return int(sizes[:count].sum())


def _data_terms(federation: Federation) -> tuple[Term, ...]:
    """A shard's rows: its features (only their sample ids and labels where the federation streams them) and its
    block's, and its test rows."""
    d, test_samples = federation.dim, federation.num_test
    held = INT64 + (INT64 if federation.streams_features else FLOAT32 * d)
    return (
        Term(f"the training features (N × d float32, d = {d})",
             "use a cluster with more memory, or more shards (--num-shards) to spread them over more nodes",
             per_sample=held, per_block_sample=FLOAT32 * d + INT64),
        Term(f"the test features ({test_samples:,} × {d} float32)", "use a cluster with more memory, or more shards",
             per_test_sample=FLOAT32 * d + INT64),
    )


def _closed_form(method: str, federation: Federation, d: int, bias: bool, rf_dim: int,
                 means_per_class: int, covariance: str, virtual_per_class: int, kept_budget: int) -> tuple[Term, ...]:
    """``method``'s terms on features of dimension ``d``."""
    classes, tests = federation.num_classes, federation.num_test
    fewer_classes = "lower the number of classes C (the schema's fedray.num_classes, or the labels)"
    scores = Term(f"the test scores (8192 × C float32, C = {classes:,})", fewer_classes,
                  per_shard=min(tests, CHUNK) * classes * FLOAT32)
    oracle = method == "fedcof-oracle"
    squares = {"diagonal": d, "spherical": 1}.get(covariance, 0) if oracle else 0  # the oracle's class Σ z∘z, Σ ‖z‖²
    class_sums = classes * (d + 1 + squares) * FLOAT64
    sums = Term(f"the class sums (C × d float64, C = {classes:,}, d = {d})", fewer_classes,
                per_block_sample=FLOAT64 * d, per_shard=SHARD_COPIES * class_sums, driver=DRIVER_COPIES * class_sums + 2 * classes * d * FLOAT64)
    if method == "fedncm":
        return scores, sums
    if method in ("fed3r", "ffc", "fed3r-rf"):
        return (scores, *_ridge(method, bias, rf_dim, d, classes, tests))
    if method == "ccvr":
        return (scores, sums, *_ccvr(d, classes, virtual_per_class))
    full = oracle and covariance == "full"  # Σ zzᵀ in the statistics
    means = 0 if oracle else int(federation.client_num_classes.sum()) * means_per_class * (d + 2) * FLOAT64
    gram = d * d * FLOAT64
    return (
        scores,
        sums,
        Term(f"the d × d covariance and Gram matrices (float64, d = {d})", "lower the feature dimension d",
             per_shard=SHARD_COPIES * gram if full else 0, driver=((DRIVER_COPIES if full else 0) + 3) * gram),
        Term("the received class means (M × d float64 for each mean per class, kept in the shards up to their budget)",
             "lower --means-per-class", per_shard=min(means, kept_budget)),
    )


def _ccvr(d: int, classes: int, virtual_per_class: int) -> tuple[Term, ...]:
    """CCVR's per-class second moments Σ zzᵀ (C × d × d float64) in every statistics object, and on the driver the
    class covariances and their eigendecomposition (two more C × d × d, one d × d at a time) and the virtual features
    (C·V rows, float64 and their float32 copy, with their labels)."""
    moments = classes * d * d * FLOAT64
    virtual = classes * virtual_per_class * (FLOAT64 * d + FLOAT32 * d + INT64)
    return (
        Term(f"the class second moments Σ zzᵀ (C × d × d float64, C = {classes:,}, d = {d})",
             "lower the feature dimension d or the number of classes C", per_block_sample=FLOAT64 * d,
             per_shard=SHARD_COPIES * moments, driver=(DRIVER_COPIES + 2) * moments),
        Term(f"the virtual features (C × V rows, float64 and float32, V = {virtual_per_class:,})",
             "lower --virtual-per-class", driver=virtual),
    )


def _ridge(method: str, bias: bool, rf_dim: int, d: int, classes: int, tests: int) -> tuple[Term, ...]:
    """Fed3R's family: the design's feature map (none, L2 normalization, or D random features), Gram and targets."""
    mapped = {"fed3r": 0, "ffc": d, "fed3r-rf": rf_dim}[method]
    p = (mapped or d) + int(bias)
    narrower = "lower --rf-dim" if method == "fed3r-rf" else "lower the feature dimension d"
    design = FLOAT64 * p + FLOAT32 * mapped + (FLOAT64 * (p - 1) if bias else 0)
    terms = [
        Term(f"the p × p Gram matrix and the design (float64, p = {p})", narrower, per_block_sample=design,
             per_shard=SHARD_COPIES * p * p * FLOAT64, driver=(DRIVER_COPIES + 2) * p * p * FLOAT64,
             per_test_sample=FLOAT32 * mapped * 2),
        Term(f"the p × C targets (float64, p = {p}, C = {classes:,})",
             "lower the number of classes C (the schema's fedray.num_classes, or the labels)",
             per_shard=SHARD_COPIES * p * classes * FLOAT64, driver=(DRIVER_COPIES + 2) * p * classes * FLOAT64),
    ]
    if method == "fed3r-rf":
        omega = d * rf_dim * FLOAT32
        terms.append(Term(f"the d × D random feature map (float32, D = {rf_dim})", "lower --rf-dim",
                          per_shard=omega, driver=omega))
    return tuple(terms)


def _training_terms(federation: Federation, sphere_dim: int | None, algorithm: FederatedAlgorithm,
                    kept: int, state_budget: float) -> tuple[Term, ...]:
    d, classes = federation.dim, federation.num_classes
    sphere, width = sphere_dim is not None, sphere_dim or d
    parameters = (width * (d + 1) + width * classes if sphere else classes * (d + 1)) * FLOAT32
    terms = [
        Term(f"the trained parameters (four float32 copies of {parameters // FLOAT32:,})",
             "lower --sphere-dim or the number of classes C" if sphere else "lower the number of classes C",
             per_shard=TRAINING_COPIES * parameters, driver=TRAINING_COPIES * parameters),
        Term(f"a round's logits (samples × C float32, C = {classes:,})", "lower --clients-per-round or the number of classes C",
             per_block_sample=LOGIT_COPIES * classes * FLOAT32,
             per_shard=min(federation.num_test, CHUNK) * classes * FLOAT32),
    ]
    dual = None if sphere else dual_form(algorithm)
    if dual is not None and dual.control:
        # the rows of the clients sampled at least once: in proportion to a shard's samples, at most --rounds' clients
        terms.append(Term("SCAFFOLD's client states in the shards (the gradient rows G: samples × C float32)",
                          "lower --client-state-memory (the rest spill to disk)",
                          per_sample=classes * FLOAT32 * kept / federation.num_clients, shard_cap=state_budget))
        terms.append(Term("SCAFFOLD's gradient rows of a round (samples × C float32)", "lower --clients-per-round",
                          per_block_sample=2 * classes * FLOAT32))
    elif (state := _client_state_bytes(algorithm, {"weight": (d, width), "bias": (width,)} if sphere else
                                       {"weight": (d, classes), "bias": (classes,)})):
        # the clients a shard holds, in proportion to its samples; at most the clients --rounds can sample
        terms.append(Term(f"the client states in the shards ({state:,} bytes a client, up to {kept:,} clients)",
                          "lower --client-state-memory (the rest spill to disk)",
                          per_sample=state * kept / int(federation.client_offsets[-1]), shard_cap=state_budget))
    return tuple(terms)


def _client_state_bytes(algorithm: FederatedAlgorithm, shapes: dict[str, tuple[int, ...]]) -> int:
    """Bytes of one client's state under ``algorithm`` when it trains by autograd, for parameters of ``shapes``
    (0: stateless).

    The algorithm makes a state for float32 parameters on PyTorch's meta device (shapes, no memory); one that cannot
    is counted as one copy of the parameters, the size of SCAFFOLD's and FedDyn's.
    """
    if not algorithm.stateful:
        return 0
    state = meta_client_state(algorithm, shapes)
    if state is None:
        return sum(int(np.prod(shape)) * FLOAT32 for shape in shapes.values())
    return sum(value.numel() * value.element_size() for value in state.values())
