"""Time to accuracy on phones: closed forms against gradient training, in virtual hours, on the iNat stand-in.

    python -m jobs.sweep_clock [--dim 128] [--out results/clock] [--rounds R] [--quick] [--asynchronous]

One run per configuration (:data:`CONFIGURATIONS`), one after another in this
process, each writing ``OUT/<NN>-<label>/`` as ``fedray run`` does, all on the
clock with the ``phones`` device table (190 measured phone networks × compute
tiers) and diurnal availability ``diurnal:86400,0.3``: each client online 30 %
of a 24 h day at a phase of its own. 0.3 is about the share of a day a phone
is idle, charging and on Wi-Fi (the conditions Gboard-style deployments train
under: a night's hours and a few more), so that a round draws among about a
third of the population and the rest come online as the day turns.

The runs: FedNCM, Fed3R and FedCOF (every client's statistics once, 10
clients a round); FedAvg as linear probing (``fedavg (LP)``); Fed3R then
FedAvg (``--init fed3r``); FedAvg with a deadline and over-commitment 1.3
(ask 13, keep the first 10 uploads by the deadline); FedNova with the same
deadline and ``--stragglers partial`` (a late client's finished steps are
kept, normalised as FedNova's paper does); FedBuff and FedAsync as linear
probing at FedAvg's concurrency (10 clients training at once; FedBuff
stepping every 5 updates, FedScale's setting; FedAsync on every update,
mixing at 0.6). Each asynchronous run aggregates as many updates as
``fedavg (LP)`` does: ``--rounds`` × 10 / its buffer server steps (FedBuff
2R, FedAsync 10R), evaluated after the same numbers of updates. The
gradient runs use :mod:`jobs.sweep_baselines`' settings (Fed3R's Appendix
C, the stand-in's learning rates; ``--probe-lr`` sets the random-head runs'
client learning rate). The deadline is the median round duration of the plain
``fedavg (LP)`` run (its ``rounds.parquet``): a deadline that about half of
its rounds would have missed, so that it cuts the slow phones' tail rather
than every round or none; ``--deadline`` sets it instead.

Every run evaluates every tenth of the training runs' rounds (every 50 of
``--rounds 500``), the closed forms and ``--init fed3r``'s first stage too: the
same grid of rounds, so that no run reaches a level first only because it was
looked at sooner (a level is read at the first evaluation that shows it).

At the end ``OUT/results.parquet`` holds every run's rows with their ``label``;
``OUT/analysis/`` the tables, printed too: each run's last evaluation on the
clock (:func:`analysis.clock.clock_columns`: virtual hours, compute and
communication, stragglers, dropped; accuracy, clients seen, upload) and the
virtual hours to 25/50/75/90 % of the best final accuracy with the traffic
and stragglers by then (:func:`analysis.clock.time_to_accuracy`);
``accuracy.png``, accuracy against virtual hours
(:func:`analysis.plots.accuracy_per_run`). The last line printed is one JSON
object: each run's virtual hours to 50 % of the best accuracy, and the run
that got there first; and FedScale's comparison (:func:`asynchronous_summary`):
the server steps synchronous FedAvg, FedBuff and FedAsync each performed in
the same virtual time (the shortest of the three runs' spans), and their
virtual hours to each level.

``--asynchronous`` runs FedScale's comparison alone: ``fedavg (LP)``,
``fedbuff (LP)`` and ``fedasync (LP)``.

What it shows of the papers' cost claims: a closed form's client uploads
once, so its time to accuracy is the time to reach enough clients once (the
upload of d² + d·C numbers on each phone's link), where gradient training
pays a model download and upload every round for thousands of rounds; the
deadline and over-commitment show how much of FedAvg's time is the slowest
phones' tail, and FedBuff, which never waits for it, steps several times as
often as FedAvg in the same virtual time (FedScale's asynchronous result).
Where the stand-in cannot speak for real features: its
features are generated, not a backbone's, so no client pays a forward pass
of MobileNetV2 (about 3 × 10⁸ multiply-adds a sample, seconds a client on a
phone, the same for every method and so a constant added to each closed-form
client and to each of a gradient run's rounds' first epoch where features are
not cached); its accuracies at d = 128 are far below the papers' at 1,280;
its clients' sample counts, not its accuracies, set the compute.

``--quick`` is a smoke run of every configuration: a 2 % stand-in of 60
classes at d = 16, 20 training rounds, one shard a run (about a minute).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import polars as pl

from analysis import clock
from analysis.compare import final_points, print_table
from analysis.results import best_final_accuracy
from fedray.core.results import write_atomically
from jobs.sweep_baselines import INIT_LR, INIT_TEMPERATURE, LP_LR, folder_name

DEVICES = "phones"
AVAILABILITY = "diurnal:86400,0.3"
"""A 24 h day, each client online 30 % of it (see the module's docstring)."""
OVER_COMMIT = 1.3
PER_ROUND = 10
DEADLINE_FROM = "fedavg (LP)"
"""The run whose median round duration is the deadline of the runs that have one."""
BUFFER = 5
"""FedBuff's server step every 5 of the 10 updates in flight (FedScale's asynchronous setting: a concurrency of 10)."""
ASYNCHRONOUS = (DEADLINE_FROM, "fedbuff (LP)", "fedasync (LP)")
"""FedScale's comparison: synchronous FedAvg and the asynchronous schedulers at its concurrency."""


@dataclass(frozen=True)
class Configuration:
    """One run: ``method`` with ``run_options`` (``fedray.run`` keywords); ``deadline``: it runs with the sweep's;
    ``steps_per_round``: its server steps for each synchronous round of the setting (an asynchronous run's, so that it
    aggregates as many updates as a synchronous run of ``PER_ROUND`` clients a round); ``probe``: linear probing from
    a random head, at the setting's learning rate."""

    label: str
    method: str
    gradient: bool
    run_options: dict = field(default_factory=dict)
    deadline: bool = False
    steps_per_round: int = 1
    probe: bool = False


CONFIGURATIONS = [
    Configuration("fedncm", "fedncm", False),
    Configuration("fed3r", "fed3r", False),
    Configuration("fedcof", "fedcof", False),
    Configuration(DEADLINE_FROM, "fedavg", True, probe=True),
    Configuration("fed3r+fedavg", "fedavg", True,
                  {"init": "fed3r", "client_lr": INIT_LR, "temperature": INIT_TEMPERATURE}),
    Configuration("fedavg (deadline, over-commit 1.3)", "fedavg", True,
                  {"over_commit": OVER_COMMIT}, deadline=True, probe=True),
    Configuration("fednova (deadline, partial)", "fednova", True,
                  {"stragglers": "partial"}, deadline=True, probe=True),
    Configuration(ASYNCHRONOUS[1], "fedavg", True,
                  {"scheduler": "fedbuff", "concurrency": PER_ROUND, "buffer": BUFFER},
                  steps_per_round=PER_ROUND // BUFFER, probe=True),
    Configuration(ASYNCHRONOUS[2], "fedavg", True,
                  {"scheduler": "fedasync", "concurrency": PER_ROUND}, steps_per_round=PER_ROUND, probe=True),
]


@dataclass(frozen=True)
class Setting:
    """The stand-in, the gradient runs' rounds, local epochs and evaluations, and linear probing's client learning
    rate."""

    dataset: str
    rounds: int
    local_epochs: int
    evaluations: int = 10
    num_shards: int | None = None
    probe_lr: float = LP_LR


def full(dim: int) -> Setting:
    return Setting(f"synthetic:inat-user-120k?dim={dim}", 5000, 5)


QUICK = Setting("synthetic:inat-user-120k?dim=16&scale=0.02&classes=60", 20, 1, 4, 1)


def chosen(asynchronous: bool) -> list[Configuration]:
    """The runs of the sweep: every configuration, or FedScale's comparison (:data:`ASYNCHRONOUS`) alone."""
    return [configuration for configuration in CONFIGURATIONS
            if not asynchronous or configuration.label in ASYNCHRONOUS]


def run_keywords(configuration: Configuration, setting: Setting, deadline: float | None) -> dict:
    """The ``fedray.run`` keywords of one run but ``out``."""
    values = {"method": configuration.method, "dataset": setting.dataset, "clients_per_round": PER_ROUND, "seed": 0,
              "quiet": True, "devices": DEVICES, "availability": AVAILABILITY, **configuration.run_options}
    steps = configuration.steps_per_round
    if configuration.probe:
        values["client_lr"] = setting.probe_lr
    if configuration.gradient:
        values |= {"sampling": "with", "rounds": setting.rounds * steps, "local_epochs": setting.local_epochs,
                   "batch_size": 50, "weight_decay": 4e-5}
    values["eval_every"] = max(1, setting.rounds // setting.evaluations) * steps  # every run, a stage before training
    if configuration.deadline:
        values["deadline"] = deadline
    if setting.num_shards is not None:
        values["num_shards"] = setting.num_shards
    return values


def median_round_s(folder: Path) -> float:
    """The median duration of a run's rounds, from its ``rounds.parquet``."""
    rounds = pl.read_parquet(folder / "rounds.parquet")
    return float((rounds["end_s"] - rounds["start_s"]).median())


def sweep(setting: Setting, out: Path, deadline: float | None,
          configurations: list[Configuration]) -> tuple[pl.DataFrame, float]:
    """``configurations`` in order, labelled rows; and the deadline the deadline's runs had (:data:`DEADLINE_FROM`,
    always among them, sets it)."""
    import fedray

    frames = []
    for index, configuration in enumerate(configurations):
        folder = out / folder_name(CONFIGURATIONS.index(configuration), configuration.label)
        started = time.perf_counter()
        metrics = fedray.run(out=folder, **run_keywords(configuration, setting, deadline)).metrics
        if configuration.label == DEADLINE_FROM and deadline is None:
            deadline = median_round_s(folder)
            print(f"deadline: {deadline:.4g} virtual s, the median round of {DEADLINE_FROM}", flush=True)
        last = metrics.row(-1, named=True)
        print(f"[{index + 1}/{len(configurations)}] {configuration.label}: accuracy {100 * last['accuracy']:.2f}%, "
              f"{last['clock_s'] / 3600:.4g} virtual h ({time.perf_counter() - started:.0f} s)", flush=True)
        frames.append(metrics.with_columns(pl.lit(configuration.label).alias("label"),
                                           pl.lit(folder.name).alias("trial_id")))
    return pl.concat(frames, how="diagonal_relaxed"), deadline


def final_table(results: pl.DataFrame) -> pl.DataFrame:
    """A row per run: its last evaluation, on the clock."""
    return final_points(results).select(
        "label", (pl.col("accuracy") * 100).round(2).alias("accuracy_%"), pl.col("round").alias("rounds"),
        "clients_seen", (pl.col("bytes_up") / 1e6).round(1).alias("upload_MB"), *clock.clock_columns(results))


def summary(times: pl.DataFrame, best: float) -> dict:
    """Each run's virtual hours to 50 % of the best accuracy (null: never), and the first to get there."""
    half = times.filter(pl.col("level") == "50%")
    hours = dict(zip(half["label"], half["virtual_h"]))
    reached = half.drop_nulls("virtual_h").sort("virtual_h", maintain_order=True)
    return {"job": "sweep_clock", "devices": DEVICES, "availability": AVAILABILITY,
            "best_accuracy": round(best, 4), "hours_to_50%": hours,
            "first_to_50%": reached["label"][0] if len(reached) else None}


def asynchronous_summary(results: pl.DataFrame, times: pl.DataFrame, out: Path) -> dict:
    """FedScale's comparison, from the runs of :data:`ASYNCHRONOUS` (all three must have run): the server steps each
    performed in the same virtual time (the shortest of their spans, from their ``rounds.parquet``), the virtual hours
    to each level, and FedBuff's and FedAsync's updates' mean staleness over the run."""
    folders = dict(results.select("label", "trial_id").unique("label", keep="first", maintain_order=True).iter_rows())
    steps = {label: pl.read_parquet(out / folders[label] / "rounds.parquet") for label in ASYNCHRONOUS}
    window = min(float(rows["end_s"].max()) for rows in steps.values())
    compared = times.filter(pl.col("label").is_in(ASYNCHRONOUS))
    hours_to = {level: dict(zip(rows["label"], rows["virtual_h"]))
                for (level,), rows in compared.group_by("level", maintain_order=True)}
    staleness = {}
    for label in ASYNCHRONOUS[1:]:
        counts = steps[label]["staleness_counts"].to_list()
        total = sum(age * count for step in counts for age, count in enumerate(step))
        staleness[label] = round(total / sum(sum(step) for step in counts), 3)
    return {"window_h": float(f"{window / clock.SECONDS_PER_HOUR:.{clock.SHOWN_FIGURES}g}"),
            "server_steps_in_window": {label: int((rows["end_s"] <= window).sum()) for label, rows in steps.items()},
            "hours_to": hours_to, "mean_staleness": staleness}


def write_tables(results: pl.DataFrame, analysis: Path) -> tuple[pl.DataFrame, pl.DataFrame]:
    finals, times = final_table(results), clock.time_to_accuracy(results, ["label"])
    write_atomically(analysis / "runs.csv", finals.write_csv)
    write_atomically(analysis / "time_to_accuracy.csv", times.write_csv)
    return finals, times


def plot(results: pl.DataFrame, path: Path) -> None:
    from analysis import plots

    points = results.select("trial_id", "label", (pl.col("clock_s") / clock.SECONDS_PER_HOUR).alias("virtual_h"),
                            (pl.col("accuracy") * 100).alias("accuracy_%"))
    plots.write_figure(plots.accuracy_per_run(points, "virtual_h", "virtual time (hours)"), path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=128, help="feature dimension of the stand-in (default %(default)s)")
    parser.add_argument("--rounds", type=int, help="training rounds of the gradient runs (default 5000; --quick 20)")
    parser.add_argument("--probe-lr", type=float, default=LP_LR,
                        help="client learning rate of the runs from a random head (default %(default)s, Fed3R's "
                             "Appendix C)")
    parser.add_argument("--deadline", type=float, help="virtual seconds (default: the median round of fedavg (LP))")
    parser.add_argument("--quick", action="store_true", help="a smoke run: a tiny stand-in, 20 training rounds")
    parser.add_argument("--asynchronous", action="store_true",
                        help=f"FedScale's comparison alone: {', '.join(ASYNCHRONOUS)}")
    parser.add_argument("--out", default="results/clock", help="output folder (default %(default)s)")
    args = parser.parse_args(argv)
    setting = QUICK if args.quick else full(args.dim)
    if args.rounds is not None:
        if args.rounds < 1:
            parser.error(f"--rounds must be at least 1, got {args.rounds}")
        setting = replace(setting, rounds=args.rounds)
    if not args.probe_lr > 0:
        parser.error(f"--probe-lr must be > 0, got {args.probe_lr}")
    setting = replace(setting, probe_lr=args.probe_lr)
    if args.deadline is not None and not args.deadline > 0:
        parser.error(f"--deadline must be a number of seconds > 0, got {args.deadline}")
    out = Path(args.out)
    configurations = chosen(args.asynchronous)
    started = time.perf_counter()
    print(f"{len(configurations)} runs on {setting.dataset}, --devices {DEVICES} --availability {AVAILABILITY}",
          flush=True)
    results, deadline = sweep(setting, out, args.deadline, configurations)
    write_atomically(out / "results.parquet", results.write_parquet)
    finals, times = write_tables(results, out / "analysis")
    plot(results, out / "analysis" / "accuracy.png")
    print("runs on the virtual clock: the last evaluation point of each")
    print_table(finals)
    best = best_final_accuracy(results)
    print(f"virtual hours to a fraction of the best final accuracy ({100 * best:.2f}%); deadline {deadline:.4g} s")
    print_table(times)
    print(f"{len(configurations)} runs in {math.ceil(time.perf_counter() - started)} s; tables and plot: "
          f"{out / 'analysis'}")
    print(json.dumps(summary(times, best) | {"deadline_s": round(deadline, 4),
                                             "asynchronous": asynchronous_summary(results, times, out)}))


if __name__ == "__main__":
    main()
