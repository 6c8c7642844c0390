"""The closed-form round loop: sample, upload (accounted), reduce, solve, evaluate."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import ray
from tqdm import tqdm

from fedray.accounting import PaperTotals
from fedray.evaluation import Evaluator
from fedray.methods.base import FLOAT_BYTES, Classifier, ClosedFormMethod
from fedray.results import EvalPoint
from fedray.runtime.shards import ShardPool


@dataclass
class RunOutcome:
    points: list[EvalPoint] = field(default_factory=list)
    classifier: Classifier | None = None
    solve_s: float = 0.0
    eval_s: float = 0.0
    paper: PaperTotals = field(default_factory=PaperTotals)


@dataclass
class _Block:
    round: int
    clients_seen: int
    samples_seen: int
    bytes_up: float
    flops_client_avg: float
    paper: dict[str, float | None]
    total: ray.ObjectRef | None


def eval_rounds(num_rounds: int, eval_every: int) -> set[int]:
    return set(range(eval_every, num_rounds + 1, eval_every)) | {num_rounds}


def run_closed_form(
    pool: ShardPool,
    method: ClosedFormMethod,
    rounds: list[np.ndarray],
    eval_every: int,
    evaluator: Evaluator,
    quiet: bool = False,
    on_point: Callable[[EvalPoint], None] | None = None,
    backbone_macs: float | None = None,
) -> RunOutcome:
    """Run ``method`` over ``rounds``; one :class:`EvalPoint` per evaluation, also passed to ``on_point``.

    ``backbone_macs`` is the backbone's forward multiply-adds per sample (F_φ),
    when known, for ``macs_client_avg_fed3r``.

    A client uploads its statistics the first time it is sampled and never
    again (the clients of one round are distinct). All blocks are submitted at
    once, so shards compute later blocks while the driver solves and evaluates
    earlier ones.
    """
    start = time.perf_counter()
    federation = pool.federation
    method_ref = ray.put(method)
    sizes = federation.client_sizes
    upload_bytes = method.upload_floats(federation) * FLOAT_BYTES
    client_flops = method.statistics_flops(sizes.astype(np.float64))
    paper_costs, paper = method.paper_costs(federation), PaperTotals()
    seen = np.zeros(federation.num_clients, dtype=bool)
    evaluate_at = eval_rounds(len(rounds), eval_every)
    blocks: list[_Block] = []
    uploads: list[np.ndarray] = []
    bytes_up = flops = 0.0
    samples = clients_seen = 0
    for number, clients in enumerate(rounds, start=1):
        new = clients[~seen[clients]]
        seen[new] = True
        uploads.append(new)
        bytes_up += float(upload_bytes[new].sum())
        flops += float(client_flops[new].sum())
        paper.add(paper_costs, new, backbone_macs)
        samples += int(sizes[new].sum())
        clients_seen += len(new)
        if number in evaluate_at:
            uploaded = np.concatenate(uploads)
            uploads = []
            total = pool.statistics(method_ref, uploaded) if len(uploaded) else None
            blocks.append(_Block(number, clients_seen, samples, bytes_up, flops / max(clients_seen, 1),
                                 paper.columns(federation.num_clients), total))

    outcome = RunOutcome(paper=paper)
    state = None
    accuracy = float("nan")
    with tqdm(total=len(rounds), unit="round", disable=quiet, desc=method.name or type(method).__name__) as progress:
        for block in blocks:
            partial = None if block.total is None else ray.get(block.total)
            if partial is not None:
                solve_start = time.perf_counter()
                state = partial if state is None else method.combine(state, partial)
                outcome.classifier = method.solve(state)
                eval_start = time.perf_counter()
                accuracy = evaluator.accuracy(method, outcome.classifier)
                outcome.solve_s += eval_start - solve_start
                outcome.eval_s += time.perf_counter() - eval_start
            point = EvalPoint(block.round, block.clients_seen, block.samples_seen, accuracy, block.bytes_up, 0.0,
                              block.flops_client_avg, time.perf_counter() - start, **block.paper)
            outcome.points.append(point)
            if on_point is not None:
                on_point(point)
            progress.update(block.round - progress.n)
            progress.set_postfix(clients=block.clients_seen, acc=f"{accuracy:.4f}")
    return outcome
