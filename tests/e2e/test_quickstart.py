"""The README's first command at full size: the iNat-User-120K stand-in (all 9,275 clients and 120,293 samples, in
928 rounds), FedNCM vs Fed3R vs FedCOF. Its features are d = 32 rather than the command's default 1,280 (``--dim``):
the clients, rounds and ranking are the same, in a fifth of the time."""

import polars as pl
import pytest

from jobs import quickstart


@pytest.mark.slow
def test_quickstart_ranks_the_methods_as_on_real_features(ray_session, tmp_path, capsys):
    quickstart.main(["--out", str(tmp_path), "--dim", "32", "--quiet"])
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
