"""``fedray.run`` and ``fedray.sweep`` check every argument as the command line and a config file do, before any work.

For every run option, wrong-typed values (a bool for a number, a number for a bool, a float for an integer, a string
that does not parse, a list, ``None`` where the option takes none, NaN and infinities) give the config file's one-line
error, and every number (and its string) the command line can be given gives the command line's outcome: its
error, or a run that starts. ``fedray.engine.run`` is the only way from either to Ray and to the output folder; here it
is replaced by a sentinel, so a value that reaches it passed every check, and one refused never got near Ray.
"""

from pathlib import Path

import numpy as np
import pytest
import ray

import fedray
import fedray.engine.run_config
import fedray.app.sweeps.tuning
from fedray.app.cli import main
from fedray.engine.config import RUN_OPTIONS, catalogue
from fedray.engine.config_files import typed_value
from tests.engine.test_run_start import no_ray_start

REPO = Path(__file__).resolve().parents[2]
NCM = f"{REPO / 'examples' / 'nearest_class_mean.py'}:NearestClassMean"
TYPE_WORDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
METHODS = ("fed3r", "fedprox", "tct")
"""A closed-form method, a training algorithm and TCT: each checks the options that apply to it."""
NAMED = {  # fedray.run's own parameters that are run options, and what each says for a value of the wrong type
    "method": "fedray.run: method must be a name, 'module:Class', 'file.py:Class' or a class, got {value!r}",
    "server_optimizer": "fedray.run: server optimizer must be a name, 'module:Class', 'file.py:Class' or a class, "
                        "got {value!r}",
    "dataset": "fedray.run: dataset must be a spec ('synthetic:…', 'parquet:PATH', 'file.py:function', ...) or a "
               "fedray.Federation, got {value!r}",
    "out": "fedray.run: out must be a folder, a str or pathlib.Path, got {value!r}",
    "postprocessor": "fedray.run: postprocessor must be a name, 'module:Class', 'file.py:Class', a class, or a list of them, "
                     "got {value!r}",
}


class EngineReached(Exception):
    """The run passed every check and would start now."""


@pytest.fixture
def engine(monkeypatch):
    """``fedray.engine.run`` (what ``fedray.run`` and ``fedray run`` call once every check passed) as a sentinel that
    raises :class:`EngineReached` with the configuration it was given."""
    def reached(config, **_):
        raise EngineReached(config)

    ray_was_up = ray.is_initialized()  # another test file's session Ray may be up already
    monkeypatch.setattr(fedray.engine.run_config, "run", reached)
    no_ray_start(monkeypatch)  # fedray run begins no Ray before it reaches the engine
    yield
    assert ray.is_initialized() is ray_was_up


def python_outcome(folder: Path, /, **keywords) -> str:
    """``fedray.run(out=folder, **keywords)`` (``keywords`` may give another ``out``): its one-line error, or ``"runs"``;
    nothing written to ``folder`` either way."""
    try:
        fedray.run(**{"out": folder, **keywords})
    except EngineReached:
        return "runs"
    except fedray.FedrayError as error:
        message = str(error)
        assert "\n" not in message
        return message
    finally:
        assert not folder.exists()
    raise AssertionError("fedray.run returned without running")


def cli_outcome(capsys, out: Path, *argv: str) -> str:
    """``fedray run ARGV``: its error (after ``fedray: error: ``), or ``"runs"``."""
    capsys.readouterr()
    try:
        rc = main(["run", *argv, "--out", str(out)])
    except EngineReached:
        return "runs"
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("fedray: error: ") and err.count("\n") == 1, err
    return err.removeprefix("fedray: error: ").strip()


def flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def wrong_values(key: str) -> list:
    """Values of the wrong type for the run option ``key``."""
    option = RUN_OPTIONS[key]
    values = {
        int: [True, False, 2.5, 2.0, float("nan"), "ten", "2.5", [2], {"n": 2}],
        float: [True, False, "small", [0.5], {"x": 0.5}],
        bool: [1, 0, 1.0, "maybe", [True]],
        str: [3, 2.5, True, ["fed3r"], {"a": 1}],
    }[option.type]
    if key == "postprocessor":  # a list of classes is its value
        values = [[value] if isinstance(value, list) else value for value in values]
    return values if option.optional else [*values, None]


def refusal(key: str, value: object) -> str:
    """What ``fedray.run`` says for ``key=value``, written out."""
    if key in NAMED:
        return NAMED[key].format(value=value)
    return f"fedray.run: option {key} must be {TYPE_WORDS[RUN_OPTIONS[key].type]}, got {value!r}"


@pytest.mark.parametrize("key", sorted(RUN_OPTIONS))
def test_every_run_option_refuses_values_of_the_wrong_type_as_a_config_file_does(key, engine, tmp_path):
    out = tmp_path / "out"
    for value in wrong_values(key):
        if key == "server_optimizer" and value is None:
            continue  # fedray.run's default: the method's own
        message = python_outcome(out, **{key: value})
        assert message == refusal(key, value), (key, value)
        if key not in NAMED:  # the same words as a config file's value gets
            with pytest.raises(fedray.FedrayError) as from_file:
                typed_value(Path("run.yaml"), key, value)
            assert message.removeprefix("fedray.run") == str(from_file.value).removeprefix("run.yaml")


NUMBERS = {
    int: [0, -1, 1, 2**63],
    float: [0, -1, 1, 0.0, -0.5, 0.5, 1.5, float("nan"), float("inf"), float("-inf")],
}
"""Numbers the command line takes for an integer, and for a number: zero, negatives, in and out of (0, 1], too large."""


def numeric_options() -> list[str]:
    return sorted(key for key, option in RUN_OPTIONS.items() if option.type in NUMBERS)


RUNS_TAKING = {
    **{name: [{"method": spec.owners[0]}] for name, spec in catalogue().items() if spec.kind in ("class", "component")},
    "sphere_dim": [{"method": "fedprox", "head": "sphere"}],
}
"""A run that takes the option, where none of METHODS' runs does (an option given to a run it does not apply to is
refused)."""


@pytest.mark.parametrize("key", numeric_options())
def test_every_number_gets_what_the_command_line_says(key, engine, capsys, tmp_path):
    out = tmp_path / "out"

    def same_words(message: str) -> str:
        """A type's check names the keyword as a config file's does (``fedray.run: option seed``); the command line
        names its flag (``--seed``)."""
        return message.replace(f"fedray.run: option {key}", flag(key))

    outcomes = set()
    for run in [{"method": method} for method in METHODS] + RUNS_TAKING.get(key, []):
        arguments = [part for name, value in run.items() for part in (flag(name), value)]
        for value in NUMBERS[RUN_OPTIONS[key].type]:
            expected = cli_outcome(capsys, out, *arguments, f"{flag(key)}={value}")
            assert same_words(python_outcome(out, **run, **{key: value})) == expected, (run, value)
            assert same_words(python_outcome(out, **run, **{key: str(value)})) == expected, (run, value)
            outcomes.add(expected)
    assert "runs" in outcomes  # the sentinel is reached: a value that passes is not refused


@pytest.mark.parametrize(("key", "value", "expected"), [
    ("rounds", 0, "--rounds must be ≥ 1, got 0"),
    ("eval_every", -1, "--eval-every must be ≥ 1, got -1"),
    ("participation", 1.5, "--participation must be in (0, 1], got 1.5"),
    ("cpus_per_shard", 0, "--cpus-per-shard must be > 0, got 0.0"),
    ("num_shards", 0, "--num-shards must be ≥ 1, got 0"),
    ("client_lr", -0.5, "--client-lr must be > 0, got -0.5"),
    ("client_momentum", 1, "--client-momentum must be in [0, 1), got 1.0"),
    ("seed", -1, "fedray.run: option seed must be an integer from 0 to 2^63 - 1, got -1"),
    ("seed", 2**63, "fedray.run: option seed must be an integer from 0 to 2^63 - 1, got 9223372036854775808"),
    ("lam", float("nan"), "fedray.run: option lam must be a finite number, got nan"),
    ("lam", "-inf", "fedray.run: option lam must be a finite number, got -inf"),
    ("lam", 10**400, "fedray.run: option lam must be a finite number, got inf"),
])
def test_out_of_range_values_are_refused_with_the_command_lines_words(key, value, expected, engine, tmp_path):
    assert python_outcome(tmp_path / "out", **{key: value}) == expected


def test_the_issues_values_are_one_line_before_any_work(engine, tmp_path):
    out = tmp_path / "out"
    assert python_outcome(out, rounds=2.5) == "fedray.run: option rounds must be an integer, got 2.5"
    assert python_outcome(out, seed=True) == "fedray.run: option seed must be an integer, got True"
    assert python_outcome(out, rounds="ten") == "fedray.run: option rounds must be an integer, got 'ten'"
    assert python_outcome(out, dataset=123) == NAMED["dataset"].format(value=123)
    assert python_outcome(out, method=3) == NAMED["method"].format(value=3)
    assert python_outcome(out, lam=np.zeros(1000)) == "fedray.run: option lam must be a number, got ndarray"
    with pytest.raises(fedray.FedrayError, match=r"^fedray.run: out must be a folder, a str or pathlib.Path, got None$"):
        fedray.run(out=None)
    assert not Path("None").exists()


def reached_config(**keywords):
    with pytest.raises(EngineReached) as reached:
        fedray.run(**keywords)
    return reached.value.args[0]


def test_strings_parse_as_on_the_command_line_and_numpy_numbers_are_numbers(engine, tmp_path):
    config = reached_config(out=tmp_path, method="fedavg", init="fed3r", num_shards="2", quiet="no", lam="1e-3",
                            rounds=np.int64(5),
                            cpus_per_shard=np.float32(0.5), client_lr=1)
    assert (config.num_shards, config.quiet, config.lam, config.rounds, config.cpus_per_shard) == (2, False, 0.001, 5, 0.5)
    assert [type(value) for value in (config.num_shards, config.lam, config.rounds, config.cpus_per_shard)] == \
        [int, float, int, float]
    assert type(config.client_lr) is float and config.out == str(tmp_path)


def test_none_is_a_value_where_the_option_takes_one(engine, tmp_path):
    assert reached_config(out=tmp_path, method="fedavg", checkpoint_every=None).checkpoint_every is None  # never
    assert reached_config(out=tmp_path, method="fedavg").checkpoint_every == 500
    assert reached_config(out=tmp_path, rounds=None).rounds is None


def test_unknown_keywords_say_where_they_belong(engine, tmp_path):
    out = tmp_path / "out"
    assert python_outcome(out, lamda=0.1) == "fedray.run: unknown option(s) lamda; did you mean lam?"
    assert python_outcome(out, learning_rate=0.1) == "fedray.run: unknown option(s) learning_rate"
    assert python_outcome(out, alpha=0.5) == ("unknown option(s) alpha (--option); alpha is an option of feddyn, not of "
                                              "fed3r (the dataset's alpha is given in its spec: ?alpha=...); this run has "
                                              "no plugin options (its built-in classes' options: fedray run --help)")
    assert python_outcome(out, method=NCM, normalize=False) == \
        f"fedray.run: unknown option(s) normalize; normalize is an option of {NCM}: give it in options={{'normalize': ...}}"


def test_the_other_arguments_are_typed_too(engine, tmp_path):
    out = tmp_path / "out"
    assert python_outcome(out, options=[("normalize", False)]) == \
        "fedray.run: options must be a mapping of option: value, got [('normalize', False)]"
    assert python_outcome(out, method=NCM, options={"normalize": "maybe"}) == \
        "--option: option normalize must be true or false, got 'maybe'"  # a plugin's option, typed as --option's
    assert python_outcome(out, resume=1) == "fedray.run: option resume must be true or false, got 1"
    assert python_outcome(out, verbose="loud") == "fedray.run: option verbose must be true or false, got 'loud'"
    assert python_outcome(out, address=6379) == "fedray.run: option address must be a string, got 6379"
    assert python_outcome(out, on_evaluation="print") == \
        "fedray.run: on_evaluation must be a function (row, classifier), got 'print'"


@pytest.fixture
def tune(monkeypatch):
    """``fedray.app.sweeps.tuning.sweep`` (Ray Tune, once the sweep's arguments passed) as a sentinel raising
    :class:`EngineReached` with the arguments it was given."""
    def reached(spec, out, **arguments):
        raise EngineReached(spec, out, arguments)

    monkeypatch.setattr(fedray.app.sweeps.tuning, "sweep", reached)


SWEEP = {"name": "x", "grid": {"seed": [0, 1]}}


@pytest.mark.parametrize(("arguments", "expected"), [
    ({"config": 3}, "fedray.sweep: config must be a sweep file (a str or pathlib.Path) or its content as a dict, got 3"),
    ({"out": None}, "fedray.sweep: out must be a folder, a str or pathlib.Path, got None"),
    ({"resume": "maybe"}, "fedray.sweep: option resume must be true or false, got 'maybe'"),
    ({"quiet": 1}, "fedray.sweep: option quiet must be true or false, got 1"),
    ({"address": ["auto"]}, "fedray.sweep: option address must be a string, got ['auto']"),
])
def test_sweep_arguments_are_one_line_before_any_work(arguments, expected, tune, tmp_path):
    with pytest.raises(fedray.FedrayError) as error:
        fedray.sweep(**{"config": SWEEP, "out": tmp_path, **arguments})
    assert str(error.value) == expected
    assert list(tmp_path.iterdir()) == []


def test_sweep_arguments_are_typed_as_run_options_are(tune, tmp_path):
    with pytest.raises(EngineReached) as reached:
        fedray.sweep(SWEEP, out=tmp_path, resume="no", quiet="yes")
    spec, out, arguments = reached.value.args
    assert (spec.name, out, arguments) == ("x", str(tmp_path),
                                           {"resume": False, "address": None, "quiet": True, "callbacks": (),
                                            "command": "fedray.sweep"})
