"""Every gradient method's client optimizer, as its options declare it: local SGD's rate and schedule, weight decay,
batch size, epochs, momentum and the softmax temperature (Fed3R Appendix C's defaults)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fedray.core.options import Metavar, Unset
from fedray.methods.training.local import LocalSGD
from fedray.methods.training.schedule import LrSchedule, ScheduleKind, parse_milestones


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

    def schedule(self, rounds: int | None) -> LrSchedule:
        """The learning-rate schedule over the run's ``rounds`` training rounds (the cosine's span; None: one)."""
        return LrSchedule(self.lr_schedule, rounds or 1, parse_milestones(self.lr_milestones), self.lr_gamma)

    def local_sgd(self, rounds: int | None) -> LocalSGD:
        """What the clients train with, over ``rounds`` training rounds."""
        return LocalSGD(lr=self.client_lr, weight_decay=self.weight_decay, batch_size=self.batch_size,
                        epochs=self.local_epochs, temperature=self.temperature, momentum=self.client_momentum,
                        schedule=self.schedule(rounds))
