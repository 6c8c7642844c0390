"""Server optimizers: they turn the clients' averaged update Δ into the next global model.

Δ is the sample-weighted mean of the clients' (θ_k − θ), a pseudo-gradient
pointing downhill. FedAvg: θ ← θ + η Δ (η = 1 is plain model averaging).
FedAvgM: m ← β m + Δ, θ ← θ + η m. FedAdam, FedAdagrad and FedYogi (Reddi et
al., ICLR 2021, Algorithm 2): m ← β₁ m + (1 − β₁) Δ, θ ← θ + η m / (√v + τ), with
v ← β₂ v + (1 − β₂) Δ² (Adam), v ← v + Δ² (Adagrad) or
v ← v − (1 − β₂) Δ² sign(v − Δ²) (Yogi).

A new server optimizer is one subclass of :class:`ServerOptimizer` (see
``examples/fedyogi.py``): its options are its constructor's keyword arguments,
its ``step`` maps (θ, Δ) to the next θ, and whatever it keeps between rounds
lives in ``self.state`` (tensors in plain dicts), which checkpoints save.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Annotated, ClassVar

from fedray.core.errors import FedrayError
from fedray.core.lazy_modules import lazy_module
from fedray.core.options import Unset

torch = lazy_module("torch", globals())

Params = dict[str, "torch.Tensor"]


class ServerOptimizer(ABC):
    """The server's update rule; ``server_lr`` is every optimizer's learning rate η."""

    name: ClassVar[str] = ""
    default_lr: ClassVar[float] = 1.0
    """η when the run does not give ``--server-lr``."""

    def __init__(self, server_lr: Annotated[float | None, "server learning rate η (default 1)", OWN_LR] = None) -> None:
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

    def __init__(self, server_lr: Annotated[float | None, "server learning rate η (default 1)", OWN_LR] = None,
                 server_momentum: Annotated[float, "server momentum β"] = 0.9) -> None:
        super().__init__(server_lr)
        self.server_momentum = server_momentum

    def step(self, params: Params, delta: Params) -> Params:
        out = {}
        for name, change in delta.items():
            momentum = self.remember(name, "m", self.server_momentum * self.slot(name, "m", change) + change)
            out[name] = params[name] + self.server_lr * momentum
        return out


class AdaptiveServerOptimizer(ServerOptimizer):
    """Reddi et al.'s Algorithm 2: m ← β₁ m + (1 − β₁) Δ, θ ← θ + η m / (√v + τ), v by :meth:`second_moment`.

    m and v start at 0 and are not bias-corrected, as in the paper. The three share their options' names
    (``adam_beta1``, ``adam_beta2``, ``adam_tau``): one flag sets β₁ whichever of them runs, and a sweep over the
    three compares them at the same β and τ.
    """

    default_lr = 0.01
    """Reddi et al.'s usual η (their tuned values differ by task and optimizer; Fed3R's was not at hand)."""

    def __init__(self, server_lr: float | None, adam_beta1: float, adam_tau: float) -> None:
        super().__init__(server_lr)
        self.adam_beta1, self.adam_tau = adam_beta1, adam_tau

    @abstractmethod
    def second_moment(self, v: torch.Tensor, square: torch.Tensor) -> torch.Tensor:
        """The next v from the last one and Δ² (elementwise)."""

    def step(self, params: Params, delta: Params) -> Params:
        out = {}
        for name, change in delta.items():
            m = self.remember(name, "m", self.adam_beta1 * self.slot(name, "m", change) + (1 - self.adam_beta1) * change)
            v = self.remember(name, "v", self.second_moment(self.slot(name, "v", change), change**2))
            out[name] = params[name] + self.step_size(name) * m / (v.sqrt() + self.adam_tau)
        return out

    def step_size(self, name: str) -> float:
        """The η that multiplies parameter ``name``'s m / (√v + τ) in this step: ``server_lr``."""
        return self.server_lr


class ServerAdam(AdaptiveServerOptimizer):
    """Adam on −Δ (Reddi et al., ICLR 2021): v ← β₂ v + (1 − β₂) Δ².

    ``adam_bias_correction`` scales η as Flower's FedAdam does (Kingma & Ba's α_t): step t (1, 2, ...) moves by
    η √(1 − β₂^(t+1)) / (1 − β₁^(t+1)), t counted per parameter in the optimizer's state (checkpoints keep it).
    Reddi et al.'s Algorithm 2 has no correction, nor has Flower's FedYogi: off by default.
    """

    name = "fedadam"

    def __init__(self, server_lr: Annotated[float | None, "server learning rate η (default 0.01)", OWN_LR] = None,
                 adam_beta1: Annotated[float, "β₁"] = 0.9, adam_beta2: Annotated[float, "β₂"] = 0.99,
                 adam_tau: Annotated[float, "τ, the adaptivity floor"] = 1e-3,
                 adam_bias_correction: Annotated[bool, "Flower's FedAdam bias correction: step t moves by "
                                                       "η √(1 − β₂^(t+1)) / (1 − β₁^(t+1))"] = False) -> None:
        super().__init__(server_lr, adam_beta1, adam_tau)
        self.adam_beta2, self.adam_bias_correction = adam_beta2, adam_bias_correction

    def second_moment(self, v: torch.Tensor, square: torch.Tensor) -> torch.Tensor:
        return self.adam_beta2 * v + (1 - self.adam_beta2) * square

    def step_size(self, name: str) -> float:
        """``server_lr``; with ``adam_bias_correction``, Flower's η √(1 − β₂^(t+1)) / (1 − β₁^(t+1)) at this step t."""
        if not self.adam_bias_correction:
            return self.server_lr
        count = torch.zeros((), dtype=torch.float64)
        t = int(self.remember(name, "step", self.slot(name, "step", count) + 1).item())
        return self.server_lr * math.sqrt(1 - self.adam_beta2 ** (t + 1)) / (1 - self.adam_beta1 ** (t + 1))


class ServerAdagrad(AdaptiveServerOptimizer):
    """Adagrad on −Δ with momentum (Reddi et al., ICLR 2021): v ← v + Δ²; it has no β₂."""

    name = "fedadagrad"

    def __init__(self, server_lr: Annotated[float | None, "server learning rate η (default 0.01)", OWN_LR] = None,
                 adam_beta1: Annotated[float, "β₁"] = 0.9,
                 adam_tau: Annotated[float, "τ, the adaptivity floor"] = 1e-3) -> None:
        super().__init__(server_lr, adam_beta1, adam_tau)

    def second_moment(self, v: torch.Tensor, square: torch.Tensor) -> torch.Tensor:
        return v + square


class ServerYogi(ServerAdam):
    """Yogi on −Δ (Reddi et al., ICLR 2021): v ← v − (1 − β₂) Δ² sign(v − Δ²)."""

    name = "fedyogi"

    def second_moment(self, v: torch.Tensor, square: torch.Tensor) -> torch.Tensor:
        return v - (1 - self.adam_beta2) * square * torch.sign(v - square)


SERVER_OPTIMIZERS: dict[str, type[ServerOptimizer]] = {
    cls.name: cls for cls in (ServerSGD, ServerMomentum, ServerAdam, ServerAdagrad, ServerYogi)}
OWN_LR = Unset("the server optimizer's own: " + ", ".join(f"{name} {cls.default_lr:g}"
                                                         for name, cls in SERVER_OPTIMIZERS.items()),
               "server learning rate η")
"""What a run's unset ``server_lr`` means: its server optimizer's :attr:`~ServerOptimizer.default_lr`."""
