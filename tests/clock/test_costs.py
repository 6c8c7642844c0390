"""A task's cost: amounts for all clients or one per client, added amount by amount, checked on construction."""

import numpy as np
import pytest

from fedray.clock.costs import TaskCost
from fedray.core.errors import FedrayError


def test_defaults_are_no_work_and_scalars_stay_floats():
    assert TaskCost() == TaskCost(0.0, 0.0, 0.0)
    cost = TaskCost(macs=3, down_bytes=np.float32(2.5), up_bytes=np.int64(7))
    assert (cost.macs, cost.down_bytes, cost.up_bytes) == (3.0, 2.5, 7.0)
    assert all(type(value) is float for value in (cost.macs, cost.down_bytes, cost.up_bytes))


def test_adding_costs_adds_each_amount():
    per_client = TaskCost(macs=np.array([1.0, 2.0, 3.0]), down_bytes=10.0, up_bytes=np.array([0.0, 4.0, 8.0]))
    total = per_client + TaskCost(macs=0.5, down_bytes=np.array([1.0, 2.0, 3.0]), up_bytes=1.0)
    assert total.macs.tolist() == [1.5, 2.5, 3.5]
    assert total.down_bytes.tolist() == [11.0, 12.0, 13.0]
    assert total.up_bytes.tolist() == [1.0, 5.0, 9.0]
    assert (TaskCost(1.0, 2.0, 3.0) + TaskCost(4.0, 5.0, 6.0)) == TaskCost(5.0, 7.0, 9.0)


def test_lists_become_float64_arrays():
    cost = TaskCost(macs=[1, 2], down_bytes=0.0, up_bytes=[3, 4])
    assert cost.macs.dtype == np.float64 and cost.macs.tolist() == [1.0, 2.0]


@pytest.mark.parametrize("amounts, message", [
    ({"macs": -1.0}, "macs must be finite numbers ≥ 0"),
    ({"down_bytes": np.array([1.0, np.nan])}, "down_bytes must be finite"),
    ({"up_bytes": np.inf}, "up_bytes must be finite"),
    ({"macs": True}, "macs must be"),
    ({"macs": "1e9"}, "macs must be"),
    ({"macs": np.zeros(3), "up_bytes": np.zeros(2)},
     r"shapes do not match \(macs \(3,\), down_bytes \(\), up_bytes \(2,\)\)"),
])
def test_bad_amounts_are_one_line(amounts, message):
    with pytest.raises(FedrayError, match=message):
        TaskCost(**amounts)
