"""Every closed-form method, ablation and gradient baseline side by side on the iNat and CIFAR-100 stand-ins, tabled.

    python -m jobs.sweep_baselines [--sections closed-form,gradient] [--dim 128] [--out results/baselines]
                                   [--quick] [--resume] [--datasets inat,cifar100] [--dataset SPEC ...] [--rounds R]

One run per (dataset, configuration), one after another in this process (one
embedded Ray for all of them), each writing ``OUT/<dataset>/<NN>-<label>/``
as ``fedray run`` does. At the end ``OUT/results.parquet`` holds every run's
rows with its ``label``, ``section`` and ``trial_id`` (the run's folder), and
:mod:`analysis.summarize` tables them per dataset × label, with the upload
cost (total, and per client that took part), into ``OUT/analysis/summary.{md,csv}``;
the table is printed.

Datasets: the iNat-User-120K stand-in (9,275 clients, 1,203 classes) and the
CIFAR-100 stand-in split over 100 clients by Hsu et al.'s Dirichlet protocol
at α = 0.1 (FedCOF's and FedNCM's setting), both at one common feature
dimension ``--dim`` (default 128, not MobileNetV2's 1,280). CCVR gathers every
class's d × d second moments (C·d² float64: 16 GB at C = 1,203, d = 1,280), in
each shard's statistics and thrice on the driver: its footprint check asks
for 9.5 GB at d = 256 and 2.7 GB at d = 128, where the 2-core, 24 GB machine
shared with other work lends Ray about 5 GB. Every method runs at the same d
so that the rows compare; the stand-in's classes separate less in fewer
dimensions, so every accuracy is far below the d = 1,280 ones (Fed3R 77.6%
there). ``--dim 1280`` is the papers' size where the memory allows
(``--sections`` and a run's own failure, one line, leave the other rows).

Configurations (:data:`CONFIGURATIONS`, one :class:`Configuration` a row, in
table order; ``--sections`` picks which run):

- ``closed-form``: FedNCM (cosine, and the classical Euclidean nearest mean),
  Fed3R, Fed3R-RF (D = 1,000: :data:`RF_DIM`), FedCOF (and with the
  between-class scatter kept), FedCOF-oracle with full, diagonal and
  spherical class covariances (and full with the between-class scatter),
  CCVR; every other option at its default (FedCOF's γ = 0.1, CCVR's 100
  virtual features a class). Each client uploads once, 10 clients a round
  (Fed3R's setting), one evaluation, at the end.
- ``gradient``: FedAvg, FedAvgM, FedAdam, FedAdagrad, FedYogi, FedProx,
  SCAFFOLD, FedDyn, FedNova as linear probing from a random head, and each
  as the second stage after Fed3R (``--init fed3r``: Fed3R until every client
  was seen, its classifier the head).
- ``noise``: rows that add a postprocessor to a closed-form method (empty for
  now: see the marked place below).

Gradient settings, Fed3R Appendix C: 10 clients a round (with replacement),
client SGD with weight decay 4e-5 and batch 50, 5 local epochs on iNat and 1 on
CIFAR-100, server SGD at learning rate 1 without momentum (FedAvgM's 0.9,
FedAdam/FedAdagrad/FedYogi's 0.01 and FedProx's μ 0.01 are their own methods'
defaults), 5,000 rounds on iNat and 1,500 on CIFAR-100 (``--rounds`` sets
both). Changed for the stand-ins: the client learning rate is 1e-3, not 0.1
(the stand-in's features are larger than MobileNetV2's, ‖z‖² ≈ 3,100 at
d = 1,280: at 0.1 training from a random head stays at chance; the LP
benchmark uses 1e-3), and after Fed3R it is 1e-5 at temperature 0.1 (Fed3R
found T = 0.1 best; a step then moves the logits 100× more, and at 1e-3 the
head falls from Fed3R's accuracy: see the README). One evaluation every
tenth of the rounds.

The full setting (the default) is 18 gradient runs of 5,000 or 1,500 rounds on
each dataset, and each ``--init fed3r`` run first draws clients with
replacement until every one was seen (about 9,000 rounds of 10 on iNat): hours
on a 2-core machine. ``--quick`` is a smoke run of every section: 20 training
rounds, d = 16, one shard a run, on a 2% iNat stand-in of 60 classes and the
CIFAR-100 stand-in over 10 clients.
"""

from __future__ import annotations

import argparse
import math
import re
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import polars as pl

from analysis.summarize import write_summary
from fedray.core.results import write_atomically

SECTIONS = ("closed-form", "gradient", "noise")
DIM = 128
"""The stand-ins' common feature dimension (see the module's docstring)."""
EVALUATE_AT_END = 10**9
"""``eval_every`` of the closed-form runs: one evaluation, after the last round."""


@dataclass(frozen=True)
class Configuration:
    """One row of the table: a ``fedray.run`` of ``method`` with ``run_options`` (its keywords: run options and the
    built-in classes' options, ``distance="euclidean"``, ``init="fed3r"``), ``options`` (a plugin's or
    postprocessor's own, as ``--option key=value``) and ``postprocessor``."""

    label: str
    method: str
    section: str
    run_options: dict = field(default_factory=dict)
    options: dict = field(default_factory=dict)
    postprocessor: str | None = None
    after: str | None = None
    """The label of a configuration this one runs only after (on the same dataset): where that one failed, this one is
    skipped (a postprocessor that refuses a method refuses it once)."""


RF_DIM = 1000
"""Fed3R-RF's random features: the papers' 5,000 (at d = 1,280) need 12 GB of Gram matrices and random test features
on the iNat stand-in, more than this machine lends Ray; 1,000 at d = 128 is the same ~8× widening."""
CLOSED_FORM = [
    Configuration("fedncm", "fedncm", "closed-form"),
    Configuration("fedncm (euclidean)", "fedncm", "closed-form", {"distance": "euclidean"}),
    Configuration("fed3r", "fed3r", "closed-form"),
    Configuration("fed3r-rf (D=1000)", "fed3r-rf", "closed-form", {"rf_dim": RF_DIM}),
    Configuration("fedcof", "fedcof", "closed-form"),
    Configuration("fedcof (between-class)", "fedcof", "closed-form", {"between_class": True}),
    Configuration("fedcof-oracle (full)", "fedcof-oracle", "closed-form", {"covariance": "full"}),
    Configuration("fedcof-oracle (diagonal)", "fedcof-oracle", "closed-form", {"covariance": "diagonal"}),
    Configuration("fedcof-oracle (spherical)", "fedcof-oracle", "closed-form", {"covariance": "spherical"}),
    Configuration("fedcof-oracle (full, between-class)", "fedcof-oracle", "closed-form", {"between_class": True}),
    Configuration("ccvr", "ccvr", "closed-form"),
]

GRADIENT_METHODS = ("fedavg", "fedavgm", "fedadam", "fedadagrad", "fedyogi", "fedprox", "scaffold", "feddyn", "fednova")
LP_LR, INIT_LR, INIT_TEMPERATURE = 1e-3, 1e-5, 0.1
GRADIENT = [
    *(Configuration(f"{name} (LP)", name, "gradient", {"client_lr": LP_LR}) for name in GRADIENT_METHODS),
    *(Configuration(f"fed3r+{name}", name, "gradient",
                    {"init": "fed3r", "client_lr": INIT_LR, "temperature": INIT_TEMPERATURE}) for name in GRADIENT_METHODS),
]

# ── noise ────────────────────────────────────────────────────────────
NOISE_EPSILONS = (0.1, 0.3, 0.5, 0.7, 0.9)
"""FedCOF App. I, Fig. 6: the noise intensities ε of the robustness curve (lower is noisier)."""
NOISE = [
    Configuration(f"fedcof + {kind} count noise (ε = {epsilon})", "fedcof", "noise",
                  options={"count_noise": kind, "count_noise_epsilon": epsilon}, postprocessor="count-noise")
    for kind in ("uniform", "gaussian", "laplace") for epsilon in NOISE_EPSILONS
]
"""FedCOF with each client's class counts perturbed (ñ = max(n + σ, 0), the means as they are), the paper's three noises
at its five intensities: the curve against the noiseless ``fedcof`` row of the closed-form section."""
# ────────────────────────────────────────────────────────────────────

CONFIGURATIONS = [*CLOSED_FORM, *GRADIENT, *NOISE]


@dataclass(frozen=True)
class Dataset:
    """A stand-in, its gradient runs' Appendix C settings and how many evaluations they make."""

    key: str
    spec: str
    rounds: int
    local_epochs: int
    evaluations: int = 10


def datasets(dim: int) -> list[Dataset]:
    return [Dataset("inat", f"synthetic:inat-user-120k?dim={dim}", 5000, 5),
            Dataset("cifar100", f"synthetic:cifar100?split=dirichlet&alpha=0.1&clients=100&dim={dim}", 1500, 1)]


QUICK = [Dataset("inat", "synthetic:inat-user-120k?dim=16&scale=0.02&classes=60", 20, 1, 2),
         Dataset("cifar100", "synthetic:cifar100?split=dirichlet&alpha=0.1&clients=10&dim=16", 20, 1, 2)]
QUICK_OPTIONS = {"fed3r-rf": {"rf_dim": 64}, "ccvr": {"virtual_per_class": 10, "virtual_epochs": 2}}
"""``--quick``'s options of the methods whose defaults are slow on any data: few random features, few virtual ones;
and one shard a run (most of a tiny run is starting its shards)."""


def run_keywords(configuration: Configuration, dataset: Dataset, quick: bool) -> dict:
    """The ``fedray.run`` keywords of one run but ``out`` (the sweep's run options over the configuration's)."""
    values = {"clients_per_round": 10, "seed": 0, "quiet": True, **configuration.run_options}
    if configuration.section == "gradient":
        values |= {"sampling": "with", "rounds": dataset.rounds, "local_epochs": dataset.local_epochs,
                   "batch_size": 50, "weight_decay": 4e-5, "eval_every": max(1, dataset.rounds // dataset.evaluations)}
    else:
        values["eval_every"] = EVALUATE_AT_END
    if quick:
        values |= {"num_shards": 1, **QUICK_OPTIONS.get(configuration.method, {})}
    keywords = {"method": configuration.method, "dataset": dataset.spec, **values}
    if configuration.options:
        keywords["options"] = dict(configuration.options)
    if configuration.postprocessor is not None:
        keywords["postprocessor"] = configuration.postprocessor
    return keywords


def check(keywords: dict) -> None:
    """Resolve and check one run's keywords as ``fedray.run`` does before any work (every option applies to the run,
    every method, algorithm and postprocessor is known and accepts its options), without loading data or Ray."""
    from fedray.app.api import KEYWORD_SPELLING, RUN
    from fedray.app.sweeps.trials import check_trial
    from fedray.engine.config import resolve
    from fedray.engine.config_files import typed_options

    named = {key for key in keywords if key not in ("method", "dataset", "options", "postprocessor")}
    config = resolve(typed_options({**keywords, "out": "."}, RUN, KEYWORD_SPELLING), {}, named=named)
    check_trial(config.validate(named).resolved())


def folder_name(index: int, label: str) -> str:
    return f"{index:02d}-" + re.sub(r"[^a-z0-9+]+", "-", label.lower()).strip("-")


def sweep(configurations: list[Configuration], sets: list[Dataset], out: Path, quick: bool, resume: bool) -> pl.DataFrame:
    """Run every configuration on every dataset (a finished run's folder is reused with ``resume``); all rows, labelled."""
    import fedray
    from fedray.core.errors import FedrayError

    runs = [(dataset, index, configuration) for dataset in sets for index, configuration in enumerate(configurations)]
    for dataset, _, configuration in runs:
        check(run_keywords(configuration, dataset, quick))
    frames, failed = [], set()
    for number, (dataset, index, configuration) in enumerate(runs, start=1):
        folder = out / dataset.key / folder_name(index, configuration.label)
        started = time.perf_counter()
        if (dataset.key, configuration.after) in failed:
            print(f"[{number}/{len(runs)}] {dataset.key} · {configuration.label}: skipped, as {configuration.after} "
                  "failed", flush=True)
            failed.add((dataset.key, configuration.label))
            continue
        if resume and (folder / "metrics.parquet").exists():
            metrics, note = pl.read_parquet(folder / "metrics.parquet"), "kept"
        else:
            try:
                metrics, note = fedray.run(out=folder, **run_keywords(configuration, dataset, quick)).metrics, "ran"
            except FedrayError as error:  # one configuration that does not fit is one missing row, not a lost sweep
                print(f"[{number}/{len(runs)}] {dataset.key} · {configuration.label}: failed: {error}", flush=True)
                failed.add((dataset.key, configuration.label))
                continue
        last = metrics.row(-1, named=True)
        print(f"[{number}/{len(runs)}] {dataset.key} · {configuration.label}: accuracy {100 * last['accuracy']:.2f}%, "
              f"{last['bytes_up'] / 1e6:.3g} MB up ({note}, {time.perf_counter() - started:.0f} s)", flush=True)
        frames.append(metrics.with_columns(pl.lit(configuration.label).alias("label"),
                                           pl.lit(configuration.section).alias("section"),
                                           pl.lit(f"{dataset.key}/{folder.name}").alias("trial_id")))
    if not frames:
        raise SystemExit("every run failed")
    return pl.concat(frames, how="diagonal_relaxed")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", default="closed-form,gradient",
                        help=f"comma-separated, of {', '.join(SECTIONS)} (default %(default)s)")
    parser.add_argument("--dim", type=int, default=DIM, help="feature dimension of both stand-ins (default %(default)s)")
    parser.add_argument("--datasets", default="inat,cifar100", help="which stand-ins, comma-separated (default %(default)s)")
    parser.add_argument("--dataset", action="append", metavar="SPEC",
                        help="run on this dataset instead of the stand-ins (repeatable)")
    parser.add_argument("--rounds", type=int, help="training rounds of the gradient runs (default: 5000 iNat, 1500 CIFAR-100)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: tiny stand-ins, 20 training rounds")
    parser.add_argument("--resume", action="store_true", help="keep the runs already finished under --out")
    parser.add_argument("--out", default="results/baselines", help="output folder (default %(default)s)")
    args = parser.parse_args(argv)
    sections = [name.strip() for name in args.sections.split(",") if name.strip()]
    unknown = [name for name in sections if name not in SECTIONS]
    if unknown or not sections:
        parser.error(f"--sections takes {', '.join(SECTIONS)}, got {args.sections!r}")
    sets = QUICK if args.quick else datasets(args.dim)
    keys = [key.strip() for key in args.datasets.split(",") if key.strip()]
    if not keys or set(keys) - {d.key for d in sets}:
        parser.error(f"--datasets takes {', '.join(d.key for d in sets)}, got {args.datasets!r}")
    sets = [d for d in sets if d.key in keys]
    if args.dataset:
        sets = [replace(sets[0], key=f"data{number}", spec=spec) for number, spec in enumerate(args.dataset)]
    if args.rounds is not None:
        sets = [replace(d, rounds=args.rounds) for d in sets]
    configurations = [c for c in CONFIGURATIONS if c.section in sections]
    if not configurations:
        raise SystemExit(f"no configuration in the sections {', '.join(sections)}")
    out = Path(args.out)
    started = time.perf_counter()
    print(f"{len(configurations)} configurations × {len(sets)} datasets: " + ", ".join(d.spec for d in sets), flush=True)
    if not (args.quick or args.dataset):
        print(f"every method at d = {args.dim}, the papers' 1,280 reduced: CCVR's class second moments (C·d² float64) "
              f"do not fit this machine at 1,280 (see the module's docstring)", flush=True)
    results = sweep(configurations, sets, out, args.quick, args.resume)
    write_atomically(out / "results.parquet", results.write_parquet)
    print(write_summary(results, out / "analysis"))
    print(f"{len(results['trial_id'].unique())} runs in {math.ceil(time.perf_counter() - started)} s; "
          f"tables: {out / 'analysis'}, rows: {out / 'results.parquet'}")


if __name__ == "__main__":
    main()
