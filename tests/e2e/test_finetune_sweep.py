"""Sweeps of fine-tuning runs: the trainers (and the closed-form stages' shards, and TCT's stage 2) run in each trial's
placement group, and each trial writes the rows a plain ``fedray run`` of its configuration writes."""

import polars as pl
import pytest

from fedray.app.cli import main
from fedray.app.sweeps.spec import SweepSpec
from fedray.app.sweeps.tuning import sweep
from tests.images import write_inat_split

TRAIN = {"backbone": "squeezenet1_1", "weights": "random", "image_size": 64, "clients_per_round": 2, "rounds": 2,
         "eval_every": 1, "batch_size": 4, "local_epochs": 1, "num_trainers": 1, "cpus_per_trainer": 0.5}
CASES = {
    # fine-tuning from a Fed3R head, then the ridge probe: shards on the embedded images share the trainer's bundle
    "finetune": ({"method": "fedavg", "finetune": "ft", "init": "fed3r", "probe_ridge": True}, {"client_lr": [0.01, 0.05]},
                 {"closed_form", "train"}),
    # TCT: stage 2's shards take the trainer's bundle once stage 1 is over
    "tct": ({"method": "tct", "entk_dim": 50, "entk_chunk": 8, "tct_rounds": 2, "tct_local_steps": 2, "tct_solver": "both"},
            {"tct_lr": [1e-3]}, {"train", "tct_closed_form", "tct_scaffold"}),
}


@pytest.mark.parametrize("case", CASES)
def test_each_trial_writes_the_rows_of_a_plain_run(ray_session, tmp_path, case):
    options, grid, stages = CASES[case]
    train_csv, images = write_inat_split(tmp_path / "data", users=4, images_per_user=3, classes=3, test_images=4)
    base = {**TRAIN, **options, "dataset": f"hsu:{train_csv}?images={images}"}
    # trials run side by side on the session's 2 CPUs: each a half-CPU driver and one half-CPU trainer (one thread,
    # as the plain runs' trainer)
    spec = SweepSpec(case, base=base, grid=grid, shards_per_trial=1, cpus_per_shard=0.5, driver_cpus=0.5)
    table = sweep(spec, tmp_path / "sweeps", quiet=True)
    [(key, values)] = grid.items()
    assert sorted(table[key].unique()) == values

    trials = sorted((tmp_path / "sweeps" / case).glob("*/metrics.parquet"))
    assert len(trials) == len(values)
    for index, metrics in enumerate(trials):
        out = tmp_path / f"plain{index}"
        assert main(["run", "--config", str(metrics.parent / "config.yaml"), "--out", str(out), "--quiet"]) == 0
        swept, plain = (pl.read_parquet(path).drop("wall_s") for path in (metrics, out / "metrics.parquet"))
        assert set(swept["stage"]) == stages
        assert swept.equals(plain), (swept, plain)
