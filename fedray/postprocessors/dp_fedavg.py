"""User-level differential privacy for training: DP-FedAvg (McMahan et al. 2018, "Learning Differentially Private
Recurrent Language Models"), for every training algorithm on features, ε(δ) from Google's ``dp-accounting`` for the
sampling the run really does, reported in every row.

    fedray run --method fedavg --sampling poisson --rounds 200 --postprocessor dp-fedavg \\
        --option clip_norm=0.5 --option dp_epsilon=4 --option dp_delta=1e-5

**Client.** A client's whole upload, every tensor the server receives from it (the model update and, where the
algorithm sends them, SCAFFOLD's control-variate change, FedNova's step count, a plugin's entries), is clipped jointly
to L2 norm S (``clip_norm``): each tensor times min(1, S/‖upload‖), ‖·‖ over all of them (an upload within S keeps its
bits). Its weight is 1 (uniform weights: the paper's w_k = min(n_k/ŵ, 1) with ŵ at most the smallest client, so no
client's weight exceeds the bound of 1 the noise is scaled to; a cap above the smallest client is not offered yet).

**Server.** The sum of the clipped uploads gets Gaussian noise N(0, σ²S²) on every entry, σ the noise multiplier
(``dp_noise``, or calibrated from ``dp_epsilon``), and the server divides it by q·W = κ (:meth:`aggregate_weight`; q =
κ/K, W = K with uniform weights): the paper's fixed-denominator estimator, unbiased for the population's mean update,
which unlike the realized Σ w_k does not tell the server how many clients took part (an empty Poisson round still
releases noise). ``dp_placement``: ``central`` (the server adds the noise once a round) or ``distributed`` (each client
adds N(0, σ²S²/κ), a round of κ carrying the central variance; not under Poisson sampling, whose rounds have no fixed
size). The algorithm's server step then runs on the noisy mean as on any other: SCAFFOLD's control variates, FedNova's
τ_eff and FedDyn's h are post-processing of the release.

**Accounting** (the unit is the client: one client's whole data added, removed or replaced), over the training rounds
released so far, in every row (``dp_epsilon``, ``dp_delta``):

- ``--sampling poisson``: each round a Poisson-subsampled Gaussian mechanism, ``PoissonSampledDpEvent(q,
  GaussianDpEvent(σ))``, composed over the rounds (add or remove one client; the setting of the usual DP-FedAvg ε);
- ``--sampling with`` (κ distinct clients a round, rounds independent): fixed-size sampling, accounted as what it is,
  ``SampledWithoutReplacementDpEvent(K, κ, GaussianDpEvent(σ/2))`` with the RDP accountant under replace-one
  neighbouring (Wang, Balle & Kasiviswanathan 2019): replacing one client's update by another's moves the sum by up to
  2S, hence σ/2. For the same σ, q and rounds its ε is many times Poisson's (6× at q = 0.01): a DP-FedAvg run that
  gives no ``--sampling`` samples by Poisson (:attr:`DPFedAvg.default_sampling`) where Poisson applies to it;
- ``--sampling without`` (passes over a permutation): a client takes part in at most ⌈t/P⌉ of t rounds (P = ⌈K/κ⌉
  rounds a pass), so the Gaussian mechanism composed that many times, with no amplification by sampling.

With distributed noise a round of m < κ clients (the last of a pass without replacement) carries σ²S²·m/κ: the
accountant is given σ·√(m/κ), m the stage's smallest round.

**Budget.** Give δ (``dp_delta``) and either ε (``dp_epsilon``: σ is the smallest multiplier in [0.1, 1000] whose ε(δ)
over the run's training rounds is at most ε, calibrated in :meth:`start`, before any work; a budget no σ there meets is
refused) or σ (``dp_noise``; both: σ is used, and the run refused if it spends more than ε). ``dp_accountant``:
``pld`` (the default, as ``dp``'s: tighter; Poisson and without-replacement sampling) or ``rdp`` (every sampling; the
one used for ``--sampling with`` when none is given). The σ used and the accountant are recorded in ``config.yaml``
and every row (``dp_noise``, ``dp_accountant``, beside ``clip_norm`` and ``sampling``): ``dp_noise=σ`` re-runs the run
bit for bit. An RDP row also says which orders its ε was minimized over (``dp_rdp_orders``: dp-accounting leaves out
the small ones where its series does not converge; :mod:`fedray.postprocessors.accounting`). σ = 0 (``dp_noise=0``)
is no privacy, ε = ∞: only the clip applies (weights and the server's denominator are the algorithm's), so with a clip
no upload reaches the run is the plain run bit for bit.

Refused at the start, in one line: closed-form statistics (``--postprocessor dp`` is sample-level DP for them: FedNCM,
Fed3R), and so a closed-form ``--init``, ``--calibrate``, SphereFed's calibration and ``--probe-ridge``; TCT's stage 2.
Noise draws come from the context's generator (the run's seed, the round, the client or the aggregate, the place in
the list), tensor after tensor in sorted name order, so a run is the same on any shard layout.
"""

from __future__ import annotations

import math
from functools import cache
from typing import TYPE_CHECKING, Annotated

import fedray
from fedray.core.lazy_modules import lazy_module
from fedray.postprocessors import accounting
from fedray.postprocessors.accounting import DEFAULT_ACCOUNTANT, PLD, RDP
from fedray.postprocessors.dp import budget_met, check_options, noisy

torch = lazy_module("torch", globals())

if TYPE_CHECKING:
    import dp_accounting

POISSON, WITH, WITHOUT = "poisson", "with", "without"


def mode(sampling: fedray.Sampling) -> str:
    """The ``--sampling`` a stage's :class:`~fedray.Sampling` is."""
    return POISSON if sampling.poisson else WITH if sampling.replacement else WITHOUT


def releases(sampling: str, rounds: int, population: int, per_round: int) -> int:
    """How many of ``rounds`` rounds one client can take part in (without replacement: one a pass), or the rounds,
    each a subsampled mechanism, under the other samplings."""
    return -(-rounds // -(-population // per_round)) if sampling == WITHOUT else rounds


def round_event(noise: float, sampling: str, population: int, per_round: int) -> dp_accounting.DpEvent:
    """One round's release as the accountant sees it, for a noise multiplier ``noise`` of the clip S."""
    import dp_accounting

    gaussian = dp_accounting.GaussianDpEvent(noise)
    if sampling == POISSON:
        return dp_accounting.PoissonSampledDpEvent(per_round / population, gaussian)
    if sampling == WITH:
        return dp_accounting.SampledWithoutReplacementDpEvent(population, per_round,
                                                              dp_accounting.GaussianDpEvent(noise / 2))
    return gaussian


def chosen(kind: str | None, sampling: str) -> str:
    """The accountant: ``kind`` when given, else the default (pld), or rdp for fixed-size sampling, which pld cannot
    account."""
    return kind or (RDP if sampling == WITH else DEFAULT_ACCOUNTANT)


def event(noise: float, sampling: str, population: int, per_round: int, rounds: int) -> dp_accounting.DpEvent:
    import dp_accounting

    return dp_accounting.SelfComposedDpEvent(round_event(noise, sampling, population, per_round),
                                             releases(sampling, rounds, population, per_round))


@cache
def epsilon(noise: float, delta: float, kind: str, sampling: str, population: int, per_round: int, rounds: int) -> float:
    """ε(δ) after ``rounds`` training rounds of noise multiplier ``noise`` under ``sampling`` (∞ without noise)."""
    if noise == 0:
        return math.inf
    if rounds == 0:
        return 0.0
    return accounting.spent(event(noise, sampling, population, per_round, rounds), delta, kind, neighbouring(sampling))


@cache
def rdp_orders(noise: float, sampling: str, population: int, per_round: int) -> str:
    """The orders the RDP accountant minimizes ε over, the same after any number of rounds (their RDP is finite where
    one round's is; :func:`~fedray.postprocessors.accounting.rdp_orders`)."""
    return accounting.rdp_orders(round_event(noise, sampling, population, per_round), neighbouring(sampling))


def neighbouring(sampling: str) -> dp_accounting.NeighboringRelation:
    """Replace-one under fixed-size sampling (its ε is stated so), add-or-remove-one under the others."""
    return accounting.REPLACE if sampling == WITH else accounting.ADD_OR_REMOVE


def calibrated(target: float, delta: float, kind: str, sampling: str, population: int, per_round: int,
               rounds: int) -> float:
    """The smallest noise multiplier in :data:`~fedray.postprocessors.accounting.NOISE_RANGE` whose ε(δ) over
    ``rounds`` is at most ``target``."""
    return accounting.calibrated(
        lambda noise: epsilon(noise, delta, kind, sampling, population, per_round, rounds), target,
        f"no noise multiplier up to {{high:g}} meets dp_epsilon={target:g} at dp_delta={delta:g} over {rounds} rounds "
        f"of --sampling {sampling} (ε there is {{spent:.3g}}); ask for a larger ε or δ, or fewer rounds")


def clipped(tensors: fedray.Params, bound: float) -> fedray.Params:
    """``tensors`` scaled jointly to L2 norm at most ``bound`` (themselves, with their bits, when within it)."""
    norm = math.sqrt(sum(float(torch.sum(tensor.double() ** 2)) for tensor in tensors.values()))
    if norm <= bound:
        return tensors
    return {name: tensor * (bound / norm) for name, tensor in tensors.items()}


class DPFedAvg(fedray.Postprocessor):
    """User-level (ε, δ)-DP for training: each client's upload clipped jointly to S, weight 1, Gaussian noise σS on the
    sum, the fixed denominator κ; ε accounted for the run's sampling."""

    def __init__(self, clip_norm: Annotated[float | None, "S: each client's whole upload clipped to L2 norm ≤ S "
                                                          "(required)"] = None,
                 dp_delta: Annotated[float | None, "δ of the (ε, δ) guarantee, 0 < δ < 1 (required)"] = None,
                 dp_epsilon: Annotated[float | None, "ε over the run's training rounds: calibrate the noise to it (or "
                                                     "give dp_noise)"] = None,
                 dp_noise: Annotated[float | None, "σ: the noise multiplier, std σ·S on the sum (or give "
                                                   "dp_epsilon; 0: clip only, no privacy)"] = None,
                 dp_placement: Annotated[str, "central (the server, once a round) or distributed (each client, "
                                              "σ/√κ; not with --sampling poisson)"] = "central",
                 dp_accountant: Annotated[str | None, "pld (poisson and without) or rdp (every sampling)"] = None
                 ) -> None:
        super().__init__()
        check_options(clip_norm, "the bound S on each client's upload norm", dp_delta, dp_epsilon, dp_noise,
                      dp_placement, dp_accountant or DEFAULT_ACCOUNTANT, "clients")
        self.clip_norm, self.delta, self.placement = float(clip_norm), float(dp_delta), dp_placement
        self.kind = dp_accountant
        """The accountant: given, or chosen in :meth:`start` (pld, or rdp for fixed-size sampling, which pld cannot
        account)."""
        self.target = dp_epsilon
        self.noise: float | None = None if dp_noise is None else float(dp_noise)
        """σ; calibrated in :meth:`start` when only a budget is given."""
        self.accounted = 1.0
        """The share √(m/κ) of σ the accountant is given: below 1 where distributed noise has rounds of m < κ."""

    default_sampling = POISSON

    @property
    def per_client(self) -> bool:
        return True

    def recorded(self) -> dict[str, object]:
        """σ (calibrated or given) and the accountant used: ``dp_noise=σ`` re-runs the same."""
        return {} if self.kind is None else {"dp_noise": self.noise, "dp_accountant": self.kind}

    def start(self, stages: tuple[fedray.StageUploads, ...]) -> None:
        for stage in stages:
            if not stage.training:
                raise ValueError(f"the {stage.stage} stage uploads closed-form statistics, which DP-FedAvg does not "
                                 f"cover: --postprocessor dp is sample-level DP for them (fedncm, fed3r)")
            if stage.stage != "training":
                raise ValueError(f"the {stage.stage} stage is not covered by DP-FedAvg yet")
        training = [stage for stage in stages if stage.training]
        if not training:
            return
        stage = training[0]
        sampling, population, per_round = mode(stage.sampling), stage.sampling.population, stage.sampling.per_round
        if sampling == WITH and self.kind == PLD:
            raise ValueError("dp_accountant=pld cannot account fixed-size sampling (--sampling with): use "
                             "dp_accountant=rdp, or --sampling poisson")
        self.kind = chosen(self.kind, sampling)
        if self.placement == "distributed":
            if sampling == POISSON:
                raise ValueError("dp_placement=distributed needs a fixed number of clients a round: give --sampling "
                                 "with (or without), or use dp_placement=central")
            self.accounted = math.sqrt(stage.smallest_group / per_round)
        if self.noise is None:
            self.noise = calibrated(self.target, self.delta, self.kind, sampling, population, per_round,
                                    stage.rounds) / self.accounted
        else:
            budget_met(self.noise, self.target, epsilon(self.noise * self.accounted, self.delta, self.kind, sampling,
                                                        population, per_round, stage.rounds),
                       f"{stage.rounds} rounds of --sampling {sampling}")

    def client(self, upload: fedray.Upload, context: fedray.UploadContext) -> fedray.Upload:
        tensors = clipped(upload.tensors, self.clip_norm)
        if self.noise == 0:
            return upload if tensors is upload.tensors else fedray.Upload(tensors, upload.weight)
        if self.placement == "distributed":
            share = self.noise * self.clip_norm / math.sqrt(context.sampling.per_round)
            tensors = noisy(tensors, dict.fromkeys(tensors, share), context.generator)
        return fedray.Upload(tensors, 1.0)

    def aggregate_weight(self, weight: float, context: fedray.UploadContext) -> float:
        return weight if self.noise == 0 else float(context.sampling.per_round)

    def aggregate(self, total: fedray.Params, context: fedray.UploadContext) -> fedray.Params:
        sampling = context.sampling  # training is the run's only stage here: its round r is the r-th release
        kind, accounted = chosen(self.kind, mode(sampling)), self.noise * self.accounted
        fedray.report(dp_epsilon=epsilon(accounted, self.delta, kind, mode(sampling), sampling.population,
                                         sampling.per_round, context.round), dp_delta=self.delta)
        if kind == RDP and accounted > 0:  # which orders its ε is minimized over (some may not converge)
            fedray.report(dp_rdp_orders=rdp_orders(accounted, mode(sampling), sampling.population, sampling.per_round))
        if self.noise == 0 or self.placement == "distributed":
            return total
        return noisy(total, dict.fromkeys(total, self.noise * self.clip_norm), context.generator)
