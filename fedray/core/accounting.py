"""The papers' accounting conventions, as metrics columns beside fedray's own.

fedray's documented default is ``bytes_up``/``bytes_down`` (float32 values
actually sent) and ``flops_client_avg`` (2 FLOPs per multiply-add of the
clients' statistics or training, backbone excluded, averaged over the clients
seen). The papers plot other axes; these columns let a user redraw them from
metrics.parquet (the manual, docs/results.md: "The papers' accounting"):

* ``comm_floats_fedcof``: FedCOF Appendix H, floats communicated in total:
  training-free methods upload once per client, nothing down (FedNCM and
  FedCOF M·d, Fed3R M·d + K·d², FedCOF-Oracle M·(d + d²), M the (client,
  class) pairs of the clients counted); federated linear probing 2·d·C per
  participation (the head each way).
* ``comm_floats_fed3r``: Fed3R Appendix D: d² + d·C per Fed3R client
  (D² + D·C for Fed3R-RF), up; FedAvg-LP-style probing d·C down and up,
  Scaffold-LP 2·d·C each way.
* ``macs_client_avg_fed3r``: Fed3R Appendix E: multiply-adds (the paper's
  "FLOPs") including the backbone's forward pass F_φ, summed over the clients'
  computations so far and divided by **all** K clients: the paper's 𝒯·t·κ/K
  (𝒯 per client per round, t rounds, κ clients a round), which this equals
  exactly when the clients hold equal numbers of samples and in expectation
  otherwise. Null when F_φ is unknown.
* ``forward_passes``: FedNCM's unit F, single-sample forward passes through the
  backbone the clients' computation implies (one per sample for a closed-form
  method; one per sample per local epoch for linear probing, which the papers
  run on images).

A count a paper does not define for a method is null (None), never a guess,
and stays null for the rest of the run once any contribution to it is.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np


@dataclass(frozen=True)
class PaperCosts:
    """Per-client costs (arrays of shape (K,)) of one computation under the papers' conventions; None where undefined.

    One computation is a closed-form client's single upload, or one participation
    in a training round. ``fed3r_macs`` excludes the backbone: its multiply-adds are
    ``backbone_factor`` × ``forward_passes`` × F_φ (the factor 3 where the backward
    pass goes through the backbone, B ≈ 2F as Fed3R and FedNCM assume), added
    when F_φ is known.
    """

    fedcof_floats: np.ndarray | None = None
    fed3r_floats: np.ndarray | None = None
    fed3r_macs: np.ndarray | None = None
    forward_passes: np.ndarray | None = None
    backbone_factor: float = 1.0


@dataclass
class PaperTotals:
    """Running totals behind the paper columns; None once a contribution was undefined."""

    fedcof_floats: float | None = 0.0
    fed3r_floats: float | None = 0.0
    fed3r_macs: float | None = 0.0
    forward_passes: float | None = 0.0

    def add(self, costs: PaperCosts | None, clients: np.ndarray, backbone_macs: float | None,
            received: np.ndarray | None = None) -> None:
        """Add the computations of ``clients`` (one each; a client may repeat); ``costs`` None: nothing defined. The
        communication columns count only the uploads of ``received`` (by default all of ``clients``): those that
        reached the server (a client that dropped out after computing its upload sent none of it)."""
        costs = costs or PaperCosts()
        received = clients if received is None else received
        macs = None
        if costs.fed3r_macs is not None and costs.forward_passes is not None and backbone_macs is not None:
            macs = costs.fed3r_macs + costs.backbone_factor * costs.forward_passes * backbone_macs
        for name, per_client, counted in (("fedcof_floats", costs.fedcof_floats, received),
                                          ("fed3r_floats", costs.fed3r_floats, received),
                                          ("fed3r_macs", macs, clients),
                                          ("forward_passes", costs.forward_passes, clients)):
            total = getattr(self, name)
            added = None if total is None or per_client is None else total + float(per_client[counted].sum())
            setattr(self, name, added)

    def columns(self, num_clients: int) -> dict[str, float | None]:
        """The metrics columns: MACs averaged over all ``num_clients`` clients (Fed3R's 𝒯·t·κ/K)."""
        return {
            "comm_floats_fedcof": self.fedcof_floats,
            "comm_floats_fed3r": self.fed3r_floats,
            "macs_client_avg_fed3r": None if self.fed3r_macs is None else self.fed3r_macs / num_clients,
            "forward_passes": self.forward_passes,
        }

    def to_dict(self) -> dict[str, float | None]:
        return {field.name: getattr(self, field.name) for field in fields(self)}
