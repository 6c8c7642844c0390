"""A run's plan: what a validated configuration builds once, before any work, and the stages it runs.

:func:`plan` turns a resolved :class:`~fedray.engine.config.RunConfig` and the
federation it runs on into a :class:`RunPlan` of built parts: how clients are
sampled, the one postprocessing every stage's uploads pass through, the shard
resources, and the list of stages (a closed form, or ``--init``'s closed form,
training on a linear head, SphereFed's projection or images, a calibration,
the ridge probe, TCT's stage 2). The stages, TCT and the memory estimate take
these parts; nothing below the engine sees the configuration.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path

from fedray.core.federation import Federation
from fedray.core.options import build
from fedray.engine.config import TCT, RunConfig
from fedray.engine.settings import local_sgd_settings, server_optimizer, training_algorithm
from fedray.methods import method_class
from fedray.methods.algorithm import FederatedAlgorithm
from fedray.methods.base import ClosedFormMethod
from fedray.methods.postprocessor import Postprocessing, Sampling, StageUploads, postprocessor_class
from fedray.methods.sphere import SphereHead
from fedray.methods.tct_stage2 import TctStage2Options
from fedray.methods.training.modes import FineTuning
from fedray.methods.training.local import LocalSGD
from fedray.methods.training.server import ServerOptimizer
from fedray.runtime import sampling
from fedray.runtime.kept import default_budget
from fedray.runtime.footprint import Footprint, closed_form_footprint, largest_clients, training_footprint
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
        return postprocessing.sampled(self.num_clients, self.per_round, self.with_replacement, first_round, self.poisson)


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


@dataclass(frozen=True)
class ClosedForm:
    """A closed-form stage: the run's method, or ``--init``'s before training (``rounds``: its budget, None until
    every client was seen)."""

    method: MethodSpec
    rounds: int | None


@dataclass(frozen=True)
class Images:
    """Fine-tuning on images: what trains (``ft``, ``ftlp``, ``ftfeat``), the network and its trainers."""

    mode: str
    backbone: str
    weights: str
    image_size: int
    num_trainers: int | None
    cpus_per_trainer: float


@dataclass(frozen=True)
class Sphere:
    """SphereFed: the l × d projection onto the sphere before a fixed classifier, trained with ``loss``."""

    dim: int | None
    loss: str


@dataclass(frozen=True)
class Training:
    """The training stage: the algorithm, its clients' local SGD and the server optimizer, for ``rounds`` rounds (None:
    until every client was seen); on a linear head, SphereFed's projection (``sphere``) or images (``images``)."""

    algorithm: FederatedAlgorithm
    server_optimizer: ServerOptimizer
    sgd: LocalSGD
    rounds: int | None
    checkpoint_every: int | None
    sphere: Sphere | None = None
    images: Images | None = None

    @property
    def name(self) -> str:
        """What it trains with, for its progress bar and memory estimate: the algorithm's name (a plugin's class name)."""
        return self.algorithm.name or type(self.algorithm).__name__


@dataclass(frozen=True)
class Calibration:
    """A closed form after training, on the features at the trained parameters, whose classifier becomes the run's:
    SphereFed's FFC on the normalized projection, or ``--calibrate METHOD``."""

    method: MethodSpec


@dataclass(frozen=True)
class Probe:
    """Fed3R on the features the head was trained on, from every client (``--probe-ridge``)."""

    method: MethodSpec


@dataclass(frozen=True)
class TctStage2:
    """TCT's stage 2 on the eNTK features at the stage-1 weights (:mod:`fedray.engine.tct`)."""

    entk_dim: int
    entk_fp16: bool
    entk_chunk: int
    rounds: int
    local_steps: int
    lr: float
    solver: str
    projection: int | None
    lam: float
    correction: bool = True
    """SCAFFOLD's control variates (False: ``--tct-fedavg``)."""
    normalize: bool = True
    """The normalization round (False: ``--tct-no-normalization``, stage 2 on the raw features)."""
    loss: str = "mse"
    last_layer: bool = False
    """eNTK features w.r.t. the last layer's weights only (``--entk-params last_layer``)."""


Stage = ClosedForm | Training | Calibration | Probe | TctStage2


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


@dataclass(frozen=True)
class RunPlan:
    """A run's built parts and its stages, in order."""

    out: Path
    identity: dict
    """The configuration as config.yaml holds it: what a checkpoint must match to resume."""
    seed: int
    eval_every: int
    quiet: bool
    backbone_macs: float | None
    sampler: Sampler
    postprocessing: Postprocessing
    shards: Shards
    stages: tuple[Stage, ...]
    footprints: list[Footprint] = field(default_factory=list)

    def stage(self, kind: type) -> Stage | None:
        """The run's stage of ``kind`` (at most one of each in a training run), or None."""
        return next((stage for stage in self.stages if isinstance(stage, kind)), None)

    @property
    def init(self) -> ClosedForm | None:
        """The closed form training starts from (``--init``), or None."""
        first = self.stages[0]
        return first if isinstance(first, ClosedForm) and self.stage(Training) is not None else None

    @cached_property
    def init_rounds(self) -> Schedule:
        """The clients of the ``--init`` closed-form stage's rounds (none without one), drawn once: training's rounds
        and its uploads' round numbers come after them."""
        return Schedule.of() if self.init is None else self.sampler.rounds(self.init.rounds)

    @cached_property
    def training_rounds(self) -> Schedule:
        """The clients of each training round: ``--rounds`` of them, else until every client was seen (found once, for
        the checkpoint's check and the training)."""
        return self.sampler.rounds(self.training.rounds, past_coverage=True)

    @property
    def training(self) -> Training:
        training = self.stage(Training)
        assert training is not None, "a training plan"
        return training

    def stage_uploads(self) -> tuple[StageUploads, ...]:
        """What each stage will upload, for the postprocessors' :meth:`~fedray.Postprocessor.start`."""
        sampler, everyone = self.sampler, self.sampler.num_clients
        drawn = Sampling.drawn(everyone, sampler.per_round, sampler.with_replacement, sampler.poisson)
        once = Sampling(everyone, everyone, False)
        told: list[StageUploads] = []
        for stage in self.stages:
            if isinstance(stage, ClosedForm):
                rounds = len(self.init_rounds) if self.init is not None else len(sampler.rounds(stage.rounds))
                told.append(closed_form_uploads("init" if self.init is not None else "closed form", drawn, rounds,
                                                self.eval_every, stage.method.cls.uploads_summed))
            elif isinstance(stage, Training):
                told.append(training_uploads("training", drawn, len(self.training_rounds)))
            elif isinstance(stage, (Calibration, Probe)):
                told.append(StageUploads("calibration" if isinstance(stage, Calibration) else "ridge probe", False, once,
                                         1, everyone, everyone))
            elif isinstance(stage, TctStage2):
                if stage.normalize:
                    told.append(StageUploads("tct normalization", False, once, 1, everyone, everyone))
                if stage.solver in ("closed_form", "both"):
                    told.append(StageUploads("tct closed form", False, once, 1, everyone, everyone))
                if stage.solver in ("scaffold", "both"):
                    told.append(training_uploads("tct stage 2", drawn, stage.rounds))
        return tuple(told)


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


def postprocessing(config: RunConfig) -> Postprocessing:
    """``--postprocessor``'s classes with their options, in order, and the run's seed for their random draws."""
    classes = [(spec, postprocessor_class(spec)) for spec in config.postprocessor_specs()]
    return Postprocessing(tuple(build(cls, config.option_values(cls), f"--postprocessor {spec}", seed=config.seed)
                                for spec, cls in classes), config.seed, tuple(spec for spec, _ in classes))


def build_method(config: RunConfig, federation: Federation) -> ClosedFormMethod:
    """``config.method`` (a built-in or a plugin) for the federation's dimension and classes, with the run's seed."""
    return method_spec(config, config.method).build(federation)


def method_spec(config: RunConfig, name: str) -> MethodSpec:
    """The closed-form method ``name`` (a built-in or a plugin) with the run's options and seed."""
    cls = method_class(name)
    return MethodSpec(name, cls, config.option_values(cls), config.seed)


def training_stage(config: RunConfig) -> Training:
    """``--method`` (TCT: ``--base``) with its local SGD and server optimizer, each built once with its options."""
    images = None
    if config.finetune is not None:
        network = config.component(FineTuning)
        images = Images(config.finetune, network.backbone, network.weights, network.image_size, config.num_trainers,
                        config.cpus_per_trainer)
    sphere = None
    if config.head == "sphere":
        head = config.component(SphereHead)
        sphere = Sphere(head.sphere_dim, head.sphere_loss)
    return Training(training_algorithm(config), server_optimizer(config), local_sgd_settings(config), config.rounds,
                    config.checkpoint_every, sphere, images)


def stages(config: RunConfig) -> tuple[Stage, ...]:
    """The stages ``config`` (resolved) runs, in order."""
    if not config.trains:
        return (ClosedForm(method_spec(config, config.method), config.rounds),)
    listed: list[Stage] = [] if config.init == "random" else [ClosedForm(method_spec(config, config.init), config.init_rounds)]
    listed.append(training_stage(config))
    if config.head == "sphere":
        listed.append(Calibration(method_spec(config, "ffc")))
    elif config.calibrate is not None:
        listed.append(Calibration(method_spec(config, config.calibrate)))
    if config.probe_ridge:
        listed.append(Probe(method_spec(config, "fed3r")))
    if config.method == TCT:
        tct = config.component(TctStage2Options)
        listed.append(TctStage2(tct.entk_dim, tct.entk_fp16, tct.entk_chunk, tct.tct_rounds, tct.tct_local_steps,
                                tct.tct_lr, tct.tct_solver, tct.tct_projection, tct.tct_lam, not tct.tct_fedavg,
                                not tct.tct_no_normalization, tct.tct_loss, tct.entk_params == "last_layer"))
    return tuple(listed)


def plan(config: RunConfig, federation: Federation, planned: tuple[Stage, ...] | None = None,
         uploads: Postprocessing | None = None) -> RunPlan:
    """The plan of ``config`` (validated and resolved) on ``federation``: every part built once, its plugins' options
    checked, before any work; ``planned`` and ``uploads``: its :func:`stages` and :func:`postprocessing` when they were
    built already (before the data was loaded, to refuse a plugin's bad option first)."""
    per_round = config.per_round(federation.num_clients)
    sampler = Sampler(federation.num_clients, per_round, config.sampling == "with", config.seed,
                      config.sampling == "poisson")
    run = RunPlan(Path(config.out), config.to_dict(), config.seed, config.eval_every, config.quiet,
                  config.backbone_macs, sampler, postprocessing(config) if uploads is None else uploads,
                  Shards(config.num_shards, config.cpus_per_shard, None if config.client_state_memory is None
                         else int(config.client_state_memory * 1e9)), stages(config) if planned is None else planned)
    return replace(run, footprints=footprints(run, federation))


ROUNDS_DRAWN_FOR_ESTIMATE = 10_000_000
"""The most client draws :func:`largest_round` makes before a run (a second time: the run draws them too)."""


def largest_round(run: RunPlan, stage: Training, federation: Federation) -> int:
    """Samples of the largest of ``stage``'s rounds, each drawn here as the run will draw it (O(κ) memory); the κ
    largest clients' where that would take more than :data:`ROUNDS_DRAWN_FOR_ESTIMATE` draws (or ``--rounds`` is
    beyond what a sequence counts: refused later, in one line). Among a million clients the hundred largest hold
    some 250,000 samples, a drawn hundred about 1,300: that bound would refuse a run that fits."""
    per_round = run.sampler.per_round
    count = len(run.training_rounds) if stage.rounds is None else stage.rounds
    if count * per_round > ROUNDS_DRAWN_FOR_ESTIMATE:
        return largest_clients(federation, per_round)
    sizes = federation.client_sizes
    return max((int(sizes[clients].sum()) for clients in run.training_rounds), default=0)


def footprints(run: RunPlan, federation: Federation) -> list[Footprint]:
    """The memory each stage of ``run`` needs on ``federation``'s features; none for runs on images (not estimated)."""
    training = run.stage(Training)
    if training is not None and training.images is not None:
        return []
    block = largest_clients(federation, run.sampler.per_round * run.eval_every)
    estimated = []
    for stage in run.stages:
        if isinstance(stage, Training):
            kept = federation.num_clients if stage.rounds is None else \
                min(federation.num_clients, stage.rounds * run.sampler.per_round)
            sphere_dim = None if stage.sphere is None else stage.sphere.dim or federation.dim
            estimated.append(training_footprint(stage.name, federation, stage.algorithm, sphere_dim, kept,
                                                largest_round(run, stage, federation),
                                                run.shards.state_budget))
        elif isinstance(stage, (ClosedForm, Calibration, Probe)):
            method, dim, label = stage.method, federation.dim, stage.method.name
            if isinstance(stage, Calibration):
                sphere = training.sphere
                label += " (--calibrate)" if sphere is None else " (SphereFed's calibration)"
                dim = federation.dim if sphere is None else sphere.dim or federation.dim
            elif training is not None:
                label += " (--init)" if isinstance(stage, ClosedForm) else " (--probe-ridge)"
            options = {key: method.values[key] for key in ("bias", "rf_dim", "means_per_class", "covariance",
                                                                "virtual_per_class")}
            estimated.append(closed_form_footprint(label, method.name, federation, dim, block, **options,
                                                   kept_budget=run.shards.kept_budget))
    return estimated
