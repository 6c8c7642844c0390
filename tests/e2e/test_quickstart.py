"""The README's first command at full size: the iNat-User-120K stand-in, FedNCM vs Fed3R vs FedCOF."""

import polars as pl
import pytest

from jobs import quickstart


@pytest.mark.slow
def test_quickstart_ranks_the_methods_as_on_real_features(ray_session, tmp_path, capsys):
    quickstart.main(["--out", str(tmp_path), "--quiet"])
    final = {
        method: pl.read_parquet(tmp_path / method / "metrics.parquet").sort("round").row(-1, named=True)
        for method in quickstart.METHODS
    }
    assert final["fedncm"]["accuracy"] < final["fed3r"]["accuracy"]
    assert final["fedncm"]["accuracy"] < final["fedcof"]["accuracy"]
    for row in final.values():
        assert (row["round"], row["clients_seen"], row["samples_seen"]) == (928, 9275, 120_293)
    rounds = pl.read_parquet(tmp_path / "fed3r" / "metrics.parquet")["round"].to_list()
    assert rounds == list(range(100, 901, 100)) + [928]
    assert "fed3r" in capsys.readouterr().out
