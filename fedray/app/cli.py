"""The ``fedray`` command line.

This module imports little at its top (no torch, no Ray), so that :func:`main`
handles Ctrl-C and SIGTERM from its first moments on; what a command needs is
imported when it runs.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import traceback
import typing
from pathlib import Path
from typing import TYPE_CHECKING

from fedray.core import interrupts
from fedray.core.errors import FedrayError
from fedray.core.numeric_options import check_numeric_options, command_line
from fedray.core.plugins import display_name, plugin_failure
from fedray.runtime.ray_start import end_process, ray_is_up

if TYPE_CHECKING:
    from fedray.core.options import Option
    from fedray.engine.config import RunConfig

VERBOSE_HELP = ("show what your code prints in Ray's workers (a plugin's client hooks, in the shards), each line "
                "after its worker's name (Ray folds repeated lines; RAY_DEDUP_LOGS=0 shows each); without it that goes "
                "to Ray's logs, /tmp/ray/session_latest/logs/worker-*.out on the node that ran it")
SHIPPED = "shipped:"
"""The argparse destination prefix of the options of the built-in algorithms shipped as plugins (``--alpha``)."""


def _run_parser(commands: argparse._SubParsersAction) -> None:
    """``fedray run``'s options, generated from the run's options (:func:`~fedray.engine.config.catalogue`): flag,
    type, choices, help and default."""
    from fedray.engine.config import REMOVED, catalogue
    from fedray.engine.run_options import GENERAL, GROUPS, RESOURCES, TRAINING, shipped_options

    parser = commands.add_parser("run", help="run one closed-form or gradient-based method on a federation",
                                 description="Run one method; writes metrics.parquet, classifier.npz and config.yaml to --out. "
                                 "Gradient methods train a softmax head on the features (linear probing).")
    parser.add_argument("--config", help="YAML file with any of the options below (command line wins)")
    groups = {GENERAL: parser, **{name: parser.add_argument_group(title) for name, title in GROUPS.items()}}
    for entry in catalogue().values():  # the options of built-in classes, in groups named after their owners
        if entry.group not in groups:
            groups[entry.group] = parser.add_argument_group(f"options of {entry.group}")
        _add_run_option(groups[entry.group], entry.option)
    parser.add_argument("--option", action="append", metavar="KEY=VALUE",
                        help="an option of the run's method, algorithm, server optimizer or postprocessor, "
                        "built-in (--option prox_mu=0.1 is --prox-mu 0.1) or your own (repeatable; see fedray "
                        "methods); OWNER.KEY=VALUE gives it to one class, named by its class name or a "
                        "built-in's --method name (--option Proximal.mu=0.1, --option fedprox.prox_mu=0.1): "
                        "needed when two of the run's classes declare KEY")
    for name, (owners, declared) in shipped_options().items():  # FedDyn's, ...: options of plugins shipped with fedray
        title = f"options of {', '.join(owners)} (training algorithm{'s' if len(owners) > 1 else ''})"
        if title not in groups:
            groups[title] = parser.add_argument_group(title)
        _add_option(groups[title], name, declared, f"{declared.help} (default {declared.default})".replace("%", "%%"),
                    dest=SHIPPED + name, metavar=name.upper())
    for name in REMOVED:  # refused in one line saying what replaced it (resolve), rather than by argparse
        parser.add_argument(command_line(name), help=argparse.SUPPRESS)
    groups[TRAINING].add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt (same options)")
    groups[RESOURCES].add_argument("--address", help="Ray cluster to join (default $RAY_ADDRESS, else an embedded local Ray)")
    groups[GENERAL].add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
    parser.set_defaults(handler=_cmd_run)


def _add_run_option(group: argparse._ActionsContainer, option: Option) -> None:
    """``--name`` for the run option ``option``; its argparse default stays None so a config file's value is kept."""
    help_text = option.help.replace("%", "%%") + default_note(option)
    if option.name == "postprocessor":  # each upload through all of them, in order: a repeated flag adds one
        group.add_argument(command_line(option.name), action=_Appended, metavar=option.metavar, help=help_text)
        return
    _add_option(group, option.name, option, help_text, choices=list(option.choices) if option.choices else None,
                metavar=option.metavar)


def _add_option(group: argparse._ActionsContainer, name: str, option: Option, help_text: str, **settings: object) -> None:
    """``--name`` for ``option``: a flag when it is a bool, else a value of its type; argparse's default None."""
    if option.type is bool:
        group.add_argument(command_line(name), action="store_const", const=True, help=help_text,
                           **({"dest": settings["dest"]} if "dest" in settings else {}))
        return
    group.add_argument(command_line(name), type=None if option.type is str else option.type, help=help_text, **settings)


class _Appended(argparse.Action):
    """A comma-separated list option given more than once: ``--postprocessor a --postprocessor b`` is ``--postprocessor a,b``."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:
        earlier = getattr(namespace, self.dest)
        setattr(namespace, self.dest, values if earlier is None else f"{earlier},{values}")


def default_note(option: Option) -> str:
    """`` (default VALUE)`` as the run holds it; for a ``None`` default, what it means; flags are off by default."""
    if option.default is False:
        return ""
    if option.default is None:
        return f" (default: {option.unset})"
    return f" (default {option.default})"


def _cmd_run(args: argparse.Namespace) -> None:
    from fedray.engine.config import resolve
    from fedray.engine.config_files import load_config_file, with_shipped_options

    file_values = load_config_file(args.config) if args.config else {}
    cli_values = {k: v for k, v in vars(args).items()
                  if k not in ("config", "address", "handler", "command", "command_line", "resume", "option", "verbose")
                  and not k.startswith(SHIPPED)}
    shipped = {k[len(SHIPPED):]: v for k, v in vars(args).items() if k.startswith(SHIPPED) and v is not None}
    cli_values = with_shipped_options({**cli_values, "options": parse_options(args.option or [])}, shipped, "fedray run")
    config = resolve(file_values, cli_values)
    with interrupts.reporting(lambda: _left_by_run(config)):
        _check_dataset(config.dataset)
        from fedray.engine.run_start import starting

        with starting(config, args.address, args.verbose) as (_, ray_start):  # Ray starts while torch imports
            ray_start.ray_imported()
            interrupts.import_whole("torch")
            from fedray.engine.run_config import run

            rows = run(config, address=args.address, resume=args.resume, verbose=args.verbose,
                       command=args.command_line, ray_start=ray_start).rows
    last = rows[-1]
    if last["diverged"]:
        raise FedrayError(f"{config.method} diverged in round {last['round']} (non-finite loss or update: lower --client-lr or --tct-lr?); "
                          f"rows up to there are in {config.out}")
    print(summary_line(config, last))


def _check_dataset(spec: str) -> None:
    """The checks of the run's dataset spec that need no data (its kind, its options, a population's and a re-split's),
    before torch is imported: a bad spec is refused in a fraction of a second, not after torch's seconds. A
    researcher's dataset function is imported there and may import torch itself, where a signal could cut the import
    short: torch is imported whole before it."""
    from fedray.data.registry import PLUGIN, check_spec, parse_spec

    if parse_spec(spec)[0] == PLUGIN:
        interrupts.import_whole("torch")
    check_spec(spec)


def summary_line(config: RunConfig, last: dict) -> str:
    """The line a finished run prints: its last row's test accuracy (and the stage that row is of), rounds, clients
    seen, upload, and where it wrote them: ``--out`` as given, or, inside Ray's copy of a job's ``--working-dir``
    (``ray job submit``), its absolute path on a second line saying so (:func:`~fedray.runtime.session.where_written`)."""
    from fedray.runtime.session import where_written

    folder, note = where_written(config.out)
    return (f"{what_ran(config)} on {config.dataset}: test accuracy {last['accuracy']:.4f} (stage {last['stage']}) after "
            f"{last['round']} rounds, {last['clients_seen']} clients seen, {last['bytes_up'] / 1e6:.1f} MB up → "
            + (config.out if note is None else f"{folder}\nnote: {note}"))


def what_ran(config: RunConfig) -> str:
    """The method, and the server optimizer that replaced its own (``fedavg with server optimizer FedYogi``)."""
    method = display_name(config.method)
    if config.trains and config.server_optimizer != config.own_server_optimizer:
        return f"{method} with server optimizer {display_name(config.server_optimizer)}"
    return method


def _left_by_run(config: RunConfig) -> str:
    """What a stopped run leaves in --out: the checkpoint to continue from, or nothing.

    A run stopped before it imported torch has written no checkpoint: it says so without importing torch (seconds)."""
    out = Path(config.out)
    if not config.trains:
        return f"nothing written to {out}"
    if "torch" not in sys.modules:
        return f"nothing written to {out} (no checkpoint yet)"
    from fedray.engine.checkpoint import CHECKPOINT, load_checkpoint

    try:
        done = load_checkpoint(out, config.to_dict()).done
    except FedrayError:  # none yet, or another run's
        return f"nothing written to {out} (no checkpoint yet)"
    return f"the last checkpoint is {out / CHECKPOINT}, after training round {done}; continue with --resume"


def parse_options(pairs: list[str]) -> dict[str, str]:
    """``--option key=value`` pairs as a mapping (values are typed by the option they set, when the run is checked)."""
    options = {}
    for pair in pairs:
        key, equals, value = pair.partition("=")
        if not equals or not key.strip():
            raise FedrayError(f"--option takes key=value, got {pair!r}")
        options[key.strip().replace("-", "_")] = value
    return options


def _cmd_methods(args: argparse.Namespace) -> None:
    from fedray.app.catalogue import catalogue, entry

    print("\n".join(entry(spec) for spec in args.classes) if args.classes else catalogue())


def _extract_parser(commands: argparse._SubParsersAction) -> None:
    from fedray.app.extract.config import ExtractConfig as Defaults

    parser = commands.add_parser(
        "extract", help="turn a dataset's images into a feature cache (once) on a pool of model replicas",
        description="Extract pooled penultimate features of every image into CACHE_DIR/<dataset>--<backbone>--<hash>/; "
        "use it with --dataset features:THAT_FOLDER. Re-running with the same configuration reuses the cache; "
        "an interrupted run resumes.",
    )
    parser.add_argument("--dataset", required=True, help="hsu:TRAIN_CSV?images=ROOT[&layout=walk|gldv2] or imagefolder:ROOT (+ ?split options)")
    parser.add_argument("--backbone", default=Defaults.backbone, help="mobilenet_v2, squeezenet1_1, resnet18, vit_b_16, resnet18_cifar, resnet18_cifar_gn or tct_cnn (default %(default)s)")
    parser.add_argument("--weights", default=Defaults.weights, help="a state-dict file, 'imagenet' (torchvision enum, torch hub cache) or 'random' (seeded; NOT pre-trained) (default %(default)s)")
    parser.add_argument("--out", default=Defaults.out, help="cache folder (default %(default)s)")
    parser.add_argument("--image-size", type=int, default=Defaults.image_size, help="center-crop size (default %(default)s; the Fed3R code used 299 on iNat)")
    parser.add_argument("--resize", type=int, help="short side before the crop (default image size × 256/224)")
    parser.add_argument("--grayscale", choices=["convert", "skip"], default=Defaults.grayscale, help="grayscale images: replicate to RGB, or skip as the Fed3R code does (default %(default)s)")
    parser.add_argument("--on-bad-image", choices=["skip", "fail"], default=Defaults.on_bad_image, help="missing or unreadable images: count and skip, or stop (default %(default)s)")
    parser.add_argument("--precision", choices=["fp32", "fp16", "bf16"], default=Defaults.precision, help="autocast precision of the model (default %(default)s)")
    parser.add_argument("--batch-size", type=int, default=Defaults.batch_size, help="images per forward pass (default %(default)s)")
    parser.add_argument("--pool-size", type=int, help="model replicas (default: one per GPU, else one per --cpus-per-worker CPUs)")
    parser.add_argument("--cpus-per-worker", type=float, default=Defaults.cpus_per_worker, help="CPUs (decoding threads) per replica (default %(default)s)")
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default=Defaults.device, help="GPU bundles when the cluster has GPUs (auto), always, or never (default %(default)s)")
    parser.add_argument("--seed", type=int, default=Defaults.seed, help="seed of --weights random (default %(default)s)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument("--address", help="Ray cluster to join (default $RAY_ADDRESS, else an embedded local Ray)")
    parser.set_defaults(handler=_cmd_extract)


def _cmd_extract(args: argparse.Namespace) -> None:
    from fedray.app.extract.config import ExtractConfig
    from fedray.app.extract.features import extract

    options = {k: v for k, v in vars(args).items() if k not in ("address", "handler", "command", "command_line")}
    if args.weights == "random":
        print(f"fedray: WARNING: --weights random (seed {args.seed}): these features are NOT pre-trained", file=sys.stderr)
    report = extract(ExtractConfig(**options), address=args.address)
    if report.cache_hit:
        print(f"cache hit: {report.entry} (no model work)")
    else:
        rate = f", {report.images_per_s:.1f} images/s" if report.images_per_s else ""
        print(f"extracted {report.images_computed} images in {report.parts_computed} parts "
              f"({report.parts_reused} reused){rate} → {report.entry}")
    if report.skipped:
        print("skipped: " + ", ".join(f"{count} {reason}" for reason, count in report.skipped.items()))
    print(f"use it with: fedray run --dataset features:{report.entry}")


def _sweep_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "sweep", help="run a Ray Tune sweep over run options (grid and random draws)",
        description="Run every trial of a sweep file (see jobs/sweeps/); writes OUT/NAME/<trial>/metrics.parquet "
        "and the combined OUT/NAME/results.parquet.",
    )
    parser.add_argument("--config", required=True, help="sweep YAML file (name, base, grid, random, ...)")
    parser.add_argument("--out", default="results/sweeps", help="sweeps folder (default %(default)s)")
    parser.add_argument("--resume", action="store_true", help="continue an interrupted sweep without redoing finished trials")
    parser.add_argument("--quiet", action="store_true", help="no Tune progress table")
    parser.add_argument("--address", help="Ray cluster to join (default $RAY_ADDRESS, else an embedded local Ray)")
    parser.set_defaults(handler=_cmd_sweep)


def _cmd_sweep(args: argparse.Namespace) -> None:
    from fedray.app.sweeps.spec import load_sweep
    from fedray.app.sweeps.tuning import RESULTS, sweep

    spec = load_sweep(args.config)
    folder = Path(args.out) / spec.name
    with interrupts.reporting(lambda: f"the sweep's state is kept in {folder}; continue with --resume" if folder.exists()
                              else f"nothing written to {folder}"):
        table = sweep(spec, args.out, resume=args.resume, address=args.address, quiet=args.quiet,
                      command=args.command_line)
    trials = table["trial_id"].n_unique() if table.height else 0
    print(f"sweep {spec.name}: {trials} trials, {table.height} evaluation rows → {Path(args.out) / spec.name / RESULTS}")


def _reproduce_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "reproduce", help="rerun a finished run folder from its config.yaml and say whether the same bits came out",
        description="Rerun the run in OUT from OUT/config.yaml into a new folder and print one line: bitwise equal, or "
        "the largest relative difference of the classifier (classifier.npz) and of the metrics (metrics.parquet, "
        "wall-clock columns excluded), and which fields of run.json differ. Exit code 0 when equal, 1 when not.")
    parser.add_argument("out", metavar="OUT", help="a finished run's folder (never written to)")
    parser.add_argument("--out", dest="new", metavar="NEW", help="where the rerun writes (default OUT-reproduced)")
    parser.add_argument("--address", help="Ray cluster to join (default $RAY_ADDRESS, else an embedded local Ray)")
    parser.set_defaults(handler=_cmd_reproduce)


def _cmd_reproduce(args: argparse.Namespace) -> int:
    from fedray.app.reproduce import reproduce

    comparison = reproduce(args.out, args.new, address=args.address, command=args.command_line)
    print(comparison.line())
    return 0 if comparison.equal else 1


def _analysis_parsers(commands: argparse._SubParsersAction) -> None:
    """``fedray compare`` and ``fedray summarize``: the commands of :mod:`analysis.compare` and
    :mod:`analysis.summarize`, with their arguments."""
    from analysis import compare, summarize

    parser = commands.add_parser("compare", help="finished runs side by side: the last evaluation point of each",
                                 description="Print one row per run (per trial of a sweep): method, dataset, what "
                                 "varies across the runs, final test accuracy, rounds, clients seen, upload, "
                                 "wall-clock seconds (--by clock: virtual hours and stragglers, and the virtual hours "
                                 "to 25/50/75/90% of the best accuracy). E.g. fedray compare results/quickstart/*")
    compare.add_arguments(parser)
    parser.set_defaults(handler=compare.compare)
    parser = commands.add_parser("summarize", help="per method × swept parameter: mean ± std over seeds, rounds and "
                                 "upload to a target accuracy", description=summarize.__doc__.splitlines()[0])
    summarize.add_arguments(parser)
    parser.set_defaults(handler=summarize.summarize_results)


def _cmd_info(args: argparse.Namespace) -> None:
    from fedray.data.parquet import ParquetFeatures
    from fedray.data.registry import load_federation

    federation = load_federation(args.spec)
    if isinstance(federation.source, ParquetFeatures):
        federation.source.check()  # a run checks the rows it reads; inspecting a file checks them all
    print(json.dumps(federation.summary(), indent=2))


def _cmd_export(args: argparse.Namespace) -> None:
    from fedray.data.export import check_directory_out, export_parquet, export_parquet_directory
    from fedray.data.registry import load_federation
    from fedray.core.writable import check_file, check_folder

    out = Path(args.out)
    if args.partition_size is None:
        check_file(out)
        export_parquet(load_federation(args.spec), out)
    else:
        check_directory_out(out, args.partition_size)
        check_folder(out)
        export_parquet_directory(load_federation(args.spec), out, args.partition_size)
    print(f"wrote {args.out}")


def _cmd_coverage(args: argparse.Namespace) -> None:
    from fedray.runtime.sampling import check_per_round, coverage

    check_numeric_options({key: getattr(args, key) for key in ("clients", "per_round", "trials", "seed")}, command_line)
    if args.clients < 1:
        raise FedrayError(f"--clients must be ≥ 1, got {args.clients}")
    check_per_round(args.clients, args.per_round, option="--per-round")
    result = coverage(args.clients, args.per_round, args.replacement, args.trials, args.seed, poisson=args.poisson)
    mode = "Poisson sampling (each client with probability κ/K)" if args.poisson else \
        f"{'with' if args.replacement else 'without'} replacement"
    print(f"K={args.clients} κ={args.per_round} {mode}, {args.trials} trials")
    for fraction, (mean, std) in result.items():
        print(f"  {fraction:>4.0%} of clients seen: {mean:9.1f} ± {std:.1f} rounds")


class _Parser(argparse.ArgumentParser):
    """argparse's parser (its subcommands' too), whose errors are one line, saying where to look, instead of the
    whole usage and then the error."""

    command = "fedray"
    """The innermost command being parsed: the one unrecognized arguments were given to (the top parser reports them)."""

    def parse_known_args(self, args=None, namespace=None):  # noqa: ANN001, ANN201 (argparse's signature)
        _Parser.command = self.prog  # a subcommand's parser runs after its parent's
        return super().parse_known_args(args, namespace)

    def error(self, message: str) -> typing.NoReturn:
        where = _Parser.command if message.startswith("unrecognized arguments") else self.prog
        raise FedrayError(f"{message}; see {where} --help")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="fedray", description="Simulate very large federations on Ray.")
    commands = parser.add_subparsers(dest="command", required=True)
    _run_parser(commands)
    _extract_parser(commands)
    _sweep_parser(commands)
    _reproduce_parser(commands)
    _analysis_parsers(commands)
    methods = commands.add_parser("methods", help="list the built-in methods and server optimizers with their options",
                                  description="Every built-in closed-form method, gradient method and server optimizer, "
                                  "with its options (type = default). Your own: --method / --server-optimizer "
                                  "module:Class or path/to/file.py:Class, options with --option key=value.")
    methods.add_argument("classes", nargs="*", metavar="CLASS",
                         help="only these: a built-in's name, or your own class as path/to/file.py:Class or module:Class "
                         "(its kind and options, with their types, defaults and help)")
    methods.set_defaults(handler=_cmd_methods)

    data = commands.add_parser("data", help="inspect or export federations").add_subparsers(dest="data_command", required=True)
    info = data.add_parser("info", help="print K, C, N, N_test, M and client-size quantiles")
    info.add_argument("spec", help="dataset spec, e.g. synthetic:inat-user-120k")
    info.set_defaults(handler=_cmd_info)
    export = data.add_parser("export", help="write a federation (with features) in the bring-your-own Parquet schema")
    export.add_argument("spec", help="dataset spec")
    export.add_argument("--out", required=True, help="output .parquet file, or directory with --partition-size")
    export.add_argument("--partition-size", type=int, metavar="N",
                        help="write a directory of parts of about N samples each (part-00000.parquet, ...), cut at client "
                        "boundaries, test rows in parts of their own: read as parquet:DIR, each shard reading only its "
                        "clients' parts")
    export.set_defaults(handler=_cmd_export)

    sampling = commands.add_parser("sampling", help="client sampling tools").add_subparsers(dest="sampling_command", required=True)
    cov = sampling.add_parser("coverage", help="rounds needed to see 25/50/75/100%% of the clients")
    cov.add_argument("--clients", type=int, required=True, help="number of clients K")
    cov.add_argument("--per-round", type=int, required=True, help="clients per round κ")
    cov.add_argument("--replacement", action="store_true", help="sample with replacement across rounds")
    cov.add_argument("--poisson", action="store_true", help="Poisson sampling: each client with probability κ/K a round")
    cov.add_argument("--trials", type=int, default=100, help="number of simulated runs (default %(default)s)")
    cov.add_argument("--seed", type=int, default=0)
    cov.set_defaults(handler=_cmd_coverage)
    return parser


def command() -> typing.NoReturn:
    """``fedray`` as a command (``python -m fedray``, the ``fedray`` script): :func:`main` on the command line, then the
    process ends with its exit code, at once where it started an embedded Ray
    (:func:`~fedray.runtime.ray_start.end_process`)."""
    end_process(main())


def main(argv: list[str] | None = None) -> int:
    """``fedray ARGV``; the exit code: 0, 2 for bad input, 1 when a plugin raised (or ``fedray reproduce`` found a
    difference), 130 after Ctrl-C and 143 after SIGTERM, whenever it comes."""
    ray_was_up = ray_is_up()
    with interrupts.handling_interrupts():
        try:
            args = build_parser().parse_args(argv)
            args.command_line = shlex.join(["fedray", *(sys.argv[1:] if argv is None else argv)])  # for run.json
            exit_code = args.handler(args)
        except BaseException as error:
            number = interrupts.signal_behind(error)
            if number is None:
                if isinstance(error, FedrayError):
                    print(f"fedray: error: {error}", file=sys.stderr)
                    return 2
                failure = plugin_failure(error) if isinstance(error, Exception) else None
                if failure is None:
                    raise
                # a researcher's plugin raised: name it and the call, then its traceback
                print(f"fedray: error: {failure}; its traceback:", file=sys.stderr)
                traceback.print_exception(error, file=sys.stderr)
                return 1
            stop = error if isinstance(error, interrupts.Stopped) else interrupts.Stopped(number)
            with interrupts.ignoring_interrupts():
                if ray_is_up() and not ray_was_up:
                    sys.modules["ray"].shutdown()
            print(f"fedray: {stop}", file=sys.stderr)
            return stop.exit_code
    return exit_code or 0
