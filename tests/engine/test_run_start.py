"""A run's first steps: the checks that need neither its data nor Ray come before Ray begins starting; a refusal after
that (once the data is read) stops the start and leaves no folder. ``RayStart`` is replaced by a recorder: no Ray
starts. The same on real processes: tests/e2e/test_ray_start.py."""

from collections.abc import Callable

import pyarrow.parquet as pq
import pytest

import fedray.engine.run_start
from fedray.core.errors import FedrayError
from fedray.engine.config import RunConfig
from fedray.engine.run_config import run
from fedray.engine.run_start import starting
from tests.app.test_cli import byo_table

SPEC = "synthetic:inat-user-120k?dim=8&scale=0.02&classes=20"


def no_ray_start(monkeypatch, at_join: Callable[[], None] = lambda: None) -> list[str]:
    """:class:`~fedray.runtime.ray_start.RayStart` replaced in runs: no Ray starts, and where a run first needs Ray
    (its join), ``at_join()`` runs instead. The list it returns hears ``begun``, ``joined`` and ``stopped`` (a block
    that ended in an error before the join)."""
    heard: list[str] = []

    class NoRayStart:
        def __init__(self, address: str | None = None, verbose: bool = False) -> None:
            heard.append("begun")

        def __enter__(self) -> "NoRayStart":
            return self

        def __exit__(self, kind, error, traceback) -> None:
            if error is not None and "joined" not in heard:
                heard.append("stopped")

        def ray_imported(self) -> None:
            """No thread imports Ray: nothing to wait for."""

        def join(self) -> None:
            heard.append("joined")
            at_join()

    monkeypatch.setattr(fedray.engine.run_start, "RayStart", NoRayStart)
    return heard


def test_a_refusal_that_needs_neither_data_nor_ray_comes_before_ray_begins(monkeypatch, tmp_path):
    heard = no_ray_start(monkeypatch)
    taken = tmp_path / "a-file"
    taken.write_text("not a folder")

    with pytest.raises(FedrayError, match="^--out "):
        with starting(RunConfig(method="fed3r", dataset=SPEC, out=str(taken))):
            pytest.fail("the block ran")
    assert heard == []


def test_the_block_gets_the_resolved_configuration_with_ray_begun_and_its_folder_held(monkeypatch, tmp_path):
    heard = no_ray_start(monkeypatch)
    out = tmp_path / "run"

    with starting(RunConfig(method="fed3r", dataset=SPEC, out=str(out))) as (config, ray_start):
        assert config == RunConfig(method="fed3r", dataset=SPEC, out=str(out)).validate().resolved()
        assert heard == ["begun"] and out.is_dir()
        ray_start.join()
    assert heard == ["begun", "joined"]
    assert not out.exists(), "the folder the block held was left empty: removed"


def test_a_run_refused_once_its_data_is_read_stops_the_start_and_leaves_no_folder(monkeypatch, tmp_path):
    heard = no_ray_start(monkeypatch, at_join=lambda: pytest.fail("the run went on to need Ray"))
    path, out = tmp_path / "train-only.parquet", tmp_path / "run"
    pq.write_table(byo_table(num_test=0), path)

    with pytest.raises(FedrayError, match="no test rows"):
        run(RunConfig(method="fed3r", dataset=f"parquet:{path}", out=str(out), quiet=True))
    assert heard == ["begun", "stopped"]
    assert not out.exists()
