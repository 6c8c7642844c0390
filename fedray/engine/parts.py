"""The built parts a run's stages take: how clients are drawn, a closed-form method with its options, the images
training runs on, the shard actors' resources, and what a stage's uploads look like."""

from __future__ import annotations

from dataclasses import dataclass

from fedray.core.federation import Federation
from fedray.core.options import build
from fedray.methods.base import ClosedFormMethod
from fedray.methods.postprocessor import Postprocessing, Sampling, StageUploads
from fedray.methods.training.modes import FineTuning
from fedray.runtime import sampling
from fedray.runtime.footprint import Footprint, method_footprint
from fedray.runtime.kept import default_budget
from fedray.runtime.schedules import Schedule


@dataclass(frozen=True)
class Sampler:
    """How a stage draws its clients: κ of the K clients a round, with or without replacement, or each client with
    probability κ/K (``poisson``), from the run's seed."""

    num_clients: int
    per_round: int
    with_replacement: bool
    seed: int
    poisson: bool = False

    def rounds(self, count: int | None, past_coverage: bool = False) -> Schedule:
        """The clients of each of ``count`` rounds (None: until every client was seen; ``past_coverage``: the count
        may exceed that), drawn as they are read."""
        return sampling.schedule(self.num_clients, self.per_round, self.with_replacement, self.seed, count,
                                 past_coverage=past_coverage, poisson=self.poisson)

    def uploads(self, postprocessing: Postprocessing, first_round: int = 0) -> Postprocessing:
        """``postprocessing`` told this sampling, its rounds numbered after ``first_round`` rounds of the run."""
        return postprocessing.sampled(self.num_clients, self.per_round, self.with_replacement, first_round,
                                      self.poisson)

    @property
    def drawn(self) -> Sampling:
        """This sampling as the postprocessors see it."""
        return Sampling.drawn(self.num_clients, self.per_round, self.with_replacement, self.poisson)

    @property
    def everyone(self) -> Sampling:
        """A round of every client once (a calibration, the ridge probe, TCT's normalization and closed form)."""
        return Sampling(self.num_clients, self.num_clients, False)


@dataclass(frozen=True)
class MethodSpec:
    """A closed-form method with its options, built on the features a stage runs on (whose dimension and classes are
    known only there: a backbone's embeddings, SphereFed's projection)."""

    name: str
    cls: type[ClosedFormMethod]
    values: dict
    seed: int

    def build(self, federation: Federation) -> ClosedFormMethod:
        return build(self.cls, self.values, f"--method {self.name}", dim=federation.dim,
                     num_classes=federation.num_classes, seed=self.seed)

    def footprint(self, label: str, federation: Federation, dim: int, block_samples: int,
                  kept_budget: int) -> Footprint:
        """The memory this method needs on ``federation``'s features of ``dim`` dimensions, ``block_samples`` at a
        time, as the stage ``label``."""
        return method_footprint(label, self.name, self.values, federation, dim, block_samples, kept_budget)


@dataclass(frozen=True)
class Images:
    """Fine-tuning on images: what trains (``ft``, ``ftlp``, ``ftfeat``), the network and its trainers."""

    mode: str
    network: FineTuning
    num_trainers: int | None
    cpus_per_trainer: float


@dataclass(frozen=True)
class Shards:
    """The shard actors' resources (``count`` None: the cluster's CPUs / ``cpus``)."""

    count: int | None
    cpus: float
    state_memory: int | None = None
    """Bytes of clients' states each shard keeps in memory (None: :func:`~fedray.runtime.kept.default_budget`)."""

    @property
    def state_budget(self) -> int:
        """Bytes of clients' states a shard keeps in memory: ``state_memory``, else its share of the machine's."""
        return default_budget(self.cpus) if self.state_memory is None else self.state_memory

    @property
    def kept_budget(self) -> int:
        """Bytes of a method's kept parts (FedCOF's received means) a shard keeps: its share of the machine's memory."""
        return default_budget(self.cpus)


def training_uploads(stage: str, sampling: Sampling, rounds: int) -> StageUploads:
    """A training stage's uploads: κ a round; without replacement a pass's last round holds K mod κ when κ does not
    divide K and the stage reaches it; under Poisson sampling κ on average, and a round may be empty."""
    population, per_round = sampling.population, sampling.per_round
    if sampling.poisson:
        return StageUploads(stage, True, sampling, rounds, per_round, 0)
    short = population % per_round
    smallest = short if short and not sampling.replacement and rounds >= -(-population // per_round) else per_round
    return StageUploads(stage, True, sampling, rounds, per_round, smallest)


def closed_form_uploads(stage: str, sampling: Sampling, rounds: int, eval_every: int,
                        summed: bool = True) -> StageUploads:
    """A closed form's uploads, every client's once, summed an evaluation block of ``eval_every`` rounds at a time
    (the last block ending with the last round); without replacement the last block holds what is left. ``summed``:
    the method's :attr:`~fedray.ClosedFormMethod.uploads_summed`."""
    population, per_round = sampling.population, sampling.per_round
    group = min(population, per_round * eval_every)
    if sampling.replacement:
        return StageUploads(stage, False, sampling, rounds, group, None, summed)
    uploads = min(population, rounds * per_round)
    last = uploads - (-(-rounds // eval_every) - 1) * per_round * eval_every
    return StageUploads(stage, False, sampling, rounds, group, min(group, last), summed)


def uploads_of_everyone(stage: str, sampler: Sampler) -> StageUploads:
    """The uploads of one round of every client once."""
    everyone = sampler.num_clients
    return StageUploads(stage, False, sampler.everyone, 1, everyone, everyone)
