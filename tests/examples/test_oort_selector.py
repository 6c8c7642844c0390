"""The Oort-style selector of examples/oort_selector.py, a plugin on the public API: by hand on a small history,
against a plain reference written out below, and in a run on the clock, where round 2 ranks round 1's clients by the
utilities of the losses they measured."""

import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

import fedray
from fedray.core.options import options_of
from fedray.core.plugins import load_class
from fedray.data.registry import load_federation
from fedray.engine.config import RunConfig
from fedray.engine.run_config import run
from fedray.methods.training.local import random_head

SPEC = f"{Path(__file__).resolve().parents[2] / 'examples' / 'oort_selector.py'}:Oort"


@pytest.fixture(scope="module")
def oort():
    return load_class(SPEC, fedray.Selector, {}, "selector")


class ThirdOffline:
    """Client c is offline at time t when (c + t) is a multiple of 3."""

    def available(self, clients, t):
        return (clients + int(t)) % 3 != 0


def small_history():
    """Ten clients; 0..5 have uploaded (utility, duration): known durations 5, 10, 10, 20, 40, 80."""
    history = fedray.ClientHistory(10)
    history.record(np.arange(6), round=0, duration_s=np.array([10.0, 40.0, 20.0, 5.0, 80.0, 10.0]),
                   utility=np.array([4.0, 9.0, 6.0, 1.0, 8.0, 5.0]))
    return history


def context(round, wanted, history, availability=None):
    num_clients = len(history.rounds)
    return fedray.RoundContext(round=round, start_s=float(round), per_round=wanted, wanted=wanted,
                               num_clients=num_clients, seed=4, scheduled=np.arange(wanted), history=history,
                               availability=availability)


def test_by_hand_the_slow_are_penalised_against_the_30th_percentile_duration(oort):
    # T = the sorted durations' entry ⌊6 · 0.3⌋ = 1: 10 s. Slower clients × (10 / t)²: 1 → 9/16, 2 → 6/4, 4 → 8/64.
    # The ranking: 5 (5.0), 0 (4.0), 2 (1.5), 3 (1.0), 1 (0.5625), 4 (0.125).
    # Round 40: ε = 0.9 · 0.98⁴¹ = 0.393; of 5 clients ⌊1.97⌋ = 1 explores, 4 exploit.
    picked = oort().select(context(40, 5, small_history()))
    assert picked[:4].tolist() == [5, 0, 2, 3]
    assert len(picked) == 5 and picked[4] in (6, 7, 8, 9)


def test_by_hand_early_rounds_explore_and_a_short_side_is_filled_by_the_other(oort):
    # Round 0: ε = 0.882; of 5, ⌊4.41⌋ = 4 explore (all four never-heard-from clients), 1 exploits.
    picked = oort().select(context(0, 5, small_history()))
    assert picked[0] == 5 and sorted(picked[1:].tolist()) == [6, 7, 8, 9]
    # Of 8, 7 would explore, but only 4 can: the other 4 exploit.
    picked = oort().select(context(0, 8, small_history()))
    assert picked[:4].tolist() == [5, 0, 2, 3] and sorted(picked[4:].tolist()) == [6, 7, 8, 9]


def test_with_equal_utilities_the_lower_id_ranks_first(oort):
    history = small_history()
    history.utility[5] = 4.0  # ties with client 0
    assert oort().select(context(100, 4, history))[:3].tolist() == [0, 5, 2]


def reference(history, online, wanted, round, alpha=2.0, threshold=30.0, start=0.9, decay=0.98, floor=0.3):
    """Oort as the example states it, one client at a time: (the exploiting clients in order, how many explore, the
    clients exploration may pick)."""
    clients = range(len(history.rounds))
    known = sorted(d for d in history.duration_s.tolist() if not math.isnan(d))
    preferred = known[min(int(len(known) * threshold / 100), len(known) - 1)] if known else math.inf
    scores = {}
    for client in clients:
        if history.rounds[client] > 0 and online[client]:
            utility = history.utility[client]
            score = 0.0 if math.isnan(utility) else float(utility)
            duration = float(history.duration_s[client])
            if duration > preferred:
                score *= (preferred / duration) ** alpha
            scores[client] = score
    unexplored = {client for client in clients if history.rounds[client] == 0 and online[client]}
    exploration = max(start * decay ** (round + 1), floor)
    exploiting = min(wanted - int(wanted * exploration), len(scores))
    exploring = min(wanted - exploiting, len(unexplored))
    exploiting = min(wanted - exploring, len(scores))
    ranked = sorted(scores, key=lambda client: (-scores[client], client))
    return ranked[:exploiting], exploring, unexplored


@pytest.mark.parametrize("round", [0, 3, 30, 200])
def test_it_matches_the_plain_reference_on_a_random_history_with_clients_offline(oort, round):
    rng = np.random.default_rng(round)
    history = fedray.ClientHistory(40)
    heard = rng.choice(40, 22, replace=False)
    utility = rng.gamma(2.0, 3.0, 22)
    utility[:3] = np.nan  # the run measured no loss for these
    history.record(heard, round=0, duration_s=rng.lognormal(3.0, 1.0, 22), utility=utility)
    availability = ThirdOffline()
    online = availability.available(np.arange(40), round)
    exploit, exploring, unexplored = reference(history, online, 9, round)
    picked = oort().select(context(round, 9, history, availability))
    assert picked[:len(exploit)].tolist() == exploit
    explored = picked[len(exploit):]
    assert len(explored) == exploring and len(set(explored.tolist())) == exploring
    assert set(explored.tolist()) <= unexplored


def test_its_options_are_the_papers_defaults_declared_for_the_command_line(oort):
    options = options_of(oort)
    assert {name: option.default for name, option in options.items()} == {
        "round_penalty": 2.0, "round_threshold": 30.0, "exploration_factor": 0.9, "exploration_decay": 0.98,
        "exploration_min": 0.3}


def test_bad_options_are_refused_in_one_line(oort):
    with pytest.raises(fedray.FedrayError, match="^--round-threshold is a percentile from 0 to 100, got 130.0$"):
        oort(round_threshold=130.0)
    with pytest.raises(fedray.FedrayError, match="^Oort needs 0 ≤ exploration_min ≤ exploration_factor ≤ 1"):
        oort(exploration_min=0.95)


TINY = "synthetic:inat-user-120k?dim=16&scale=0.005&classes=10&seed=3"  # 46 clients, d = 16, 10 classes
RUN = {"method": "fedavg", "dataset": TINY, "seed": 5, "clients_per_round": 5, "num_shards": 2, "cpus_per_shard": 0.5,
       "quiet": True, "selector": SPEC}


def test_in_a_run_round_2_exploits_the_utilities_of_the_losses_round_1_measured(ray_session, tmp_path):
    """Exploration off (ε = 0) and no penalty (α = 0): round 1 draws 5 clients never heard from, round 2 ranks them by
    Oort's |B| · sqrt(mean loss²) of their samples at the head round 1 started from (the run's random head), written
    out here in float64 and ranked by the plain reference above."""
    options = {"round_penalty": 0.0, "exploration_factor": 0.0, "exploration_min": 0.0}
    completed = run(RunConfig(out=str(tmp_path / "run"), rounds=2, eval_every=2, options=options, **RUN))
    federation = load_federation(TINY)
    first = completed.rounds[0]
    sample_ids, labels, offsets = federation.train_arrays(0, federation.num_clients)
    features = federation.require_features().features("train", sample_ids).numpy().astype(np.float64)
    head = random_head(federation.dim, federation.num_classes, seed=5)
    weight, bias = head["weight"].numpy().astype(np.float64), head["bias"].numpy().astype(np.float64)
    history = fedray.ClientHistory(federation.num_clients)
    utility = []
    for client in first.tolist():
        losses = []
        for row in range(offsets[client], offsets[client + 1]):
            logits = features[row] @ weight + bias
            losses.append(math.log(sum(math.exp(z) for z in logits)) - logits[labels[row]])
        utility.append(len(losses) * math.sqrt(sum(loss * loss for loss in losses) / len(losses)))
    history.record(first, round=1, duration_s=np.ones(len(first)), utility=np.array(utility))
    exploit, exploring, _ = reference(history, np.ones(federation.num_clients, dtype=bool), 5, 2, alpha=0.0,
                                      start=0.0, floor=0.0)
    assert exploring == 0 and sorted(exploit) == sorted(first.tolist())
    assert exploit != sorted(exploit)  # ranked by utility, not by id as when no loss is measured
    assert completed.rounds[1].tolist() == exploit


class Interrupted(Exception):
    pass


def test_a_resumed_run_selects_from_the_utilities_its_checkpoint_kept(ray_session, tmp_path):
    """Two of each round's five explore, three exploit: the rounds after the checkpoint rank the clients by the
    utilities measured before it, as in the run that never stopped."""
    config = RunConfig(rounds=4, eval_every=2, checkpoint_every=2, devices="phones",
                       options={"exploration_factor": 0.4, "exploration_min": 0.4}, **RUN)
    whole = run(replace(config, out=str(tmp_path / "whole")))

    def stop_at_round_four(point, classifier):  # before its checkpoint: the run resumes from round 2's
        if point.round == 4:
            raise Interrupted

    with pytest.raises(Interrupted):
        run(replace(config, out=str(tmp_path / "parts")), on_point=stop_at_round_four)
    resumed = run(replace(config, out=str(tmp_path / "parts")), resume=True)
    assert [row.tolist() for row in resumed.rounds] == [row.tolist() for row in whole.rounds]
    assert pq.read_table(tmp_path / "parts" / "rounds.parquet").equals(pq.read_table(tmp_path / "whole" /
                                                                                     "rounds.parquet"))
