"""One trainer's local work: clients' SGD from the global model, evaluation and embedding.

A client's training (:func:`~fedray.gradient.client_sgd.local_sgd`) is a
pure function of the global state, its samples, its mini-batches and (for
SCAFFOLD) the control variates: the model is reloaded
from the global state before every client, and the mini-batches are
``minibatches(n, batch_size, epochs, client_rng(seed, round, client))`` — the
linear-probing path's — so a run does not depend on how clients are spread
over trainers (beyond the float round-off of summing them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch.nn.functional import cross_entropy

from fedray.finetune.images import ImageReader
from fedray.finetune.model import FineTuneModel, Mode, sent_names, trained_names
from fedray.gradient.backend import Params
from fedray.gradient.client_sgd import client_algorithm, client_batches, local_sgd
from fedray.gradient.local import LocalSGD
from fedray.spherefed.classifier import sphere_loss
from fedray.tct.entk import EntkSpec, entk_features, reinitialize_last_layer


@dataclass(frozen=True)
class LocalTraining:
    """What a run's clients do: put in the object store once per run, so one trainer pool serves runs of any settings.

    ``sphere_loss`` (``mse`` or ``ce``) makes it SphereFed: the backbone's
    features are L2-normalized before the fixed head and the loss is
    :func:`~fedray.spherefed.classifier.sphere_loss`; None is a linear head with
    cross-entropy at the temperature.
    """

    mode: Mode
    sgd: LocalSGD
    seed: int
    sphere_loss: str | None = None

    def loss(self, logits: torch.Tensor, labels: torch.Tensor, total: bool = False) -> torch.Tensor:
        """The mean loss of a batch, or its sum over the batch with ``total``."""
        if self.sphere_loss is None:
            return cross_entropy(logits, labels, reduction="sum" if total else "mean")
        mean = sphere_loss(logits, labels, self.sphere_loss, self.sgd.temperature)
        return mean * len(labels) if total else mean


@dataclass
class Partial:
    """A trainer's sums over its clients of a round, plus SCAFFOLD's new control variate of each of them."""

    delta: Params
    weight: float
    loss_sum: float
    samples: int
    controls: dict[int, Params] = field(default_factory=dict)


def add_partials(a: Partial, b: Partial) -> Partial:
    """The sum of two trainers' partials."""
    delta = {name: a.delta[name] + b.delta[name] for name in a.delta}
    return Partial(delta, a.weight + b.weight, a.loss_sum + b.loss_sum, a.samples + b.samples, {**a.controls, **b.controls})


def training_device() -> torch.device:
    """CUDA when the process has a GPU, with cuDNN's deterministic kernels (reproducible runs); the CPU otherwise."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    return torch.device("cuda")


def chunks(size: int, batch_size: int) -> list[np.ndarray]:
    return [np.arange(start, min(start + batch_size, size)) for start in range(0, size, batch_size)]


class ClientTrainer:
    """Trains clients with a trainer's model replica (on its device) as ``training`` says."""

    def __init__(self, model: FineTuneModel, training: LocalTraining, device: torch.device) -> None:
        self.model, self.mode, self.sgd, self.seed, self.device = model, training.mode, training.sgd, training.seed, device
        self.training = training
        self.algorithm = client_algorithm(training.sgd, training.loss)
        model.temperature = training.sgd.temperature
        model.sphere = training.sphere_loss is not None
        for name, parameter in model.named_parameters():
            parameter.requires_grad_(self.mode.trains(name))
        self.trained = trained_names(model, self.mode)
        self.sent = sent_names(model, self.mode)

    def _on_device(self, tensors: Params) -> Params:
        return {name: tensor.to(self.device) for name, tensor in tensors.items()}

    def train_clients(
        self,
        params: Params,
        control: Params | None,
        clients: list[int],
        rows: list[np.ndarray],
        labels: torch.Tensor,
        reader: ImageReader,
        round_number: int,
        client_controls: dict[int, Params | None],
    ) -> Partial:
        """Train each client (``rows[k]``: its rows in ``reader``/``labels``) from ``params``, one after another.

        ``control`` is SCAFFOLD's server control variate (``None`` without
        SCAFFOLD) and ``client_controls`` the clients' own (``None`` before a
        client's first participation: zeros).
        """
        start = self._on_device(params)
        control = self._on_device(control) if control is not None else None
        delta = {name: torch.zeros_like(start[name]) for name in self.sent}
        loss_sum, samples, controls = 0.0, 0, {}
        for client, client_rows in zip(clients, rows):
            own = client_controls.get(client)
            own = self._on_device(own) if own is not None else None
            client_loss, new = self._train_client(start, control, own, client_rows, labels, reader, round_number, client)
            size = len(client_rows)
            state = self.model.state_dict()
            for name in self.sent:
                delta[name] += size * (state[name] - start[name])
            if new is not None:
                controls[client] = new
            loss_sum += client_loss
            samples += size
        return Partial({name: value.cpu() for name, value in delta.items()}, float(samples), loss_sum, samples, controls)

    def _train_client(
        self,
        start: Params,
        control: Params | None,
        own: Params | None,
        rows: np.ndarray,
        labels: torch.Tensor,
        reader: ImageReader,
        round_number: int,
        client: int,
    ) -> tuple[float, Params | None]:
        """Local SGD of one client from ``start``; returns the starting model's summed loss and its new control (SCAFFOLD) or None."""
        sgd, size = self.sgd.for_round(round_number), len(rows)
        plan = client_batches(size, sgd, self.seed, round_number, client)
        evaluation = chunks(size, sgd.batch_size)
        stream = reader.batches([rows[batch] for batch in evaluation + plan])
        self.model.load_state_dict(start)
        self.model.train(self.mode.trains_backbone)
        loss_sum = 0.0
        with torch.no_grad():
            for batch in evaluation:
                logits = self.model(next(stream).to(self.device))
                loss_sum += float(self.training.loss(logits, labels[rows[batch]], total=True))
        # in train mode the loss pass moved BN's running statistics: start training from the global state again
        self.model.load_state_dict(start)
        parameters = dict(self.model.named_parameters())
        trained = {name: parameters[name] for name in self.trained}
        new = local_sgd(trained, lambda _: self.model(next(stream).to(self.device)), labels[rows], plan, sgd, self.algorithm,
                        {name: start[name] for name in self.trained}, control, own)
        return loss_sum, None if new is None else {name: value.cpu() for name, value in new.items()}


@torch.inference_mode()
def backbone_features(model: FineTuneModel, params: Params, reader: ImageReader, batch_size: int, device: torch.device) -> torch.Tensor:
    """The backbone's features of all of ``reader``'s images, in order, in eval mode (on ``device``)."""
    model.load_state_dict(params)
    model.eval()
    features = [model.backbone(images.to(device)) for images in reader.batches(chunks(len(reader.paths), batch_size))]
    return torch.cat(features) if features else torch.zeros(0, model.head.in_features, device=device)


def images_entk(model: FineTuneModel, params: Params, reader: ImageReader, spec: EntkSpec, device: torch.device) -> torch.Tensor:
    """TCT's eNTK features (:func:`~fedray.tct.entk.entk_features`) of all of ``reader``'s images at ``params``, in order, on the CPU."""
    model.load_state_dict(params)
    linearized = reinitialize_last_layer(model, spec.seed)
    index = spec.index.to(device)
    features = [
        entk_features(linearized, images.to(device), index, chunk_size=spec.chunk_size, dtype=spec.dtype).cpu()
        for images in reader.batches(chunks(len(reader.paths), spec.chunk_size))
    ]
    return torch.cat(features) if features else torch.zeros(0, len(spec.index), dtype=spec.dtype)


@torch.inference_mode()
def count_correct(model: FineTuneModel, params: Params, reader: ImageReader, labels: torch.Tensor, batch_size: int, device: torch.device) -> int:
    """How many of ``reader``'s images ``params`` classifies as ``labels`` (eval mode; the temperature changes no argmax)."""
    features = backbone_features(model, params, reader, batch_size, device)
    return int((model.head(features).argmax(dim=1) == labels).sum())
