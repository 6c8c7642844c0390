"""Whether an actor is one that Ray restarted, asked without Ray's warning about its own deprecated field."""

import os
import time
import warnings

import ray

from fedray.runtime.restarts import this_actor_was_restarted


@ray.remote(num_cpus=0, max_restarts=1)
class Asker:
    def ask(self) -> tuple[bool, list[str]]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            restarted = this_actor_was_restarted()
        return restarted, [str(warning.message) for warning in caught]

    def pid(self) -> int:
        return os.getpid()


def test_a_restarted_actor_knows_it_and_no_warning_is_raised(ray_session):
    actor = Asker.remote()
    assert ray.get(actor.ask.remote()) == (False, [])
    first = ray.get(actor.pid.remote())
    ray.kill(actor, no_restart=False)
    deadline = time.monotonic() + 60
    while True:  # ray.kill returns at once: calls reach the old process, or fail, until Ray has restarted the actor
        try:
            if ray.get(actor.pid.remote(), timeout=60) != first:
                break
        except ray.exceptions.RayActorError:
            pass
        assert time.monotonic() < deadline, "Ray did not restart the actor in 60 s"
        time.sleep(0.05)
    assert ray.get(actor.ask.remote()) == (True, [])
    ray.kill(actor)
