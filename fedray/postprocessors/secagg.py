"""Secure aggregation (SecAgg, Bonawitz et al. 2017; SecAgg+, Bell et al. 2020) simulated exactly, without its cryptography.

    fedray run --method fed3r --postprocessor secagg --option secagg_clip=1000 --option secagg_dropout=0.1
    fedray run --method fedncm --postprocessor secagg --option secagg_clip=1000 --option secagg_neighbours=8
    fedray run --method fed3r --secure-aggregation --option secagg_clip=1000 --option secagg_masks=generate

What the server receives is what SecAgg's would: the sum of the clients' quantized uploads in the ring Z_{2^b},
nothing else, bit for bit. By default (``secagg_masks=model``) the masks are modelled: the server gets that sum
directly, and what the masks cost (their expansion, the protocol's bytes and round trips) is reported and, on the
clock, timed in each participant's task (:meth:`protocol_cost`), not paid
(:mod:`fedray.clock.secagg_costs`). With ``secagg_masks=generate`` the masks are real (expanded from seeds) and
cancel in the server's sum, to the same bits. Either way the key agreement and secret sharing that make them secret
are not run, only their effect.

**Quantization.** Each value x of a client's upload is clipped to [−C, C] (``secagg_clip``) and sent as the
integer q = rint(x / Δ) + h in [0, 2^v − 2], Δ = C / h, h = 2^(v−1) − 1, on v bits (``secagg_value_bits``), in
the ring Z_{2^b} (``secagg_bits``; by default b = 53 − ⌈log₂ n⌉, the largest float64 sums exactly). The grid is
symmetric with 0 on it (q = h): a zero, most of a sparse upload such as ZᵀY, stays exactly zero, where a grid of
2^v levels from −C to C would put it halfway between two and round every client's zeros the same way (a bias of
Δ/2 per client). The sum of the n participants' integers must fit the ring: n · (2^v − 1) ≤ 2^b − 1. Given v, a
group whose sum could exceed it stops the run in one line before any mask is drawn (the ring never wraps
silently); by default v is the largest that fits the group's n. The server decodes the ring's sum S of the s
survivors' integers as (S − s · h) · Δ.

**Masks** (``secagg_masks=generate``). Client i sends
y_i = q_i + p_i + Σ_{j ∈ N(i), j > i} m_ij − Σ_{j ∈ N(i), j < i} m_ij mod 2^b: a self-mask p_i and a pairwise mask
m_ij with each neighbour j, each expanded with Philox (counter-based) from its own seed, a SeedSequence of the
group's shared seed (the run's seed, the aggregate's round, the postprocessor's place) and the client numbers.
N(i) is every other participant (SecAgg) or, with ``secagg_neighbours`` k, i's neighbours in a k-regular graph
(SecAgg+: a Harary graph, the participants on a ring in a seeded random order, each joined to the k/2 before and
after it).

**Modelled masks** (``secagg_masks=model``, the default). The masks cancel in the sum of the survivors' uploads, and
the dropped clients' pairwise masks with survivors are what the server removes from the seeds it reconstructs, so
they change no bit of what the server decodes: each surviving client sends what is left of y_i once they cancel,
its integers centred, q_i − h = rint(clip(x) / Δ) in [−h, h] (held exactly in float64; a zero stays 0, so a sparse
upload costs its nonzeros), and the server decodes their sum, S − s · h, times Δ. Who drops, the graph, the
threshold and every refusal are the same draws and the same checks as with generated masks
(``tests/postprocessors/test_secagg.py`` compares the two bit for bit).

**Who the participants are.** Pairwise masks need each client's group: the clients whose uploads the server sums
into one aggregate (a training round's clients; a closed-form evaluation block's, its clients uploading in different
rounds; everyone in a calibration, a ridge probe, TCT's normalization and closed form). The engine tells it through
:attr:`fedray.UploadContext.participants` and ``shared_seed``; an upload without them is refused in one line.

**Training updates.** The server sums a round's updates weighted, Σ_k w_k · Δ_k (FedAvg: w_k = n_k), in float32,
which cannot add ring elements exactly. secagg asks for exact sums (:attr:`fedray.Postprocessor.exact_sum`): each
update reaches it as w_k · Δ_k in float64 (every entry: SCAFFOLD's control variates and FedNova's step counts alike),
is clipped to [−C, C] (so C bounds the *weighted* update's entries), quantized and masked as below, and added as it
is; the server decodes the sum, divides it by Σ w_k over the survivors (the weights a real deployment would append to
the masked vector: the server learns the same number), and the training loop casts it back to float32. A dropped
client's weight does not reach the server either.

**Checked before the run** (:meth:`SecureAggregation.start`): every stage's largest aggregate must fit the ring
(and float64's exact integers), its smallest must give each client at least t neighbours (a group of one, whose
sum is its upload, is refused), and SecAgg+'s k must be below the largest group; one line, nothing run or written.
Where only the run's draws tell the smallest group (a closed form sampled with replacement), each group is checked
as it forms. Poisson sampling (``--sampling poisson``) is refused: its rounds may be empty or smaller than t + 1.

**Dropouts.** Each participant drops, independently with probability ``secagg_dropout`` (drawn once per group
from its shared seed), after the masks are agreed and before its masked upload: it sends zeros (nothing to the
sum). The server then removes the survivors' self-masks and, for each dropped client j, its pairwise masks
with its surviving neighbours, as it would from the seeds it reconstructs from the shares held by j's
neighbours: a participant's seeds can be reconstructed when at least t (``secagg_threshold``, by default a
majority of a client's neighbours) of its neighbours survive; when one cannot, the server cannot unmask the
sum and the run stops in one line naming the round (real SecAgg aborts that round). The rows count what the
server received (:meth:`SecureAggregation.dropped` tells the engine who drops): a dropped client's upload is not
in ``clients_seen``, ``samples_seen``, ``bytes_up`` nor the papers' communication columns; it sent none of its
vector, and its protocol messages before dropping (keys, shares) are SecAgg's overhead, in the cost model's
columns below. What it computed and received (``flops_client_avg``, ``macs_client_avg_fed3r``,
``forward_passes``, ``bytes_down``) counts as in a plain run.

**Exactness through a float sum.** fedray's server adds uploads as floats (float64 for closed-form statistics).
The masked integers are held in float64: their sum, below n · 2^b, is exact while n · 2^b ≤ 2^53, which is
checked (b ≤ 53 − ⌈log₂ n⌉); the server reduces it mod 2^b in uint64 and unmasks there, so the unmasked sum is
the plain sum of the survivors' quantized integers bit for bit (``tests/postprocessors/test_secagg.py``). Only
float64 uploads added by the server are accepted: an upload with integer tensors is refused in one line. FedCOF's
is, before the run (its ``uploads_summed`` is False): its server estimates the class covariances from each client's
own class means, rows it keeps side by side (with their integer class indices), never adds, so no secure sum can
carry them; fedcof-oracle's uploads are sums.

**Masks at scale.** The client hooks run in the shards, per aggregate, for its uploaders only. Generated, a client
expands k + 1 masks of m values (all n − 1 pairs for SecAgg), raw Philox words added mod 2^64 in place and reduced
mod 2^b once; the server expands one per survivor (and the dropped clients' pairs). Modelled, each value is rounded
on its own and a zero stays 0 (:attr:`entrywise`): where the method gives compact statistics
(:meth:`fedray.ClosedFormMethod.compact_statistics`: Fed3R, FedNCM), a client's upload is computed, rounded and added
only at the classes it holds (Fed3R: its ZᵀZ and its classes' columns of ZᵀY, not d·C;
:mod:`fedray.runtime.compact_sum`), a chunk of a shard's clients rounded in one call (:meth:`entry_maps`), the same
sum bit for bit; other methods' uploads go through :meth:`client` whole. Secure aggregation still needs each
client's statistics on its own, not one GEMM per shard: that, not the masks, is what a modelled run pays beyond a
plain one (``python -m jobs.bench_secagg``).

**Cost model** (:func:`fedray.clock.secagg_costs.secagg_costs`, reported by the aggregate, columns of
metrics.parquet, for the group of the row's last block or round, the same whether the masks are modelled or
generated): what a surviving participant sends, in bytes, by Bonawitz et al.'s four rounds with d neighbours
(n − 1, or k): ``secagg_key_bytes`` its two public keys (2 · 32), ``secagg_share_bytes`` its encrypted shares of
its two secrets to each neighbour and one share per neighbour at unmasking (3 · 32 · d), ``secagg_masked_bytes``
its masked vector (⌈m · b / 8⌉ for m values), and their sum ``secagg_bytes_per_participant``; what it receives,
``secagg_down_bytes_per_participant`` (its neighbours' keys and the shares addressed to it, 4 · 32 · d); the mask
words it expands, ``secagg_mask_words_per_participant`` ((d + 1) · m); the round trips it makes beyond a plain
upload, ``secagg_round_trips`` (3: AdvertiseKeys, ShareKeys, Unmasking); the server's work,
``secagg_server_reconstructions`` (one secret per participant: a survivor's self-mask seed, a dropped client's key)
and ``secagg_server_prg_values`` (the mask values it expands: m per survivor plus m per surviving neighbour of each
dropped client, O(m n²) for SecAgg, O(m n k) for SecAgg+); and ``secagg_dropped``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Annotated, Literal, get_args

import numpy as np

import fedray
from fedray.core.lazy_modules import lazy_module
from fedray.clock.costs import TaskCost
from fedray.clock.secagg_costs import KEY_BYTES, secagg_costs
from fedray.core.options import Option

torch = lazy_module("torch", globals())

RING_BITS_MAX = 53
"""float64 holds every integer below 2^53: a group's masked sum must stay below it."""
Masks = Literal["model", "generate"]
"""``secagg_masks``: the masks' effect computed (the survivors' quantized sum) or the masks drawn and cancelled."""


class SecureAggregation(fedray.Postprocessor):
    """SecAgg / SecAgg+: each upload quantized into Z_{2^b} and masked; the server unmasks the survivors' sum exactly."""

    flags = (Option("secure_aggregation", bool, False, "uploads summed by secure aggregation (SecAgg, SecAgg+ with "
                    "--option secagg_neighbours=k), simulated exactly: --postprocessor secagg added last; its options "
                    "secagg_clip (required), secagg_bits, secagg_value_bits, secagg_dropout, secagg_threshold as "
                    "--option key=value"),)
    added_last = True

    def __init__(self, secagg_clip: Annotated[float | None, "the clipping range C: each value clipped to [−C, C] "
                                                           "before quantization (> 0; required)"] = None,
                 secagg_bits: Annotated[int | None, "b: the ring Z_2^b the masked sums live in (1 to 53; by default "
                                                    "the largest whose n-fold sum float64 holds exactly)"] = None,
                 secagg_value_bits: Annotated[int | None, "v: the bits of each quantized value (2 ≤ v ≤ b; by "
                                                         "default the most that fit the group's sum)"] = None,
                 secagg_dropout: Annotated[float, "the probability that a participant drops before sending "
                                                  "(0 ≤ p < 1)"] = 0.0,
                 secagg_threshold: Annotated[int | None, "t: the surviving neighbours needed to reconstruct a "
                                                         "client's seeds (≥ 1; by default a majority)"] = None,
                 secagg_neighbours: Annotated[int | None, "k: SecAgg+'s neighbours per client in a k-regular graph "
                                                          "(even, ≥ 2; by default all pairs: SecAgg)"] = None,
                 secagg_masks: Annotated[Masks,
                                         "model: the server gets the survivors' quantized sum, the masks' cost "
                                         "reported, not paid; generate: each client's masks drawn and cancelled "
                                         "(the same sum, bit for bit)"] = "model") -> None:
        super().__init__()
        if secagg_clip is None or not 0 < secagg_clip < math.inf:
            raise ValueError(f"option secagg_clip is required and must be a finite number > 0 (the range [−C, C] "
                             f"each value is clipped to), got {secagg_clip}")
        if secagg_bits is not None and not 1 <= secagg_bits <= RING_BITS_MAX:
            raise ValueError(f"option secagg_bits must be from 1 to {RING_BITS_MAX}, got {secagg_bits}")
        if secagg_value_bits is not None and not 2 <= secagg_value_bits <= (secagg_bits or RING_BITS_MAX):
            raise ValueError(f"option secagg_value_bits must be from 2 to secagg_bits={secagg_bits or RING_BITS_MAX}, "
                             f"got {secagg_value_bits}")
        if not 0 <= secagg_dropout < 1:
            raise ValueError(f"option secagg_dropout must be in [0, 1), got {secagg_dropout}")
        if secagg_threshold is not None and secagg_threshold < 1:
            raise ValueError(f"option secagg_threshold must be ≥ 1, got {secagg_threshold}")
        if secagg_neighbours is not None and (secagg_neighbours < 2 or secagg_neighbours % 2):
            raise ValueError(f"option secagg_neighbours must be even and ≥ 2, got {secagg_neighbours}")
        if secagg_masks not in get_args(Masks):
            raise ValueError(f"option secagg_masks must be model or generate, got {secagg_masks!r}")
        self.clip, self.bits, self.value_bits = float(secagg_clip), secagg_bits, secagg_value_bits
        self.dropout, self.threshold, self.neighbours = secagg_dropout, secagg_threshold, secagg_neighbours
        self.generate = secagg_masks == "generate"
        self._group: Group | None = None

    def __getstate__(self) -> dict:
        """Without the cached :class:`Group`: a copy sent to the shards makes its own, once a group."""
        return {**self.__dict__, "_group": None}

    @property
    def per_client(self) -> bool:
        return True

    @property
    def exact_sum(self) -> bool:
        """The masked ring elements must be added exactly: a training update reaches :meth:`client` as w_k · Δ_k in
        float64 and is summed as it is."""
        return True

    def start(self, stages: tuple[fedray.StageUploads, ...]) -> None:
        """Refuse, before any work, a run with a stage whose aggregates the ring or the threshold cannot serve: its
        largest group's sum could overflow the ring, its smallest group leaves a client fewer neighbours than t, or
        SecAgg+'s k neighbours are more than a group holds. A stage whose smallest group only its draws tell (a closed
        form sampled with replacement) is checked as each group forms. A stage whose uploads the server sees client
        by client (FedCOF's mean rows) is refused: no secure sum carries them."""
        for told in stages:
            if not told.summed:
                raise ValueError(f"the {told.stage} stage's uploads (like fedcof's mean rows) are kept side by side "
                                 f"by the server, never added, so no secure sum carries them (fedcof-oracle's "
                                 f"statistics are sums)")
            largest = f"the {told.stage} stage's aggregates of up to {told.group} uploads"
            _, _, problem = self.ring(told.group)
            if problem is not None:
                raise ValueError(f"{largest}: {problem}")
            if self.neighbours is not None and self.neighbours >= told.group:
                raise ValueError(f"{largest}: secagg_neighbours={self.neighbours} is more than a client's "
                                 f"{told.group - 1} others: leave it out for all pairs (SecAgg)")
            if told.sampling.poisson:
                raise ValueError(f"the {told.stage} stage samples clients by --sampling poisson: each round holds a "
                                 f"random number of them, which can be none or fewer than the secagg_threshold + 1 a "
                                 f"group needs to be unmasked (real SecAgg aborts such a round); use --sampling "
                                 f"without or with (κ = --clients-per-round clients every round)")
            if told.smallest_group is not None:
                _, problem = self.graph(told.smallest_group)
                if problem is not None:
                    raise ValueError(f"the {told.stage} stage's smallest aggregate of {told.smallest_group} uploads: "
                                     f"{problem}")

    def ring(self, n: int) -> tuple[int, int, str | None]:
        """A group of ``n``'s ring bits b and value bits v, and why they cannot serve it (None: they can)."""
        bits = self.bits if self.bits is not None else RING_BITS_MAX - math.ceil(math.log2(n))
        if n << bits > 1 << RING_BITS_MAX:
            return bits, 0, (f"their masked sum reaches {n} · 2^{bits}, beyond float64's exact integers "
                             f"(2^{RING_BITS_MAX}): set secagg_bits ≤ {RING_BITS_MAX - math.ceil(math.log2(n))}")
        fitting = ((1 << bits) - 1) // n  # the largest per-client integer whose n-fold sum fits the ring
        value_bits = self.value_bits if self.value_bits is not None else (fitting + 1).bit_length() - 1
        if value_bits < 2 or n * ((1 << value_bits) - 1) > (1 << bits) - 1:
            return bits, value_bits, (f"their sum of {value_bits}-bit values can reach {n} · (2^{value_bits} − 1), "
                                      f"which overflows the ring Z_2^{bits}: set secagg_value_bits ≤ "
                                      f"{(fitting + 1).bit_length() - 1} or raise secagg_bits")
        return bits, value_bits, None

    def degree(self, n: int) -> int:
        """A participant's neighbours in a group of ``n``: every other one (SecAgg), or k (SecAgg+) where k < n − 1."""
        return n - 1 if self.neighbours is None or self.neighbours >= n - 1 else self.neighbours

    def protocol_cost(self, participants: int, values: int) -> TaskCost | None:
        """A surviving participant's part of the protocol in a group of ``participants``
        (:mod:`fedray.clock.secagg_costs`): the masks it expands, its neighbours' keys and the shares addressed to it, and its keys, shares and masked
        vector sent in place of its plain upload; None for a group of one (refused when it forms)."""
        if participants < 2:
            return None
        degree = self.degree(participants)
        costs = secagg_costs(values, self.ring(participants)[0], degree, np.ones(1, dtype=bool), np.array([degree]))
        return TaskCost(float(costs.macs[0]), float(costs.down_bytes[0]), float(costs.up_bytes[0]))

    def graph(self, n: int) -> tuple[int, str | None]:
        """A group of ``n``'s threshold t, and why no client's seeds could be reconstructed (None: they can): a
        client's neighbours (n − 1, or k) must be ≥ t, so a group of one is refused (its sum is its upload)."""
        degree = self.degree(n)
        threshold = self.threshold if self.threshold is not None else degree // 2 + 1
        if threshold > degree:
            needs = " (a group needs ≥ t + 1 participants)" if degree == n - 1 else ""
            return threshold, (f"secagg_threshold={threshold} is more than a client's {degree} neighbours: no "
                               f"client's seeds could ever be reconstructed{needs}")
        return threshold, None

    def dropped(self, context: fedray.UploadContext) -> list[int]:
        """The participants that drop (:attr:`Group.dropped`): the rows count only the survivors' uploads."""
        if self.dropout == 0 or not context.participants:
            return []
        lost = dropouts(context.shared_seed, len(context.participants), self.dropout)
        return [client for client, gone in zip(context.participants, lost) if gone]

    def group(self, context: fedray.UploadContext) -> Group:
        """The group ``context``'s upload is summed in, made once for all its uploads in this process (a group's
        draws cost O(n): made for each of its n clients, they would cost O(n²))."""
        known = self._group
        if known is None or known.seed != context.shared_seed or not (
                known.participants is context.participants or known.participants == context.participants):
            known = self._group = Group(self, context)
        return known

    def client(self, upload: fedray.Upload, context: fedray.UploadContext) -> fedray.Upload:
        group = self.group(context)
        names = _float64_names(upload.tensors, f"client {context.client}")
        if group.dropped[group.position(context.client)]:  # nothing reaches the server: not its values, its weight
            return fedray.Upload({name: torch.zeros_like(tensor) for name, tensor in upload.tensors.items()}, 0.0)
        if not self.generate:  # what the masks leave once they cancel: its integers, centred, exact in float64
            return fedray.Upload({name: group.centred(upload.tensors[name]) for name in names}, upload.weight)
        values = _flat(upload.tensors, names)
        masked = group.quantize(values).view(np.uint64)  # added mod 2^64, reduced mod 2^b once: 2^b divides 2^64
        masked += group.self_mask(context.client, len(values))
        for other in group.neighbours(group.position(context.client)):
            group.add_pair_mask(masked, context.client, other)
        masked &= np.uint64(group.ring_mask)
        return fedray.Upload(_unflat(upload.tensors, names, masked.astype(np.float64)), upload.weight)

    @property
    def entrywise(self) -> bool:
        """With modelled masks a client's upload is quantized value by value, a zero staying 0 (:meth:`entry_map`):
        the shards hand it only a client's statistics at the classes it holds."""
        return not self.generate

    def entry_map(self, context: fedray.UploadContext) -> Callable[[torch.Tensor], torch.Tensor]:
        """:meth:`client` with modelled masks, value by value: a survivor's centred integers, a dropped client's 0."""
        group = self.group(context)
        return torch.zeros_like if group.dropped[group.position(context.client)] else group.rounded

    def entry_maps(self, contexts: list[fedray.UploadContext]) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        """:meth:`entry_map` of many clients in one rounding, the dropped clients' values then set to 0."""
        group = self.group(contexts[0])
        dropped = torch.from_numpy(group.dropped[group.positions([context.client for context in contexts])])

        def mapped(values: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
            rounded = group.rounded(values)
            if dropped.any():
                rounded[torch.repeat_interleave(dropped, counts)] = 0.0
            return rounded

        return mapped

    def aggregate(self, total: fedray.Params, context: fedray.UploadContext) -> fedray.Params:
        """The survivors' quantized sum decoded: with generated masks, the ring's sum unmasked by the survivors'
        self-masks and their pairwise masks with the dropped; with modelled ones, the sum as it arrived (the survivors'
        integers, exact in float64, never wrapping the ring: checked)."""
        group = self.group(context)
        names = _float64_names(total, "the aggregate")
        values = _flat(total, names)
        group.check_recoverable(context.round)
        fedray.report(**group.costs(len(values)))
        if not self.generate:  # Σ (q_i − h) over the survivors: S − s·h
            return _unflat(total, names, values.astype(np.int64).astype(np.float64) * group.step)
        sums = values.astype(np.uint64)
        for position, client in enumerate(group.participants):
            if not group.dropped[position]:
                sums -= group.self_mask(client, len(sums))
                continue
            for other in group.neighbours(position):  # the survivors' masks with a dropped client, from its seeds
                if not group.dropped[group.position(other)]:
                    group.add_pair_mask(sums, other, client, subtract=True)
        sums &= np.uint64(group.ring_mask)
        survivors = int((~group.dropped).sum())
        return _unflat(total, names, (sums.astype(np.int64) - survivors * group.half_range).astype(np.float64)
                       * group.step)


class Group:
    """The clients summed into one aggregate and what they agree on: the graph, the dropouts, the quantization."""

    def __init__(self, secagg: SecureAggregation, context: fedray.UploadContext) -> None:
        if not context.participants:
            raise fedray.FedrayError("--postprocessor secagg: this stage does not tell the postprocessors which clients "
                                     "are summed together (training rounds, TCT); secagg applies to closed-form methods")
        self.participants = context.participants
        self.sorted_participants = np.asarray(self.participants, dtype=np.int64)
        n = len(self.participants)
        where = f"--postprocessor secagg: round {context.round}, {n} participants"
        bits, value_bits, problem = secagg.ring(n)
        self.threshold, unreachable = secagg.graph(n)
        if problem is not None or unreachable is not None:
            raise fedray.FedrayError(f"{where}: {problem or unreachable}")
        self.seed, self.bits, self.ring_mask = context.shared_seed, bits, (1 << bits) - 1
        self.half_range = (1 << (value_bits - 1)) - 1  # h: the integer 0 is sent as
        self.clip, self.step = secagg.clip, secagg.clip / self.half_range
        self.degree = secagg.degree(n)
        self.half = None if self.degree == n - 1 else self.degree // 2
        order = self._generator(2).permutation(n)
        self.ring_order, self.ring_place = order, np.argsort(order)  # SecAgg+'s Harary graph: ring positions
        self.dropped = dropouts(self.seed, n, secagg.dropout)

    def position(self, client: int) -> int:
        """Where ``client`` is among the (sorted) participants; one line when it is not one of them."""
        return int(self.positions([client])[0])

    def positions(self, clients: list[int]) -> np.ndarray:
        """Where ``clients`` are among the (sorted) participants; one line naming the first that is not one of them."""
        clients = np.asarray(clients, dtype=np.int64)
        positions = np.searchsorted(self.sorted_participants, clients)
        found = positions < len(self.participants)
        found[found] = self.sorted_participants[positions[found]] == clients[found]
        if not found.all():
            raise fedray.FedrayError(f"--postprocessor secagg: client {clients[~found][0]} uploads into an aggregate of "
                                     f"{len(self.participants)} participants it is not one of")
        return positions

    def neighbours(self, position: int) -> list[int]:
        """The clients that share pairwise masks with the participant at ``position``."""
        n = len(self.participants)
        if self.half is None:
            return [client for other, client in enumerate(self.participants) if other != position]
        place = self.ring_place[position]
        return [self.participants[self.ring_order[(place + step) % n]]
                for step in (*range(-self.half, 0), *range(1, self.half + 1))]

    def surviving_neighbours(self) -> np.ndarray:
        """How many of each participant's neighbours survive: who hold the shares of its seeds."""
        alive = (~self.dropped).astype(np.int64)
        if self.half is None:
            return alive.sum() - alive
        n = len(self.participants)
        alive_on_ring = alive[self.ring_order]  # the participant at each place of SecAgg+'s ring
        steps = (*range(-self.half, 0), *range(1, self.half + 1))
        return sum(alive_on_ring[(self.ring_place + step) % n] for step in steps)

    def check_recoverable(self, round_number: int) -> None:
        """That every participant has ≥ t surviving neighbours, else one line naming the first that has not."""
        alive = self.surviving_neighbours()
        short = np.flatnonzero(alive < self.threshold)
        if len(short):
            position = int(short[0])
            what = "dropped" if self.dropped[position] else "survived"
            raise fedray.FedrayError(f"--postprocessor secagg: round {round_number}: client "
                                     f"{self.participants[position]} {what} with only {alive[position]} surviving "
                                     f"neighbours, fewer than secagg_threshold={self.threshold}: the server cannot "
                                     f"unmask the sum ({int(self.dropped.sum())} of {len(self.participants)} dropped)")

    def costs(self, size: int) -> dict[str, float]:
        """The cost model's columns for a vector of ``size`` values (:func:`fedray.clock.secagg_costs.secagg_costs`):
        what a surviving participant sends and expands, what the server expands and reconstructs."""
        costs = secagg_costs(size, self.bits, self.degree, ~self.dropped, self.surviving_neighbours())
        survivor = int(np.argmin(self.dropped))  # one that sent its vector (some did: the sum could be unmasked)
        sent = int(costs.up_bytes[survivor])
        return {"secagg_masked_bytes": costs.masked_bytes, "secagg_key_bytes": 2 * KEY_BYTES,
                "secagg_share_bytes": sent - costs.masked_bytes - 2 * KEY_BYTES, "secagg_bytes_per_participant": sent,
                "secagg_down_bytes_per_participant": int(costs.down_bytes[survivor]),
                "secagg_mask_words_per_participant": int(costs.mask_words[survivor]),
                "secagg_round_trips": int(costs.round_trips[survivor]),
                "secagg_dropped": int(self.dropped.sum()),
                "secagg_server_prg_values": costs.server_mask_words,
                "secagg_server_reconstructions": costs.server_reconstructions}

    def quantize(self, values: np.ndarray) -> np.ndarray:
        return np.rint(np.clip(values, -self.clip, self.clip) / self.step).astype(np.int64) + self.half_range

    def centred(self, tensor: torch.Tensor) -> torch.Tensor:
        """:meth:`quantize`'s integers less h, rint(clip(x) / Δ) in [−h, h], as a new float64 tensor (exact): a zero
        stays 0, so only the nonzero values are computed (a sparse upload such as ZᵀY costs its nonzeros)."""
        values = tensor.detach().cpu().numpy().reshape(-1)
        centred = np.zeros(len(values))
        support = np.flatnonzero(values)
        centred[support] = np.rint(np.clip(values[support], -self.clip, self.clip) / self.step)
        return torch.from_numpy(centred).reshape(tensor.shape)

    def rounded(self, values: torch.Tensor) -> torch.Tensor:
        """:meth:`centred`'s integers, rint(clip(x) / Δ), for values that are mostly nonzero (a client's statistics at
        the classes it holds): every value rounded, the same bits (round half to even, as ``np.rint``)."""
        return values.clamp(-self.clip, self.clip).div_(self.step).round_()

    def _generator(self, *key: int) -> np.random.Generator:
        """The group's stream ``key`` (1: dropouts, 2: the ring order, 3 and 4: masks), Philox from the shared seed."""
        return np.random.Generator(np.random.Philox(np.random.SeedSequence((self.seed, *key))))

    def _expand(self, key: tuple[int, ...], size: int) -> np.ndarray:
        """The mask ``key``: ``size`` raw 64-bit Philox words (uniform; taken mod 2^b when the sum is reduced), the
        group's stream ``key`` (counter-based: a word costs the same wherever it is in the stream)."""
        return np.random.Philox(np.random.SeedSequence((self.seed, *key))).random_raw(size)

    def self_mask(self, client: int, size: int) -> np.ndarray:
        return self._expand((4, client), size)

    def add_pair_mask(self, values: np.ndarray, client: int, other: int, subtract: bool = False) -> None:
        """Add to ``values`` (uint64, in place, mod 2^64) what ``client`` adds for its pair with ``other``: +m when it
        is the lower number, −m otherwise (the opposite with ``subtract``)."""
        low, high = min(client, other), max(client, other)
        mask = self._expand((3, low, high), len(values))
        if (client == low) != subtract:
            values += mask
        else:
            values -= mask


def dropouts(seed: int, n: int, rate: float) -> np.ndarray:
    """Which of a group's ``n`` participants drop: one U[0, 1) draw each, below ``rate``, from the group's stream 1 of
    its shared ``seed``."""
    return np.random.Generator(np.random.Philox(np.random.SeedSequence((seed, 1)))).random(n) < rate


def _float64_names(tensors: fedray.Params, where: str) -> list[str]:
    """The upload's tensor names, sorted; one line when one is not float64."""
    names = sorted(tensors)
    for name in names:
        if tensors[name].dtype != torch.float64:
            raise fedray.FedrayError(f"--postprocessor secagg: {where}'s {name!r} is {tensors[name].dtype}: secagg masks "
                                     f"float64 uploads the server adds (statistics, weighted training updates), not "
                                     f"integer tensors (FedCOF's class means are kept side by side, never added: "
                                     f"fedcof-oracle's statistics are sums)")
    return names


def _flat(tensors: fedray.Params, names: list[str]) -> np.ndarray:
    """The tensors ``names`` as one new float64 vector, in that order."""
    if not names:
        return np.zeros(0)
    return torch.cat([tensors[name].detach().reshape(-1).cpu() for name in names]).numpy()


def _unflat(template: fedray.Params, names: list[str], values: np.ndarray) -> fedray.Params:
    out, start = {}, 0
    for name in names:
        tensor = template[name]
        out[name] = torch.from_numpy(values[start:start + tensor.numel()].copy()).reshape(tensor.shape)
        start += tensor.numel()
    return out
