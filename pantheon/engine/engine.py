"""Engine: one per loaded model. Ties the GGUF file, tokenizer, chat template, ModelRunner, slot
table and scheduler together; the scheduler's thread owns the device.

The asyncio side never touches a JAX array: `submit` hands a `GenerationRequest` to the device
thread and yields its events (`Admitted`, `Delta`, `ChoiceEnd`, `RequestEnd`, `RequestError`) from an
asyncio queue; `call` runs a function on the device thread (session export/restore/release)."""

from __future__ import annotations

import asyncio
import hashlib

import jax
import time
from pathlib import Path
from typing import AsyncIterator, Callable

from pantheon.engine.events import GenerationRequest
from pantheon.engine.graphs import GraphRegistry
from pantheon.engine.memory import MemoryLadder
from pantheon.engine.runner import ModelRunner
from pantheon.engine.scheduler import BusyError, Scheduler
from pantheon.engine import blob as session_blob
from pantheon.engine.sessions import CapacityError, SessionError, SlotTable
from pantheon.gguf.reader import GGUFFile, open_gguf
from pantheon.model.family import family_of
from pantheon.model.spec import ModelSpec, spec_from_gguf
from pantheon.model.weights import params_nbytes
from pantheon.text.chat_template import ChatTemplate
from pantheon.text.reasoning import think_mode
from pantheon.text.tokenizer import Tokenizer

__all__ = ["Engine", "BusyError"]
DEFAULT_PREFILL_TOK_S = 500.0  # before a prefill has been measured (SmolLM2, 2 CPU cores)


class Engine:
    def __init__(self, path: str | Path, name: str | None = None, ctx_cap: int = 4096, max_sessions: int = 4,
                 max_concurrent: int = 0, batching: bool = True, queue_depth: int = 32,
                 numerics: str = "exact", reasoning_budget: int = 0, device=None,
                 idle_ttl_s: float = 12 * 3600, watch_grace_s: float = 45.0):
        t0 = time.perf_counter()
        self.path = Path(path)
        self.gguf: GGUFFile = open_gguf(self.path)
        self.spec: ModelSpec = spec_from_gguf(self.gguf)
        self.name = name or self.path.name.removesuffix(".gguf")
        self.tokenizer = Tokenizer.from_gguf(self.gguf)
        self.template = ChatTemplate.from_gguf(self.gguf, self.tokenizer)
        self.think = think_mode(self.template.source)
        self.ctx_configured = ctx_cap if ctx_cap > 0 else self.spec.ctx_train
        self.ctx = min(self.ctx_configured, self.spec.ctx_train)
        self.reasoning_budget = reasoning_budget
        self.max_concurrent_configured = max_concurrent or max_sessions
        # Without the batch scheduler: one generation at a time and no queue (the single-user path).
        self.max_concurrent_served = self.max_concurrent_configured if batching else 1
        self.max_sessions = max_sessions
        n_slots = max(max_sessions, self.max_concurrent_served)
        family = family_of(self.spec)
        if hasattr(device, "devices") and device.size > 1 and not family.can_truncate:
            raise ValueError("the hybrid model runs on one die (its sharding is not built yet)")
        self.numerics = family.numerics_for(self.gguf, self.spec, numerics)
        self.registry = GraphRegistry()
        self.device = device
        params = family.load_params(self.gguf, self.spec, device=device)
        self.runner = ModelRunner(self.spec, self.numerics, params, n_slots, self.ctx, self.registry, device=device)
        self.table = SlotTable(n_slots, max_sessions, can_truncate=family.can_truncate, idle_ttl_s=idle_ttl_s,
                               watch_grace_s=watch_grace_s)
        devices = list(device.devices.flat) if hasattr(device, "devices") else [device] if device is not None else []
        self.ladder = MemoryLadder(devices=devices)
        self.scheduler = Scheduler(self, self.runner, self.table, queue_depth if batching else 0)
        self.load_s = time.perf_counter() - t0
        self.weight_bytes = params_nbytes(params)
        self.kv_bytes = self.runner.cache.nbytes
        self._prefill = (0, 0.0)  # tokens, seconds of measured prefills
        self._weights_version: int | None = None
        self._grammar_factory = None

    # ---- what the memory ladder allows right now ------------------------------------------------------
    @property
    def effective_ctx(self) -> int:
        """The per-session window clients may plan against (`context_window`, `usage.kv_cap`)."""
        return self.ladder.window(self.ctx)

    @property
    def max_concurrent(self) -> int:
        """Requests decoding at once, as served now (`max_concurrent`)."""
        return self.ladder.concurrency(self.max_concurrent_served)

    @property
    def grammar_factory(self):
        """llguidance over this model's vocabulary (built on first use: ~0.1 s for 49k tokens)."""
        if self._grammar_factory is None:
            from pantheon.text.tools import GrammarFactory

            self._grammar_factory = GrammarFactory(self.tokenizer)
        return self._grammar_factory

    @property
    def tool_dialect(self):
        from pantheon.text.tools import dialect_for

        return dialect_for(self.name, self.spec.arch, "bos_token" in (self.template.source or ""))

    @property
    def device_bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes

    def bytes_per_device(self) -> dict[int, int]:
        """Device buffer bytes of this model per device id (weights, KV/state, sampler state)."""
        out: dict[int, int] = {}
        leaves = jax.tree_util.tree_leaves((self.runner.params, self.runner.cache, self.runner.sampler_state))
        for a in leaves:
            if not isinstance(a, jax.Array):  # host-resident KV (the allocation fallback)
                continue
            for shard in a.addressable_shards:
                out[shard.device.id] = out.get(shard.device.id, 0) + shard.data.nbytes
        return out

    # ---- text helpers -----------------------------------------------------------------------------
    def render_chat(self, messages: list[dict], **kwargs) -> str:
        return self.template.render(messages, add_generation_prompt=True, **kwargs)

    def encode_prompt(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, parse_special=True, add_bos=False)

    # ---- measurements -----------------------------------------------------------------------------
    def record_prefill(self, tokens: int, seconds: float) -> None:
        n, s = self._prefill
        self._prefill = (n + tokens, s + seconds)

    def prefill_rate(self) -> float:
        n, s = self._prefill
        return n / s if n and s > 0 else DEFAULT_PREFILL_TOK_S

    @property
    def prefill_measured(self) -> bool:
        return self._prefill[0] > 0

    @property
    def weights_version(self) -> int:
        """Derived from the weights themselves (not the file name): a hash of every tensor's bytes."""
        if self._weights_version is None:
            h = hashlib.sha256()
            for name in sorted(self.gguf.tensors):
                h.update(name.encode())
                h.update(memoryview(self.gguf.tensor_data(name)).cast("B"))
            self._weights_version = int.from_bytes(h.digest()[:6], "big")
        return self._weights_version

    # ---- the device thread ----------------------------------------------------------------------
    def start(self) -> None:
        self.scheduler.start()

    def stop(self) -> None:
        self.scheduler.stop()

    @property
    def busy(self) -> bool:
        return self.scheduler.load > 0

    async def submit(self, request: GenerationRequest) -> AsyncIterator:
        """Queue `request` (BusyError at once when slots and queue are full) and yield its events.
        Closing the iterator early (client disconnect) cancels it; its slot frees within one step."""
        self.scheduler.reserve()
        self.start()
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        self.scheduler.put(("generate", (request, lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev))))
        try:
            while (ev := await events.get()) is not None:
                yield ev
        finally:
            request.cancelled.set()

    async def call(self, fn: Callable):
        """Run fn() on the device thread and return its result (or raise its exception)."""
        self.start()
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def done(result, error):
            loop.call_soon_threadsafe(lambda: future.done() or (
                future.set_exception(error) if error else future.set_result(result)))

        self.scheduler.put(("call", (fn, done)))
        return await future

    def run_sync(self, request: GenerationRequest, emit: Callable) -> None:
        """Run one request to completion on this thread (the CLI; no server)."""
        self.scheduler.reserve()
        self.scheduler.put(("generate", (request, lambda ev: ev is not None and emit(ev))))
        self.scheduler.loop(until_idle=True)

    # ---- session export / restore (device thread: run through `call`) -------------------------------
    def export_session(self, session_id: str) -> dict:
        if session_id not in self.table.sessions:
            raise SessionError(404, "session_not_found", f"no live session {session_id!r}")
        if self.table.session_busy(session_id):
            raise SessionError(429, "session_busy", f"a turn is in flight on session {session_id!r}; retry after it")
        slot = self.table.latest_slot(session_id)
        if slot is None:
            raise SessionError(404, "session_not_found", f"session {session_id!r} holds no cached conversation")
        n_tok = len(slot.tokens)
        data = session_blob.pack({"arch": self.spec.arch, "weights_version": self.weights_version, "n_tok": n_tok},
                                 self.runner.export_slot(slot.index, n_tok))
        return {"session_id": session_id, "weights_version": self.weights_version, "n_tok": n_tok,
                "blob_bytes": len(data), "blob": data, "tokens": list(slot.tokens)}

    def restore_session(self, session_id: str, data: bytes, tokens: list[int]) -> dict:
        try:
            header, arrays = session_blob.unpack(data)
        except session_blob.BlobError as e:
            raise SessionError(400, "bad_session_blob", str(e)) from None
        bad = lambda msg: SessionError(400, "bad_session_blob", msg)
        if header.get("arch") != self.spec.arch:
            raise bad(f"blob is for architecture {header.get('arch')!r}, this model is {self.spec.arch!r}")
        if header.get("weights_version") != self.weights_version:
            raise SessionError(409, "weights_version_mismatch", "blob was captured under different weights; "
                                                                "replay the conversation instead")
        n_tok = header.get("n_tok")
        if not isinstance(n_tok, int) or n_tok != len(tokens):
            raise bad(f"blob covers {n_tok} tokens but {len(tokens)} tokens were sent")
        if not 0 < n_tok < self.ctx:
            raise bad(f"blob of {n_tok} tokens does not fit this model's window ({self.ctx})")
        if any(not isinstance(t, int) or not 0 <= t < self.spec.n_vocab for t in tokens):
            raise bad("tokens must be token ids of this model")
        layout = self.runner.slot_layout(n_tok)
        got = {k: (tuple(a.shape), str(a.dtype)) for k, a in arrays.items()}
        if got != layout:
            raise bad("blob arrays do not fit this model's state layout")
        try:
            claimed = self.table.acquire(session_id, list(tokens))
        except CapacityError:
            claimed = None
        if claimed is None:
            raise SessionError(429, "model_at_session_capacity", "no free session slot for the restore")
        slot, _ = claimed
        try:
            self.runner.import_slot(slot.index, arrays)
        except Exception:
            self.table.release_slot(slot, [])
            raise
        self.table.release_slot(slot, list(tokens))
        return {"restored": True, "session_id": session_id, "n_tok": n_tok}
