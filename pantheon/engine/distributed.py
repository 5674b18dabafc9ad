"""One model over several hosts, on JAX's multi-controller runtime (`jax.distributed`).

Every process runs `pantheon serve` with the same model flags plus `--coordinator HOST:PORT
--num-processes N --process-id I`. `initialize` joins the runtime (on the CPU with gloo
collectives), so `jax.devices()` lists every process's dies and the model is placed on a Mesh over
all of them: each process holds its shards and runs the same compiled programs. Process 0 serves
HTTP and schedules; before each device call that changes state (a scheduler step, a slot's
sampler reset, a repair) it broadcasts the call and its arguments (`StepChannel`, a collective
through `multihost_utils.broadcast_one_to_all`), and the other processes replay it in the same
order (`follow`), so every process issues the same programs with the same inputs. Outputs are
replicated, so process 0 reads them locally.

Limits (stated, and refused where reachable): one model per serve; the session host tier and
session export/restore are off (a slot's KV is spread over processes)."""

from __future__ import annotations

import logging
import pickle
import time

import numpy as np

log = logging.getLogger(__name__)
KEEPALIVE_S = 20.0


def initialize(coordinator: str, num_processes: int, process_id: int) -> None:
    import jax

    # CPU dies talk over gloo (the setting concerns only the CPU client; GPUs use NCCL)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator, num_processes=num_processes, process_id=process_id)
    log.info("process %d of %d joined %s: %d dies in all, %d here", process_id, num_processes, coordinator,
             jax.device_count(), jax.local_device_count())


def is_multiprocess() -> bool:
    import jax

    return jax.process_count() > 1


class StepChannel:
    """Process 0's device calls, broadcast to the other processes in order. Every process calls
    send (process 0) or recv (the others) at the same points: each is two collectives (the length,
    then the pickled call)."""

    def __init__(self):
        self.last = time.monotonic()

    @staticmethod
    def _broadcast(x: np.ndarray) -> np.ndarray:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.broadcast_one_to_all(x))

    def send(self, message) -> None:
        payload = pickle.dumps(message)
        self._broadcast(np.array([len(payload)], np.int32))
        self._broadcast(np.frombuffer(payload, np.uint8))
        self.last = time.monotonic()

    def recv(self):
        n = int(self._broadcast(np.zeros(1, np.int32))[0])
        return pickle.loads(self._broadcast(np.zeros(n, np.uint8)).tobytes())


def follow(runner, channel: StepChannel) -> None:
    """A follower's loop: replay process 0's runner calls until it says stop (None)."""
    log.info("following process 0's steps")
    while True:
        message = channel.recv()
        if message is None:
            log.info("process 0 stopped: leaving")
            return
        name, args = message
        if name == "noop":
            continue
        try:
            getattr(runner, name)(*args, _replay=True)
        except Exception:  # noqa: BLE001 - process 0 met the same failure and reports it
            log.exception("replayed %s failed", name)
