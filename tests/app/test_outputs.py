"""Nothing lost at the end: unusable output locations refused before any work, a run's files completed as a whole,
a full disk refused in one line with the previous files kept, stale temporaries cleaned, other files (a training run's
checkpoint) left alone, files created with the user's umask."""

import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import fedray.data.registry
import fedray.app.extract.features
import fedray.engine.run_config
import fedray.app.sweeps.tuning
from analysis.results import result_files
from fedray.app.cli import main
from fedray.core.errors import FedrayError
from fedray.core.folder_lock import LOCK
from fedray.engine.config import resolve
from fedray.engine.checkpoint import CHECKPOINT
from fedray.core.results import write_atomically
from tests.app.test_cli import SMALL_RUN, SPEC, cli, expect_error, metrics, run_cli
from tests.core.test_folder_lock import held_by_another_process  # noqa: F401 (a fixture)
from tests.full_disk import fill, hashes, small_disk  # noqa: F401 (a fixture)
from tests.images import write_squeezenet_weights

REPO = Path(__file__).resolve().parents[2]
RUN_FILES = ["classifier.npz", "config.yaml", "metrics.parquet", "run.json"]


class WorkStarted(AssertionError):
    """Raised by the first step of a command's work: the output check should have refused before it."""


def no_work(*args, **kwargs):
    raise WorkStarted


@pytest.fixture
def work_forbidden(monkeypatch):
    """Every command's first step of work fails the test: what is refused must be refused before it."""
    monkeypatch.setattr(fedray.engine.run_config, "load_federation", no_work)
    monkeypatch.setattr(fedray.app.sweeps.tuning, "init_ray", no_work)
    monkeypatch.setattr(fedray.app.extract.features, "load_federation", no_work)
    monkeypatch.setattr(fedray.data.registry, "load_federation", no_work)


def sweep_file(tmp_path) -> Path:
    path = tmp_path / "sweep.yaml"
    path.write_text(f"name: tiny\nbase:\n  dataset: '{SPEC}'\n  method: fed3r\ngrid:\n  seed: [0, 1]\n")
    return path


@pytest.fixture(scope="module")
def weights_file(tmp_path_factory) -> Path:
    return write_squeezenet_weights(tmp_path_factory.mktemp("weights") / "squeezenet.pt")


def command(kind: str, out: Path, tmp_path: Path, weights_file: Path) -> list:
    """``fedray KIND`` writing to ``out`` (run, sweep, extract: a folder; export: a file)."""
    if kind == "sweep":
        return ["sweep", "--config", sweep_file(tmp_path), "--out", out, "--quiet"]
    return {
        "run": ["run", "--dataset", SPEC, "--out", out, *SMALL_RUN],
        "extract": ["extract", "--dataset", f"imagefolder:{tmp_path / 'images'}", "--backbone", "squeezenet1_1",
                    "--weights", weights_file, "--image-size", "64", "--out", out, "--quiet"],
        "export": ["data", "export", SPEC, "--out", out],
    }[kind]


def files_under(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# --- unusable --out: refused before any work -----------------------------------------------------------------


@pytest.mark.parametrize("kind, case", [(kind, "a-file") for kind in ("run", "sweep", "extract")] +
                         [(kind, "under-a-file") for kind in ("run", "sweep", "extract", "export")])
def test_an_out_that_is_or_is_under_a_file_is_refused_before_any_work(work_forbidden, weights_file, tmp_path, capsys,
                                                                       kind, case):
    existing = tmp_path / "results.txt"
    existing.write_text("someone's notes\n")
    out = existing if case == "a-file" else existing / "out" / ("x.parquet" if kind == "export" else "run")
    args = command(kind, out, tmp_path, weights_file)
    before = files_under(tmp_path)
    err = expect_error(capsys, args)
    where = "" if case == "a-file" else f"{existing} "
    assert err == f"fedray: error: --out {out}: {where}is a file, not a folder\n"
    assert files_under(tmp_path) == before


def test_data_export_to_a_folder_is_refused_before_any_work(work_forbidden, tmp_path, capsys):
    (tmp_path / "kept.txt").write_text("kept\n")
    err = expect_error(capsys, ["data", "export", SPEC, "--out", tmp_path])
    assert err == f"fedray: error: --out {tmp_path}: is a folder; name the file to write, e.g. {tmp_path / 'federation.parquet'}\n"
    assert os.listdir(tmp_path) == ["kept.txt"]


def unprivileged() -> list[str]:
    """A command prefix that takes root's power to write anywhere (CAP_DAC_OVERRIDE) away; none when not root."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("running as root without setpriv: no way to make a folder unwritable")
    capabilities = "-dac_override,-dac_read_search"
    return [setpriv, f"--bounding-set={capabilities}", f"--inh-caps={capabilities}"]


UNPRIVILEGED_CLI = """
import contextlib, io, json, sys
import fedray.data.registry, fedray.app.extract.features, fedray.engine.run_config, fedray.app.sweeps.tuning

def no_work(*args, **kwargs):
    raise SystemExit("work started: the output check should have refused before it")

for module, name in ((fedray.engine.run_config, "load_federation"), (fedray.app.sweeps.tuning, "init_ray"),
                     (fedray.app.extract.features, "load_federation"), (fedray.data.registry, "load_federation")):
    setattr(module, name, no_work)
from fedray.app.cli import main
from fedray.core.errors import FedrayError
from fedray.engine.config import resolve

results = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        results.append((main(argv), err.getvalue()))
print(json.dumps(results))
"""


@pytest.mark.slow  # whole runs; the full suite (CI) runs it, the fast layer keeps a lighter sibling
def test_an_out_in_a_read_only_folder_is_refused_before_any_work(weights_file, tmp_path):
    """Every command, --out a read-only folder, a folder to create in it, or one in a folder that may not be searched:
    one process without root's power to write anywhere runs them all, each command's work replaced by a failure."""
    prefix = unprivileged()
    read_only, locked = tmp_path / "read-only", tmp_path / "locked"
    read_only.mkdir()
    (read_only / "kept.txt").write_text("kept\n")
    locked.mkdir()
    cases = [(kind, out, "cannot create files in it") for kind, out in
             [("run", read_only), ("sweep", read_only), ("extract", read_only)]]
    cases += [(kind, read_only / name, "cannot create the folder") for kind, name in
              [("run", "run"), ("sweep", "sweeps"), ("extract", "cache")]]
    cases += [("export", read_only / "federation.parquet", f"cannot create files in {read_only}"),
              ("export", read_only / "sub" / "federation.parquet", f"cannot create the folder {read_only / 'sub'}")]
    cases += [(kind, locked / "out", "cannot reach it") for kind in ("run", "sweep", "extract")]
    cases += [("export", locked / "federation.parquet", "cannot reach it")]
    commands = [[str(a) for a in command(kind, out, tmp_path, weights_file)] for kind, out, _ in cases]
    read_only.chmod(0o555)
    locked.chmod(0o000)
    try:
        done = subprocess.run([*prefix, sys.executable, "-c", UNPRIVILEGED_CLI, json.dumps(commands)], cwd=REPO,
                              capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=300)
    finally:
        read_only.chmod(0o755)
        locked.chmod(0o755)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.splitlines()[-1])
    for (kind, out, needle), (rc, err) in zip(cases, results, strict=True):
        assert rc == 2, (kind, out, err)
        assert err == f"fedray: error: --out {out}: {needle} (Permission denied)\n", (kind, out, err)
    assert sorted(p.name for p in read_only.iterdir()) == ["kept.txt"] and list(locked.iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["locked", "read-only", "sweep.yaml"]


# --- a run's files: complete as a whole, temporaries cleaned, nothing else touched ---------------------------

KILLING_DRIVER = '''
import os, signal, sys

killed_at, argv = int(sys.argv[1]), sys.argv[2:]
out = os.path.abspath(argv[argv.index("--out") + 1])
replace, renames = os.replace, []

def dying(source, target):
    """Every rename as it is, but the process is killed instead of the KILLED_AT-th rename into --out."""
    if os.path.dirname(os.path.abspath(target)) == out:
        renames.append(target)
        if len(renames) == killed_at:
            os.kill(os.getpid(), signal.SIGKILL)
    replace(source, target)

os.replace = dying
from fedray.app.cli import main
from fedray.core.errors import FedrayError
from fedray.engine.config import resolve
sys.exit(main(argv))
'''


def end_session(session: int) -> None:
    """SIGKILL whatever the killed driver left running in its own session (its embedded Ray): only what this test started."""
    for pid in (int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()):
        try:
            if os.getsid(pid) == session:
                os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


@pytest.fixture(scope="module")
def previous_run(ray_session, tmp_path_factory):
    """A complete fed3r run (seed 0, κ 20) to reuse folders of."""
    out = tmp_path_factory.mktemp("previous") / "run"
    assert main(["run", "--method", "fed3r", "--dataset", SPEC, "--out", str(out), *SMALL_RUN,
                            "--clients-per-round", "20", "--eval-every", "100"]) == 0
    return out


@pytest.mark.slow
@pytest.mark.parametrize("killed_at, left, temporaries", [
    (1, "previous", [".classifier.npz.", ".config.yaml.", ".metrics.parquet.", ".metrics.parquet.", ".run.json."]),
    (8, ["classifier.npz", "config.yaml", "run.json"],
     [".classifier.npz.", ".config.yaml.", ".metrics.parquet.", ".metrics.parquet.", ".run.json."]),
], ids=["killed-once-every-file-is-written", "killed-before-the-last-rename"])
def test_a_run_killed_while_writing_never_leaves_a_mix_that_looks_complete(previous_run, tmp_path, capsys, killed_at, left,
                                                                          temporaries):
    """The swap renames the previous run's four files aside (metrics.parquet first), then the new run's four in
    (metrics.parquet last): killed before the first, the previous run is as it was; killed before the eighth, the
    folder holds the new classifier, config and run.json without metrics.parquet, which analysis does not take for a
    run."""
    out = tmp_path / "reused"
    shutil.copytree(previous_run, out)
    previous = files_under(out)
    new_run = ["--clients-per-round", "40", "--seed", "5", "--lam", "0.5", "--eval-every", "100"]
    args = ["run", "--method", "fed3r", "--dataset", SPEC, "--out", out, *SMALL_RUN, *new_run]
    process = subprocess.Popen([sys.executable, "-c", KILLING_DRIVER, str(killed_at), *map(str, args)], cwd=REPO,
                               env={**os.environ, "PYTHONPATH": str(REPO)}, start_new_session=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert process.wait(timeout=300) == -signal.SIGKILL
    finally:
        end_session(process.pid)

    names = sorted(os.listdir(out))
    assert LOCK in names, "a SIGKILLed run leaves its lock file (released by the kernel: it blocks nothing)"
    names.remove(LOCK)
    assert sorted(n[: -len("XXXXXXXX.tmp")] for n in names if n.endswith(".tmp")) == temporaries
    if left == "previous":
        assert {name: data for name, data in files_under(out).items() if not name.endswith(".tmp") and name != LOCK} == \
            previous
        assert result_files([out]) == [out / "metrics.parquet"]
    else:
        assert [n for n in names if not n.endswith(".tmp")] == left
        assert yaml.safe_load((out / "config.yaml").read_text())["seed"] == 5, "the new run's config"
        with pytest.raises(FedrayError, match="no results.parquet or metrics.parquet"):
            result_files([out])  # analysis sees no complete run there

    rc, _, err = run_cli(capsys, SPEC, out, *new_run)
    assert rc == 0, err
    assert sorted(os.listdir(out)) == RUN_FILES, "the next run completes the folder and removes the stale temporaries"
    assert [(row["seed"], row["clients_per_round"], row["lam"]) for row in metrics(out)] == [(5, 40, 0.5)]


@pytest.mark.slow  # whole runs; the full suite (CI) runs it, the fast layer keeps a lighter sibling
def test_a_later_run_removes_only_its_own_stale_temporaries(previous_run, tmp_path, capsys):
    out = tmp_path / "run"
    shutil.copytree(previous_run, out)
    stale = [".metrics.parquet.ab12cd34.tmp", ".config.yaml.k3_9xq0z.tmp", ".checkpoint.pt.0f1e2d3c.tmp"]
    others = [".metrics.parquet.mine.tmp", ".notes.ab12cd34.tmp", "metrics.parquet.ab12cd34.tmp", "draft.tmp"]
    for name in stale + others:
        (out / name).write_text("left over\n")
    rc, _, err = run_cli(capsys, SPEC, out, "--eval-every", "100")
    assert rc == 0, err
    assert sorted(os.listdir(out)) == sorted(RUN_FILES + others)


def test_export_removes_its_own_stale_temporaries(tmp_path, capsys):
    out = tmp_path / "federation.parquet"
    (tmp_path / ".federation.parquet.ab12cd34.tmp").write_text("left over\n")
    (tmp_path / ".other.parquet.ab12cd34.tmp").write_text("someone else's\n")
    rc, _, err = cli(capsys, "data", "export", SPEC, "--out", out)
    assert rc == 0, err
    assert sorted(os.listdir(tmp_path)) == [".other.parquet.ab12cd34.tmp", "federation.parquet"]


@pytest.mark.parametrize("method, extra", [("fed3r", []), ("fedavg", ["--rounds", "2", "--eval-every", "1"])],
                         ids=["closed-form", "training-that-wrote-no-checkpoint"])
def test_a_run_leaves_a_checkpoint_it_did_not_write(ray_session, tmp_path, capsys, method, extra):
    out = tmp_path / "training"
    out.mkdir()
    (out / CHECKPOINT).write_bytes(b"a training run's checkpoint")
    rc, _, err = run_cli(capsys, SPEC, out, *extra, method=method)
    assert rc == 0, err
    assert sorted(os.listdir(out)) == sorted([*RUN_FILES, CHECKPOINT])
    assert (out / CHECKPOINT).read_bytes() == b"a training run's checkpoint"


@pytest.mark.parametrize("method", ["fed3r", "fedavg"])
def test_a_run_into_a_folder_another_run_holds_is_refused_before_any_work(work_forbidden, held_by_another_process,
                                                                           capsys, method):
    out, holder = held_by_another_process
    (out / CHECKPOINT).write_bytes(b"the running training run's checkpoint")
    before = files_under(out)
    expect_error(capsys, ["run", "--method", method, "--dataset", SPEC, "--out", out, *SMALL_RUN],
                 f"--out {out}: in use by another fedray run (pid {holder.pid})")
    assert files_under(out) == before


@pytest.mark.slow  # whole runs; the full suite (CI) runs it, the fast layer keeps a lighter sibling
def test_a_run_into_a_fine_tuning_folder_does_not_leave_the_old_model_beside_its_results(previous_run, tmp_path, capsys):
    out = tmp_path / "run"
    shutil.copytree(previous_run, out)
    (out / "model.pt").write_bytes(b"an earlier fine-tuned model")
    rc, _, err = run_cli(capsys, SPEC, out, "--eval-every", "100")
    assert rc == 0, err
    assert sorted(os.listdir(out)) == RUN_FILES


# --- a full disk: one line, the previous files as they were, no temporaries ---------------------------------------


def test_a_run_onto_a_full_disk_keeps_the_previous_run(previous_run, small_disk, capsys):
    out = small_disk / "run"
    shutil.copytree(previous_run, out)
    fill(small_disk)
    previous = hashes(small_disk)
    rc, _, err = run_cli(capsys, SPEC, out, "--seed", "5", "--eval-every", "100")
    assert rc == 2
    assert re.fullmatch(rf"fedray: error: disk full: writing {re.escape(str(out))} needed [0-9.]+ kB, 0 kB free\n", err), err
    assert hashes(small_disk) == previous


def test_data_export_onto_a_full_disk_keeps_the_previous_file(small_disk, capsys):
    """The estimate: 2,099 rows of 8 float32 features and a label, 4 × 9 bytes each: 75,564 bytes, 19 blocks of 4 kB."""
    out = small_disk / "federation.parquet"
    rc, _, err = cli(capsys, "data", "export", SPEC, "--out", out)
    assert rc == 0, err
    fill(small_disk)
    previous = hashes(small_disk)
    err = expect_error(capsys, ["data", "export", SPEC, "--out", out])
    assert err == f"fedray: error: disk full: writing {out} needed 77.8 kB, 0 kB free\n"
    assert hashes(small_disk) == previous


# --- file modes: the umask, like any other tool ---------------------------------------------------------------


@pytest.fixture
def umask_027():
    previous = os.umask(0o027)
    yield 0o640
    os.umask(previous)


def test_written_files_follow_the_umask(umask_027, tmp_path):
    write_atomically(tmp_path / "a" / "file.txt", lambda p: p.write_text("x"))
    assert stat.S_IMODE((tmp_path / "a" / "file.txt").stat().st_mode) == umask_027


@pytest.mark.slow  # whole runs; the full suite (CI) runs it, the fast layer keeps a lighter sibling
def test_a_runs_files_follow_the_umask(ray_session, umask_027, tmp_path, capsys):
    rc, _, err = run_cli(capsys, SPEC, tmp_path / "run", "--eval-every", "100")
    assert rc == 0, err
    assert {name: stat.S_IMODE((tmp_path / "run" / name).stat().st_mode) for name in RUN_FILES} == \
        dict.fromkeys(RUN_FILES, umask_027)


# --- a row's configuration columns: the options that apply to its run ---------------------------------------------

CLOSED_FORM_OPTIONS = {"lam", "bias", "rf_dim", "rf_sigma", "distance", "gamma", "means_per_class", "covariance",
                       "between_class", "virtual_per_class", "virtual_epochs", "virtual_lr", "virtual_batch_size",
                       "virtual_momentum"}
TRAINING_OPTIONS = {"client_lr", "weight_decay", "batch_size", "local_epochs", "client_momentum", "lr_schedule",
                    "lr_milestones", "lr_gamma", "server_lr", "temperature", "init", "init_rounds",
                    "probe_ridge", "checkpoint_every", "client_state_memory", "head", "server_optimizer"}
SERVER_OPTIONS = {"server_momentum", "adam_beta1", "adam_beta2", "adam_tau", "adam_bias_correction"}
ALGORITHM_OPTIONS = {"prox_mu"}
SPHERE_OPTIONS = {"sphere_dim", "sphere_loss"}
IMAGE_OPTIONS = {"finetune", "backbone", "weights", "image_size"}
TCT_OPTIONS = {"base", "entk_dim", "entk_fp16", "entk_chunk", "tct_rounds", "tct_local_steps", "tct_lr", "tct_solver",
               "tct_projection", "tct_lam", "tct_fedavg", "tct_no_normalization", "tct_loss", "entk_params"}
EVERY_RUNS = {"method", "dataset", "clients_per_round", "participation", "sampling", "rounds", "eval_every", "seed",
              "backbone_macs", "num_trainers", "cpus_per_trainer", "num_shards", "cpus_per_shard"}


@pytest.mark.parametrize("values, columns", [
    ({"method": "fedncm"}, EVERY_RUNS | {"distance"}),
    ({"method": "fed3r-rf"}, EVERY_RUNS | {"lam", "bias", "rf_dim", "rf_sigma"}),
    ({"method": "fedcof"}, EVERY_RUNS | {"gamma", "means_per_class", "between_class"}),
    ({"method": "fedcof-oracle"}, EVERY_RUNS | {"gamma", "covariance", "between_class"}),
    ({"method": "ccvr"}, EVERY_RUNS | {"virtual_per_class", "virtual_epochs", "virtual_lr", "virtual_batch_size",
                                       "virtual_momentum"}),
    ({"method": "fedavg"}, EVERY_RUNS | TRAINING_OPTIONS),
    ({"method": "fedadam", "init": "fed3r"}, EVERY_RUNS | TRAINING_OPTIONS | {"lam", "bias", "adam_beta1", "adam_beta2",
                                                                        "adam_tau", "adam_bias_correction"}),
    ({"method": "fedavgm", "probe_ridge": True}, EVERY_RUNS | TRAINING_OPTIONS | {"lam", "bias", "server_momentum"}),
    ({"method": "fedprox", "head": "sphere"}, EVERY_RUNS | TRAINING_OPTIONS | SPHERE_OPTIONS | {"lam", "bias", "prox_mu"}),
    ({"method": "tct", "base": "fedprox"}, EVERY_RUNS | TRAINING_OPTIONS | IMAGE_OPTIONS | TCT_OPTIONS | {"prox_mu"}),
    ({"method": "fedavg", "finetune": "ftlp"}, EVERY_RUNS | TRAINING_OPTIONS | IMAGE_OPTIONS),
    ({"method": "tct"}, EVERY_RUNS | TRAINING_OPTIONS | IMAGE_OPTIONS | TCT_OPTIONS),
])
def test_a_rows_configuration_columns_are_the_options_that_apply_to_its_run(values, columns):
    assert set(resolve({}, values).metrics_columns()) == columns
    assert columns <= CLOSED_FORM_OPTIONS | TRAINING_OPTIONS | SERVER_OPTIONS | ALGORITHM_OPTIONS | SPHERE_OPTIONS | \
        IMAGE_OPTIONS | TCT_OPTIONS | EVERY_RUNS


def test_a_plugin_is_named_by_its_class_with_its_spec_beside_it():
    ncm = f"{REPO / 'examples' / 'nearest_class_mean.py'}:NearestClassMean"
    columns = resolve({}, {"method": ncm, "options": {"normalize": "false"}}).metrics_columns()
    assert (columns["method"], columns["method_spec"], columns["normalize"]) == ("NearestClassMean", ncm, False)
    assert set(columns) == EVERY_RUNS | {"method_spec", "normalize"}
    yogi, proximal = (f"{REPO / 'examples' / name}" for name in ("fedyogi.py:FedYogi", "proximal_client.py:Proximal"))
    columns = resolve({}, {"method": proximal, "server_optimizer": yogi}).metrics_columns()
    assert (columns["server_optimizer"], columns["server_optimizer_spec"], columns["method"],
            columns["method_spec"]) == ("FedYogi", yogi, "Proximal", proximal)
    assert {"yogi_beta1", "mu"} <= set(columns) and not SERVER_OPTIONS & set(columns)
