"""A sweep of fine-tuning runs: the trainers run in each trial's placement group, and each trial writes what a plain
``fedray run`` of its configuration writes."""

import polars as pl

from fedray.cli import main
from fedray.sweep.spec import SweepSpec
from fedray.sweep.tuning import sweep
from tests.images import write_inat_split


def test_a_fine_tuning_sweep_gives_each_trial_the_rows_of_a_plain_run(ray_session, tmp_path):
    train_csv, images = write_inat_split(tmp_path / "data", users=4, images_per_user=3, classes=3, test_images=4)
    base = {"method": "fedavg", "finetune": "ft", "dataset": f"hsu:{train_csv}?images={images}", "backbone": "squeezenet1_1",
            "weights": "random", "image_size": 64, "clients_per_round": 2, "rounds": 2, "eval_every": 1, "batch_size": 4,
            "local_epochs": 1, "num_trainers": 1, "cpus_per_trainer": 0.5}
    # two trials at once on the session's 2 CPUs: each a half-CPU driver and one half-CPU trainer (one thread, as the
    # plain runs' trainer)
    spec = SweepSpec("ft", base=base, grid={"client_lr": [0.01, 0.05]}, shards_per_trial=1, cpus_per_shard=0.5, driver_cpus=0.5)
    table = sweep(spec, tmp_path / "sweeps", quiet=True)
    assert sorted(table["client_lr"].unique()) == [0.01, 0.05]

    trials = sorted((tmp_path / "sweeps" / "ft").glob("*/metrics.parquet"))
    assert len(trials) == 2
    for index, metrics in enumerate(trials):
        out = tmp_path / f"plain{index}"
        assert main(["run", "--config", str(metrics.parent / "config.yaml"), "--out", str(out), "--quiet"]) == 0
        swept, plain = (pl.read_parquet(path).drop("wall_s") for path in (metrics, out / "metrics.parquet"))
        assert swept["stage"].to_list() == ["train"] * 3 and swept["round"].to_list() == [0, 1, 2]
        assert swept.equals(plain), (swept, plain)
