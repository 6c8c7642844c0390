"""Objects that restartable actors fetch by a name, never through their constructor.

Ray cannot restart an actor whose creation arguments hold object references
(ray-project/ray#53727: it warns about every such actor, in an error line),
yet a shard must find its assignment again after a restart, and a shard of a
federation held only in memory its rows. So a restartable actor takes a name
(text) and fetches its objects through it, as often as it starts:

- small objects (a shard's assignment: a few hundred bytes) are pickled into
  the key-value store of Ray's GCS, which every process of the cluster reads
  (:func:`read`): no process of their own;
- large ones (a federation's rows held in memory) are put in the object store,
  and their references kept by a small actor of their own, never restarted,
  that the driver names and keeps on its node (where ``ray.put`` placed the
  objects) (:func:`fetch`). Its worker process starts only for a run that has
  such objects: a run on a dataset spec starts none, and its shards take both
  of Ray's prestarted workers at once.

Entries a driver that was killed could not release stay in a long-lived
cluster's GCS (a few hundred bytes a shard); an embedded Ray ends with them.
"""

from __future__ import annotations

import pickle
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

import ray
from ray.experimental.internal_kv import _internal_kv_del, _internal_kv_get, _internal_kv_put
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

NAMESPACE = "fedray"
"""The GCS key-value namespace of the small objects."""


@ray.remote(num_cpus=0, max_restarts=0)
class _Keeper:
    """References by key (given at creation: an actor that never restarts may take them there)."""

    def __init__(self, objects: dict[Any, ray.ObjectRef]) -> None:
        self.objects = objects

    def reference(self, key: Any) -> list[ray.ObjectRef]:
        """The reference of ``key``, in a list so that Ray returns it unresolved."""
        return [self.objects[key]]

    def replace(self, objects: dict[Any, list[ray.ObjectRef]]) -> None:
        """Keep ``objects`` (each reference in a list, so that Ray hands it over unresolved) instead."""
        self.objects = {key: references[0] for key, references in objects.items()}


def _small_key(name: str, key: Any) -> bytes:
    return f"{name}/{key!r}".encode()


@dataclass(frozen=True)
class NamedObjects:
    """Objects kept under ``name`` until :meth:`release`: small ones read by :func:`read`, large ones fetched by
    :func:`fetch`, from any process of the cluster."""

    name: str
    small_keys: tuple = ()
    keeper: Any = field(default=None, compare=False)
    """The actor keeping the large objects' references (None: there are none)."""

    @staticmethod
    def new_name() -> str:
        return f"fedray-named-{uuid.uuid4().hex}"

    @classmethod
    def put(cls, small: dict[Any, Any], large: dict[Any, Any], name: str | None = None) -> "NamedObjects":
        """Keep ``small`` (pickled into the GCS) and ``large`` (in the object store) under ``name`` (default: a
        :meth:`new_name`)."""
        kept = cls(cls.new_name() if name is None else name)
        return kept.replace(small, large)

    def replace(self, small: dict[Any, Any], large: dict[Any, Any]) -> "NamedObjects":
        """The same name keeping ``small`` and ``large`` instead of the objects kept so far (which go once nothing
        else holds them), from when this returns."""
        for key, value in small.items():
            _internal_kv_put(_small_key(self.name, key), pickle.dumps(value), namespace=NAMESPACE)
        for key in set(self.small_keys) - small.keys():
            _internal_kv_del(_small_key(self.name, key), namespace=NAMESPACE)
        keeper = self.keeper
        if keeper is not None:
            ray.get(keeper.replace.remote({key: [ray.put(value)] for key, value in large.items()}))
        elif large:
            here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
            keeper = _Keeper.options(name=self.name, scheduling_strategy=here).remote(
                {key: ray.put(value) for key, value in large.items()})
        return replace(self, small_keys=tuple(small), keeper=keeper)

    def release(self) -> None:
        for key in self.small_keys:
            _internal_kv_del(_small_key(self.name, key), namespace=NAMESPACE)
        if self.keeper is not None:
            ray.kill(self.keeper)


def read(name: str, key: Any) -> Any:
    """The small object kept under ``key`` by the :class:`NamedObjects` named ``name``."""
    value = _internal_kv_get(_small_key(name, key), namespace=NAMESPACE)
    if value is None:
        raise KeyError(f"{name} keeps no {key!r}")
    return pickle.loads(value)


def fetch(name: str, key: Any) -> Any:
    """The large object kept under ``key`` by the :class:`NamedObjects` named ``name``."""
    return ray.get(ray.get(ray.get_actor(name).reference.remote(key))[0])
