"""Device tables: loading and validation, each client's device, a task's durations by hand, the built-ins."""

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from scipy import stats
from scipy.special import ndtri

from fedray.clock.costs import TaskCost
from fedray.clock.devices import Devices, load_table
from fedray.clock.streams import uniforms
from fedray.core.errors import FedrayError
from fedray.core.options import options_of

THREE = """client_id,macs_per_s,down_bps,up_bps
0,1e9,8e6,4e6
1,2e9,16e6,8e6
2,4e9,80e6,40e6
"""


def written(tmp_path, text: str, name: str = "devices.csv") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_durations_by_hand_on_three_devices(tmp_path):
    devices = Devices(written(tmp_path, THREE))
    cost = TaskCost(macs=4e9, down_bytes=1e6, up_bytes=np.array([5e5, 5e5, 1e6]))
    compute, down, up = devices.durations(np.array([2, 0, 1]), 3, cost, seed=0)
    assert compute.tolist() == [1.0, 4.0, 2.0]  # 4e9 / (4e9, 1e9, 2e9)
    assert down.tolist() == [0.1, 1.0, 0.5]  # 8e6 bits / (80e6, 8e6, 16e6)
    assert up.tolist() == [0.1, 1.0, 1.0]  # (4e6, 4e6, 8e6) bits / (40e6, 4e6, 8e6)
    assert devices.durations(np.array([2, 0, 1]), 3, cost, 0).total_s.tolist() == [0.1 + 1.0 + 0.1, 6.0, 3.5]


def test_jitter_multiplies_each_part_by_its_lognormal_factor(tmp_path):
    table = "client_id,macs_per_s,down_bps,up_bps,macs_jitter,up_jitter\n0,1e9,8e6,4e6,0.5,0.25\n1,2e9,16e6,8e6,0,0\n"
    devices = Devices(written(tmp_path, table))
    clients = np.array([0, 1])
    durations = devices.durations(clients, 7, TaskCost(2e9, 1e6, 1e6), seed=5)
    z_compute, z_up = ndtri(uniforms(5, 41, clients, 7, 0)), ndtri(uniforms(5, 41, clients, 7, 2))
    assert durations.compute_s.tolist() == [2.0 * np.exp(0.5 * z_compute[0]), 1.0]
    assert durations.down_s.tolist() == [1.0, 0.5]  # no down_jitter column: σ 0, no factor
    assert durations.up_s.tolist() == [2.0 * np.exp(0.25 * z_up[0]), 1.0]
    again = devices.durations(clients, 7, TaskCost(2e9, 1e6, 1e6), seed=5)
    assert np.array_equal(again.compute_s, durations.compute_s)
    assert devices.durations(clients, 8, TaskCost(2e9, 1e6, 1e6), seed=5).compute_s[0] != durations.compute_s[0]


def test_a_jitter_has_median_one(tmp_path):
    devices = Devices(written(tmp_path, "macs_per_s,down_bps,up_bps,macs_jitter,share\n1e9,1e6,1e6,0.8,1\n"))
    compute = devices.durations(np.arange(20_000), 4, TaskCost(macs=1e9), seed=2).compute_s
    assert abs(np.median(compute) - 1.0) < 0.03 and abs(np.log(compute).std() - 0.8) < 0.02


def test_assignment_follows_the_shares(tmp_path):
    """χ² of 10⁵ clients' devices against the shares 0.5, 0.3, 0.2, at a fixed seed: under the α = 0.001 critical
    value of 2 degrees of freedom."""
    table = "macs_per_s,down_bps,up_bps,share\n1e9,1e6,1e6,0.5\n2e9,1e6,1e6,0.3\n3e9,1e6,1e6,0.2\n"
    devices = Devices(written(tmp_path, table))
    counts = np.bincount(devices.assign(100_000, seed=8), minlength=3)
    expected = np.array([0.5, 0.3, 0.2]) * 100_000
    assert ((counts - expected) ** 2 / expected).sum() < stats.chi2.ppf(0.999, df=2)


def test_the_devices_kept_by_assign_are_those_drawn_for_its_seed_and_no_other():
    drawn = Devices("phones")
    kept = Devices("phones")
    kept.assign(500, seed=3)
    clients = np.array([499, 7, 600, 7, 0])  # 600 is beyond the kept rows: drawn
    assert kept.device_of(clients, seed=3).tolist() == drawn.device_of(clients, seed=3).tolist()
    assert kept.device_of(clients, seed=4).tolist() == drawn.device_of(clients, seed=4).tolist()
    assert kept.device_of(clients, seed=3).dtype == np.int64


def test_a_clients_device_does_not_depend_on_the_layout():
    devices = Devices("phones")
    everyone = devices.assign(10_000, seed=3)
    assert np.array_equal(devices.device_of(np.arange(100, 200), seed=3), everyone[100:200])
    shuffled = np.random.default_rng(1).permutation(np.arange(100, 200))
    assert np.array_equal(devices.device_of(shuffled, seed=3), everyone[shuffled])
    assert not np.array_equal(devices.assign(10_000, seed=4), everyone)
    cost = TaskCost(macs=1e9, down_bytes=1e6, up_bytes=1e6)
    whole = devices.durations(np.arange(10_000), 2, cost, seed=3)
    part = devices.durations(shuffled, 2, cost, seed=3)
    for all_of, some in zip(whole, part):
        assert np.array_equal(some, all_of[shuffled])


def test_a_million_clients_get_their_devices_in_one_call():
    """Vectorised over the clients (its speed is jobs.bench_scale --clock's): every client gets a row of the table."""
    devices = Devices("phones")
    assigned = devices.assign(1_000_000, seed=0)
    assert assigned.shape == (1_000_000,) and assigned.min() >= 0 and assigned.max() < len(devices.table)


def test_a_table_of_client_ids_gives_each_client_its_row(tmp_path):
    devices = Devices(written(tmp_path, "client_id,macs_per_s,down_bps,up_bps\n2,1e9,1,1\n0,2e9,1,1\n1,3e9,1,1\n"))
    assert devices.assign(3, seed=0).tolist() == [1, 2, 0]
    assert devices.device_of(np.array([2, 2, 0]), seed=99).tolist() == [0, 0, 1]


def test_parquet_loads_as_csv_does(tmp_path):
    columns = {"macs_per_s": [1e9, 2e9], "down_bps": [1e6, 2e6], "up_bps": [3e6, 4e6], "share": [0.25, 0.75]}
    pq.write_table(pa.table(columns), tmp_path / "devices.parquet")
    from_parquet = load_table(str(tmp_path / "devices.parquet"))
    from_csv = load_table(written(tmp_path, "macs_per_s,down_bps,up_bps,share\n1e9,1e6,3e6,0.25\n2e9,2e6,4e6,0.75\n"))
    for column in ("macs_per_s", "down_bps", "up_bps", "share", "macs_jitter"):
        assert np.array_equal(getattr(from_parquet, column), getattr(from_csv, column))


def test_the_built_ins_load():
    uniform = Devices()
    assert uniform.devices is None and uniform.table.source == "uniform"  # no --devices: uniform's table
    assert len(uniform.table) == 1 and uniform.table.share.tolist() == [1.0]
    assert uniform.table.name == ("median-phone",)
    assert not uniform.table.macs_jitter.any() and not uniform.table.down_jitter.any()
    assert uniform.assign(5, seed=1).tolist() == [0, 0, 0, 0, 0]
    phones = Devices("phones").table
    assert len(phones) == 190 and abs(phones.share.sum() - 1) < 1e-12
    assert len(set(phones.macs_per_s.tolist())) == 10 and len(set(phones.down_bps.tolist())) == 19
    # the anchor's tier holds the Pixel 4 (2.885e9 multiply-adds/s): the fastest tiers straddle it
    assert phones.macs_per_s.min() < 2.885e9 < phones.macs_per_s.max()
    assert phones.macs_per_s.max() < 2 * 2.885e9 and phones.macs_per_s.min() > 2.885e9 / 20


def test_the_option_is_declared_for_the_engine():
    option = options_of(Devices)["devices"]
    assert (option.type, option.default, option.metavar) == (str, None, "uniform|phones|FILE")
    assert option.unset == "no clock; uniform when another clock option is given"


BAD_TABLES = [
    ("macs_per_s,down_bps,share\n1e9,1e6,1\n", "no column up_bps"),
    ("macs_per_s,down_bps,up_bps\n1e9,1e6,1e6\n", "give a column share .* or a column client_id"),
    ("client_id,macs_per_s,down_bps,up_bps,share\n0,1e9,1e6,1e6,1\n", "give a column share .* exactly one of them"),
    ("macs_per_s,down_mbps,up_bps,share\n1e9,1,1e6,1\n", "column 'down_mbps' has units fedray does not read"),
    ("macs_per_s,down_bps,up_bps,share,speed\n1e9,1e6,1e6,1,3\n", "unknown column 'speed'"),
    ("macs_per_s,down_bps,up_bps,share\n", "no rows"),
    ("macs_per_s,down_bps,up_bps,share\n1e9,1e6,1e6,0.5\n0,1e6,1e6,0.5\n", "column macs_per_s, row 2: a rate must be"),
    ("macs_per_s,down_bps,up_bps,share\n1e9,-1e6,1e6,1\n", "column down_bps, row 1: a rate must be a finite num"),
    ("macs_per_s,down_bps,up_bps,share\n1e9,1e6,nan,1\n", "column up_bps, row 1: a rate must be .* got nan"),
    ("macs_per_s,down_bps,up_bps,share\n1e9,1e6,NaN,1\n", "column up_bps, row 1: a rate must be .* got nan"),
    ("macs_per_s,down_bps,up_bps,share\n1e9,1e6,inf,1\n", "column up_bps, row 1: a rate must be a finite"),
    ("macs_per_s,down_bps,up_bps,share\n1e9,1e6,NA,1\n", "column up_bps, row 1: 'NA' is not a number"),
    ("macs_per_s,down_bps,up_bps,share\n1e9,,1e6,1\n", "column down_bps, row 1 is empty"),
    ("macs_per_s,down_bps,up_bps,share\n1e9,1e6,1e6,0.5\nfast,1e6,1e6,0.5\n", "column macs_per_s, row 2: 'fast' is"),
    ("macs_per_s,down_bps,up_bps,up_jitter,share\n1e9,1e6,1e6,-0.1,1\n", "column up_jitter, row 1: a jitter σ must"),
    ("macs_per_s,down_bps,up_bps,share\n1e9,1e6,1e6,0.5\n1e9,1e6,1e6,0\n", "column share, row 2: a share must be"),
    ("macs_per_s,down_bps,up_bps,share\n1e9,1e6,1e6,0.5\n1e9,1e6,1e6,0.4\n",
     "column share sums to 0.9, not 1 \\(within 1e-09\\)$"),
    ("client_id,macs_per_s,down_bps,up_bps\n0,1e9,1,1\n1,1e9,1,1\n0,1e9,1,1\n",
     "column client_id, row 3: client 0 is listed again \\(first at row 1\\)"),
    ("client_id,macs_per_s,down_bps,up_bps\n0,1e9,1,1\n-1,1e9,1,1\n", "column client_id, row 2: a client id must be"),
    ("client_id,macs_per_s,down_bps,up_bps\n0.5,1e9,1,1\n", "column client_id, row 1: a client id must be an integer"),
]


@pytest.mark.parametrize("text, message", BAD_TABLES)
def test_a_bad_table_is_one_line_naming_file_column_and_row(tmp_path, text, message):
    path = written(tmp_path, text)
    with pytest.raises(FedrayError, match=f"^devices table {path}: {message}") as error:
        Devices(path)
    assert "\n" not in str(error.value)


def test_a_share_sum_within_1e_9_is_one(tmp_path):
    table = "macs_per_s,down_bps,up_bps,share\n1e9,1e6,1e6,0.5\n1e9,1e6,1e6,0.5000000005\n"
    assert len(Devices(written(tmp_path, table)).table) == 2


@pytest.mark.parametrize("clients, message", [
    (4, "column client_id has no row for client 3 \\(the population has 4 clients, the table 3 rows\\)"),
    (2, "column client_id, row 3: client 2 is not in the population of 2 clients"),
])
def test_client_ids_must_be_the_population(tmp_path, clients, message):
    path = written(tmp_path, THREE)
    with pytest.raises(FedrayError, match=f"^devices table {path}: {message}$"):
        Devices(path).assign(clients, seed=0)


def test_a_gap_in_the_client_ids_is_named(tmp_path):
    path = written(tmp_path, "client_id,macs_per_s,down_bps,up_bps\n0,1e9,1,1\n2,1e9,1,1\n")
    with pytest.raises(FedrayError, match="no row for client 1 "):
        Devices(path).assign(3, seed=0)
    with pytest.raises(FedrayError, match="no row for client 1$"):
        Devices(path).durations(np.array([0, 1]), 0, TaskCost(), seed=0)


@pytest.mark.parametrize("devices, message", [
    ("fast", "--devices takes uniform, phones or a .csv or .parquet device table, got 'fast'"),
    ("missing.csv", "devices table missing.csv: no such file"),
])
def test_an_unknown_name_or_file(devices, message):
    with pytest.raises(FedrayError, match=f"^{message}$"):
        Devices(devices)


def test_an_unreadable_file_is_one_line(tmp_path):
    path = tmp_path / "devices.parquet"
    path.write_bytes(b"not a parquet file")
    with pytest.raises(FedrayError, match=f"^devices table {path}: unreadable") as error:
        Devices(str(path))
    assert "\n" not in str(error.value)


def test_a_cost_per_client_must_match_the_clients(tmp_path):
    with pytest.raises(FedrayError, match=r"the cost's macs has shape \(2,\), the clients \(3,\)"):
        Devices(written(tmp_path, THREE)).durations(np.arange(3), 0, TaskCost(macs=np.ones(2)), seed=0)
