"""A plugin that cannot load is refused in one line, before any work, and the run writes no results.

The plugins are small files the tests write.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fedray.cli import main

SPEC = "synthetic:inat-geo-100?dim=8&scale=0.2&classes=6"
SMALL_RUN = ["--num-shards", "1", "--cpus-per-shard", "0.5", "--quiet"]


def refused(capsys, out: Path, *args: object) -> str:
    """The one line of a run refused with exit code 2 (its message after ``fedray: error: ``), which wrote no results."""
    capsys.readouterr()
    rc = main(["run", "--dataset", SPEC, "--out", str(out), *SMALL_RUN, *map(str, args)])
    _, err = capsys.readouterr()
    assert rc == 2 and err.startswith("fedray: error: ") and err.count("\n") == 1, err
    assert not (out / "metrics.parquet").exists() and not (out / "classifier.npz").exists()
    return err.removeprefix("fedray: error: ").rstrip("\n")


# --- plugins that cannot load: refused before Ray starts, nothing written


ABSTRACT = "import fedray\n\n\nclass HalfDone(fedray.ClosedFormMethod):\n    def solve(self, stats):\n        pass\n"
NOT_A_DATACLASS = '''
import fedray


class OwnConstructor(fedray.ClientAlgorithm):
    def __init__(self, mu=0.1):
        object.__setattr__(self, "mu", mu)


class Undecorated(fedray.ClientAlgorithm):
    mu: float = 0.1
'''


def refused_to_load(capsys, out: Path, *args: object) -> str:
    line = refused(capsys, out, *args)
    assert not out.exists()
    return line


@pytest.mark.parametrize("source, message", [
    ("import fedray\n\nclass Broken(fedray.ClosedFormMethod:\n    pass\n",
     "the plugin failed to load (SyntaxError: invalid syntax ({name}, line 3))"),
    ("raise RuntimeError('no GPU here')\n", "the plugin failed to load (RuntimeError: no GPU here, at {path}:1)"),
    ("import sys\n\nsys.exit(3)\n", "the plugin failed to load (it called sys.exit(3) while loading)"),
])
def test_a_plugin_file_that_fails_to_load_is_one_line(tmp_path, capsys, source, message):
    path = tmp_path / "broken_file_plugin.py"
    path.write_text(source)
    line = refused_to_load(capsys, tmp_path / "out", "--method", f"{path}:Broken")
    assert line == f"{path}: " + message.format(name=path.name, path=path)


@pytest.mark.parametrize("module, source, message", [
    ("syntax_error_plugin", "import fedray\n\nclass Broken(fedray.ClosedFormMethod:\n    pass\n",
     "SyntaxError: invalid syntax (syntax_error_plugin.py, line 3)"),
    ("raising_plugin", "\nraise RuntimeError('no GPU here')\n", "RuntimeError: no GPU here, at {path}:2"),
    ("exiting_plugin", "import sys\n\nsys.exit()\n", "it called sys.exit(None) while loading"),
])
def test_a_plugin_module_that_fails_to_import_is_one_line(tmp_path, capsys, monkeypatch, module, source, message):
    (tmp_path / f"{module}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    line = refused_to_load(capsys, tmp_path / "out", "--method", f"{module}:Broken")
    assert line == f"{module}:Broken: cannot import {module} (" + message.format(path=tmp_path / f"{module}.py") + ")"


def test_an_abstract_method_is_one_line(tmp_path, capsys):
    (tmp_path / "abstract.py").write_text(ABSTRACT)
    spec = f"{tmp_path / 'abstract.py'}:HalfDone"
    assert refused_to_load(capsys, tmp_path / "out", "--method", spec) == \
        f"{spec}: HalfDone is abstract: it does not define client_statistics, combine, which a subclass of " \
        "fedray.ClosedFormMethod must"
    assert refused_to_load(capsys, tmp_path / "out", "--method", "fedray:ClosedFormMethod") == \
        "fedray:ClosedFormMethod: ClosedFormMethod is abstract: it does not define client_statistics, combine, solve, " \
        "which a subclass of fedray.ClosedFormMethod must"


@pytest.mark.parametrize("name", ["OwnConstructor", "Undecorated"])
def test_a_client_algorithm_that_is_not_a_dataclass_is_one_line(tmp_path, capsys, name):
    (tmp_path / "hooks.py").write_text(NOT_A_DATACLASS)
    spec = f"{tmp_path / 'hooks.py'}:{name}"
    line = refused_to_load(capsys, tmp_path / "out", "--method", "fedavg", "--client-algorithm", spec)
    assert line == f"{spec}: {name} is not a dataclass: decorate it with @dataclass(frozen=True), as " \
        "fedray.ClientAlgorithm is (its fields with defaults are its options)"
