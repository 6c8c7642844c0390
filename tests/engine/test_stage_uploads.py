"""Before any work, every postprocessor is told what each stage of the run will upload (``Postprocessor.start``), and
may refuse the run there, in one line, with nothing written."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import numpy as np
import pytest

import fedray
from fedray.core.errors import FedrayError
from fedray.engine.clocked import clocked_closed_form_uploads
from fedray.engine.config import resolve
from fedray.engine.plan import closed_form_uploads, training_uploads
from fedray.engine.run_config import run
from fedray.methods.postprocessor import Sampling, StageUploads

DATASET = "synthetic:inat-geo-100?dim=12&scale=0.2&classes=10"
"""721 clients."""
SMALL = {"dataset": DATASET, "clients_per_round": 6, "num_shards": 2, "cpus_per_shard": 0.5, "quiet": True,
         "client_lr": 0.05, "local_epochs": 1, "batch_size": 8}


class Telling(fedray.Postprocessor):
    """Writes the stages it is told to ``log`` (JSON lines), then refuses the run: what a run tells is all these tests
    read, and a refusal in ``start`` stops the run before any work."""

    def __init__(self, log: Annotated[str, "the file the stages are written to"] = "") -> None:
        super().__init__()
        self.log = log

    def start(self, stages):
        with open(self.log, "a") as log:
            for told in stages:
                log.write(json.dumps([told.stage, told.training, told.sampling.population, told.sampling.per_round,
                                      told.sampling.replacement, told.rounds, told.group, told.smallest_group,
                                      told.summed]) + "\n")
        raise ValueError("told")


class Refusing(fedray.Postprocessor):
    def start(self, stages):
        raise ValueError(f"needs groups of 1000 uploads, the {stages[0].stage} stage sums {stages[0].group}")


def told(tmp_path: Path, name: str, **values) -> list[list]:
    log = tmp_path / f"{name}.log"
    config = resolve({}, {**SMALL, "out": str(tmp_path / name), "postprocessor": f"{__name__}:Telling",
                          "options": {"log": str(log)}, **values}, drop_unused=True)
    with pytest.raises(FedrayError, match=f"^--postprocessor {__name__}:Telling: told$"):
        run(config)
    return [json.loads(line) for line in log.read_text().splitlines()]


def test_a_closed_form_block_sums_kappa_times_eval_every_uploads_and_the_last_block_what_is_left():
    # K = 10, κ = 3, every 2 rounds: rounds of 3, 3, 3, 1 uploads; blocks of 6 and 4
    assert closed_form_uploads("closed form", Sampling(10, 3, False), 4, 2) == \
        StageUploads("closed form", False, Sampling(10, 3, False), 4, 6, 4)
    # a budget of 3 rounds: 9 uploads, blocks of 6 and 3
    assert closed_form_uploads("init", Sampling(10, 3, False), 3, 2).smallest_group == 3
    # with replacement a block holds the clients drawn for the first time: known only as they are drawn
    assert closed_form_uploads("closed form", Sampling(10, 3, True), 9, 2) == \
        StageUploads("closed form", False, Sampling(10, 3, True), 9, 6, None)
    assert closed_form_uploads("closed form", Sampling(10, 3, False), 4, 5).group == 10   # one block: everyone


def test_a_closed_form_block_on_the_clock_sums_the_first_uploads_of_its_rounds_up_to_an_evaluation():
    # drawn with replacement: a client kept again uploads nothing new; rounds 1-2 make a block of 4 (0, 1, 2, 3),
    # round 3 one of none (no aggregate), rounds 4-5 one of 1 (client 4)
    rounds = [np.array(clients, dtype=np.int64) for clients in ([0, 1, 2], [2, 3], [1, 0], [0], [4, 3])]
    sampling = Sampling(6, 3, True)
    assert clocked_closed_form_uploads("closed form", sampling, rounds, {2, 3, 5}) == \
        StageUploads("closed form", False, sampling, 5, 4, 1)
    assert clocked_closed_form_uploads("init", sampling, rounds, {1, 5}, summed=False) == \
        StageUploads("init", False, sampling, 5, 3, 2, False)


def test_a_training_round_sums_kappa_uploads_and_a_pass_s_last_round_k_mod_kappa():
    assert training_uploads("training", Sampling(10, 3, False), 4) == \
        StageUploads("training", True, Sampling(10, 3, False), 4, 3, 1)
    assert training_uploads("training", Sampling(10, 3, False), 3).smallest_group == 3    # the short round not reached
    assert training_uploads("training", Sampling(10, 3, True), 40).smallest_group == 3
    assert training_uploads("training", Sampling(9, 3, False), 40).smallest_group == 3


def test_a_closed_form_run_tells_its_one_stage(ray_session, tmp_path):
    # 721 clients, 6 a round without replacement until all are seen: 121 rounds; blocks of 2 rounds (12 uploads),
    # the last block round 121 alone: 721 − 120·6 = 1 upload
    assert told(tmp_path, "fed3r", method="fed3r", eval_every=2) == \
        [["closed form", False, 721, 6, False, 121, 12, 1, True]]


def test_fedcofs_uploads_are_told_not_summed(ray_session, tmp_path):
    # the server sees FedCOF's mean rows client by client (ClosedFormMethod.uploads_summed)
    assert told(tmp_path, "fedcof", method="fedcof", eval_every=2) == \
        [["closed form", False, 721, 6, False, 121, 12, 1, False]]


def test_a_two_stage_run_tells_its_init_training_and_calibration(ray_session, tmp_path):
    stages = told(tmp_path, "init", method="fedavg", init="fed3r", init_rounds=3, rounds=2, eval_every=3,
                  calibrate="fedncm")
    assert stages == [["init", False, 721, 6, True, 3, 18, None, True],        # training samples with replacement
                      ["training", True, 721, 6, True, 2, 6, 6, True],
                      ["calibration", False, 721, 721, False, 1, 721, 721, True]]


def test_a_refusal_in_start_is_one_line_before_anything_is_written(ray_session, tmp_path):
    config = resolve({}, {**SMALL, "out": str(tmp_path / "refused"), "method": "fedncm", "eval_every": 5,
                          "postprocessor": f"{__name__}:Refusing"}, drop_unused=True)
    with pytest.raises(FedrayError) as refused:
        run(config)
    assert str(refused.value) == (f"--postprocessor {__name__}:Refusing: needs groups of 1000 uploads, the closed form "
                                  "stage sums 30")
    assert not (tmp_path / "refused").exists()
