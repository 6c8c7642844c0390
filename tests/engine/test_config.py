"""The run configuration made from the components' declarations: a new option of a built-in component is one field."""

import subprocess
import sys
import textwrap

THROWAWAY = textwrap.dedent('''
    """A built-in server optimizer the test adds, with one option, before fedray reads the built-ins' options."""
    import contextlib
    import io
    import json
    import sys
    from pathlib import Path
    from typing import Annotated

    from fedray.methods.training import server


    class Throwaway(server.ServerSGD):
        """θ ← θ + η Δ, with a knob."""

        name = "throwaway"

        def __init__(self, server_lr: float | None = None,
                     throwaway_knob: Annotated[float, "a knob only this test turns"] = 0.5) -> None:
            super().__init__(server_lr)
            self.throwaway_knob = throwaway_knob


    server.SERVER_OPTIMIZERS["throwaway"] = Throwaway

    from fedray.app.catalogue import catalogue
    from fedray.app.cli import build_parser, main
    from fedray.app.sweeps.spec import sweep_spec
    from fedray.app.sweeps.trials import trial_config
    from fedray.engine.config import resolve
    from fedray.engine.config_files import load_config_file

    shown = io.StringIO()
    with contextlib.redirect_stdout(shown), contextlib.suppress(SystemExit):
        main(["run", "--help"])
    flags = vars(build_parser().parse_args(["run", "--method", "fedavg", "--server-optimizer", "throwaway",
                                            "--throwaway-knob", "0.25"]))
    command_line = resolve({}, {key: value for key, value in flags.items() if key in ("method", "server_optimizer",
                                                                                        "throwaway_knob")})
    yaml = Path(sys.argv[1]) / "run.yaml"
    yaml.write_text("method: fedavg\\nserver_optimizer: throwaway\\nthrowaway_knob: 0.75\\n")
    from_file = resolve(load_config_file(yaml), {})
    sweep = sweep_spec({"name": "knobs", "base": {"method": "fedavg", "server_optimizer": "throwaway"},
                        "grid": {"throwaway_knob": [0.1, 0.2]}}, Path("sweep"))
    trial = trial_config({**sweep.base, "throwaway_knob": 0.2}, "out")
    print(json.dumps({
        "help": [line.strip() for line in shown.getvalue().splitlines()
                 if "throwaway-knob" in line or "only this" in line],
        "methods": [line.strip() for line in catalogue().splitlines() if "throwaway" in line],
        "command_line": command_line.metrics_columns()["throwaway_knob"],
        "yaml": from_file.metrics_columns()["throwaway_knob"],
        "sweep": [sweep.grid["throwaway_knob"], trial.throwaway_knob],
        "default": resolve({}, {"method": "fedavg",
                                "server_optimizer": "throwaway"}).metrics_columns()["throwaway_knob"],
        "other_runs": "throwaway_knob" in resolve({}, {"method": "fedavg"}).metrics_columns(),
    }))
''')


def test_a_new_option_of_a_built_in_is_one_declaration_everywhere(tmp_path):
    """A built-in class added with one option: its flag and --help line, its fedray methods line, its YAML and sweep
    key and its metrics column, all from the declaration (``fedray run`` with no other edit)."""
    script = tmp_path / "throwaway.py"
    script.write_text(THROWAWAY)
    result = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    import json

    found = json.loads(result.stdout.splitlines()[-1])
    assert found["help"][-1].endswith("a knob only this test turns (default 0.5)"), found["help"]
    assert "--throwaway-knob THROWAWAY_KNOB" in " ".join(found["help"])
    assert found["methods"] == ["throwaway      θ ← θ + η Δ, with a knob.",
                                "throwaway_knob: float = 0.5  (a knob only this test turns)"]
    assert (found["command_line"], found["yaml"], found["default"]) == (0.25, 0.75, 0.5)
    assert found["sweep"] == [[0.1, 0.2], 0.2]
    assert found["other_runs"] is False


def test_the_run_configuration_holds_the_runs_own_options():
    """The run's own options are RunConfig's fields; its components' live in one mapping, each spelt as a field too."""
    from dataclasses import fields, replace

    from fedray.engine.config import RunConfig

    assert len(fields(RunConfig)) <= 35
    config = RunConfig(method="fed3r", lam=0.5, clip_norm=2.0, options={"x": 1})
    assert (config.lam, config.clip_norm, config.options, replace(config, lam=0.25).lam) == (0.5, 2.0, {"x": 1}, 0.25)
    assert replace(config, options={"y": 2}).component_options["lam"] == 0.5 and RunConfig().lam == 0.01



def test_a_plugin_option_may_not_take_a_component_options_name():
    """``--option secure_aggregation=...`` is not the flag (its postprocessor takes no such option): refused, as a run
    option's name, and not mixed into the components' options it would share a key with."""
    import pytest

    from fedray.core.errors import FedrayError
    from fedray.engine.config import resolve

    with pytest.raises(FedrayError, match="^--option secure_aggregation: secure_aggregation is a run option: use "
                                          "--secure-aggregation$"):
        resolve({}, {"method": "fed3r", "options": {"secure_aggregation": "true"}})
    flagged = resolve({}, {"method": "fed3r", "options": {"clip_norm": "1", "dp_noise": "0", "dp_delta": "1e-5"}})
    assert (flagged.clip_norm, flagged.postprocessor, flagged.options["dp_accountant"]) == (1.0, "dp", "pld")
