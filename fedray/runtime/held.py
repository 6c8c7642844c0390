"""Large values a restartable actor needs, sent by reference with its calls instead of with its constructor.

Ray logs an ERROR for every actor that may restart and whose constructor
arguments live in the object store (a lost argument makes the restart fail).
So such an actor's constructor takes small descriptors only; what is large
(a trainer's image list, a model's weights) is put in the object store once by
the driver, which keeps the reference, and travels with every call wrapped in
:class:`Held`, so Ray passes the reference, not the value. The actor fetches
the value on its first call, after starting or after a restart (Ray retries
the failed call, with the same :class:`Held`, on the restarted actor).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ray


@dataclass(frozen=True)
class Held:
    """A reference to a value in the object store; the driver that made it keeps it alive as long as its actors."""

    ref: ray.ObjectRef

    @classmethod
    def put(cls, value: Any) -> "Held":
        return cls(ray.put(value))

    def get(self) -> Any:
        return ray.get(self.ref)
