"""Server optimizers: they turn the clients' averaged update Δ into the next global model.

Δ is the sample-weighted mean of the clients' (θ_k − θ), a pseudo-gradient
pointing downhill. FedAvg: θ ← θ + η Δ (η = 1 is plain model averaging).
FedAvgM: m ← β m + Δ, θ ← θ + η m. FedAdam (Reddi et al., ICLR 2021):
m ← β₁ m + (1 − β₁) Δ, v ← β₂ v + (1 − β₂) Δ², θ ← θ + η m / (√v + τ).

A new server optimizer is one subclass of :class:`ServerOptimizer` (see
``examples/fedyogi.py``): its options are its constructor's keyword arguments,
its ``step`` maps (θ, Δ) to the next θ, and whatever it keeps between rounds
lives in ``self.state`` (tensors in plain dicts), which checkpoints save.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Annotated, ClassVar

import torch

from fedray.core.errors import FedrayError

Params = dict[str, torch.Tensor]


class ServerOptimizer(ABC):
    """The server's update rule; ``server_lr`` is every optimizer's learning rate η."""

    name: ClassVar[str] = ""
    default_lr: ClassVar[float] = 1.0
    """η when the run does not give ``--server-lr``."""

    def __init__(self, server_lr: Annotated[float | None, "server learning rate η (default 1)"] = None) -> None:
        self.server_lr = self.default_lr if server_lr is None else server_lr
        if not self.server_lr > 0:
            raise FedrayError(f"--server-lr must be > 0, got {self.server_lr}")
        self.state: dict[str, dict[str, torch.Tensor]] = {}

    @abstractmethod
    def step(self, params: Params, delta: Params) -> Params:
        """The next values of the parameters in ``delta`` (the sample-weighted mean client change), from ``params``.

        Return new tensors; ``params`` and ``delta`` are the engine's and must not be changed.
        """

    def slot(self, name: str, key: str, like: torch.Tensor) -> torch.Tensor:
        """Per-parameter state ``key`` of parameter ``name`` (zeros like ``like`` the first time)."""
        return self.state.setdefault(name, {}).get(key, torch.zeros_like(like))

    def remember(self, name: str, key: str, value: torch.Tensor) -> torch.Tensor:
        self.state.setdefault(name, {})[key] = value
        return value


class ServerSGD(ServerOptimizer):
    """θ ← θ + η Δ."""

    name = "fedavg"

    def step(self, params: Params, delta: Params) -> Params:
        return {name: params[name] + self.server_lr * change for name, change in delta.items()}


class ServerMomentum(ServerOptimizer):
    """m ← β m + Δ, θ ← θ + η m (server momentum)."""

    name = "fedavgm"

    def __init__(self, server_lr: Annotated[float | None, "server learning rate η (default 1)"] = None,
                 server_momentum: Annotated[float, "server momentum β"] = 0.9) -> None:
        super().__init__(server_lr)
        self.server_momentum = server_momentum

    def step(self, params: Params, delta: Params) -> Params:
        out = {}
        for name, change in delta.items():
            momentum = self.remember(name, "m", self.server_momentum * self.slot(name, "m", change) + change)
            out[name] = params[name] + self.server_lr * momentum
        return out


class ServerAdam(ServerOptimizer):
    """Adam on −Δ (Reddi et al., ICLR 2021); their usual η = 0.01 (Fed3R's value was not at hand)."""

    name = "fedadam"
    default_lr = 0.01

    def __init__(self, server_lr: Annotated[float | None, "server learning rate η (default 0.01)"] = None,
                 adam_beta1: Annotated[float, "β₁"] = 0.9, adam_beta2: Annotated[float, "β₂"] = 0.99,
                 adam_tau: Annotated[float, "τ, the adaptivity floor"] = 1e-3) -> None:
        super().__init__(server_lr)
        self.adam_beta1, self.adam_beta2, self.adam_tau = adam_beta1, adam_beta2, adam_tau

    def step(self, params: Params, delta: Params) -> Params:
        out = {}
        for name, change in delta.items():
            m = self.remember(name, "m", self.adam_beta1 * self.slot(name, "m", change) + (1 - self.adam_beta1) * change)
            v = self.remember(name, "v", self.adam_beta2 * self.slot(name, "v", change) + (1 - self.adam_beta2) * change**2)
            out[name] = params[name] + self.server_lr * m / (v.sqrt() + self.adam_tau)
        return out


SERVER_OPTIMIZERS: dict[str, type[ServerOptimizer]] = {cls.name: cls for cls in (ServerSGD, ServerMomentum, ServerAdam)}
