"""Run options are declared once, by the run (RunConfig) and its components (the catalogue): the command line, its
help and its defaults come from there; files and sweeps go through the same typing, and an unknown key is refused
with one line saying where it belongs."""

import re
from pathlib import Path

import pytest

from fedray.app.cli import build_parser, main
from fedray.app.api import KEYWORD_SPELLING
from fedray.engine.config import RUN_OPTIONS, RunConfig, catalogue, resolve
from fedray.engine.config_files import load_config_file, typed_options, typed_value
from fedray.core.errors import FedrayError
from fedray.methods import method_class
from fedray.core.options import options_of
from fedray.app.sweeps.spec import load_sweep
from tests.engine.test_run_start import no_ray_start

REPO = Path(__file__).resolve().parents[2]
NCM = f"{REPO / 'examples' / 'nearest_class_mean.py'}:NearestClassMean"
YOGI = f"{REPO / 'examples' / 'fedyogi.py'}:FedYogi"


def run_help(capsys, monkeypatch) -> dict[str, str]:
    """``fedray run --help`` on a terminal wide enough for one line per option: {flag: its line}."""
    monkeypatch.setenv("COLUMNS", "100000")
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    entries: dict[str, str] = {}
    flag = None
    for line in capsys.readouterr().out.splitlines():
        if line.startswith("  --"):
            flag = line.split()[0]
            entries[flag] = line.strip()
        elif flag and line.startswith("    "):  # the help under a long flag
            entries[flag] += " " + line.strip()
        else:
            flag = None
    return entries


def run_actions() -> dict:
    commands = next(a for a in build_parser()._actions if a.dest == "command")
    return {flag: action for action in commands.choices["run"]._actions for flag in action.option_strings}


def test_every_run_option_has_a_flag_with_help():
    actions = run_actions()
    for name in [*catalogue(), "options"]:
        flag = "--option" if name == "options" else "--" + name.replace("_", "-")
        assert flag in actions, flag
        assert actions[flag].help and actions[flag].help.strip(), flag
        assert actions[flag].default is None, f"{flag}: a config file's value must survive an absent flag"
    assert {"--config", "--resume", "--address"} <= actions.keys()


def test_run_help_shows_each_default_as_the_dataclass_holds_it(capsys, monkeypatch):
    shown = run_help(capsys, monkeypatch)
    for spec in catalogue().values():
        line = shown["--" + spec.name.replace("_", "-")]
        if spec.default is None:
            assert "(default: " in line, line  # what no value means, in words
        elif spec.default is False:
            assert "default" not in line, line  # a flag: off unless given
        else:
            assert line.endswith(f"(default {spec.default})"), line


def test_run_help_defaults_written_out(capsys, monkeypatch):
    shown = run_help(capsys, monkeypatch)
    assert shown["--method"].endswith("(default fed3r)")
    assert shown["--lam"].endswith("(default 0.01)")
    assert shown["--weight-decay"].endswith("(default 4e-05)")
    assert shown["--entk-dim"].endswith("(default 100000)")
    assert shown["--tct-lr"].endswith("(default 5e-05)")
    assert shown["--adam-tau"].endswith("(default 0.001)")
    assert shown["--clients-per-round"].endswith("(default: 10)")
    assert shown["--server-lr"].endswith("(default: the server optimizer's own: fedavg 1, fedavgm 1, fedadam 0.01, "
                                         "fedadagrad 0.01, fedyogi 0.01)")
    assert shown["--prox-mu"].endswith("(default: 0.01 with fedprox)")
    assert "{constant,cosine,step}" in shown["--lr-schedule"]


def test_method_options_take_their_defaults_from_the_method_classes():
    config = RunConfig()
    assert (config.lam, config.bias, config.rf_dim, config.gamma, config.means_per_class) == (0.01, False, 5000, 0.1, 1)
    assert (config.server_momentum, config.adam_beta1, config.adam_beta2, config.adam_tau) == (0.9, 0.9, 0.99, 1e-3)


@pytest.mark.parametrize(("key", "value", "expected"), [
    ("lam", "1e-3", 0.001),       # YAML reads 1e-3 as a string
    ("lam", 2, 2.0),
    ("rounds", None, None),
    ("clients_per_round", 20, 20),
    ("bias", True, True),
])
def test_file_values_are_typed(key, value, expected):
    typed = typed_value(Path("run.yaml"), key, value)
    assert typed == expected and type(typed) is type(expected)


def test_run_and_plugin_options_share_one_typing_and_its_messages():
    lam, normalize = RUN_OPTIONS["lam"], options_of(method_class(NCM))["normalize"]
    with pytest.raises(FedrayError) as run_error:
        lam.coerce("small", "run.yaml")
    with pytest.raises(FedrayError) as plugin_error:
        normalize.coerce("maybe", "--option")
    assert str(run_error.value) == "run.yaml: option lam must be a number, got 'small'"
    assert str(plugin_error.value) == "--option: option normalize must be true or false, got 'maybe'"
    assert RUN_OPTIONS["quiet"].coerce("yes", "--option") is True and normalize.coerce("no", "--option") is False


def refusal(load, path, text: str) -> str:
    """The one-line error of ``load(path)`` on a file holding ``text``, with the path shortened to its name."""
    path.write_text(text)
    with pytest.raises(FedrayError) as error:
        load(path)
    return str(error.value).replace(str(path), path.name)


def config_error(tmp_path, text: str) -> str:
    return refusal(load_config_file, tmp_path / "run.yaml", text)


def test_unknown_config_keys_name_where_they_belong(tmp_path):
    assert config_error(tmp_path, "lamda: 0.1\n") == "run.yaml: unknown option(s) lamda; did you mean lam?"
    assert config_error(tmp_path, "learning_rate: 0.1\n") == "run.yaml: unknown option(s) learning_rate"
    (tmp_path / "run.yaml").write_text("alpha: 0.5\n")  # FedDyn's alpha, checked with the run's classes
    with pytest.raises(FedrayError, match=r"^unknown option\(s\) alpha \(--option\); alpha is an option of feddyn, not "
                                          r"of fed3r \(the dataset's alpha is given in its spec: \?alpha=...\); "):
        resolve(load_config_file(tmp_path / "run.yaml"), {})
    assert config_error(tmp_path, f"method: {NCM}\nnormalize: false\n") == \
        f"run.yaml: unknown option(s) normalize; normalize is an option of {NCM}: give it under options: {{normalize: ...}}"
    assert config_error(tmp_path, f"method: fedavg\nserver_optimizer: {YOGI}\nyogi_tau: 0.01\n") == \
        f"run.yaml: unknown option(s) yogi_tau; yogi_tau is an option of {YOGI}: give it under options: {{yogi_tau: ...}}"
    (tmp_path / "ok.yaml").write_text("method: feddyn\nalpha: 0.1\n")
    assert resolve(load_config_file(tmp_path / "ok.yaml"), {}).options == {"alpha": 0.1}, "a shipped algorithm's option"


def test_a_config_folder_is_called_a_folder(tmp_path):
    with pytest.raises(FedrayError) as refused:
        load_config_file(tmp_path)
    assert str(refused.value) == f"{tmp_path}: is a folder, not a config file; name a YAML file"
    (tmp_path / "config.yaml").write_text("method: fed3r\n")  # a run's folder
    with pytest.raises(FedrayError) as refused:
        load_config_file(tmp_path)
    assert str(refused.value) == f"{tmp_path}: is a folder, not a config file; did you mean {tmp_path / 'config.yaml'}?"


def sweep_error(tmp_path, text: str) -> str:
    return refusal(load_sweep, tmp_path / "sweep.yaml", text)


def test_unknown_sweep_keys_name_where_they_belong(tmp_path):
    assert sweep_error(tmp_path, "name: x\ngrid: {lamda: [0.1]}\n") == "sweep.yaml: grid.lamda is not a run option; did you mean lam?"
    assert sweep_error(tmp_path, "name: x\ngrid: {split: [classes]}\n") == \
        "sweep.yaml: grid.split is not a run option (split is an option of the dataset: write grid.dataset.split)"
    assert sweep_error(tmp_path, "name: x\nbase: {split: classes}\n") == \
        "sweep.yaml: base.split is not a run option (split is an option of the dataset: give it in base.dataset as ?split=...)"
    assert sweep_error(tmp_path, "name: x\ngrid: {yogi_tau: [0.1]}\n") == \
        "sweep.yaml: grid.yogi_tau is not a run option (a plugin's option is written grid.options.yogi_tau)"
    for key in ("num_shards", "cpus_per_shard", "num_trainers", "cpus_per_trainer"):
        assert sweep_error(tmp_path, f"name: x\nbase: {{{key}: 2}}\n") == \
            f"sweep.yaml: base.{key} is the sweep's to set: shards_per_trial (a trial's shards, or its trainers when it " \
            "fine-tunes) and cpus_per_shard (the CPUs of each)"
    assert sweep_error(tmp_path, "name: x\ngrid: {out: [a, b]}\n") == \
        "sweep.yaml: grid.out is set for every trial by fedray sweep --out"
    assert sweep_error(tmp_path, "name: x\nmethod: fed3r\n") == \
        "sweep.yaml: unknown key(s) method; a sweep has name, base, grid, random, num_samples, shards_per_trial, " \
        "cpus_per_shard, gpus_per_shard, driver_cpus; method is a run option: give it under base: (or grid:, random:)"
    assert sweep_error(tmp_path, "name: x\nnum_sample: 2\n") == \
        "sweep.yaml: unknown key(s) num_sample; a sweep has name, base, grid, random, num_samples, shards_per_trial, " \
        "cpus_per_shard, gpus_per_shard, driver_cpus; did you mean num_samples?"


@pytest.mark.parametrize(("method", "server_optimizer"), [
    ("fedavg", YOGI), ("fedprox", "fedadam"), ("scaffold", "fedavgm"),  # plain averaging on the server: replaced
    ("fedadam", "fedadam"), ("fedavgm", "fedavgm"),                     # a method's own server optimizer, named
    ("fedyogi", "fedyogi"), ("fedprox", "fedadagrad"),
])
def test_a_server_optimizer_replaces_plain_averaging_only(method, server_optimizer):
    config = resolve({}, {"method": method, "server_optimizer": server_optimizer})
    assert config.server_optimizer == server_optimizer


OWNED = {  # each option of a built-in class, the classes that declare it, and its default there: written out
    "lam": (["fed3r", "fed3r-rf", "ffc"], 0.01), "bias": (["fed3r", "fed3r-rf", "ffc"], False),
    "rf_dim": (["fed3r-rf"], 5000), "rf_sigma": (["fed3r-rf"], None), "gamma": (["fedcof", "fedcof-oracle"], 0.1),
    "means_per_class": (["fedcof"], 1), "distance": (["fedncm"], "cosine"), "covariance": (["fedcof-oracle"], "full"),
    "between_class": (["fedcof", "fedcof-oracle"], False),
    "virtual_per_class": (["ccvr"], 100), "virtual_epochs": (["ccvr"], 10), "virtual_lr": (["ccvr"], 0.01),
    "virtual_batch_size": (["ccvr"], 64), "virtual_momentum": (["ccvr"], 0.9),
    "server_lr": (["fedavg", "fedavgm", "fedadam", "fedadagrad", "fedyogi"], None),
    "server_momentum": (["fedavgm"], 0.9), "adam_beta1": (["fedadam", "fedadagrad", "fedyogi"], 0.9),
    "adam_beta2": (["fedadam", "fedyogi"], 0.99), "adam_tau": (["fedadam", "fedadagrad", "fedyogi"], 1e-3),
    "adam_bias_correction": (["fedadam", "fedyogi"], False),
    "prox_mu": (["fedprox"], None), "variant": (["scaffold"], "I"),
    # the components a run has when it trains, on SphereFed's head, fine-tuning on images, with TCT's stage 2
    "client_lr": (["local SGD"], 0.1), "weight_decay": (["local SGD"], 4e-5), "batch_size": (["local SGD"], 50),
    "local_epochs": (["local SGD"], 5), "client_momentum": (["local SGD"], 0.0),
    "lr_schedule": (["local SGD"], "constant"), "lr_milestones": (["local SGD"], None),
    "lr_gamma": (["local SGD"], 0.1), "temperature": (["local SGD"], 1.0),
    "sphere_dim": (["SphereFed's head"], None), "sphere_loss": (["SphereFed's head"], "mse"),
    "backbone": (["fine-tuning on images"], "mobilenet_v2"), "weights": (["fine-tuning on images"], "imagenet"),
    "image_size": (["fine-tuning on images"], 224),
    **{name: (["TCT's stage 2"], default) for name, default in (
        ("entk_dim", 100_000), ("entk_fp16", False), ("entk_chunk", 32), ("tct_rounds", 100),
        ("tct_local_steps", 500), ("tct_lr", 5e-5), ("tct_solver", "scaffold"), ("tct_projection", None),
        ("tct_lam", 0.0), ("tct_fedavg", False), ("tct_no_normalization", False), ("tct_loss", "mse"),
        ("entk_params", "all"))},
    # the clock's components: each option None when not given (a run that gives none has no clock)
    "devices": (["the clients' devices"], None),
    **{name: (["the clock's choices"], None) for name in ("availability", "selector", "eval_every_s")},
    **{name: (["synchronous rounds"], None) for name in ("over_commit", "deadline", "stragglers")},
    **{name: (["asynchronous rounds"], None) for name in ("scheduler", "concurrency", "buffer", "staleness",
                                                        "max_staleness", "mixing", "staleness_divide")},
}


def test_the_options_of_built_in_classes_are_theirs_in_the_run_and_its_help(capsys, monkeypatch):
    owned = {name: spec for name, spec in catalogue().items() if spec.kind in ("class", "component")}
    assert {name: (list(spec.owners), spec.default) for name, spec in owned.items()} == OWNED
    shown = run_help(capsys, monkeypatch)
    from fedray.methods.training_algorithms import FedProx
    from fedray.methods.training.server import ServerAdam
    for flag, owner, name in (("--prox-mu", FedProx, "prox_mu"), ("--gamma", method_class("fedcof"), "gamma"),
                              ("--adam-tau", ServerAdam, "adam_tau")):
        assert shown[flag].split(maxsplit=2)[2].startswith(options_of(owner)[name].help + " (default")


@pytest.mark.parametrize(("option", "flag"), [
    ({"method": "fedprox", "options": {"prox_mu": "0.05"}}, {"method": "fedprox", "prox_mu": 0.05}),
    ({"method": "fed3r", "options": {"lam": 2}}, {"method": "fed3r", "lam": 2.0}),
    ({"method": "fedavgm", "options": {"server_momentum": "0.5"}}, {"method": "fedavgm", "server_momentum": 0.5}),
])
def test_an_owned_option_given_as_option_is_the_run_option(option, flag):
    assert resolve({}, option) == resolve({}, flag)
    assert resolve(option, {}) == resolve(flag, {})  # a file's options: {prox_mu: ...}
    assert resolve(option, {}).options == {}


def test_an_owned_option_on_the_command_line_wins_over_the_file_either_way():
    assert resolve({"method": "fedprox", "prox_mu": 0.2}, {"options": {"prox_mu": "0.3"}}).prox_mu == 0.3
    assert resolve({"method": "fedprox", "options": {"prox_mu": 0.2}}, {"prox_mu": 0.3}).prox_mu == 0.3
    with pytest.raises(FedrayError, match=r"^prox_mu is given twice: as --prox-mu and as --option prox_mu"):
        resolve({}, {"method": "fedprox", "prox_mu": 0.3, "options": {"prox_mu": "0.3"}})


def test_an_owned_option_under_a_files_options_is_typed_and_named_with_the_file(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("method: fedprox\noptions: {prox_mu: 1e-3}\n")
    assert load_config_file(path) == {"method": "fedprox", "prox_mu": 0.001, "options": {}}
    path.write_text("method: fedprox\noptions: {prox_mu: strong}\n")
    with pytest.raises(FedrayError, match=rf"^{re.escape(str(path))}: option prox_mu must be a number, got 'strong'$"):
        load_config_file(path)
    path.write_text("method: fedprox\nprox_mu: 0.1\noptions: {prox_mu: 0.2}\n")
    with pytest.raises(FedrayError, match=rf"^{re.escape(str(path))}: prox_mu is given twice: as --prox-mu and as --option"):
        load_config_file(path)


def test_the_options_of_the_algorithms_shipped_as_plugins_are_in_the_help_under_their_owner(capsys, monkeypatch):
    from fedray.methods.training_algorithms import BUILT_IN, algorithm_class

    shown = run_help(capsys, monkeypatch)
    shipped = [(name, key, option) for name, spec in BUILT_IN.items() if isinstance(spec, str)
               for key, option in options_of(algorithm_class(name)).items()]
    assert [(name, key) for name, key, _ in shipped] == [("feddyn", "alpha")]  # FedNova has none
    for _, key, option in shipped:
        flag = "--" + key.replace("_", "-")
        assert shown[flag].split(maxsplit=2)[2] == f"{option.help} (default {option.default})"
    monkeypatch.setenv("COLUMNS", "100000")
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    assert "options of feddyn (training algorithm):\n  --alpha ALPHA " in capsys.readouterr().out


def resolved_command_line(monkeypatch, *args: str) -> RunConfig:
    """The configuration ``fedray run ARGS`` resolves, the run itself not started."""
    import fedray.engine.run_config

    seen = []

    def capture(config, **_):
        seen.append(config)
        raise FedrayError("captured")

    monkeypatch.setattr(fedray.engine.run_config, "run", capture)
    no_ray_start(monkeypatch)  # fedray run begins no Ray before it reaches the engine
    assert main(["run", "--quiet", "--out", "unused", *args]) == 2
    return seen[0]


def test_a_shipped_algorithms_option_is_a_flag_a_file_key_a_keyword_and_a_sweep_key(monkeypatch, capsys, tmp_path):
    by_option = resolved_command_line(monkeypatch, "--method", "feddyn", "--option", "alpha=0.1")
    assert by_option.options == {"alpha": 0.1}
    assert resolved_command_line(monkeypatch, "--method", "feddyn", "--alpha", "0.1") == by_option
    path = tmp_path / "run.yaml"
    path.write_text("method: feddyn\nout: unused\nquiet: true\nalpha: 0.1\n")
    assert resolve(load_config_file(path), {}) == by_option
    keywords = typed_options({"method": "feddyn", "out": "unused", "quiet": True, "alpha": 0.1}, "fedray.run", KEYWORD_SPELLING)
    assert resolve(keywords, {}) == by_option
    assert load_sweep(write_sweep(tmp_path, "grid: {method: [feddyn], alpha: [0.1, 0.2]}")).grid == {
        "method": ["feddyn"], "options.alpha": [0.1, 0.2]}


DATASET_ALPHA = " (the dataset's alpha is given in its spec: ?alpha=...)"


@pytest.mark.parametrize("args, message", [
    (["--method", "fedavg", "--option", "alpha=0.1"], "unknown option(s) alpha (--option); alpha is an option of "
     f"feddyn, not of fedavg{DATASET_ALPHA}; this run has no plugin options (its built-in classes' options: fedray run --help)"),
    (["--method", "fedavg", "--alpha", "0.1"], "unknown option(s) alpha (--option); alpha is an option of feddyn, "
     f"not of fedavg{DATASET_ALPHA}; this run has no plugin options (its built-in classes' options: fedray run --help)"),
    (["--method", "fedavg", "--option", "beta=0.1"], "unknown option(s) beta (--option); this run has no plugin "
     "options (its built-in classes' options: fedray run --help)"),
    (["--method", "feddyn", "--alpha", "0.1", "--option", "alpha=0.2"], "fedray run: alpha is given twice: as --alpha "
     "(or alpha: in YAML) and as --option alpha (or options: {alpha: ...})"),
])
def test_a_shipped_algorithms_option_elsewhere_or_twice_is_one_line(capsys, tmp_path, args, message):
    assert main(["run", "--quiet", "--out", str(tmp_path / "out"), *args]) == 2
    assert capsys.readouterr().err == f"fedray: error: {message}\n"
    assert not (tmp_path / "out").exists()


def write_sweep(tmp_path, text: str) -> Path:
    path = tmp_path / "sweep.yaml"
    path.write_text(f"name: x\n{text}\n")
    return path


def test_a_repeated_postprocessor_adds_to_the_list_in_order():
    args = build_parser().parse_args(["run", "--postprocessor", "clip.py:Clip", "--postprocessor", "noise.py:Noise,q.py:Q",
                                      "--postprocessor", "mask:Mask"])
    assert args.postprocessor == "clip.py:Clip,noise.py:Noise,q.py:Q,mask:Mask"
    assert build_parser().parse_args(["run", "--postprocessor", "clip.py:Clip"]).postprocessor == "clip.py:Clip"


NOT_APPLYING = [
    ({"method": "fedavg", "lam": 0.1}, "--lam applies to fed3r, fed3r-rf, ffc (closed-form methods), not to this run (--method fedavg)"),
    ({"method": "fedavg", "gamma": 0.5}, "--gamma applies to fedcof, fedcof-oracle (closed-form methods), not to this run (--method fedavg)"),
    ({"method": "fed3r", "client_lr": 0.5}, "--client-lr applies to gradient methods, not to this run (--method fed3r)"),
    ({"method": "fedavg", "server_momentum": 0.5},
     "--server-momentum applies to fedavgm (server optimizer), not to this run (--method fedavg with server optimizer fedavg)"),
    ({"method": "fedavgm", "adam_beta1": 0.5},
     "--adam-beta1 applies to fedadam, fedadagrad, fedyogi (server optimizers), not to this run (--method fedavgm with "
     "server optimizer fedavgm)"),
    ({"method": "fedadagrad", "adam_beta2": 0.5},  # Adagrad's v has no β₂
     "--adam-beta2 applies to fedadam, fedyogi (server optimizers), not to this run (--method fedadagrad with server "
     "optimizer fedadagrad)"),
    ({"method": "fedavg", "prox_mu": 0.1}, "--prox-mu applies to fedprox (training algorithm), not to this run (--method fedavg)"),
    ({"method": "fed3r", "sphere_dim": 4}, "--sphere-dim applies to SphereFed (--head sphere), not to this run (--method fed3r)"),
    ({"method": "fedavg", "base": "fedprox"}, "--base applies to --method tct, not to this run (--method fedavg)"),
]


@pytest.mark.parametrize("values, message", NOT_APPLYING)
def test_an_option_that_does_not_apply_to_the_run_is_refused_from_the_command_line_and_a_file(values, message):
    for file_values, cli_values in ((values, {}), ({}, values)):
        with pytest.raises(FedrayError) as refused:
            resolve(file_values, cli_values)
        assert str(refused.value) == message


def test_a_flag_that_does_not_apply_is_refused_even_at_its_default_value(capsys, tmp_path):
    assert main(["run", "--method", "fedavg", "--server-momentum", "0.9", "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == ("fedray: error: --server-momentum applies to fedavgm (server optimizer), not to "
                                       "this run (--method fedavg with server optimizer fedavg)\n")
    assert resolve({"method": "fedavg", "server_momentum": 0.9}, {}).method == "fedavg", \
        "a file's value at the default is what every config.yaml holds: not refused"
    assert not (tmp_path / "out").exists()


def test_an_option_applies_where_a_stage_of_the_run_takes_it():
    assert resolve({}, {"method": "fedavg", "init": "fed3r", "lam": 0.1}).lam == 0.1
    assert resolve({}, {"method": "fedavgm", "server_momentum": 0.5}).server_momentum == 0.5
    assert resolve({}, {"method": "fedavg", "server_optimizer": "fedadam", "adam_beta1": 0.5}).adam_beta1 == 0.5
    assert resolve({}, {"method": "fedyogi", "adam_beta2": 0.5}).adam_beta2 == 0.5
    assert resolve({}, {"method": "fedavg", "head": "sphere", "sphere_dim": 4}).sphere_dim == 4
