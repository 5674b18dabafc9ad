"""Attention-path residency: where each attention layer's KV lives, whether a kernel attends it,
and the contract's `attention` counters (`/admin/models`)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import jax
import numpy as np

from pantheon.config import kv_retry_budget
from pantheon.engine.dies import die_budget, visible_dies
from pantheon.faults import FAULTS
from pantheon.model import kernels as kern

if TYPE_CHECKING:
    from pantheon.engine.runner import ModelRunner



class AttentionResidency:
    """Where each attention layer's KV lives, and the contract's `attention` counters.

    A layer whose device KV allocation fails (out of memory, or an injected `kv_alloc` fault) keeps
    its KV in host memory and attends there (llama.forward's host path: same tokens, slower). The
    allocation is retried on a bounded backoff (PN_KV_RETRY_BUDGET tries, default 5); on success
    the host rows move to the device and the layer is on-die again. A layer whose KV cannot fit
    its die at all is `impossible` and is not retried. Dense models only: the hybrid model's
    attention layers always hold device KV."""

    def __init__(self, runner: "ModelRunner", backoff_s: float = 1.0):
        self.runner, self.backoff_s = runner, backoff_s
        self.budget = kv_retry_budget()
        self.failures: dict[int, int] = {}  # host layer -> failed allocations
        self.next_retry: dict[int, float] = {}
        self.gave_up: set[int] = set()
        self.impossible: set[int] = set()
        self.host_engagements = 0
        self.ring_alloc_failures = 0
        if runner.family.can_truncate:  # dense: every layer's KV is its own buffer pair
            for layer in range(len(runner.cache.k)):
                if FAULTS.take("kv_alloc"):
                    self._to_host(layer)

    @property
    def layers(self) -> int:
        return len(self.runner.cache.k)

    def host_layers(self) -> list[int]:
        return [i for i, k in enumerate(self.runner.cache.k) if isinstance(k, np.ndarray)]

    def _to_host(self, layer: int) -> None:
        cache = self.runner.cache
        kind = np.uint8 if cache.k[layer].dtype == np.uint8 else np.float32  # a q8_0 cache keeps its bytes
        host_k = np.zeros(cache.k[layer].shape, kind)
        host_v = np.zeros(cache.v[layer].shape, kind)
        cache.k[layer], cache.v[layer] = host_k, host_v  # the device buffers are dropped
        self.host_engagements += 1
        self._failed(layer)
        if 2 * host_k.nbytes // self._dies() > self._die_bytes():
            self.impossible.add(layer)  # its rings exceed a whole die: no retry can succeed

    def _dies(self) -> int:
        sharding = self.runner.state_sharding
        return len(sharding.device_set) if sharding is not None else 1

    def _die_bytes(self) -> int:
        """The smallest budget among the dies holding this model's KV (`vram_budget`)."""
        sharding = self.runner.state_sharding
        ids = {d.id for d in sharding.device_set} if sharding is not None else {jax.devices()[0].id}
        return min((die_budget(d) for d in visible_dies() if d.device_id in ids), default=1 << 62)

    def _failed(self, layer: int) -> None:
        self.ring_alloc_failures += 1
        n = self.failures[layer] = self.failures.get(layer, 0) + 1
        self.next_retry[layer] = time.monotonic() + self.backoff_s * 2 ** (n - 1)
        if n > self.budget:
            self.gave_up.add(layer)

    def retry_due(self) -> None:
        """Try to move host layers back to the device (the device thread calls this between steps)."""
        now = time.monotonic()
        cache = self.runner.cache
        for layer in self.host_layers():
            if layer in self.gave_up or layer in self.impossible or now < self.next_retry.get(layer, 0.0):
                continue
            try:
                if FAULTS.take("kv_alloc"):
                    raise MemoryError("injected KV allocation failure")
                k = jax.device_put(cache.k[layer].astype(self.runner.kv_dtype), self.runner.state_sharding)
                v = jax.device_put(cache.v[layer].astype(self.runner.kv_dtype), self.runner.state_sharding)
            except Exception:  # noqa: BLE001 - any allocation failure keeps the host path
                self._failed(layer)
                continue
            cache.k[layer], cache.v[layer] = k, v

    def kernel_reason(self) -> str | None:
        """Why the layers whose KV is on the device still attend on the jnp reference (from the
        kernel choice their decode programs record, model/kernels.py), or None when a kernel runs
        them: Pallas on a GPU, the native kernel on the CPU."""
        spec, cache = self.runner.spec, self.runner.cache
        wanted = kern.attention_modes(1, spec.head_dim, tuple(cache.layer_shape))
        if dict(kern.choose(wanted, self.runner.kv_dtype))[kern.ATTENTION_DECODE] != "reference":
            return None
        return "no_flash_kernels" if all(wanted.values()) else "kv_geometry_or_ring_wrap"

    def reached(self) -> bool:
        """Whether the forward has run an attention layer yet (a program that attends was built):
        the contract omits the `attention` object until then."""
        attending = set(self.runner.family.kv_programs) | {"attn_project"}
        return bool(attending & self.runner.registry.programs())

    def counters(self, operator: bool) -> dict:
        """`ondie`: layers whose KV is on the device and whose decode attention runs a kernel;
        `host`: the others, each for a reason: KV in host memory (`ring_alloc_failed`), or the jnp
        reference attending (`no_flash_kernels`: no kernel on this backend; `kv_geometry_or_ring_wrap`:
        the kernel cannot run these shapes)."""
        host_kv = len(self.host_layers())
        reasons = {"ring_alloc_failed": host_kv} if host_kv else {}
        reason = self.kernel_reason()
        if reason is not None and self.layers > host_kv:
            reasons[reason] = self.layers - host_kv
        host = sum(reasons.values())
        out = {"ondie": self.layers - host, "host": host, "total": self.layers}
        if operator or self.gave_up:
            out["gave_up"] = len(self.gave_up)
        if operator or self.impossible:
            out["impossible"] = len(self.impossible)
        if operator:
            out["host_engagements"] = self.host_engagements
            out["ring_alloc_failures"] = self.ring_alloc_failures
            if host:
                out["reasons"] = reasons
        return out
