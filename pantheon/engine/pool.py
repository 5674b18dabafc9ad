"""The serve's table of loaded models: load (one upload at a time), unload (drain first), routing.

Errors carry the contract's status and `type` (`PoolError`); the web layer only renders them."""

from __future__ import annotations

import gc
import logging
import math
import os
import threading
import time
import traceback
from dataclasses import dataclass

from pantheon.config import ENV_HOST_MEMORY, MAX_MODEL_DIES, ModelConfig, Settings, host_memory_cap
from pantheon.engine.dies import die_budget, visible_dies
from pantheon.engine.engine import Engine
from pantheon.engine.memory import meminfo_bytes, release_free_memory
from pantheon.gguf.reader import MAX_MESSAGE, GGUFError, clip, open_gguf
from pantheon.model.dtypes import compute_dtype, itemsize, kv_cache_dtype, kv_value_bytes
from pantheon.model.qwen35moe import expert_role, held_in_blocks, q3k_expert_roles
from pantheon.model.spec import spec_from_gguf
from pantheon.model.state import layer_lengths
from pantheon.native import build as native_build
from pantheon.native.qmatmul import supported as qmatmul_supported
from pantheon.pallas.dispatch import GPU_BACKENDS
from pantheon.pallas.qmatmul import holds as gpu_holds, plane_bytes

log = logging.getLogger(__name__)
LOADING, READY, UNLOADING, FAILED = "loading", "ready", "unloading", "failed"


class PoolError(Exception):
    def __init__(self, status: int, type_: str, message: str):
        message = clip(message, 2 * MAX_MESSAGE)  # the path and a clipped GGUFError, at most
        super().__init__(message)
        self.status, self.type, self.message = status, type_, message


@dataclass
class ModelEntry:
    config: ModelConfig
    state: str = LOADING
    engine: Engine | None = None
    error: str | None = None


# Q3KPlanes hold a Q3_K block of 110 GGUF bytes in 114 (pantheon/pallas/moe_q3k.py)
Q3K_PLANE_BYTES = 114 / 110


def estimate_device_bytes(path: str, ctx: int, n_slots: int, kv_dtype: str = "auto", numerics: str = "exact",
                          mesh: bool = False) -> int:
    """The bytes the model in `path` will occupy on its device(s) (`estimate_bytes`), in the
    compute dtype of this backend (model/dtypes.py: bf16 on a GPU) and its KV cache type; on one
    GPU (not a `mesh` of dies) with the layer matrices the Pallas kernel reads in their blocks."""
    import jax

    g = open_gguf(path)
    arch = g.architecture

    def meta(key, default):
        value = g.get(f"{arch}.{key}", default)
        return int((value[0] if isinstance(value, list) else value) or 0)

    n_head = max(meta("attention.head_count", 1), 1)
    kv_heads = meta("attention.head_count_kv", n_head)
    head_dim = meta("attention.key_length", meta("embedding_length", 0) // n_head)
    tensors = {name: (t.shape, t.ggml_type, t.nbytes) for name, t in g.tensors.items()}
    kv_positions = None
    if arch in ("gemma3", "mistral"):  # sliding layers hold rings (model/spec.py, model/state.py)
        try:
            kv_positions = sum(layer_lengths(spec_from_gguf(g), ctx))
        except GGUFError:
            pass  # the load refuses the file with its reason; count the whole context here
    return estimate_bytes(arch, tensors, meta("block_count", 0), kv_heads, head_dim, ctx, n_slots,
                          itemsize(compute_dtype(jax.default_backend())),
                          kv_value_bytes(kv_cache_dtype(jax.default_backend(), kv_dtype, numerics)), kv_positions,
                          gpu_blocks=jax.default_backend() in GPU_BACKENDS and not mesh,
                          on_cpu=jax.default_backend() == "cpu")


def estimate_bytes(arch: str, tensors: dict[str, tuple], n_layer: int, kv_heads: int, head_dim: int, ctx: int,
                   n_slots: int, itemsize: int = 4, kv_itemsize: float | None = None,
                   kv_positions: int | None = None, gpu_blocks: bool = False, on_cpu: bool = False) -> int:
    """tensors: {name: (shape, ggml type, GGUF bytes)}. Tensor by tensor as the loaders place them:
    routed experts whose role stays Q3_K stay in blocks (qwen35moe.q3k_expert_roles: Q3KPlanes), every
    other matrix is dequantized to the compute dtype (`itemsize` bytes; the few kept f32 are
    counted at it too: the router and conv taps are <0.1 % of a model), 1-D tensors stay f32; but
    an f32 model on the CPU with the native kernel keeps the matrices the kernel reads in
    their blocks only (weights._load_resident, qwen35moe.held_in_blocks; either numerics); plus KV of
    `kv_itemsize` bytes a value (default: the compute dtype's; q8_0's 34 / 32) for n_slots + the scratch slot (every layer counted, an upper bound for the
    hybrid's attention-only KV); kv_positions: the positions all layers hold together, where
    sliding layers hold rings (default n_layer * ctx). gpu_blocks (one GPU): the layer matrices the
    Pallas kernel reads stay in blocks as QPlanes (weights._load_planes; pallas/qmatmul.py). on_cpu:
    the CPU backend, where qwen35moe's layers hold their blocks too (qwen35moe.held_in_blocks)."""
    q3k = q3k_expert_roles((expert_role(name), kind) for name, (_, kind, _) in tensors.items()
                           if expert_role(name)) if arch == "qwen35moe" else frozenset()
    resident = itemsize == 4 and native_build.available()
    if arch == "qwen35moe":  # its loader keeps blocks on the CPU only (qwen35moe.load_params)
        held = lambda name: on_cpu and held_in_blocks(name, q3k)  # noqa: E731
    else:
        held = lambda name: True  # noqa: E731
    weights = 0
    for name, (shape, kind, nbytes) in tensors.items():
        if expert_role(name) in q3k:
            weights += int(nbytes * Q3K_PLANE_BYTES)
        elif resident and len(shape) in (2, 3) and qmatmul_supported(kind) and held(name):  # 3: routed experts
            weights += nbytes  # the file's blocks
        elif gpu_blocks and arch != "qwen35moe" and gpu_holds(kind, shape):
            weights += plane_bytes(kind, nbytes)
        else:
            weights += int(math.prod(shape)) * (itemsize if len(shape) > 1 else 4)
    positions = n_layer * ctx if kv_positions is None else kv_positions
    return weights + int(2 * positions * (n_slots + 1) * kv_heads * head_dim * (kv_itemsize or itemsize))


class ModelPool:
    def __init__(self, settings: Settings | None = None):
        # read once, when the serve starts: every model it loads (at start or by /admin) shares them
        self.settings = settings or Settings.from_env()
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

    def names(self) -> list[str]:
        return list(dict.fromkeys(e.config.name for e in self.ready()))

    def served_name(self, name: str | None) -> str | None:
        """The served name `name` is, or is an alias of, among the ready models; else None."""
        for e in self.ready():
            if name == e.config.name or name in e.config.aliases:
                return e.config.name
        return None

    def replicas(self, name: str) -> list[Engine]:
        return [e.engine for e in self.ready() if e.config.name == name]

    @staticmethod
    def pick(replicas: list[Engine], session_id: str | None) -> Engine:
        """The replica holding the session, else the least loaded one."""
        if session_id is not None:
            for engine in replicas:
                if session_id in engine.table.sessions:
                    return engine
        return min(replicas, key=lambda e: e.scheduler.load)

    def resolve(self, model: str | None, session_id: str | None = None) -> Engine:
        """The contract's routing: one served name takes any `model`; several need an exact match.
        Replicas of a name (instances on different dies) share its requests."""
        names = self.names()
        if not names:
            msg = "no models loaded" + (" (a model is still loading; retry shortly)" if self.loading() else "")
            raise PoolError(503, "no_models_loaded", msg)
        if len(names) == 1:
            return self.pick(self.replicas(names[0]), session_id)
        if (served := self.served_name(model)) is not None:
            return self.pick(self.replicas(served), session_id)
        raise PoolError(404, "model_not_found", f"model {model!r} not found; loaded: {', '.join(names)}")

    def find(self, name: str | None, session_id: str | None = None) -> Engine | None:
        """Session routes: `name` selects the model; absent -> the default (first loaded) model."""
        names = self.names()
        served = names[0] if names and name is None else self.served_name(name)
        return None if served is None else self.pick(self.replicas(served), session_id)

    # ---- load / unload ------------------------------------------------------------------------------
    def load(self, config: ModelConfig) -> ModelEntry:
        """Blocking; run it off the event loop."""
        self.admit(config)
        with self._lock:
            for existing in self._entries.values():
                if existing.config.name != config.name:
                    continue
                if existing.state == UNLOADING:
                    raise PoolError(409, "load_failed", f"model {config.name!r} is already unloading")
                if not (config.dies and existing.config.dies):
                    raise PoolError(409, "load_failed", f"model {config.name!r} is already loaded "
                                                        "(a replica needs its own dies)")
            entry = ModelEntry(config)
            self._entries[self._key(config)] = entry
        failure = self._build(entry, config)
        if failure is None:
            return entry
        reclaim()  # what the refused load built (a tokenizer, weights, compiled programs) goes now
        raise failure

    def _build(self, entry: ModelEntry, config: ModelConfig) -> PoolError | None:
        """Build the entry's engine; the refusal (entry removed), or None when it is READY. The
        refusal is returned, not raised, and carries no traceback of the failure: those frames hold
        the half-built engine, which `reclaim` must be able to free."""
        try:
            with self._upload:
                device = placement(config.dies)
                entry.engine = Engine(config, self.settings, device=device)
                import jax

                if jax.process_count() > 1 and jax.process_index() == 0:  # engine/distributed.py
                    from pantheon.engine.distributed import StepChannel

                    entry.engine.runner.mirror = StepChannel()
                entry.engine.start()
                if self.settings.warm_up:
                    entry.engine.warm_up()
            entry.state = READY
            return None
        except GGUFError as e:
            failure = PoolError(500, "load_failed", str(e))
        except ValueError as e:  # e.g. heads not divisible by the die count
            failure = PoolError(400, "load_failed", f"cannot load {config.name!r} on dies "
                                                    f"{list(config.dies or [])}: {e}")
        except Exception as e:  # noqa: BLE001 - any load failure is reported, the server stays up
            # the traceback as text: a LogRecord holding exc_info would keep the half-built engine alive
            log.error("load of %s failed:\n%s", config.path, traceback.format_exc())
            failure = PoolError(500, "load_failed", f"loading {config.path} failed: {e}")
        self._fail(entry, failure.message)
        return failure

    @staticmethod
    def _key(config: ModelConfig) -> str:
        """Instances are keyed by name and dies: replicas of one name live on different dies."""
        return config.name + ("@" + ",".join(map(str, config.dies)) if config.dies else "")

    def _fail(self, entry: ModelEntry, message: str) -> None:
        with self._lock:
            key = self._key(entry.config)
            if self._entries.get(key) is entry:
                del self._entries[key]
        if entry.engine is not None:
            entry.engine.stop()
            entry.engine = None

    def admit(self, config: ModelConfig) -> None:
        """PoolError unless `config`'s model may load: the file exists, its dies are free, and what
        the load will occupy (`estimate_device_bytes`: the weights as held, KV in its type) fits
        in 90 % of its target's available memory — checked before a byte is read, so a model that
        cannot fit is refused with one line instead of an OOM kill mid-load."""
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
                                         max(config.max_sessions, config.max_concurrent_configured), config.kv_dtype,
                                         config.numerics, mesh=bool(config.dies) and len(config.dies) > 1)
        except GGUFError as e:
            raise PoolError(500, "load_failed", str(e)) from None
        except (TypeError, ValueError, ArithmeticError):  # odd metadata: the load's spec check names it
            need = 0
        self.check_fits(config, need)

    def check_fits(self, config: ModelConfig, need: int) -> None:
        """507 when `need` bytes exceed 90 % of what the model's target has available."""
        have, where = self.available_bytes(config)
        if need > 0.9 * have:
            raise PoolError(507, "load_failed", f"admission refused: {config.name} needs ~{need >> 20} MiB, "
                                                f"{have >> 20} MiB {where} available")

    def available_bytes(self, config: ModelConfig) -> tuple[int, str]:
        """What a new model may occupy, and where: on an accelerator, the budget of its dies
        (`vram_budget`, from the allocator's limit) less what models already hold there; on the
        CPU, the host's available memory (the CPU's device memory is the host's)."""
        import jax

        if jax.default_backend() == "cpu":
            cap = host_memory_cap()
            have = meminfo_bytes("MemAvailable", 1 << 62)
            return (have, "host memory") if cap is None or cap >= have else (cap, f"host memory ({ENV_HOST_MEMORY})")
        dies = visible_dies()
        targets = [dies[i] for i in (config.dies or [0]) if 0 <= i < len(dies)]
        used = {}
        for e in self.ready():
            for dev, n in e.engine.bytes_per_device().items():
                used[dev] = used.get(dev, 0) + n
        have = sum(max(die_budget(d) - used.get(d.device_id, 0), 0) for d in targets)
        return have, f"on dies {[d.index for d in targets]} (vram_budget less what loaded models hold)"

    def unload(self, name: str) -> None:
        """Blocking: drains the in-flight generations of every replica of `name`, then frees them."""
        with self._lock:
            entries = [e for e in self._entries.values() if e.config.name == name and e.state != FAILED]
            if not entries:
                raise PoolError(404, "unload_failed", f"model {name!r} is not loaded")
            if any(e.state == UNLOADING for e in entries):
                raise PoolError(409, "unload_failed", f"model {name!r} is already unloading")
            if any(e.state == LOADING for e in entries):
                raise PoolError(409, "unload_failed", f"model {name!r} is still loading")
            for e in entries:
                e.state = UNLOADING
        for entry in entries:
            while entry.engine.busy:  # drain: the generations in flight finish first
                time.sleep(0.05)
            entry.engine.stop()
        with self._lock:
            for entry in entries:
                self._entries.pop(self._key(entry.config), None)
        del entries, entry
        reclaim()

    def close(self) -> None:
        for e in self.entries():
            if e.engine is not None:
                e.engine.stop()


def reclaim() -> None:
    """Free what an unloaded or refused model left, now. An Engine is a web of reference cycles
    (its table's spill/fill are its bound methods, the scheduler points back at it, jax arrays and
    executables hang off the runner), so refcounting never frees it: only the cyclic collector's
    rare full pass did, and RSS grew ~25 MiB per load/unload cycle until then. Then the allocator
    hands the freed pages back to the OS (memory.release_free_memory)."""
    gc.collect()
    release_free_memory()


def placement(dies: tuple[int, ...] | None):
    """Where a model lives: the default device, one die, or a Mesh over several (axis "tp")."""
    if not dies:
        return None
    import jax
    import numpy as np
    from jax.sharding import Mesh

    devices = [jax.devices()[d] for d in dies]
    return devices[0] if len(devices) == 1 else Mesh(np.array(devices), ("tp",))
