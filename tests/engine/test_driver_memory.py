"""A large population is generated, sampled and evaluated without a per-sample array in the driver.

``synthetic:inat-geo-3k?clients=25000`` draws its client sizes from iNat-Geo-3K's table (890 samples a client on
average): some 22 million training samples, 25,000 clients. One int64 per sample would be 180 MB; the driver's
numbers per client are 200 KB an array. tracemalloc sees every numpy and Python allocation of the driver (the shards
are other processes)."""

import tracemalloc

import fedray
from fedray.data.registry import load_federation

SPEC = "synthetic:inat-geo-3k?clients=25000&dim=4&classes=20"
LIMIT = 40 * 2**20
"""Far below one per-sample int64 array (8 bytes × ~22 M samples), far above the per-client arrays."""


def test_the_driver_holds_numbers_per_client_never_per_sample(ray_session, tmp_path):
    # a small run first: the modules a run imports are in memory before tracing starts (they are not the data's)
    fedray.run(method="fedncm", dataset="synthetic:inat-user-120k?clients=40&dim=4&classes=20", out=tmp_path / "warm",
               clients_per_round=10, num_shards=2, cpus_per_shard=0.5, quiet=True)
    tracemalloc.start()
    try:
        federation = load_federation(SPEC)
        samples = int(federation.client_offsets[-1])
        result = fedray.run(method="fedncm", dataset=SPEC, out=tmp_path / "run", clients_per_round=100, sampling="with",
                            num_shards=2, cpus_per_shard=0.5, eval_every=50, quiet=True)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert samples > 20_000_000 and 8 * samples > 4 * LIMIT
    assert result.metrics["clients_seen"][-1] == 25_000, "with replacement until every client was seen"
    assert result.metrics["accuracy"][-1] > 0.05
    assert peak < LIMIT, f"the driver's traced peak was {peak / 2**20:.0f} MB"
