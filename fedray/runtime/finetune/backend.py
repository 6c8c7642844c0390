"""Federated fine-tuning of a torchvision backbone on images: the training backend the FedAvg-family loop drives.

Per round the driver puts the global state in the object store once; each
trainer of the pool trains its sampled clients one after another and returns
Σ n_k (θ_k − θ), Σ n_k and the starting model's summed loss; the trainers'
partial sums are tree-reduced. The whole state is put each round (frozen
parts included) because every replica needs it to run the model; what a
client would exchange in a real deployment, the trained part, is what
:meth:`FineTuneBackend.model_floats` counts.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import ray
import torch
from ray.util.placement_group import PlacementGroup

from fedray.core.accounting import PaperCosts
from fedray.core.federation import Federation
from fedray.core.errors import FedrayError
from fedray.methods.training.images import LocalTraining
from fedray.methods.finetune_model import (
    HEAD,
    FineTuneModel,
    Mode,
    backbone_flops,
    get_mode,
    head_init,
    sent_names,
    trained_names,
)
from fedray.runtime.client_states import Layout, meta_layout
from fedray.runtime.finetune.pool import TrainerPool
from fedray.methods.training.backend import Params, RoundUpdate
from fedray.methods.training.budgets import checked_budgets, full_steps
from fedray.methods.training.local import LocalSGD
from fedray.methods.algorithm import FederatedAlgorithm
from fedray.methods.postprocessor import Postprocessing
from fedray.methods.training_algorithms import FedAvg, paper_family
from fedray.data.images.backbones import feature_model, load_weights
from fedray.methods.base import Classifier
from fedray.methods.sphere import SphereHead, fixed_classifier
from fedray.methods.training.modes import FineTuning
from fedray.methods.entk import entk_num_parameters, head_coordinates


def check_sgd(sgd: LocalSGD) -> None:
    if (sgd.lr <= 0 or sgd.batch_size < 1 or sgd.epochs < 1 or sgd.temperature <= 0 or sgd.prox_mu < 0 or sgd.weight_decay < 0
            or not 0 <= sgd.momentum < 1):
        raise FedrayError(f"bad local SGD settings {sgd}: need lr, temperature > 0, batch size, epochs ≥ 1, prox_mu, weight decay ≥ 0, "
                          f"momentum in [0, 1)")


class FineTuneBackend:
    """A run's settings and initial weights on a :class:`TrainerPool` (whose trainers keep their clients' states).

    Modes: ``ft`` trains backbone and head, ``ftlp`` the head only (linear
    probing on images), ``ftfeat`` the backbone only (the head stays as
    initialized: classifier-free traffic). BatchNorm: see :mod:`fedray.methods.finetune_model`.
    ``seed`` seeds the ``random`` weights and the clients' mini-batch orders.
    """

    def __init__(
        self, pool: TrainerPool, weights_spec: str, mode: str, sgd: LocalSGD, seed: int, *,
        algorithm: FederatedAlgorithm = FedAvg(), sphere_loss: str | None = None, owns_pool: bool = False,
        postprocessing: Postprocessing = Postprocessing(), client_losses: bool = False,
    ) -> None:
        """``client_losses``: each round measures its clients' squared losses."""
        self.pool, self.owns_pool, self.algorithm = pool, owns_pool, algorithm
        if sphere_loss is not None and get_mode(mode).trains_head:
            raise FedrayError(f"SphereFed's classifier is fixed: fine-tune the backbone only (ftfeat), not {mode}")
        self.training = LocalTraining(get_mode(mode), sgd, seed, algorithm, sphere_loss, postprocessing, client_losses)
        check_sgd(sgd)
        federation, backbone = pool.federation, pool.backbone
        weights = load_weights(backbone, weights_spec, seed)
        model = FineTuneModel(feature_model(backbone, weights.state_dict), backbone.dim, federation.num_classes, sgd.temperature)
        self.flops_per_image = backbone_flops(model, pool.image_size, backbone.channels)
        self.backbone_parameters = sum(parameter.numel() for parameter in model.backbone.parameters())
        self.entk_num_parameters = entk_num_parameters(model)
        self.entk_head = head_coordinates(model)
        """The eNTK coordinates of the one-output head's weight (TCT's last-layer ablation)."""
        state = model.state_dict()
        self.initial_backbone = {name: value for name, value in state.items() if not name.startswith(HEAD)}
        self.state_shapes = {name: value.shape for name, value in state.items()}
        self.trained = trained_names(model, self.mode)
        self.sent = sent_names(model, self.mode)
        self.training_ref = ray.put(self.training)

    @classmethod
    def start(
        cls,
        federation: Federation,
        network: FineTuning,
        mode: str,
        sgd: LocalSGD,
        seed: int,
        *,
        num_trainers: int | None = None,
        cpus_per_trainer: float = 1.0,
        algorithm: FederatedAlgorithm = FedAvg(),
        sphere: SphereHead | None = None,
        postprocessing: Postprocessing = Postprocessing(),
        eval_batch_size: int = 64,
        trial_group: PlacementGroup | None = None,
        state_budget: int | None = None,
        client_losses: bool = False,
    ) -> FineTuneBackend:
        """A backend fine-tuning ``network`` (SphereFed's backbone under its fixed classifier with ``sphere``) on a pool
        of its own (see :meth:`TrainerPool.start`, also for ``trial_group``), shut down with it."""
        get_mode(mode)
        check_sgd(sgd)
        pool = TrainerPool.start(federation, network.backbone, image_size=network.image_size, num_trainers=num_trainers,
                                 cpus_per_trainer=cpus_per_trainer, eval_batch_size=eval_batch_size, trial_group=trial_group,
                                 state_budget=state_budget)
        try:
            return cls(pool, network.weights, mode, sgd, seed, algorithm=algorithm, owns_pool=True,
                       sphere_loss=None if sphere is None else sphere.sphere_loss, postprocessing=postprocessing,
                       client_losses=client_losses)
        except BaseException:
            pool.shutdown()
            raise

    @property
    def mode(self) -> Mode:
        return self.training.mode

    @property
    def trained_names(self) -> frozenset[str]:
        """What the clients train and the algorithm sees. The BN running statistics they also send are averaged as
        they are (θ ← θ + Δ, never stepped by momentum or Adam, or a running variance could turn negative)."""
        return frozenset(self.trained)

    def initial_params(self, head_seed: int) -> Params:
        """The loaded backbone weights and a head initialized like ``nn.Linear`` from ``head_seed``.

        SphereFed's head is the fixed classifier built from ``head_seed``
        (:func:`~fedray.methods.sphere.fixed_classifier`), without bias.
        """
        dim, num_classes = self.pool.backbone.dim, self.pool.federation.num_classes
        if self.training.sphere_loss is not None:
            weight, bias = fixed_classifier(num_classes, dim, head_seed).to(torch.float32), torch.zeros(num_classes)
        else:
            weight, bias = head_init(dim, num_classes, head_seed)
        return {**{name: value.clone() for name, value in self.initial_backbone.items()}, "head.weight": weight, "head.bias": bias}

    def client_state_layout(self) -> Layout | None:
        """What the algorithm's ``init_client_state`` makes for the trained parameters."""
        return meta_layout(self.algorithm, {name: tuple(self.state_shapes[name]) for name in self.trained})

    def with_head(self, params: Params, head: Params) -> Params:
        """The head is an ``nn.Linear`` (C × d weight): a closed-form stage's d × C weight goes in transposed."""
        return {**params, "head.weight": head["weight"].T.contiguous(), "head.bias": head["bias"]}

    def head(self, params: Params) -> Classifier:
        """The ``nn.Linear`` head (C × d) as a d × C classifier of the backbone's features."""
        return Classifier(params["head.weight"].T.clone(), params["head.bias"].clone())

    def calibration_map(self, params: Params) -> tuple[None, None]:
        """The backbone itself is fine-tuned under the fixed classifier: FFC calibrates on its normalized embeddings."""
        return None, None

    def sphere_arrays(self, params: Params) -> dict[str, np.ndarray]:
        return {"fixed_classifier": params["head.weight"].numpy()}

    def _check(self, params: Params) -> None:
        if set(params) != set(self.state_shapes):
            differing = sorted(set(self.state_shapes) ^ set(params))
            raise FedrayError(f"parameters do not match the {self.pool.backbone.name} model (first differing name: {differing[0]})")

    def _put(self, params: Params) -> ray.ObjectRef:
        self._check(params)
        return ray.put(params)

    def train_round(self, params: Params, broadcast: Params, clients: np.ndarray, round_number: int,
                    steps: np.ndarray | None = None) -> RoundUpdate:
        """``steps``: each client's step budget (None: none), as on features
        (:func:`~fedray.methods.training.heads.train_linear_heads` says what a partial client uploads)."""
        clients = np.asarray(clients, dtype=np.int64)
        num_clients = self.pool.federation.num_clients
        if not len(clients) or len(np.unique(clients)) != len(clients) or clients.min() < 0 or clients.max() >= num_clients:
            raise FedrayError(f"a round needs distinct client numbers in 0..{num_clients - 1}, got {clients.tolist()[:10]}")
        steps = checked_budgets(steps, clients)
        self._check(params)
        received = ray.put({"params": params, "broadcast": broadcast})
        training = self.training_ref
        if self.training.postprocessing.per_client:  # the client hooks told the round's participants
            training = ray.put(replace(self.training,
                                       postprocessing=self.training.postprocessing.among(clients, round_number)))
        return self.pool.train(training, received, clients, round_number, steps)

    def local_steps(self, clients: np.ndarray) -> np.ndarray:
        sgd = self.training.sgd
        return full_steps(np.diff(self.pool.federation.client_offsets)[clients], sgd.batch_size, sgd.epochs)

    def accuracy(self, params: Params) -> float:
        """Top-1 accuracy on the test split, each trainer classifying its share of the test images (eval mode)."""
        return self.pool.accuracy(self._put(params))

    def embed(self, params: Params, split: str) -> tuple[torch.Tensor, np.ndarray]:
        """Backbone features (N, d) float32 and labels of every sample of ``split`` ("train" in federation train order, or "test")."""
        return self.pool.embed(self._put(params), split)

    def model_floats(self) -> int:
        """Floats of what a client trains, plus BN statistics when the backbone is trained."""
        return sum(self.state_shapes[name].numel() for name in self.sent)

    def client_flops(self, sizes: np.ndarray) -> np.ndarray:
        """Training FLOPs of one participation: n · epochs samples, each

        * ``ft``, ``ftfeat``: 3 F + 6 d C (backbone forward + backward ≈ 3× its forward F; the head's forward and backward),
        * ``ftlp``: F + 6 d C (forward only through the frozen backbone).

        F is the backbone's forward FLOPs on one image, counted by torch's
        FlopCounterMode at the pool's image size. The loss pass before
        training (an evaluation, not training) is not counted.
        """
        head = 6.0 * self.pool.backbone.dim * self.pool.federation.num_classes
        backbone = (3.0 if self.mode.trains_backbone else 1.0) * self.flops_per_image
        return np.asarray(sizes, dtype=np.float64) * self.training.sgd.epochs * (backbone + head)

    def paper_costs(self, sizes: np.ndarray) -> PaperCosts:
        """One participation as the papers count it: b backbone parameters (BN statistics not counted), the head d·C
        floats (no bias), F_M = F_φ + d·C forward multiply-adds, B ≈ 2F.

        FedCOF App. H: 2(b + d·C) for ``ft``, 2·d·C for ``ftlp`` (``ftfeat``, SCAFFOLD, SphereFed: undefined);
        Fed3R App. D: 2(b + d·C), 2·d·C, 2·b (``ftfeat``), twice that with Scaffold; App. E:
        3·E·n_k·F_M (``ft``, ``ftfeat``), E·n_k(F_φ + 3·d·C) (``ftlp``); FedNCM: E·n_k forward passes.
        """
        if self.training.sphere_loss is not None:
            return PaperCosts()
        mode, head = self.mode, float(self.pool.backbone.dim * self.pool.federation.num_classes)
        sent = (float(self.backbone_parameters) if mode.trains_backbone else 0.0) + (head if mode.trains_head else 0.0)
        passes = self.training.sgd.epochs * sizes
        per_client = np.ones_like(passes)
        family = paper_family(self.algorithm)
        if family is None:
            return PaperCosts()
        scaffold = family == "scaffold"
        return PaperCosts(
            fedcof_floats=None if scaffold or not mode.trains_head else 2 * sent * per_client,
            fed3r_floats=(4 if scaffold else 2) * sent * per_client,
            fed3r_macs=3 * head * passes,
            forward_passes=passes,
            backbone_factor=3.0 if mode.trains_backbone else 1.0,
        )

    def shutdown(self) -> None:
        """Shut the pool down if this backend started it (a shared pool is its owner's to shut down)."""
        if self.owns_pool:
            self.pool.shutdown()
