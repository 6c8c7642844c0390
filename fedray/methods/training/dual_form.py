"""Which training algorithms linear heads on features train in the dual form: one decision, the engine's.

The dual form (:mod:`fedray.methods.training.local`) trains many clients' softmax
heads at once, exactly, for client halves it knows: FedAvg's (also FedAvgM's,
FedAdam's, FedAdagrad's and FedYogi's clients), FedProx's and SCAFFOLD's with option-I control
variates (option II keeps a dense c_i per client: autograd). It is a fast path, never a different algorithm: it applies to those
built-in classes as they are built, and a subclass (a plugin may change any
hook) trains by autograd. Training (:mod:`fedray.methods.training.heads`) and
the memory estimate (:mod:`fedray.runtime.footprint`) both ask :func:`dual_form`.
"""

from __future__ import annotations

from dataclasses import dataclass

from fedray.methods.algorithm import FederatedAlgorithm
from fedray.methods.training_algorithms import FedAvg, FedProx, Scaffold


@dataclass(frozen=True)
class DualForm:
    """What the dual form trains: local SGD on the path's cross-entropy with FedProx's pull ``prox_mu`` and, with
    ``control``, SCAFFOLD's option-I correction (its clients' states: the gradient rows G, c_i = X_iᵀ G_i); it uploads
    the update weighted by the clients' samples (and, with ``control``, the change of c_i)."""

    prox_mu: float = 0.0
    control: bool = False


def dual_form(algorithm: FederatedAlgorithm) -> DualForm | None:
    """The dual form's settings for ``algorithm`` on linear heads, or None: it trains by autograd."""
    kind = type(algorithm)
    if kind is FedAvg:
        return DualForm()
    if kind is FedProx:
        return DualForm(prox_mu=algorithm.prox_mu)
    if kind is Scaffold and algorithm.variant == "I":
        return DualForm(control=True)
    return None
