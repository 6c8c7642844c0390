"""Training on images: the fine-tuning backend on a trainer pool of its own, and the closed-form stages on the images
embedded by the backbone at that moment (in shards of their own: ``--num-shards``, default 1, next to the trainers).

Loaded only by runs on images (it imports torchvision). SphereFed (``--head
sphere``) fine-tunes the backbone under the fixed classifier, then calibrates
with FFC on the normalized embeddings.
"""

from __future__ import annotations

from functools import partial
from typing import Callable, TypeVar

from fedray.core.federation import TEST, TRAIN, Federation
from fedray.data.memory import with_features
from fedray.engine.parts import Images, Shards
from fedray.engine.pipeline import Embeddings, StageContext
from fedray.methods.algorithm import FederatedAlgorithm
from fedray.methods.finetune_model import get_mode, trained_names
from fedray.methods.postprocessor import Postprocessing
from fedray.methods.sphere import SphereHead
from fedray.methods.training.backend import Params
from fedray.methods.training.local import LocalSGD
from fedray.runtime.evaluator import Evaluator
from fedray.runtime.finetune.backend import FineTuneBackend
from fedray.runtime.shards import ShardPool

T = TypeVar("T")


def open_network(images: Images, context: StageContext, *, sgd: LocalSGD, algorithm: FederatedAlgorithm,
                 sphere: SphereHead | None, postprocessing: Postprocessing,
                 client_losses: bool = False) -> tuple[FineTuneBackend, Embeddings, float | None]:
    """The backend fine-tuning ``images`` with ``algorithm`` and ``sgd`` (SphereFed's backbone under its fixed
    classifier with ``sphere``), on a trainer pool of its own (in the Tune trial's bundles inside one), held by
    ``context`` until the run ends; where the closed-form stages find the embeddings; and F_φ (the run's, else half
    the backbone's measured FLOPs per image). ``client_losses``: each round measures its clients' squared losses."""
    run = context.run
    backend = FineTuneBackend.start(
        context.federation, images.network, images.mode, sgd, run.seed, num_trainers=images.num_trainers,
        cpus_per_trainer=images.cpus_per_trainer, algorithm=algorithm, sphere=sphere, postprocessing=postprocessing,
        trial_group=context.trial_group, state_budget=run.shards.state_memory, client_losses=client_losses,
    )
    context.hold(backend, backend.shutdown)
    backbone_macs = backend.flops_per_image / 2 if run.backbone_macs is None else run.backbone_macs
    return backend, partial(on_embeddings, run.shards, backend), backbone_macs


def on_embeddings(shards: Shards, backend: FineTuneBackend, params: Params,
                  work: Callable[[ShardPool, Evaluator], T]) -> T:
    """``work`` on shards holding the federation's images embedded by the backbone of ``params``.

    Inside a Tune trial the shards share the trainers' bundles, claiming no CPU:
    trainers and shards take turns (the trainers wait while the shards work).
    """
    train_features, _ = backend.embed(params, TRAIN)
    test_features, _ = backend.embed(params, TEST)
    embedded = with_features(backend.pool.federation, train_features, test_features)
    trial_group = backend.pool.trial_group
    if trial_group is None:
        pool = ShardPool.start(embedded, shards.count or 1, shards.cpus)
    else:
        pool = ShardPool.start(embedded, cpus_per_shard=0, trial_group=trial_group)
    try:
        return work(pool, Evaluator(pool))
    finally:
        pool.shutdown()


def network_shape(images: Images, federation: Federation) -> tuple[Params, Params]:
    """The fine-tuned network's state dict (its shapes, for a checkpoint's check) and the part of it that trains."""
    model = images.network.structure(federation)
    params = model.state_dict()
    return params, {name: params[name] for name in trained_names(model, get_mode(images.mode))}
