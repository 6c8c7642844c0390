"""Build the clock's built-in device tables, ``phones`` and ``uniform``, from FLASH's public phone measurements.

    python -m jobs.build_phones_table [--source DIR] [--out DIR]

``--source``: FLASH's data files (``speed_distri.json``, ``raw_ai_benchmark_list.json``; by default
``../shared/datasets/devices/flash`` beside the checkout, or ``../../shared/...`` for a worktree one folder deeper);
``--out``: where the tables go (by default ``fedray/clock/tables/``, where they are committed). The readings below
are explained, with the provenance and FLASH's licence, in ``fedray/clock/tables/README.md``.

- **Networks.** Each of FLASH's 19 speed distributions (a phone's mean u and standard deviation σ of its download
  and upload speed) is read in KB/s, 1 KB = 1,024 bytes, as FLASH's ``models/device.py`` reads it (a model's size in
  bytes / 1,024, "kb because speed data use 'kb/s'", divided by the speed is the time in seconds), and becomes the
  lognormal with FLASH's mean and standard deviation: median u / √(1 + (σ/u)²) and σ_log = √(ln(1 + (σ/u)²)).
- **Compute.** AI-Benchmark's ``CPU_F_AI_Score`` (float inference on the CPU, where on-device training runs) of the
  333 phone entries, cut into ten tiers of equal counts (deciles, slowest first); a tier's rate is the geometric mean
  of its entries' scores times :data:`ANCHOR_MACS_PER_S` / the anchor phone's score. The anchor: FLASH's measured
  on-device training of its FEMNIST CNN on a Google Pixel 4, 179 ms per batch of 10
  (``models/utils/device_util/device_util.py``, ``femnist_mean``; batch size 10 in ``models/default.cfg``), at the
  CNN's forward multiply-adds × 3 (a backward pass ≈ 2 forward, fedray's accounting convention).
- **Shares.** Network and tier independent: a row's share is its tier's count of entries / 333 × 1/19.
- **uniform.** One device, no jitter: the ``phones`` population's median of each rate (share-weighted).

Rates are rounded to integers and σ to 6 significant digits; shares are exact fractions' floats. Prints the paths it
wrote.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
TABLES = ROOT / "fedray" / "clock" / "tables"
SOURCES = tuple(parent / "shared" / "datasets" / "devices" / "flash" for parent in (ROOT.parent, ROOT.parents[1]))

SPEED_BITS_PER_UNIT = 8 * 1024
"""FLASH's speeds in KB/s (1 KB = 1,024 bytes), as bits per second."""
FEMNIST_CNN_FORWARD_MACS = (28 * 28 * 32 * 5 * 5 * 1 + 14 * 14 * 64 * 5 * 5 * 32 + 7 * 7 * 64 * 2048 + 2048 * 62)
"""FLASH's (LEAF's) FEMNIST CNN, one 28×28 sample: conv 5×5×32 "same", pool, conv 5×5×64 "same", pool, dense 2048,
dense 62 — 17,211,904 multiply-adds."""
TRAINING_FACTOR = 3
"""A training step's multiply-adds per forward pass's: forward + backward (≈ 2 forward)."""
ANCHOR_MODEL = "Google Pixel 4"
ANCHOR_BATCH = 10
ANCHOR_SECONDS_PER_BATCH = 0.179
ANCHOR_MACS_PER_S = ANCHOR_BATCH * TRAINING_FACTOR * FEMNIST_CNN_FORWARD_MACS / ANCHOR_SECONDS_PER_BATCH
"""≈ 2.885 × 10⁹ multiply-adds per second: the Pixel 4's FP32 training rate on FLASH's measurement."""
COMPUTE_SCORE = "CPU_F_AI_Score"
TIERS = 10
PHONES_COLUMNS = ("name", "macs_per_s", "down_bps", "up_bps", "down_jitter", "up_jitter", "share")


def lognormal(mean: float, std: float) -> tuple[float, float]:
    """(median, σ_log) of the lognormal with this mean and standard deviation."""
    spread = 1.0 + (std / mean) ** 2
    return mean / math.sqrt(spread), math.sqrt(math.log(spread))


def networks(source: Path) -> list[dict]:
    """FLASH's 19 speed distributions, in the file's order: name, down_bps, up_bps and their σ_log."""
    rows = []
    for device_id, speeds in json.loads((source / "speed_distri.json").read_text()).items():
        down, down_jitter = (lognormal(speeds["down_u"] * SPEED_BITS_PER_UNIT,
                                       speeds["down_sigma"] * SPEED_BITS_PER_UNIT))
        up, up_jitter = lognormal(speeds["up_u"] * SPEED_BITS_PER_UNIT, speeds["up_sigma"] * SPEED_BITS_PER_UNIT)
        rows.append({"network": device_id[:8], "down_bps": down, "up_bps": up, "down_jitter": down_jitter,
                     "up_jitter": up_jitter})
    return rows


def compute_tiers(source: Path) -> list[tuple[float, int]]:
    """(multiply-adds per second, entries) of each compute tier, slowest first."""
    phones = json.loads((source / "raw_ai_benchmark_list.json").read_text())
    anchors = [int(phone[COMPUTE_SCORE]) for phone in phones if phone["Model"] == ANCHOR_MODEL]
    if len(anchors) != 1:
        raise SystemExit(f"{source}: expected one {ANCHOR_MODEL} entry, found {len(anchors)}")
    ordered = sorted((int(phone[COMPUTE_SCORE]), phone["Model"]) for phone in phones)
    scores = np.array([score for score, _ in ordered], dtype=np.float64)
    return [(ANCHOR_MACS_PER_S * float(np.exp(np.log(tier).mean())) / anchors[0], len(tier))
            for tier in np.array_split(scores, TIERS)]


def phones_rows(source: Path) -> list[dict]:
    """The ``phones`` table: every compute tier × every network."""
    tiers, nets = compute_tiers(source), networks(source)
    entries = sum(count for _, count in tiers)
    return [{"name": f"tier{number:02d}-net-{net['network']}", "macs_per_s": rate,
             **{column: net[column] for column in ("down_bps", "up_bps", "down_jitter", "up_jitter")},
             "share": count / (entries * len(nets))}
            for number, (rate, count) in enumerate(tiers, start=1) for net in nets]


def weighted_median(values: list[float], shares: list[float]) -> float:
    """The smallest value at or above which half the population's share lies."""
    order = np.argsort(values, kind="stable")
    cumulative = np.cumsum(np.asarray(shares)[order])
    return float(np.asarray(values)[order][np.searchsorted(cumulative, 0.5)])


def uniform_row(phones: list[dict]) -> dict:
    """The ``uniform`` table's one device: the ``phones`` population's median rates."""
    shares = [row["share"] for row in phones]
    return {"name": "median-phone", "share": 1.0,
            **{rate: weighted_median([row[rate] for row in phones], shares)
               for rate in ("macs_per_s", "down_bps", "up_bps")}}


def formatted(row: dict) -> dict:
    """Rates as integers, σ to 6 significant digits, shares (exact fractions' floats) as Python writes them."""
    return {column: (round(value) if column.endswith(("_per_s", "_bps"))
                     else float(f"{value:.6g}") if column.endswith("_jitter") else value)
            for column, value in row.items()}


def write(path: Path, columns: tuple[str, ...], rows: list[dict]) -> None:
    with path.open("w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=columns, lineterminator="\n")
        writer.writeheader()
        writer.writerows(formatted(row) for row in rows)


def build(source: Path, out: Path) -> list[Path]:
    """Write ``phones.csv`` and ``uniform.csv`` into ``out`` from FLASH's files in ``source``."""
    phones = phones_rows(source)
    out.mkdir(parents=True, exist_ok=True)
    write(out / "phones.csv", PHONES_COLUMNS, phones)
    write(out / "uniform.csv", ("name", "macs_per_s", "down_bps", "up_bps", "share"), [uniform_row(phones)])
    return [out / "phones.csv", out / "uniform.csv"]


def default_source() -> Path | None:
    """FLASH's data beside the checkout, if it is there."""
    return next((path for path in SOURCES if (path / "speed_distri.json").is_file()), None)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, default=default_source(), help="FLASH's data files")
    parser.add_argument("--out", type=Path, default=TABLES, help="where the tables go")
    args = parser.parse_args(argv)
    if args.source is None:
        parser.error(f"no FLASH data at {' or '.join(map(str, SOURCES))}: give --source")
    for path in build(args.source, args.out):
        print(path)


if __name__ == "__main__":
    main()
