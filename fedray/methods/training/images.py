"""One trainer's local work: clients' SGD from the global model, evaluation and embedding.

A client's training (:func:`~fedray.methods.training.client_sgd.train_client`) is a
pure function of the global state, its samples, its mini-batches and its own
state (SCAFFOLD's c_i, ...; kept by its trainer): the model is reloaded
from the global state before every client, and the mini-batches are
``minibatches(n, batch_size, epochs, client_rng(seed, round, client))`` — the
linear-probing path's — so a client's upload does not depend on how clients are
spread over trainers, and their sum follows the fixed tree with one client a
leaf (:meth:`~fedray.runtime.fixed_tree.TreeSum.of_terms`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
from torch.nn.functional import cross_entropy

from fedray.data.images.reader import ImageReader
from fedray.methods.finetune_model import FineTuneModel, Mode, sent_names, trained_names
from fedray.methods.training.backend import ClientLosses, RoundUpdate
from fedray.methods.training.budgets import budgeted
from fedray.methods.checks import check_same_upload
from fedray.methods.training.client_sgd import add_upload, client_batches, loss_squares, start_client, train_client
from fedray.methods.training.heads import States
from fedray.methods.training.local import LocalSGD
from fedray.methods.algorithm import FederatedAlgorithm, Params
from fedray.methods.postprocessor import Postprocessing
from fedray.methods.sphere import sphere_loss
from fedray.methods.entk import EntkSpec, entk_features, reinitialize_last_layer


@dataclass(frozen=True)
class LocalTraining:
    """What a run's clients do: put in the object store once per run, so one trainer pool serves runs of any settings.

    ``sphere_loss`` (``mse`` or ``ce``) makes it SphereFed: the backbone's
    features are L2-normalized before the fixed head and the loss is
    :func:`~fedray.methods.sphere.sphere_loss`; None is a linear head with
    cross-entropy at the temperature.
    """

    mode: Mode
    sgd: LocalSGD
    seed: int
    algorithm: FederatedAlgorithm
    sphere_loss: str | None = None
    postprocessing: Postprocessing = Postprocessing()
    client_losses: bool = False
    """Measure each client's squared losses at the round's starting model (:class:`RoundUpdate`'s
    ``client_losses``)."""

    def loss(self, logits: torch.Tensor, labels: torch.Tensor, total: bool = False) -> torch.Tensor:
        """The mean loss of a batch, or its sum over the batch with ``total``."""
        if self.sphere_loss is None:
            return cross_entropy(logits, labels, reduction="sum" if total else "mean")
        mean = sphere_loss(logits, labels, self.sphere_loss, self.sgd.temperature)
        return mean * len(labels) if total else mean


def training_device() -> torch.device:
    """CUDA when the process has a GPU, with cuDNN's deterministic kernels and IEEE float32 (reproducible runs that
    agree with the CPU's to round-off); the CPU otherwise."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    ieee_float32()
    return torch.device("cuda")


def ieee_float32() -> None:
    """float32 matrix products and convolutions in IEEE float32 on CUDA, not TF32 (cuDNN's default for convolutions,
    whose 10-bit mantissa moved a fine-tuning run's loss by 1e-3 a round from the CPU's on an H100)."""
    conv = getattr(torch.backends.cudnn, "conv", None)
    if conv is not None and hasattr(conv, "fp32_precision"):  # PyTorch ≥ 2.9: its per-backend settings (TF32 by default)
        torch.backends.cuda.matmul.fp32_precision = "ieee"
        conv.fp32_precision = "ieee"
    else:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False


def chunks(size: int, batch_size: int) -> list[np.ndarray]:
    return [np.arange(start, min(start + batch_size, size)) for start in range(0, size, batch_size)]


class ClientTrainer:
    """Trains clients with a trainer's model replica (on its device) as ``training`` says."""

    def __init__(self, model: FineTuneModel, training: LocalTraining, device: torch.device) -> None:
        self.model, self.mode, self.sgd, self.seed, self.device = model, training.mode, training.sgd, training.seed, device
        self.training, self.algorithm = training, training.algorithm
        model.temperature = training.sgd.temperature
        model.sphere = training.sphere_loss is not None
        for name, parameter in model.named_parameters():
            parameter.requires_grad_(self.mode.trains(name))
        self.trained = trained_names(model, self.mode)
        self.statistics = [name for name in sent_names(model, self.mode) if name not in self.trained]

    def _on_device(self, tensors: Params) -> Params:
        return {name: tensor.to(self.device) for name, tensor in tensors.items()}

    def client_updates(
        self,
        params: Params,
        broadcast: Params,
        clients: list[int],
        rows: list[np.ndarray],
        labels: torch.Tensor,
        reader: ImageReader,
        round_number: int,
        states: States,
        steps: np.ndarray | None = None,
    ) -> Iterator[tuple[int, RoundUpdate]]:
        """Train each client (``rows[k]``: its rows in ``reader``/``labels``) from ``params``, one after another, with
        its state from ``states`` (its new state goes back there), at most ``steps[k]`` local steps (None: all); each
        client's upload as it is added, a one-client :class:`RoundUpdate` on the CPU (w_k · t_k), in order."""
        start = self._on_device(params)
        broadcast = self._on_device(broadcast)
        weighted, first = not self.training.postprocessing.exact, None
        for k, (client, client_rows) in enumerate(zip(clients, rows)):
            own = states.get(client)
            squares = np.zeros(1) if self.training.client_losses else None
            client_loss, upload, state = self._train_client(start, broadcast, None if own is None else self._on_device(own),
                                                            client_rows, labels, reader, round_number, client,
                                                            None if steps is None else int(steps[k]), squares)
            size = len(client_rows)
            model_state = self.model.state_dict()
            statistics = {name: (size * (model_state[name] - start[name])).cpu() for name in self.statistics}
            upload = self.training.postprocessing.client(upload, client, round_number)
            sums = {name: value.cpu() for name, value in add_upload(None, upload, self.algorithm, weighted).items()}
            if first is None:
                first = sums
            else:
                check_same_upload(self.algorithm, sums, first)
            states.put(client, None if state is None else {name: value.cpu() for name, value in state.items()})
            losses = None if squares is None else ClientLosses(np.array([client], dtype=np.int64), squares)
            yield client, RoundUpdate(sums, upload.weight, 1, client_loss, size, statistics, losses)

    def _train_client(
        self,
        start: Params,
        broadcast: Params,
        own: Params | None,
        rows: np.ndarray,
        labels: torch.Tensor,
        reader: ImageReader,
        round_number: int,
        client: int,
        budget: int | None,
        squares: np.ndarray | None = None,
    ) -> tuple[float, object, Params | None]:
        """Local SGD of one client from ``start`` (at most ``budget`` steps): the starting model's summed loss, its
        upload and its next state; the sum of its squared losses at ``start`` into ``squares[0]`` (None: not
        measured)."""
        sgd, size = self.sgd.for_round(round_number), len(rows)
        plan = budgeted(client_batches(size, sgd, self.seed, round_number, client), budget)
        evaluation = chunks(size, sgd.batch_size)
        stream = reader.batches([rows[batch] for batch in evaluation + plan])
        self.model.load_state_dict(start)
        self.model.train(self.mode.trains_backbone)
        parameters = dict(self.model.named_parameters())
        gradient = self.algorithm.needs_start_gradient
        self.model.zero_grad(set_to_none=True)  # the previous client's last step left its gradients
        loss_sum = 0.0
        with torch.set_grad_enabled(gradient):
            for batch in evaluation:
                logits = self.model(next(stream).to(self.device))
                loss = self.training.loss(logits, labels[rows[batch]], total=True)
                loss_sum += float(loss.detach())
                if squares is not None:
                    squares[0] += loss_squares(self.training.loss, logits.detach(), labels[rows[batch]])
                if gradient:  # ∇ of the mean loss over the client's samples, accumulated chunk by chunk
                    (loss / size).backward()
        start_gradient = None
        if gradient:
            start_gradient = {name: parameters[name].grad.clone() for name in self.trained}
            self.model.zero_grad(set_to_none=True)
        # in train mode the loss pass moved BN's running statistics: start training from the global state again
        self.model.load_state_dict(start)
        trained = {name: parameters[name] for name in self.trained}
        received = {name: start[name] for name in self.trained}
        round_ = start_client(self.algorithm, client, round_number, size, plan, sgd, received, broadcast, own,
                              self.training.loss, start_gradient)
        upload, state = train_client(self.algorithm, round_, trained, lambda _, __: self.model(next(stream).to(self.device)),
                                     labels[rows], plan, sgd)
        return loss_sum, upload, state


@torch.inference_mode()
def backbone_features(model: FineTuneModel, params: Params, reader: ImageReader, batch_size: int, device: torch.device) -> torch.Tensor:
    """The backbone's features of all of ``reader``'s images, in order, in eval mode (on ``device``)."""
    model.load_state_dict(params)
    model.eval()
    features = [model.backbone(images.to(device)) for images in reader.batches(chunks(len(reader.paths), batch_size))]
    return torch.cat(features) if features else torch.zeros(0, model.head.in_features, device=device)


def images_entk(model: FineTuneModel, params: Params, reader: ImageReader, spec: EntkSpec, device: torch.device) -> torch.Tensor:
    """TCT's eNTK features (:func:`~fedray.methods.entk.entk_features`) of all of ``reader``'s images at ``params``, in order, on the CPU."""
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
