"""Every gradient method's client optimizer, as its options declare it: local SGD's rate and schedule, weight decay,
batch size, epochs, momentum and the softmax temperature (Fed3R Appendix C's defaults)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fedray.core.errors import FedrayError
from fedray.core.numeric_options import check_positive
from fedray.core.options import Metavar, Unset
from fedray.methods.training.local import LocalSGD
from fedray.methods.training.schedule import SCHEDULES, LrSchedule, ScheduleKind, parse_milestones


@dataclass(frozen=True)
class ClientOptimizer:
    """The clients' local SGD: its options, and the :class:`LocalSGD` a run's clients train with."""

    client_lr: Annotated[float, "client SGD learning rate"] = 0.1
    weight_decay: Annotated[float, "client SGD weight decay"] = 4e-5
    batch_size: Annotated[int, "client mini-batch size"] = 50
    local_epochs: Annotated[int, "local epochs per round"] = 5
    client_momentum: Annotated[float, "client SGD momentum, torch's heavy ball; the buffer starts at zero for every "
                                      "client every round"] = 0.0
    lr_schedule: Annotated[ScheduleKind,
                           "client learning rate over the training rounds: constant, cosine (annealed to 0 over "
                           "--rounds) or step (× --lr-gamma after each of --lr-milestones)"] = "constant"
    lr_milestones: Annotated[str | None, "step schedule: comma-separated training rounds after which the rate decays "
                                         "(\"50,75\")", Unset("none; constant and cosine take none"),
                             Metavar("R1,R2,...")] = None
    lr_gamma: Annotated[float, "step schedule: the decay factor"] = 0.1
    temperature: Annotated[float, "softmax temperature: logits / T (0.1 suits a closed-form init)"] = 1.0

    def __post_init__(self) -> None:
        check_positive({"client_lr": self.client_lr, "batch_size": self.batch_size, "local_epochs": self.local_epochs,
                        "temperature": self.temperature, "lr_gamma": self.lr_gamma})
        if not 0 <= self.client_momentum < 1:
            raise FedrayError(f"--client-momentum must be in [0, 1), got {self.client_momentum}")
        if self.lr_schedule not in SCHEDULES:
            raise FedrayError(f"--lr-schedule must be one of {', '.join(SCHEDULES)}, got {self.lr_schedule!r}")
        if (self.lr_milestones is not None) != (self.lr_schedule == "step"):
            raise FedrayError("--lr-schedule step needs --lr-milestones, and --lr-milestones applies to step only")
        try:
            milestones = parse_milestones(self.lr_milestones)
        except ValueError:
            milestones = (0,)
        if self.lr_schedule == "step" and (not milestones or min(milestones) < 1):
            raise FedrayError(f"--lr-milestones takes comma-separated training rounds ≥ 1, got {self.lr_milestones!r}")

    def schedule(self, rounds: int | None) -> LrSchedule:
        """The learning-rate schedule over the run's ``rounds`` training rounds (None: until every client was seen,
        which a cosine cannot span)."""
        if self.lr_schedule == "cosine" and rounds is None:
            raise FedrayError("--lr-schedule cosine anneals over the run's training rounds: give --rounds")
        return LrSchedule(self.lr_schedule, rounds or 1, parse_milestones(self.lr_milestones), self.lr_gamma)

    def local_sgd(self, rounds: int | None) -> LocalSGD:
        """What the clients train with, over ``rounds`` training rounds."""
        return LocalSGD(lr=self.client_lr, weight_decay=self.weight_decay, batch_size=self.batch_size,
                        epochs=self.local_epochs, temperature=self.temperature, momentum=self.client_momentum,
                        schedule=self.schedule(rounds))
