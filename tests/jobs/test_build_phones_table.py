"""``jobs.build_phones_table``: the committed built-in tables are what it makes of FLASH's files; its readings."""

import math

import numpy as np
import pytest

from jobs import build_phones_table as build


@pytest.mark.skipif(build.default_source() is None, reason="FLASH's data files are not beside this checkout")
def test_the_committed_tables_are_rebuilt_from_flashs_files(tmp_path):
    for path in build.build(build.default_source(), tmp_path):
        assert path.read_text() == (build.TABLES / path.name).read_text(), f"{path.name} differs: rerun the job"


def test_the_anchor_is_flashs_pixel_4_measurement():
    # conv 5×5×1→32 on 28×28, conv 5×5×32→64 on 14×14, dense 3136→2048, dense 2048→62
    assert build.FEMNIST_CNN_FORWARD_MACS == 627_200 + 10_035_200 + 6_422_528 + 126_976 == 17_211_904
    assert build.ANCHOR_MACS_PER_S == 10 * 3 * 17_211_904 / 0.179


def test_a_network_keeps_flashs_mean_and_deviation():
    median, sigma = build.lognormal(7491.4, 3369.3)
    assert math.isclose(median * math.exp(sigma**2 / 2), 7491.4, rel_tol=1e-12)  # the lognormal's mean
    variance = (math.exp(sigma**2) - 1) * median**2 * math.exp(sigma**2)
    assert math.isclose(math.sqrt(variance), 3369.3, rel_tol=1e-12)


def test_the_weighted_median_is_where_half_the_population_lies():
    assert build.weighted_median([5.0, 1.0, 3.0], [0.2, 0.3, 0.5]) == 3.0  # 1: 0.3, 3: 0.8
    assert build.weighted_median([5.0, 1.0, 3.0], [0.6, 0.3, 0.1]) == 5.0  # 1: 0.3, 3: 0.4, 5: 1.0
    assert build.weighted_median([2.0, 1.0], [0.5, 0.5]) == 1.0


def test_uniform_is_the_phones_median():
    phones = np.genfromtxt(build.TABLES / "phones.csv", delimiter=",", names=True, dtype=None, encoding="utf-8")
    uniform = np.genfromtxt(build.TABLES / "uniform.csv", delimiter=",", names=True, dtype=None, encoding="utf-8")
    for rate in ("macs_per_s", "down_bps", "up_bps"):
        order = np.argsort(phones[rate], kind="stable")
        below = np.cumsum(phones["share"][order])
        assert uniform[rate] == phones[rate][order][np.searchsorted(below, 0.5)]
