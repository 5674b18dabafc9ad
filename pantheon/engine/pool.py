"""The serve's table of loaded models: load (one upload at a time), unload (drain first), routing.

Errors carry the contract's status and `type` (`PoolError`); the web layer only renders them."""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from pantheon.config import MAX_MODEL_DIES, EngineEnv, ModelConfig
from pantheon.engine.dies import visible_dies
from pantheon.engine.engine import Engine
from pantheon.engine.memory import meminfo_bytes
from pantheon.gguf.reader import GGUFError, open_gguf

log = logging.getLogger(__name__)
LOADING, READY, UNLOADING, FAILED = "loading", "ready", "unloading", "failed"


class PoolError(Exception):
    def __init__(self, status: int, type_: str, message: str):
        super().__init__(message)
        self.status, self.type, self.message = status, type_, message


@dataclass
class ModelEntry:
    config: ModelConfig
    state: str = LOADING
    engine: Engine | None = None
    error: str | None = None


def estimate_device_bytes(path: str, ctx: int, n_slots: int) -> int:
    """f32 weights (every tensor element x 4 bytes) + f32 KV for n_slots + scratch."""
    g = open_gguf(path)
    elements = sum(int(math.prod(t.shape)) for t in g.tensors.values())
    arch = g.architecture
    n_layer = int(g.get(f"{arch}.block_count", 0) or 0)
    kv_heads = g.get(f"{arch}.attention.head_count_kv", g.get(f"{arch}.attention.head_count", 0)) or 0
    kv_heads = kv_heads[0] if isinstance(kv_heads, list) else kv_heads
    n_embd = int(g.get(f"{arch}.embedding_length", 0) or 0)
    n_head = g.get(f"{arch}.attention.head_count", 1) or 1
    n_head = n_head[0] if isinstance(n_head, list) else n_head
    head_dim = int(g.get(f"{arch}.attention.key_length", n_embd // max(int(n_head), 1)))
    kv = 2 * n_layer * (n_slots + 1) * ctx * int(kv_heads) * head_dim * 4
    return elements * 4 + kv


class ModelPool:
    def __init__(self):
        self._entries: dict[str, ModelEntry] = {}
        self._lock = threading.Lock()  # guards _entries
        self._upload = threading.Lock()  # one model upload in flight at a time

    # ---- queries ------------------------------------------------------------------------------------
    def entries(self) -> list[ModelEntry]:
        with self._lock:
            return list(self._entries.values())

    def ready(self) -> list[ModelEntry]:
        return [e for e in self.entries() if e.state == READY]

    def any_busy(self) -> bool:
        return any(e.engine is not None and e.engine.busy for e in self.entries())

    def loading(self) -> bool:
        return any(e.state == LOADING for e in self.entries())

    def resolve(self, model: str | None) -> Engine:
        """The contract's routing: one model takes any name; several need an exact match."""
        ready = self.ready()
        if not ready:
            msg = "no models loaded" + (" (a model is still loading; retry shortly)" if self.loading() else "")
            raise PoolError(503, "no_models_loaded", msg)
        if len(ready) == 1:
            return ready[0].engine
        for e in ready:
            if e.config.name == model:
                return e.engine
        names = ", ".join(e.config.name for e in ready)
        raise PoolError(404, "model_not_found", f"model {model!r} not found; loaded: {names}")

    def find(self, name: str | None) -> Engine | None:
        """Session routes: `name` selects the model; absent -> the default (first loaded) model."""
        ready = self.ready()
        if not ready:
            return None
        if name is None:
            return ready[0].engine
        return next((e.engine for e in ready if e.config.name == name), None)

    # ---- load / unload ------------------------------------------------------------------------------
    def load(self, config: ModelConfig) -> ModelEntry:
        """Blocking; run it off the event loop."""
        self._admit(config)
        with self._lock:
            existing = self._entries.get(config.name)
            if existing is not None and existing.state != FAILED:
                what = "already unloading" if existing.state == UNLOADING else "already loaded"
                raise PoolError(409, "load_failed", f"model {config.name!r} is {what}")
            entry = self._entries[config.name] = ModelEntry(config)
        try:
            with self._upload:
                device = visible_dies_devices(config.dies)
                env = EngineEnv.from_env()
                entry.engine = Engine(config.path, config.name, ctx_cap=config.ctx_cap,
                                      max_sessions=config.max_sessions, max_concurrent=config.max_concurrent,
                                      batching=env.batching, queue_depth=env.queue_depth,
                                      numerics=config.numerics, reasoning_budget=config.reasoning_budget,
                                      device=device, idle_ttl_s=env.idle_ttl_s, watch_grace_s=env.watch_grace_s)
                entry.engine.start()
            entry.state = READY
            return entry
        except GGUFError as e:
            self._fail(entry, str(e))
            raise PoolError(500, "load_failed", str(e)) from None
        except Exception as e:  # noqa: BLE001 - any load failure is reported, the server stays up
            log.exception("load of %s failed", config.path)
            self._fail(entry, str(e))
            raise PoolError(500, "load_failed", f"loading {config.path} failed: {e}") from None

    def _fail(self, entry: ModelEntry, message: str) -> None:
        with self._lock:
            if self._entries.get(entry.config.name) is entry:
                del self._entries[entry.config.name]

    def _admit(self, config: ModelConfig) -> None:
        if config.dies is not None and len(config.dies) > MAX_MODEL_DIES:
            raise PoolError(400, "invalid_request_error", f"too many dies ({len(config.dies)} > {MAX_MODEL_DIES})")
        if not os.path.isfile(config.path):
            raise PoolError(404, "load_failed", f"file not found: {config.path}")
        if config.dies:
            visible = len(visible_dies())
            bad = [d for d in config.dies if not 0 <= d < visible]
            if not visible or bad:
                raise PoolError(400, "load_failed", f"dies {bad or list(config.dies)} not visible "
                                                    f"(this serve holds {visible} dies)")
            taken = {d for e in self.entries() if e.config.dies for d in e.config.dies}
            if taken & set(config.dies):
                raise PoolError(507, "load_failed", f"dies {sorted(taken & set(config.dies))} are bound to "
                                                    "another model")
        try:
            need = estimate_device_bytes(config.path, config.ctx_cap,
                                         max(config.max_sessions, config.max_concurrent_configured))
        except GGUFError as e:
            raise PoolError(500, "load_failed", str(e)) from None
        have = meminfo_bytes("MemAvailable", 1 << 62)
        if need > 0.9 * have:
            raise PoolError(507, "load_failed", f"admission refused: {config.name} needs ~{need >> 20} MiB, "
                                                f"{have >> 20} MiB host memory available")

    def unload(self, name: str) -> None:
        """Blocking: drains the in-flight generation, then frees the model."""
        with self._lock:
            entry = self._entries.get(name)
            if entry is None or entry.state == FAILED:
                raise PoolError(404, "unload_failed", f"model {name!r} is not loaded")
            if entry.state == UNLOADING:
                raise PoolError(409, "unload_failed", f"model {name!r} is already unloading")
            if entry.state == LOADING:
                raise PoolError(409, "unload_failed", f"model {name!r} is still loading")
            entry.state = UNLOADING
        engine = entry.engine
        while engine.busy:  # drain: the generations in flight finish first
            time.sleep(0.05)
        engine.stop()
        with self._lock:
            del self._entries[name]

    def close(self) -> None:
        for e in self.entries():
            if e.engine is not None:
                e.engine.stop()


def visible_dies_devices(dies: tuple[int, ...] | None):
    """The device the model is placed on: the first named die (multi-die sharding: issue 6)."""
    if not dies:
        return None
    import jax

    return jax.devices()[dies[0]]
