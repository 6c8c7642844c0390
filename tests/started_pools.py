"""The shard pools a test's runs start, kept so that the test can act on them (kill a shard mid-run)."""

from fedray.runtime.shards import ShardPool


def keeping_started_pools(monkeypatch) -> list[ShardPool]:
    """Patch ``ShardPool.start`` to append every pool it starts to the returned list."""
    pools: list[ShardPool] = []
    start = ShardPool.start.__func__

    def keep(cls, *args, **kwargs):
        pools.append(start(cls, *args, **kwargs))
        return pools[-1]

    monkeypatch.setattr(ShardPool, "start", classmethod(keep))
    return pools
