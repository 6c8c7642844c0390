"""A run's plan: what a validated configuration builds once, before any work, and the stages it runs.

:func:`plan` turns a resolved :class:`~fedray.engine.config.RunConfig` and the
federation it runs on into a :class:`RunPlan` of built parts: how clients are
sampled, the one postprocessing every stage's uploads pass through, the shard
resources, and the list of stages (a closed form, or training on a linear
head, SphereFed's projection or images from ``--init``'s closed form, then a
calibration, the ridge probe, TCT's stage 2), which the engine runs in order
(:mod:`fedray.engine.pipeline`). The stages and the memory estimate take these
parts; nothing below the engine sees the configuration.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from fedray.core.federation import Federation
from fedray.core.options import build
from fedray.core.plugins import display_name
from fedray.engine.calibration import Calibration, Probe
from fedray.engine.closed_form import ClosedForm
from fedray.engine.clocked import run_clock
from fedray.engine.config import TCT, RunConfig
from fedray.engine.parts import Images, MethodSpec, Sampler, Shards, closed_form_uploads, training_uploads
from fedray.engine.pipeline import RunPlan, Stage, footprints
from fedray.engine.settings import local_sgd_settings, server_optimizer, training_algorithm
from fedray.engine.stages import Training
from fedray.methods import method_class
from fedray.methods.base import ClosedFormMethod
from fedray.methods.postprocessor import Postprocessing, postprocessor_class
from fedray.methods.ridge import PROBE_METHOD
from fedray.methods.sphere import SphereHead
from fedray.methods.tct_stage2 import TctStage2Options
from fedray.methods.training.modes import FineTuning

__all__ = ["ClosedForm", "Calibration", "Images", "MethodSpec", "Probe", "RunPlan", "Sampler", "Shards", "Stage",
           "Training", "closed_form_uploads", "footprints", "plan", "postprocessing", "stages", "training_uploads"]


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
    images = None if config.finetune is None else \
        Images(config.finetune, config.component(FineTuning), config.num_trainers, config.cpus_per_trainer)
    sphere = config.component(SphereHead) if config.head == "sphere" else None
    return Training(algorithm=training_algorithm(config), server_optimizer=server_optimizer(config),
                    sgd=local_sgd_settings(config), rounds=config.rounds, checkpoint_every=config.checkpoint_every,
                    sphere=sphere, images=images, method=display_name(config.training_algorithm))


def stages(config: RunConfig) -> tuple[Stage, ...]:
    """The stages ``config`` (resolved) runs, in order."""
    if not config.trains:
        return (ClosedForm(method_spec(config, config.method), config.rounds),)
    training = training_stage(config)
    if config.init != "random":
        training = replace(training, init=ClosedForm(method_spec(config, config.init), config.init_rounds))
    listed: list[Stage] = [training]
    if training.sphere is not None:
        listed.append(Calibration(method_spec(config, training.sphere.calibration_method), training.sphere))
    elif config.calibrate is not None:
        listed.append(Calibration(method_spec(config, config.calibrate)))
    if config.probe_ridge:
        listed.append(Probe(method_spec(config, PROBE_METHOD)))
    if config.method == TCT:
        from fedray.engine.tct import TctStage2  # torchvision loads only for TCT's runs

        listed.append(TctStage2(config.component(TctStage2Options)))
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
    return replace(run, footprints=footprints(run, federation), clock=run_clock(config, federation, sampler))
