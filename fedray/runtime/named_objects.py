"""Objects in Ray's object store that restartable actors fetch by a name, never through their constructor.

Ray cannot restart an actor whose creation arguments hold object references
(ray-project/ray#53727: it warns about every such actor, in an error line),
yet a shard of a federation held only in memory must find its rows again
after a restart. So the references live in a small actor of their own, never
restarted, that the driver names and keeps on its node (where ``ray.put``
placed the objects); a restartable actor takes that name (text) and fetches
its object through it, as often as it starts.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy


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


@dataclass(frozen=True)
class NamedObjects:
    """``objects`` put in Ray's object store and kept there until :meth:`release`; :func:`fetch` reads one by key."""

    name: str
    keeper: Any

    @staticmethod
    def new_name() -> str:
        return f"fedray-named-{uuid.uuid4().hex}"

    @classmethod
    def put(cls, objects: dict[Any, Any], name: str | None = None) -> "NamedObjects":
        """Keep ``objects`` under ``name`` (default: a :meth:`new_name`)."""
        name = cls.new_name() if name is None else name
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        references = {key: ray.put(value) for key, value in objects.items()}
        return cls(name, _Keeper.options(name=name, scheduling_strategy=here).remote(references))

    def replace(self, objects: dict[Any, Any]) -> None:
        """Keep ``objects`` instead of those kept so far (which go once nothing else holds them), from when this
        returns."""
        ray.get(self.keeper.replace.remote({key: [ray.put(value)] for key, value in objects.items()}))

    def release(self) -> None:
        ray.kill(self.keeper)


def fetch(name: str, key: Any) -> Any:
    """The object kept under ``key`` by the :class:`NamedObjects` named ``name``."""
    return ray.get(ray.get(ray.get_actor(name).reference.remote(key))[0])
