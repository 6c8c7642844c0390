import numpy as np
import pytest

from fedray.clock.traces import TraceAvailability
from fedray.clock.streams import uniforms
from fedray.core.errors import FedrayError

SEED = 4
SPAN = 60.0
TRACES = {
    "a": [(0, 10), (20, 25), (40, 60)],  # its last interval runs into the next repetition's first
    "b": [(5, 15), (30, 31)],
    "c": [(0, 60)],  # online for ever
    "d": [(10, 20), (59, 60)],
}
CLIENTS = np.arange(50)
REPETITIONS = 8


@pytest.fixture
def trace_file(tmp_path):
    rows = sorted((start, end, name) for name, intervals in TRACES.items() for start, end in intervals)
    path = tmp_path / "traces.csv"  # the traces' rows interleaved, each trace's in order
    path.write_text("trace_id,start_s,end_s\n" + "".join(f"{name},{start},{end}\n" for start, end, name in rows))
    return path


def online_intervals(client: int) -> list[tuple[float, float]]:
    """The client's trace (⌊u · 4⌋ of the sorted ids) repeated, intervals that touch joined, listed one by one."""
    name = sorted(TRACES)[min(int(uniforms(SEED, 44, np.array([client]))[0] * 4), 3)]
    listed: list[tuple[float, float]] = []
    for repetition in range(REPETITIONS):
        for start, end in TRACES[name]:
            start, end = repetition * SPAN + start, repetition * SPAN + end
            if listed and listed[-1][1] == start:
                listed[-1] = (listed[-1][0], end)
            else:
                listed.append((start, end))
    return listed


def reference(listed: list[tuple[float, float]], t: float) -> tuple[bool, float, float]:
    """(available, next_available, online_until) at t; an interval reaching the last repetition's end never ends."""
    for start, end in listed:
        if start <= t < end:
            return True, t, np.inf if end == REPETITIONS * SPAN else end
    return False, min(start for start, _ in listed if start > t), t


def test_lookups_match_the_intervals_listed_one_by_one(trace_file):
    model = TraceAvailability(trace_file=str(trace_file), seed=SEED)
    edges = [float(r * SPAN + edge) for r in range(REPETITIONS - 2) for intervals in TRACES.values()
             for interval in intervals for edge in interval]
    inside = [edge for edge in edges if edge > 0]
    times = np.unique([0.0, 7.5, 100.25, *edges, *np.nextafter(edges, np.inf), *np.nextafter(inside, -np.inf)])
    seen = set()
    for client in CLIENTS:
        listed = online_intervals(client)
        seen.add(listed[0])
        ids = np.full(times.size, client)
        expected = [reference(listed, t) for t in times]
        assert model.available(ids, times).tolist() == [online for online, _, _ in expected]
        assert model.next_available(ids, times).tolist() == [moment for _, moment, _ in expected]
        assert model.online_until(ids, times).tolist() == [until for _, _, until in expected]
    assert len(seen) == 4  # every trace was followed by some client


def test_intervals_are_half_open_and_join_across_the_repetition(trace_file):
    model = TraceAvailability(trace_file=str(trace_file), seed=SEED)
    follows_a = CLIENTS[[online_intervals(c)[0] == (0, 10) for c in CLIENTS]][:1]
    assert model.available(follows_a, 20.0).tolist() == [True]
    assert model.available(follows_a, 25.0).tolist() == [False]
    assert model.stays_available(follows_a, 20.0, 25.0).tolist() == [True]
    assert model.stays_available(follows_a, 20.0, np.nextafter(25.0, np.inf)).tolist() == [False]
    assert model.online_until(follows_a, 45.0).tolist() == [70.0]
    assert model.stays_available(follows_a, 45.0, 70.0).tolist() == [True]


def test_the_most_clients_online_at_once_decides_whether_rounds_fill(trace_file):
    model = TraceAvailability(trace_file=str(trace_file), seed=SEED)
    listed = [online_intervals(client) for client in CLIENTS]
    moments = sorted({float(edge) for intervals in TRACES.values() for interval in intervals for edge in interval})
    most = max(sum(reference(intervals, t)[0] for intervals in listed) for t in moments)
    assert 0 < most < CLIENTS.size
    model.check_rounds_can_fill(most, CLIENTS.size)
    with pytest.raises(FedrayError, match=f"has at most {most} of the 50 clients online at once: a round of {most + 1} "
                                          "never fills"):
        model.check_rounds_can_fill(most + 1, CLIENTS.size)


def test_a_trace_file_is_needed():
    with pytest.raises(FedrayError, match="--availability trace needs a trace file: trace:FILE"):
        TraceAvailability()


def test_no_rounding_opens_a_gap_at_the_seam_of_two_repetitions(tmp_path):
    """m · 0.7 + 0.7 falls short of (m + 1) · 0.7 for many m (m = 12, 14, 17, ...): a trace online across the seam
    must not go offline for that rounding."""
    path = tmp_path / "seam.csv"
    path.write_text("trace_id,start_s,end_s\n1,0,0.3\n1,0.5,0.7\n")
    model = TraceAvailability(trace_file=str(path), seed=0)
    repetitions = np.arange(2000.0)
    clients = np.zeros(repetitions.size, dtype=np.int64)
    seams = np.concatenate([repetitions * 0.7 + 0.7, (repetitions + 1) * 0.7])
    assert model.available(np.concatenate([clients, clients]), seams).all()
    assert model.stays_available(clients, repetitions * 0.7 + 0.6, repetitions * 0.7 + 0.9).all()
