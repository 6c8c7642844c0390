"""Postprocessors: what happens to every upload between a client and the server, in one place for every method.

A client's upload (a closed-form method's statistics, a training algorithm's
update, in every stage of a run: a closed-form ``--init``, training, SphereFed's
calibration, the ridge probe, TCT's stage 2) passes through each postprocessor's
:meth:`Postprocessor.client` on its way out, and the server's sum of the
uploads through each one's :meth:`Postprocessor.aggregate` before it is used,
in the order given (``--postprocessor a.py:Clip,b.py:Noise``). This is where
clipping, noise, quantization and secure-aggregation masks go. A closed-form
method's upload is a sum over its samples, so a bound on each sample's
contribution is set before the sum: :meth:`Postprocessor.features` maps each
client's feature rows before its statistics are computed (differential
privacy's clipping to a norm R, :mod:`fedray.postprocessors.dp`), and
:meth:`Postprocessor.select` may keep a subset of each client's samples before
that (a bound on a client's contribution: at most m samples, the excess dropped
at random from the client's generator). Both apply to closed-form statistics
only (every stage's), in the shards, not at test time nor in training.

**What the server sums.** A client's hook gets the :class:`~fedray.Upload`
itself: its named tensors (:func:`flatten`: a statistics dataclass's fields, a
tuple's items, an update's parameters), its ``weight`` and, for closed-form
statistics, its ``parts`` (:class:`~fedray.UploadParts`: which tensors are sums
over samples and of what degree, class counts, per-client rows), as the method
declares them; an aggregate hook finds the sum's in ``context.parts``. A
postprocessor reads an upload's structure there, never a method's field names.
The server receives Σ_k weight_k · tensors_k (and Σ_k weight_k), so clipping the tensors to norm C
bounds a client's contribution by weight_k · C: DP-FedAvg also bounds (or
fixes) the weight, which the hook may change. A training algorithm's weight is
its own (FedAvg: the client's samples n_k); a closed-form method's statistics
are sums already and are added as they are (weight 1, which stays 1). The
server divides a training round's sum by the weight
:meth:`Postprocessor.aggregate_weight` returns (by default Σ_k weight_k as
received): DP-FedAvg's fixed denominator q·W goes there.

A postprocessor is one subclass with its options as typed keyword arguments of
its constructor (``--option key=value``), like a server optimizer. Each call
gets an :class:`UploadContext`: where the upload is, the run's population and
sampling (what an accountant needs), and a ``torch.Generator`` seeded from the
run's seed, the round, the client (or the aggregate) and the postprocessor's
place in the list, so its random draws are the same on any shard layout. What
it keeps between rounds goes in ``self.state`` (named tensors), which
checkpoints save. What a hook returns is checked where it arrives: the names,
shapes and dtypes it got, finite values, a finite weight > 0.

Before any work (in the driver, before the data reaches the shards),
:meth:`Postprocessor.start` is told what each stage of the run will upload
(:class:`StageUploads`: closed-form statistics or training updates, the
sampling, the rounds, how many uploads an aggregate sums): the place to refuse
a run the postprocessor cannot serve, in one line, and to fix what depends on
the whole run (a noise multiplier calibrated to a budget over its releases).

Where the sums are (fedray sums uploads inside the shards): a postprocessor
whose :attr:`~Postprocessor.per_client` is true makes every client's upload
exist on its own (closed-form statistics are then also computed client by
client, the dual form of linear heads forms each client's update). The fast
path's sum is kept unless a client hook changed an upload: a postprocessor that
changes nothing (σ = 0, a clip no upload reaches) changes no bit. The
aggregate of a training round is its clients' sum; a closed-form method's
aggregates are the sums of each evaluation block's uploads (the server solves
once a block).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from fedray.clock.costs import TaskCost
from fedray.core.errors import FedrayError, shown
from fedray.core.lazy_modules import lazy_module
from fedray.core.options import Option
from fedray.core.plugins import is_plugin, load_class, registered
from fedray.methods.algorithm import Params, Upload
from fedray.methods.base import ClientBatch
from fedray.methods.checks import (SUMMED_AS_THEY_ARE, check_features, check_selection, check_state,
                                   check_upload_like)
from fedray.methods.upload_parts import UploadParts

torch = lazy_module("torch", globals())

AGGREGATE = -1
"""The client number the aggregate's generator is seeded with."""


@dataclass(frozen=True)
class Sampling:
    """How a stage's clients are drawn: ``per_round`` (κ) of the ``population`` (K) each round, with or without
    ``replacement`` across rounds (the clients of one round are always distinct).

    ``poisson`` (``--sampling poisson``): each client takes part in each round independently with probability
    q = κ/K (:attr:`rate`), so κ is the expected number a round and a round may be empty; ``replacement`` is then
    true (a client may take part in many rounds)."""

    population: int = 1
    per_round: int = 1
    replacement: bool = False
    poisson: bool = False

    @classmethod
    def drawn(cls, population: int, per_round: int, replacement: bool, poisson: bool = False) -> "Sampling":
        """κ of K clients a round, with or without ``replacement``, or each with probability κ/K (``poisson``, which
        draws with replacement across rounds)."""
        return cls(population, per_round, replacement or poisson, poisson)

    @property
    def rate(self) -> float:
        """q = κ/K: the chance a given client takes part in a given round (under every mode, on average)."""
        return self.per_round / self.population


@dataclass(frozen=True)
class StageUploads:
    """What one stage of a run will send through the postprocessors, as the plan knows it before the run
    (:meth:`Postprocessor.start`).

    ``stage`` names it (``closed form``, ``init`` (a closed form before training), ``training``, ``calibration``,
    ``ridge probe``, ``tct normalization``, ``tct closed form``, ``tct stage 2``); ``training``: its uploads are
    training updates, weighted, summed into one aggregate a round, rather than closed-form statistics (each client's
    once, summed into one aggregate an evaluation block); ``sampling``: how its clients are drawn; ``rounds``: its
    rounds (a closed form's: until every client was seen, or its budget); ``group``: the most uploads an aggregate
    sums, and ``smallest_group`` the fewest (None where only the run's draws tell: a closed form's blocks under
    sampling with replacement hold the clients drawn for the first time). Under Poisson sampling a training round's
    ``group`` is κ, the expected number of uploads (any number up to K may come), and ``smallest_group`` 0: a round
    may be empty, and its aggregate, all zeros, still goes through :meth:`Postprocessor.aggregate`. ``summed``: the
    server only adds the uploads together; False where it sees them client by client (FedCOF's mean rows: its
    method's :attr:`~fedray.ClosedFormMethod.uploads_summed`)."""

    stage: str
    training: bool
    sampling: Sampling
    rounds: int
    group: int
    smallest_group: int | None
    summed: bool = True


class BuiltOnFirstUse:
    """A field that holds a value or a function that makes it, called the first time the field is read (then kept):
    :attr:`UploadContext.generator`, whose seed costs a SeedSequence per client, for hooks that mostly never draw."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.slot = f"_{name}"

    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        if instance is None:
            raise AttributeError(self.slot[1:])  # no default: a dataclass field that must be given
        value = instance.__dict__[self.slot]
        if callable(value) and not isinstance(value, torch.Generator):
            value = instance.__dict__[self.slot] = value()
        return value

    def __set__(self, instance: Any, value: Any) -> None:
        instance.__dict__[self.slot] = value


@dataclass(frozen=True)
class UploadContext:
    """Where an upload is: ``client`` (:data:`AGGREGATE` for the server's sum), the ``round`` it belongs to (a closed-form
    block's last round for its aggregate), how many ``clients`` it sums, the ``generator`` of its random draws (given
    as a generator, or as a function that makes it, called only if a hook reads it), and the stage's
    :class:`Sampling` (K, κ, with or without replacement).

    ``participants``: the clients whose uploads are summed into the same aggregate as this one (sorted: a closed-form
    evaluation block's uploaders, or everyone in SphereFed's calibration and the ridge probe), and ``shared_seed`` a
    seed the same for all of them and their aggregate (from the run's seed, the aggregate's round and the
    postprocessor's place): what clients agree on without talking, such as secure aggregation's pairwise masks.
    A training round's are its clients (every backend's, TCT's stage 2 included); empty and 0 where a caller does
    not tell them (a postprocessor applied by hand).

    ``parts``: in an aggregate hook, what the closed-form sum's tensors are (its method's
    :class:`~fedray.UploadParts`; None for a training round's sum); a client hook has them in ``upload.parts``."""

    client: int
    round: int
    clients: int
    generator: torch.Generator = BuiltOnFirstUse()
    sampling: Sampling = Sampling()
    participants: tuple[int, ...] = ()
    shared_seed: int = 0
    parts: UploadParts | None = None


class Postprocessor:
    """The identity: subclass it and override :meth:`client`, :meth:`aggregate` or both."""

    def __init__(self) -> None:
        self.state: Params = {}

    default_sampling: str | None = None
    """The ``--sampling`` a training run with this postprocessor takes when it gives none and Poisson sampling applies
    to it (None: the run's own default). DP-FedAvg's is ``poisson``, the sampling its usual ε is stated for."""

    flags: ClassVar[tuple[Option, ...]] = ()
    """Run options (``fedray run`` flags, YAML and sweep keys, metrics columns) that add a registered postprocessor
    (``--postprocessor`` NAME) to a run when one is set to other than its default: after the run's own
    ``--postprocessor`` list and before those :attr:`added_last`, unless one of the run's takes them already. Those it
    declares in its constructor too are its options, which the flags set (DP's ``--clip-norm``, ``--dp-*``)."""
    training_counterpart: ClassVar[str | None] = None
    """The registered postprocessor that :attr:`flags` add to a run that trains instead of this one, when this one
    treats closed-form statistics and that one training updates (dp's is dp-fedavg); None: this one."""
    added_last: ClassVar[bool] = False
    """Whether :attr:`flags` add it after every other postprocessor (secure aggregation sums what they made)."""

    @property
    def per_client(self) -> bool:
        """Whether :meth:`client`, :meth:`features` or :meth:`select` changes uploads (by default: whether the subclass
        overrides any)."""
        return any(getattr(type(self), hook) is not getattr(Postprocessor, hook) for hook in ("client", "features", "select"))

    def select(self, labels: torch.Tensor, context: UploadContext) -> torch.Tensor | None:
        """Which of one client's samples (``labels``: its rows' labels, in order) its closed-form statistics are
        computed from, in the shards before :meth:`features`: the indices of the rows kept (int64, increasing, at
        least one), or None for all of them (a selection of every row changes no bit). Random choices come from
        ``context.generator`` (the run's seed, the round the client uploads in, the client and the postprocessor's
        place; a stream of its own, not the one :meth:`client` gets), so they are the same on any shard layout."""
        return None

    @property
    def exact_sum(self) -> bool:
        """Whether the server must add what :meth:`client` returns exactly, as it is (secure aggregation's masked ring
        elements), where it would add a training update's w_k · tensors_k in the update's dtype (float32). Then a
        training upload reaches :meth:`client` with its weight already multiplied in, in float64 (tensors w_k · t_k, the
        weight w_k), and the shards and the server add the float64 tensors it returns as they are, and its weight (w_k,
        or 0 for an upload that does not reach the server: a dropped client) into Σ w_k; the aggregate hooks get those
        float64 sums and the training loop casts them back to the model's dtype. Closed-form statistics (float64, weight
        1) are unchanged. False by default: a run without such a postprocessor sums as it always did, bit for bit."""
        return False

    def start(self, stages: tuple[StageUploads, ...]) -> None:
        """Told once, in the driver, before any work: what each stage of the run will upload, in order. Raise
        :class:`~fedray.FedrayError` (or ``ValueError``) with one line to refuse the run; set what depends on the whole
        run here (the copies the shards use are made after it)."""

    def recorded(self) -> dict[str, object]:
        """What :meth:`start` resolved that the options did not say (a noise multiplier calibrated to a budget, the
        accountant chosen for the run's sampling), by the names of this class's options: the run writes these values
        in ``config.yaml`` and in every row, in place of what was given, so that the record re-runs the same."""
        return {}

    def features(self, features: torch.Tensor) -> torch.Tensor:
        """A client's feature rows (one sample each, in the method's ``features_dtype``) before a closed-form method
        computes its statistics from them, in the shards: a per-sample contribution bound (clipping each row to a norm)
        goes here, since the upload holds only sums. Return a new tensor of the same shape and dtype (``features`` is
        not to be changed); rows it returns unchanged keep their bits. Not applied at test time, nor to training."""
        return features

    def client(self, upload: Upload, context: UploadContext) -> Upload:
        """One client's upload as it leaves the client: its tensors and the weight the server sums them with; return a
        new :class:`~fedray.Upload` (``upload`` and its tensors are not to be changed)."""
        return upload

    @property
    def entrywise(self) -> bool:
        """Whether :meth:`client` maps a closed-form upload's values each on its own, a zero to a zero
        (:meth:`entry_map`): the shards may then hand it only a client's values that can be nonzero (its statistics
        at the classes it holds, :meth:`fedray.ClosedFormMethod.compact_statistics`), where every postprocessor that
        changes uploads is entrywise and none selects samples or maps features. False by default."""
        return False

    def entry_map(self, context: UploadContext) -> Callable[[torch.Tensor], torch.Tensor]:
        """Where :attr:`entrywise`: what :meth:`client` does to each value of the closed-form upload ``context`` names,
        as a map of a float64 tensor of some of its values to a new one of the same shape (0 to 0), bit for bit."""
        raise NotImplementedError(f"{type(self).__name__} is not entrywise")

    def entry_maps(self, contexts: Sequence[UploadContext]) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        """Where :attr:`entrywise`: :meth:`entry_map` of several clients' uploads into one aggregate (``contexts``: the
        same participants and shared seed), as a map of ``values`` (a float64 vector: some of the values of
        ``contexts``' clients, client after client) and ``counts`` (int64: how many each client has there) to a new
        vector, each client's values mapped as its :meth:`entry_map` maps them, bit for bit. By default each client's
        map on its own values; a postprocessor that maps many clients' values in one call (secure aggregation: one
        rounding of a shard's clients) overrides it. A subclass that overrides :meth:`entry_map` without overriding
        this has its clients mapped one by one by its :meth:`entry_map`."""
        maps = [self.entry_map(context) for context in contexts]

        def mapped(values: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
            return torch.cat([entry_map(part) for entry_map, part in zip(maps, values.split(counts.tolist()))])

        return mapped

    def aggregate(self, total: Params, context: UploadContext) -> Params:
        """The sum of the uploads as the server receives it; return new tensors (``total`` is not to be changed)."""
        return total

    def dropped(self, context: UploadContext) -> Iterable[int]:
        """Which of ``context.participants`` never reach the server: the clients whose uploads :meth:`client` turns into
        nothing (weight 0, secure aggregation's dropouts), told from the aggregate's context alone (its participants,
        ``shared_seed``), in the driver, so that the rows count only what the server received (``clients_seen``,
        ``samples_seen``, ``bytes_up``, the papers' communication columns). None by default."""
        return ()

    def protocol_cost(self, participants: int, values: int) -> TaskCost | None:
        """What this postprocessor's protocol asks of each participant of an aggregate of ``participants`` uploads of
        ``values`` values, for the run's clock (:mod:`fedray.clock`), as a participant that completes it: in
        ``macs`` and ``down_bytes`` the multiply-adds and bytes received it adds to the participant's task, in
        ``up_bytes`` all it sends, its upload included, in place of the plain upload's bytes (secure aggregation's
        key agreement, masks and masked vector). None by default: the plain upload, nothing more."""
        return None

    def aggregate_weight(self, weight: float, context: UploadContext) -> float:
        """The weight a training round's server divides its sum by (:attr:`~fedray.Aggregate.weight`), given the sum
        of the uploads' weights it received (0 in an empty round): that sum by default. DP-FedAvg's fixed-denominator
        estimator returns q·W here, a number that does not depend on who took part (the realized sum would tell the
        server how many did). Called before :meth:`aggregate`, with the same context; not for closed-form stages."""
        return weight


def flatten(value: Any, prefix: str = "") -> Params:
    """The tensors in ``value`` (dataclasses, dicts, lists, tuples of tensors) by their path: ``sums``, ``0.weight``."""
    if isinstance(value, torch.Tensor):
        return {prefix: value}
    if dataclasses.is_dataclass(value):
        items = [(field.name, getattr(value, field.name)) for field in dataclasses.fields(value)]
    elif isinstance(value, dict):
        items = list(value.items())
    elif isinstance(value, (list, tuple)):
        items = list(enumerate(value))
    else:
        return {}
    out: Params = {}
    for key, item in items:
        out.update(flatten(item, f"{prefix}.{key}" if prefix else str(key)))
    return out


def unflatten(template: Any, tensors: Params, prefix: str = "") -> Any:
    """``template`` with each of its tensors replaced by the one of ``tensors`` at its path."""
    if isinstance(template, torch.Tensor):
        return tensors[prefix]
    name = (lambda key: f"{prefix}.{key}" if prefix else str(key))
    if dataclasses.is_dataclass(template):
        return dataclasses.replace(template, **{field.name: unflatten(getattr(template, field.name), tensors, name(field.name))
                                                for field in dataclasses.fields(template) if field.init})
    if isinstance(template, dict):
        return {key: unflatten(item, tensors, name(key)) for key, item in template.items()}
    if isinstance(template, (list, tuple)):
        return type(template)(unflatten(item, tensors, name(index)) for index, item in enumerate(template))
    return template


@dataclass(frozen=True)
class Postprocessing:
    """A run's postprocessors, applied in order, with the run's ``seed`` and the current stage's ``sampling``.

    Built once per run; every stage uses the same postprocessors (their state
    carries from stage to stage) with its own :class:`Sampling` (:meth:`sampled`)
    and ``first_round``: a stage that numbers its rounds from 1 (training after
    a closed-form ``--init``) hands the postprocessors the run's round numbers,
    ``first_round`` + its own, so that no two uploads of a run share a generator.
    """

    postprocessors: Sequence[Postprocessor] = ()
    seed: int = 0
    names: Sequence[str] = ()
    """How the run named each postprocessor (``--postprocessor NAME``), for its errors."""
    sampling: Sampling = Sampling()
    first_round: int = 0
    participants: tuple[int, ...] = ()
    group_round: int = 0

    @property
    def per_client(self) -> bool:
        return any(postprocessor.per_client for postprocessor in self.postprocessors)

    @property
    def exact(self) -> bool:
        """Whether a client hook asks for exact sums (:attr:`Postprocessor.exact_sum`): a training upload's tensors then
        leave :meth:`client` as w_k · t_k in float64, to be added as they are."""
        return any(postprocessor.per_client and postprocessor.exact_sum for postprocessor in self.postprocessors)

    def sampled(self, population: int, per_round: int, replacement: bool, first_round: int = 0,
                poisson: bool = False) -> "Postprocessing":
        """The same postprocessors (and their state) for a stage that draws ``per_round`` of ``population`` clients
        (``poisson``: each with probability κ/K), its round r being the run's ``first_round`` + r."""
        return dataclasses.replace(self, sampling=Sampling.drawn(population, per_round, replacement, poisson),
                                   first_round=first_round)

    def among(self, participants: Iterable[int], round_number: int) -> "Postprocessing":
        """The same postprocessors (and their state) for the uploads of ``participants``, summed into one aggregate of
        the stage's round ``round_number``: their contexts' ``participants`` and ``shared_seed``."""
        return dataclasses.replace(self, participants=tuple(sorted(int(client) for client in participants)),
                                   group_round=self.first_round + round_number)

    def _shared_seed(self, index: int) -> int:
        return _seed(self.seed, self.group_round, index, 0) if self.participants else 0

    def _generator(self, round_number: int, client: int, index: int, *stream: int) -> Callable[[], torch.Generator]:
        """What makes the generator of an upload's context (built if a hook draws: :attr:`UploadContext.generator`);
        ``round_number``: the run's; ``stream``: (1,) for :meth:`Postprocessor.select`'s, () for the hooks'."""
        return functools.partial(_seeded_generator, self.seed, round_number, client + 1, index, *stream)

    def selected(self, batch: ClientBatch, rounds: Sequence[int]) -> ClientBatch:
        """``batch`` (its clients uploading in the stage's ``rounds``) with the rows every postprocessor's
        :meth:`Postprocessor.select` keeps of each client, in order; ``batch`` itself when none drops a row."""
        selecting = [(index, postprocessor) for index, postprocessor in enumerate(self.postprocessors)
                     if type(postprocessor).select is not Postprocessor.select]
        if not selecting:
            return batch
        kept, offsets = [], [0]
        for position, (client, round_number) in enumerate(zip(batch.clients.tolist(), rounds)):
            rows = torch.arange(int(batch.offsets[position]), int(batch.offsets[position + 1]))
            round_number = self.first_round + int(round_number)
            for index, postprocessor in selecting:
                context = UploadContext(client, round_number, 1, self._generator(round_number, client, index, 1),
                                        self.sampling, self.participants, self._shared_seed(index))
                chosen = check_selection(postprocessor, len(rows), postprocessor.select(batch.labels[rows], context),
                                         f"round {round_number}, client {client}")
                rows = rows if chosen is None else rows[chosen]
            kept.append(rows)
            offsets.append(offsets[-1] + len(rows))
        if offsets[-1] == len(batch.labels):
            return batch
        index = torch.cat(kept)
        return ClientBatch(batch.features[index], batch.labels[index], np.array(offsets), batch.clients)

    def start(self, stages: tuple[StageUploads, ...]) -> None:
        """Every postprocessor told the run's stages (:meth:`Postprocessor.start`), in order; a ``ValueError`` it
        raises becomes a one-line :class:`FedrayError` naming it."""
        for index, postprocessor in enumerate(self.postprocessors):
            try:
                postprocessor.start(stages)
            except ValueError as error:
                raise FedrayError(f"--postprocessor {self._name(index)}: {error}") from None

    def _name(self, index: int) -> str:
        """How the run named its ``index``-th postprocessor (its class's name where the run did not say)."""
        return self.names[index] if index < len(self.names) else type(self.postprocessors[index]).__name__

    def recorded(self) -> dict[str, object]:
        """What the postprocessors resolved in :meth:`start` (:meth:`Postprocessor.recorded`), by option name."""
        return {name: value for postprocessor in self.postprocessors
                for name, value in postprocessor.recorded().items()}

    def features(self, features: torch.Tensor) -> torch.Tensor:
        """A closed-form client's feature rows through every postprocessor's :meth:`Postprocessor.features`, in order;
        ``features`` itself when none overrides it."""
        for postprocessor in self.postprocessors:
            if type(postprocessor).features is not Postprocessor.features:
                features = check_features(postprocessor, features, postprocessor.features(features))
        return features

    def client(self, upload: Upload, client: int, round_number: int, weighted: bool = True) -> Upload:
        """``upload`` through every postprocessor's client hook: ``upload`` itself (the same object) when none has one
        or none changed a bit of it, else a new one. ``weighted`` false: a closed-form upload, whose weight stays 1.
        Before the first hook that asks for exact sums, a weighted upload's weight is multiplied into its tensors, in
        float64 (:attr:`Postprocessor.exact_sum`): its weight cannot change after that, but to 0 (dropped)."""
        if not self.per_client:
            return upload
        current, round_number = upload, self.first_round + round_number
        kept_because = SUMMED_AS_THEY_ARE
        for index, postprocessor in enumerate(self.postprocessors):
            if postprocessor.per_client:
                exact = postprocessor.exact_sum
                if exact and weighted:
                    current, weighted = Upload({name: tensor.to(torch.float64) * current.weight
                                                for name, tensor in current.tensors.items()}, current.weight), False
                    kept_because = (f"training round {round_number}'s update reaches --postprocessor "
                                    f"{self._name(index)} (exact_sum) with its weight w_k already multiplied into its "
                                    f"tensors, so from there on the weight stays w_k, or 0 for an upload that never "
                                    f"reaches the server; change the weight in a hook before it")
                context = UploadContext(client, round_number, 1, self._generator(round_number, client, index), self.sampling,
                                        self.participants, self._shared_seed(index))
                current = check_upload_like(postprocessor, current, postprocessor.client(current, context), weighted,
                                            f"round {round_number}, client {client}", may_drop=exact,
                                            kept_because=kept_because)
                if current.parts is not upload.parts:  # what it returned has the same tensors: their parts go with them
                    current = dataclasses.replace(current, parts=upload.parts)
        return upload if _same(current, upload) else current

    def statistics(self, statistics: Any, client: int, round_number: int, parts: UploadParts | None = None) -> Any:
        """A closed-form method's ``statistics`` of one client through :meth:`client` (weight 1), described by
        ``parts`` (its method's :meth:`~fedray.ClosedFormMethod.upload_parts`; None: the default, sums over samples);
        the same object when nothing changed."""
        if not self.per_client:
            return statistics
        upload = Upload(flatten(statistics), 1.0, UploadParts() if parts is None else parts)
        processed = self.client(upload, client, round_number, weighted=False)
        return statistics if processed is upload else unflatten(statistics, processed.tensors)

    def client_sum(self, uploads: Iterable[tuple[int, int, Any]], add: Callable[[Any, Any], Any],
                   parts: UploadParts | None = None) -> Any:
        """Statistics uploads ``(client, round, statistics)`` described by ``parts``, each through :meth:`statistics`,
        summed in order by ``add``; None when no hook changed any: the caller's batched sum then stands, bit for bit a
        run's without postprocessors (a sum client by client adds in another order)."""
        total, changed = None, False
        for client, round_number, statistics in uploads:
            processed = self.statistics(statistics, client, round_number, parts)
            changed = changed or processed is not statistics
            total = processed if total is None else add(total, processed)
        return total if changed else None

    @property
    def entrywise(self) -> bool:
        """Whether every postprocessor that changes uploads maps their values each on its own
        (:attr:`Postprocessor.entrywise`) and none selects samples or maps features."""
        changing = [postprocessor for postprocessor in self.postprocessors if postprocessor.per_client]
        return bool(changing) and all(postprocessor.entrywise and type(postprocessor).select is Postprocessor.select
                                      and type(postprocessor).features is Postprocessor.features
                                      for postprocessor in changing)

    def entry_maps(self, clients: Sequence[int], round_numbers: Sequence[int]
                   ) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        """Where :attr:`entrywise`: what :meth:`statistics` does to each value of the uploads of ``clients`` (each in
        the stage's round of ``round_numbers``), as a map of a float64 vector of some of their values, client after
        client, and of how many each has there (int64 ``counts``): every postprocessor's
        :meth:`Postprocessor.entry_maps` in order, each one's result checked (a new float64 vector of that length)."""
        round_numbers = [self.first_round + int(round_number) for round_number in round_numbers]
        maps = []
        for index, postprocessor in enumerate(self.postprocessors):
            if postprocessor.per_client:
                contexts = [UploadContext(client, round_number, 1, self._generator(round_number, client, index),
                                          self.sampling, self.participants, self._shared_seed(index))
                            for client, round_number in zip(clients, round_numbers)]
                maps.append((index, _batched_entry_maps(postprocessor)(contexts)))

        def mapped(values: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
            for index, entry_map in maps:
                returned = entry_map(values, counts)
                if not isinstance(returned, torch.Tensor) or returned.shape != values.shape \
                        or returned.dtype != torch.float64:
                    raise FedrayError(f"--postprocessor {self._name(index)}: entry_maps' map returned "
                                      f"{getattr(returned, 'dtype', type(returned).__name__)} "
                                      f"{tuple(getattr(returned, 'shape', ()))} for {len(clients)} clients (client "
                                      f"{clients[0]} of round {round_numbers[0]} first); expected float64 "
                                      f"{tuple(values.shape)}, like the values it got")
                values = returned
            return values

        return mapped

    def dropped(self, round_number: int) -> np.ndarray:
        """The participants (:meth:`among`) whose uploads of the stage's round ``round_number`` some postprocessor's
        :meth:`Postprocessor.dropped` says never reach the server, sorted; one line where it names a client that is
        not a participant."""
        round_number, lost = self.first_round + round_number, set()
        for index, postprocessor in enumerate(self.postprocessors):
            if type(postprocessor).dropped is not Postprocessor.dropped:
                context = UploadContext(AGGREGATE, round_number, len(self.participants),
                                        self._generator(round_number, AGGREGATE, index), self.sampling,
                                        self.participants, self._shared_seed(index))
                named = set(map(int, postprocessor.dropped(context)))
                if not named <= set(self.participants):
                    raise FedrayError(f"--postprocessor {self._name(index)}: dropped named clients "
                                      f"{sorted(named - set(self.participants))[:5]} in round {round_number}; expected "
                                      f"some of the aggregate's participants (context.participants)")
                lost |= named
        return np.array(sorted(lost), dtype=np.int64)

    def protocol_cost(self, participants: int, values: int) -> TaskCost | None:
        """What the postprocessors' protocols ask of each participant of an aggregate
        (:meth:`Postprocessor.protocol_cost`), in order: their multiply-adds and bytes received added up, and the last one's bytes sent (each sends what the
        one before it gave it, in its place); None where none has a protocol. One line where one returns other than a
        TaskCost of single amounts."""
        total = None
        for index, postprocessor in enumerate(self.postprocessors):
            cost = postprocessor.protocol_cost(participants, values)
            if cost is None:
                continue
            if not isinstance(cost, TaskCost) or any(np.ndim(amount) for amount in (cost.macs, cost.down_bytes,
                                                                                     cost.up_bytes)):
                raise FedrayError(f"--postprocessor {self._name(index)}: protocol_cost returned {shown(cost)}; expected "
                                  f"a TaskCost of one amount each (a participant's), or None")
            total = cost if total is None else TaskCost(total.macs + cost.macs, total.down_bytes + cost.down_bytes,
                                                        cost.up_bytes)
        return total

    def aggregate_weight(self, weight: float, round_number: int, clients: int) -> float:
        """A training round's weight sum through every postprocessor's :meth:`Postprocessor.aggregate_weight`, in
        order; ``weight`` itself when none overrides it. Each must return a finite number > 0, or 0 where it was
        handed 0 (no upload reached the server: the round changes nothing); a 0 for a round whose uploads arrived would
        make it a silent no-op, and is refused in one line naming the postprocessor."""
        round_number = self.first_round + round_number
        for index, postprocessor in enumerate(self.postprocessors):
            if type(postprocessor).aggregate_weight is not Postprocessor.aggregate_weight:
                context = UploadContext(AGGREGATE, round_number, clients, self._generator(round_number, AGGREGATE, index),
                                        self.sampling, self.participants, self._shared_seed(index))
                returned = postprocessor.aggregate_weight(weight, context)
                nobody = weight == 0 and returned == 0
                if isinstance(returned, bool) or not isinstance(returned, (int, float)) or not math.isfinite(returned) \
                        or not (returned > 0 or nobody):
                    raise FedrayError(f"--postprocessor {self._name(index)}: aggregate_weight returned {returned!r} in "
                                      f"training round {round_number} (handed {weight:g}); expected a finite weight "
                                      f"> 0, the number the round's sum is divided by (0 only where it was handed 0: "
                                      f"no upload arrived)")
                weight = float(returned)
        return weight

    def aggregate(self, total: Any, round_number: int, clients: int, parts: UploadParts | None = None) -> Any:
        """The server's sum through every postprocessor's aggregate hook, its tensors described by ``parts`` (a
        closed-form method's :meth:`~fedray.ClosedFormMethod.upload_parts`; None for a training round's sum); itself
        when there are none."""
        if not self.postprocessors:
            return total
        tensors, round_number = flatten(total), self.first_round + round_number
        for index, postprocessor in enumerate(self.postprocessors):
            context = UploadContext(AGGREGATE, round_number, clients, self._generator(round_number, AGGREGATE, index),
                                    self.sampling, self.participants, self._shared_seed(index), parts)
            returned = postprocessor.aggregate(tensors, context)
            tensors = check_upload_like(postprocessor, Upload(tensors, 1.0), Upload(returned, 1.0), False,
                                        f"round {round_number}", method="aggregate").tensors
            check_state(postprocessor, "aggregate", postprocessor.state, "tensors by name")
        return unflatten(total, tensors)

    def state_dict(self) -> list[Params]:
        return [dict(postprocessor.state) for postprocessor in self.postprocessors]

    def load_state_dict(self, states: list[Params]) -> None:
        for postprocessor, state in zip(self.postprocessors, states):
            postprocessor.state = dict(state)


@functools.lru_cache(maxsize=256)
def _seed(*entropy: int) -> int:
    """A 63-bit seed from ``entropy`` (the run's seed, a round, ...), independent of any other tuple's (cached: a
    group's shared seed is asked for at each of its clients' uploads)."""
    return int(np.random.SeedSequence(entropy).generate_state(2, np.uint64)[0]) & (2**63 - 1)


def _batched_entry_maps(postprocessor: Postprocessor) -> Callable[[Sequence[UploadContext]], Callable]:
    """``postprocessor``'s :meth:`Postprocessor.entry_maps`, or the default one (its :meth:`Postprocessor.entry_map`
    client by client) where the class that defines its ``entry_maps`` is not one that defines its ``entry_map``'s."""
    def defining(name: str) -> type:
        return next(cls for cls in type(postprocessor).__mro__ if name in vars(cls))

    if issubclass(defining("entry_maps"), defining("entry_map")):
        return postprocessor.entry_maps
    return functools.partial(Postprocessor.entry_maps, postprocessor)


def _seeded_generator(*entropy: int) -> torch.Generator:
    return torch.Generator().manual_seed(_seed(*entropy))


def _same(a: Upload, b: Upload) -> bool:
    """Whether two uploads hold the same weight and bitwise-equal tensors (``torch.equal``: −0.0 equals 0.0, and the
    original, with its bits, is the one kept)."""
    return a is b or (a.weight == b.weight and a.tensors.keys() == b.tensors.keys()
                      and all(torch.equal(a.tensors[name], b.tensors[name]) for name in a.tensors))


ENTRY_POINTS = "fedray.postprocessors"
"""The entry-point group of the postprocessors installed packages register by ``--postprocessor`` name: fedray's own
(written as plugins on the public interface, in its pyproject.toml) and a researcher's package's the same way."""

BUILT_IN: dict[str, str] = registered(ENTRY_POINTS)
"""Every built-in postprocessor by ``--postprocessor`` name, as its ``module:Class``."""


def postprocessor_class(spec: str) -> type[Postprocessor]:
    """The postprocessor ``spec`` names: a built-in, ``module:Class`` or ``path/to/file.py:Class``."""
    if not is_plugin(spec) and spec not in BUILT_IN:
        raise FedrayError(f"unknown postprocessor {spec!r}; built-in: {', '.join(BUILT_IN) or 'none'}; "
                          f"or your own fedray.Postprocessor subclass as module:Class or path/to/file.py:Class")
    return load_class(BUILT_IN.get(spec, spec), Postprocessor, {}, "postprocessor")
