"""Accuracy against a differential-privacy budget: ε ∈ {0.5, 1, 2, 4, 8, ∞} × FedNCM, Fed3R, FedCOF (and FedAvg linear
probing through DP-FedAvg) on the iNat-User-120K stand-in, tabled and plotted.

    python -m jobs.sweep_privacy [--methods fedncm,fed3r,fedcof,fedavg] [--dim 128] [--epsilons 0.5,1,2,4,8,inf]
                                 [--out results/privacy] [--quick] [--resume] [--dataset SPEC] [--rounds R]

Each method runs once without DP (its plain row) and once per ε with the DP
flags (``--clip-norm R --dp-delta δ --dp-epsilon ε``, which add
``--postprocessor dp`` to a closed-form method and ``dp-fedavg`` to a training
one): sample-level DP, the noise central (the server adds it once to each
evaluation block's sum), σ calibrated to ε by dp-accounting's PLD accountant.
ε = ∞ is ``--dp-noise 0``: no noise, ε reported as ∞.

**The clip R** of the closed-form methods is the largest norm of the
stand-in's training features, found from the data and printed, rounded up
(at d = 128: 20.49, so R = 20.5; the median is 17.8): no row is clipped, so
the ε = ∞ row is the plain run bit for bit (the job checks it and says so),
and every finite ε prices exactly the noise. A smaller R (a quantile) would
trade a clip bias for less noise; this sweep measures the noise alone.
**δ** is 1e-5, or the largest power of ten below 1/N where N (the training
samples) exceeds 10⁵: 1e-6 on the stand-in's 120,293 samples.

Every closed-form run uploads each client once, 10 clients a round (Fed3R's
setting), and evaluates once, at the end: one release, whose ε every row
reports (``dp_epsilon``, at most the ε asked). FedAvg-LP (the baselines
sweep's linear probing: client learning rate 1e-3, 5 local epochs, 10 clients
a round) runs ``--rounds`` rounds (default :data:`FEDAVG_ROUNDS`) with each
client's update clipped to :data:`UPDATE_CLIP` (DP-FedAvg's S), so its
ε = ∞ row is FedAvg with clipped updates, the plain row without: they are
equal only where no update reaches the clip. It runs through the ``dp-fedavg``
postprocessor (issue 28 §2): the default ``--methods`` includes it only where
that is registered, and says so otherwise.

FedCOF's mean rows are noised by each client (``--dp-placement distributed``:
the server sees each client's rows, never their sum). A method the DP
postprocessor refuses (a plugin's, say) is skipped after its first refusal,
with the postprocessor's one line: its plain row stays.

Writes ``OUT/results.parquet`` (every row, with ``label``, ``trial_id`` and
the asked ``target_epsilon``: null for the plain runs), ``OUT/analysis/``
(``privacy.md`` and ``privacy.csv``: method × ε → accuracy; ``accuracy_vs_epsilon.png``:
one line per method, log x, the plain accuracy dashed), and prints the table
and one JSON line at the end. ``--quick``: a 2% stand-in at d = 16 (as the
baselines sweep's), one shard a run.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import replace
from pathlib import Path

import polars as pl

from analysis.results import final_rows
from fedray.core.results import write_atomically
from jobs.sweep_baselines import LP_LR, QUICK, Configuration, Dataset, sweep

CLOSED_FORM = ("fedncm", "fed3r", "fedcof")
TRAINING = "fedavg"
METHODS = (*CLOSED_FORM, TRAINING)
EPSILONS = (0.5, 1.0, 2.0, 4.0, 8.0, math.inf)
DIM = 128
DELTA = 1e-5
"""δ, unless 1/N is smaller (:func:`delta_for`)."""
UPDATE_CLIP = 1.0
"""FedAvg-LP's clip of a client's update (DP-FedAvg's S, in the update's L2 norm)."""
FEDAVG_ROUNDS = 500
PLACEMENT = {"fedcof": "distributed"}
"""FedCOF's mean rows are never summed (the server sees each client's): each client adds the noise, the full σ."""
SECTION = "privacy"
PLAIN = "no DP"
"""The table's column of the plain runs."""


def delta_for(samples: int) -> float:
    """1e-5, or the largest power of ten below 1/``samples`` when that is smaller (δ < 1/N, the usual requirement)."""
    return min(DELTA, 10.0 ** math.floor(math.log10(1 / samples)))


def clip_for(spec: str) -> tuple[float, float, int]:
    """(R, the largest training feature norm, N) of the dataset ``spec``: R is that norm rounded up to hundredths
    (after a 1e-4 relative margin, so that no row's norm, however rounded, exceeds it)."""
    import torch

    from fedray.data.registry import load_federation

    federation = load_federation(spec)
    sample_ids, _, _ = federation.train_arrays(0, federation.num_clients)
    largest = float(torch.linalg.vector_norm(federation.source.features("train", sample_ids), dim=1).max())
    return math.ceil(largest * (1 + 1e-4) * 100) / 100, largest, len(sample_ids)


def label(method: str, epsilon: float | None) -> str:
    """``fed3r``, ``fed3r, ε = 0.5``, ``fed3r, ε = inf``: also the run's folder name (``01-fed3r-inf``)."""
    return method if epsilon is None else f"{method}, ε = {epsilon:g}"


def budget(epsilon: float) -> dict:
    """The DP flag of one ε: ``dp_noise=0`` for ε = ∞ (no noise), else the budget the noise is calibrated to."""
    return {"dp_noise": 0.0} if math.isinf(epsilon) else {"dp_epsilon": epsilon}


def configurations(methods: list[str], epsilons: list[float], clip: float, delta: float) -> list[Configuration]:
    """Per method: its plain run, its ε = ∞ run, then the finite ε (each skipped if the ε = ∞ run was refused)."""
    rows = []
    for method in methods:
        section, base, bound = ("gradient", {"client_lr": LP_LR}, UPDATE_CLIP) if method == TRAINING else (SECTION, {}, clip)
        first = label(method, math.inf) if math.inf in epsilons else None
        rows.append(Configuration(label(method, None), method, section, dict(base)))
        for epsilon in sorted(epsilons, key=lambda e: (not math.isinf(e), e)):
            rows.append(Configuration(label(method, epsilon), method, section,
                                      {**base, "clip_norm": bound, "dp_delta": delta, **budget(epsilon),
                                       **({"dp_placement": PLACEMENT[method]} if method in PLACEMENT else {})},
                                      after=None if math.isinf(epsilon) else first))
    return rows


def targets(configurations: list[Configuration], epsilons: list[float]) -> pl.DataFrame:
    """Each label's asked ε (null: the plain run)."""
    asked = {label(c.method, e): e for c in configurations for e in epsilons}
    return pl.DataFrame({"label": [c.label for c in configurations],
                         "target_epsilon": [asked.get(c.label) for c in configurations]},
                        schema={"label": pl.String, "target_epsilon": pl.Float64})


def column(epsilon: float | None) -> str:
    return PLAIN if epsilon is None else "∞" if math.isinf(epsilon) else f"{epsilon:g}"


def accuracy_table(finals: pl.DataFrame, methods: list[str], epsilons: list[float]) -> pl.DataFrame:
    """method × (no DP, each ε) → final accuracy; null where a run is missing (refused or failed)."""
    found = {(row["method"], row["target_epsilon"]): row["accuracy"] for row in finals.iter_rows(named=True)}
    grid = [None, *sorted(epsilons)]
    return pl.DataFrame([{"method": method, **{column(e): found.get((method, e)) for e in grid}} for method in methods],
                        schema={"method": pl.String, **{column(e): pl.Float64 for e in grid}})


def markdown(table: pl.DataFrame, clip: float, delta: float) -> str:
    header = table.columns
    clips = f"closed-form clip R = {clip:g}" + (f", FedAvg's update clip {UPDATE_CLIP:g}" if TRAINING in table["method"] else "")
    lines = [f"Accuracy (%) by ε (δ = {delta:g}; {clips}; —: refused or failed)", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in table.iter_rows():
        lines.append("| " + " | ".join([row[0], *("—" if v is None else f"{100 * v:.2f}" for v in row[1:])]) + " |")
    return "\n".join(lines) + "\n"


def plot(table: pl.DataFrame, epsilons: list[float], path: Path) -> None:
    """Accuracy against ε, log x, one line per method; its plain run's accuracy dashed in the same colour."""
    import matplotlib.pyplot as plt

    finite = sorted(e for e in epsilons if math.isfinite(e))
    fig, axes = plt.subplots(figsize=(6, 4))
    for index, row in enumerate(table.iter_rows(named=True)):
        colour = f"C{index % 10}"
        points = [(e, row[column(e)]) for e in finite if row[column(e)] is not None]
        if points:
            axes.plot([e for e, _ in points], [100 * a for _, a in points], marker="o", color=colour, label=row["method"])
        if row[PLAIN] is not None:
            axes.axhline(100 * row[PLAIN], color=colour, linestyle="--", linewidth=1,
                         label=f"{row['method']}, no DP" + ("" if points else " (DP refused)"))
    axes.set_xscale("log")
    axes.minorticks_off()
    axes.set_xticks(finite, [f"{e:g}" for e in finite])
    axes.set_xlabel("ε at fixed δ (per sample for the closed forms, per client for FedAvg)")
    axes.set_ylabel("test accuracy (%)")
    axes.grid(True, alpha=0.3)
    axes.legend(fontsize="small")
    fig.tight_layout()
    write_atomically(path, lambda p: fig.savefig(p, format="png", dpi=120))
    plt.close(fig)


def default_methods() -> tuple[list[str], str | None]:
    """The closed-form methods, and FedAvg-LP where ``dp-fedavg`` is registered; a note when it is not."""
    from fedray.methods.postprocessor import BUILT_IN
    from fedray.postprocessors.dp import GaussianMechanism

    training_dp = GaussianMechanism.training_counterpart  # what the DP flags add to a training run
    if training_dp in BUILT_IN:
        return list(METHODS), None
    return list(CLOSED_FORM), (f"{TRAINING} (FedAvg-LP) left out: the {training_dp} postprocessor (DP-FedAvg) is not "
                               f"registered in this install; --methods {TRAINING} asks for it")


def number(value: float | None) -> float | str | None:
    """A number for JSON, which has no infinity: ε = ∞ is "inf"."""
    return "inf" if value is not None and math.isinf(value) else value


def parse_epsilons(text: str) -> list[float]:
    values = [float(part) for part in text.split(",") if part.strip()]
    if not values or any(not value > 0 for value in values) or len(set(values)) < len(values):
        raise ValueError(text)
    return values


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", help=f"comma-separated, of {', '.join(METHODS)} (default: the closed-form three, "
                        f"and {TRAINING} where dp-fedavg is registered)")
    parser.add_argument("--epsilons", default=",".join(f"{e:g}" for e in EPSILONS),
                        help="the budgets, comma-separated, inf for no noise (default %(default)s)")
    parser.add_argument("--dim", type=int, default=DIM, help="the stand-in's feature dimension (default %(default)s)")
    parser.add_argument("--dataset", metavar="SPEC", help="run on this dataset instead of the iNat stand-in")
    parser.add_argument("--rounds", type=int, help=f"FedAvg-LP's rounds (default {FEDAVG_ROUNDS}; --quick: 20)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: a 2%% stand-in at d = 16, one shard a run")
    parser.add_argument("--resume", action="store_true", help="keep the runs already finished under --out")
    parser.add_argument("--out", default="results/privacy", help="output folder (default %(default)s)")
    args = parser.parse_args(argv)
    try:
        epsilons = parse_epsilons(args.epsilons)
    except ValueError:
        parser.error(f"--epsilons takes distinct numbers > 0 (inf: no noise), comma-separated, got {args.epsilons!r}")
    note = None
    if args.methods is None:
        methods, note = default_methods()
    else:
        methods = [name.strip() for name in args.methods.split(",") if name.strip()]
        if not methods or set(methods) - set(METHODS) or len(set(methods)) < len(methods):
            parser.error(f"--methods takes {', '.join(METHODS)}, got {args.methods!r}")
    dataset = QUICK[0] if args.quick else Dataset("inat", f"synthetic:inat-user-120k?dim={args.dim}", FEDAVG_ROUNDS, 5)
    if args.dataset:
        dataset = replace(dataset, key="data", spec=args.dataset)
    if args.rounds is not None:
        dataset = replace(dataset, rounds=args.rounds)
    started = time.perf_counter()
    clip, largest, samples = clip_for(dataset.spec)
    delta = delta_for(samples)
    print(f"{dataset.spec}: {samples} training samples, the largest feature norm {largest:.6g}: clip R = {clip:g} "
          f"(no row clipped, so ε = ∞ is the plain run), δ = {delta:g}", flush=True)
    if note:
        print(note, flush=True)
    planned = configurations(methods, epsilons, clip, delta)
    out = Path(args.out)
    results = sweep(planned, [dataset], out, args.quick, args.resume).join(targets(planned, epsilons), on="label")
    write_atomically(out / "results.parquet", results.write_parquet)
    finals = final_rows(results)
    table = accuracy_table(finals, methods, epsilons)
    text = markdown(table, clip, delta)
    write_atomically(out / "analysis" / "privacy.csv", table.write_csv)
    write_atomically(out / "analysis" / "privacy.md", lambda path: path.write_text(text))
    plot(table, epsilons, out / "analysis" / "accuracy_vs_epsilon.png")
    print(text)
    rows = {row["method"]: row for row in table.iter_rows(named=True)}
    skipped = [method for method in methods if all(rows[method][column(e)] is None for e in epsilons)]
    equal = {method: rows[method][column(math.inf)] == rows[method][PLAIN] for method in methods
             if math.inf in epsilons and method not in skipped}
    private = finals.filter(pl.col("target_epsilon").is_not_null()) if "dp_epsilon" in finals.columns else finals.clear()
    spent = {f"{row['method']}, ε = {column(row['target_epsilon'])}": number(row["dp_epsilon"])
             for row in private.iter_rows(named=True)}
    for method, same in equal.items():
        print(f"{method}: the ε = ∞ run's accuracy {'equals' if same else 'DIFFERS from'} the plain run's", flush=True)
    if skipped:
        print(f"skipped under DP (refused, see above): {', '.join(skipped)}", flush=True)
    print(f"tables and plot: {out / 'analysis'}, rows: {out / 'results.parquet'}")
    print(json.dumps({"job": "sweep_privacy", "dataset": dataset.spec, "samples": samples, "max_feature_norm": largest,
                      "clip_norm": clip, "update_clip": UPDATE_CLIP, "dp_delta": delta, "methods": methods,
                      "skipped": skipped, "note": note,
                      "accuracy": {row["method"]: {key: value for key, value in row.items() if key != "method"}
                                   for row in table.iter_rows(named=True)},
                      "dp_epsilon": spent, "infinite_equals_plain": equal,
                      "seconds": round(time.perf_counter() - started, 1)}, ensure_ascii=False))


if __name__ == "__main__":
    main()
