from pathlib import Path

import numpy as np
import pytest

from fedray.clock.availability import AlwaysAvailable, Availability
from fedray.clock.availability_specs import availability_from_spec
from fedray.clock.diurnal import DiurnalAvailability
from fedray.clock.markov import MarkovAvailability
from fedray.clock.traces import TraceAvailability
from fedray.core.errors import FedrayError

TRACES = "trace_id,start_s,end_s\n" + "".join(f"{i},{10 * i},{10 * i + 30}\n" for i in range(20))


def test_specs_build_their_models_with_the_runs_seed(tmp_path):
    (tmp_path / "t.csv").write_text(TRACES)
    assert availability_from_spec("always", seed=3) == AlwaysAvailable()
    assert availability_from_spec("markov:600,1800.5", seed=3) == MarkovAvailability(600.0, 1800.5, seed=3)
    assert availability_from_spec("diurnal:86400,0.25", seed=3) == DiurnalAvailability(86400.0, 0.25, seed=3)
    traces = availability_from_spec(f"trace:{tmp_path / 't.csv'}", seed=3)
    assert isinstance(traces, TraceAvailability) and (traces.trace_file, traces.seed) == (str(tmp_path / "t.csv"), 3)
    assert traces.traces.num_traces == 20


def test_a_trace_files_path_may_hold_commas_and_colons(tmp_path):
    (tmp_path / "a,b:c.csv").write_text(TRACES)
    assert availability_from_spec(f"trace:{tmp_path / 'a,b:c.csv'}", seed=0).traces.num_traces == 20


@pytest.mark.parametrize("spec, message", [
    ("sometimes", "--availability: unknown model 'sometimes' .one of always, markov:ON_S,OFF_S, diurnal:PERIOD_S,DUTY, "
                  "trace:FILE."),
    ("markov", "--availability: markov is spelled markov:ON_S,OFF_S, got 'markov'"),
    ("markov:60", "--availability: markov is spelled markov:ON_S,OFF_S, got 'markov:60'"),
    ("markov:60,", "--availability: markov is spelled markov:ON_S,OFF_S"),
    ("diurnal:1,2,3", "--availability: diurnal is spelled diurnal:PERIOD_S,DUTY"),
    ("always:1", "--availability: always is spelled always, got 'always:1'"),
    ("trace:", "--availability: trace is spelled trace:FILE"),
    ("markov:a,60", "--availability markov:a,60: option markov_on_s must be a number, got 'a'"),
    ("markov:60,inf", "--availability markov:60,inf: option markov_off_s must be a finite number"),
    ("markov:60,0", "--markov-off-s must be > 0, got 0.0"),
    ("diurnal:86400,1.5", r"--diurnal-duty must be in \(0, 1\)"),
])
def test_bad_specs_are_refused(spec, message):
    with pytest.raises(FedrayError, match=message):
        availability_from_spec(spec, seed=0)


def built(spec: str, folder: Path) -> Availability:
    if spec == "trace":
        (folder / "t.csv").write_text(TRACES)
        spec = f"trace:{folder / 't.csv'}"
    return availability_from_spec(spec, seed=1)


@pytest.mark.parametrize("spec", ["markov:60,140", "diurnal:100,0.3", "trace"])
def test_lookups_do_not_depend_on_their_order_or_company(spec, tmp_path):
    model = built(spec, tmp_path)
    rng = np.random.default_rng(5)
    clients = rng.integers(0, 10**6, size=400)
    times = rng.uniform(0, 1e5, size=400)
    lookups = (model.available, model.next_available, model.online_until)
    together = [lookup(clients, times) for lookup in lookups]
    order = rng.permutation(400)
    model.available(clients[::-1], 3e5)  # an earlier lookup elsewhere changes nothing
    shuffled = [lookup(clients[order], times[order]) for lookup in lookups]
    alone = [[lookup(clients[i : i + 1], times[i : i + 1])[0] for i in range(0, 400, 37)] for lookup in lookups]
    for whole, permuted, one_by_one in zip(together, shuffled, alone):
        assert np.array_equal(whole[order], permuted)
        assert whole[::37].tolist() == one_by_one


@pytest.mark.parametrize("spec", ["always", "markov:600,1800", "diurnal:86400,0.3", "trace"])
def test_a_million_clients_cost_a_build_and_lookups_of_a_thousand(spec, tmp_path):
    model = built(spec, tmp_path)
    model.check_rounds_can_fill(1000, 10**6)
    chosen = np.random.default_rng(0).choice(10**6, size=1000, replace=False)
    start = model.next_available(chosen, 5000.0)
    finish = start + np.random.default_rng(1).exponential(300.0, size=1000)
    assert model.available(chosen, start).all()
    assert model.stays_available(chosen, start, finish).sum() > 0


@pytest.mark.parametrize("spec", ["markov:60,140", "diurnal:100,0.3", "diurnal:0.7,0.9", "trace"])
def test_the_lookups_agree_with_one_another(spec, tmp_path):
    """next_available gives a moment ``available`` finds online, online_until one it finds offline, and the client is
    online just before it."""
    model = built(spec, tmp_path)
    rng = np.random.default_rng(2)
    clients = rng.integers(0, 10**6, size=3000)
    times = rng.uniform(0, 1e4, size=3000)
    start = model.next_available(clients, times)
    assert np.all(start >= times) and model.available(clients, start).all()
    end = model.online_until(clients, start)
    assert np.all(end > start) and not model.available(clients, end).any()
    assert model.available(clients, np.nextafter(end, -np.inf)).all()
