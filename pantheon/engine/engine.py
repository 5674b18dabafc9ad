"""Engine: one per loaded model. Ties the GGUF file, tokenizer, chat template, ModelRunner, slot
table and scheduler together; the scheduler's thread owns the device.

The asyncio side never touches a JAX array: `submit` hands a `GenerationRequest` to the device
thread and yields its events (`Admitted`, `Delta`, `ChoiceEnd`, `RequestEnd`, `RequestError`) from an
asyncio queue; `call` runs a function on the device thread (session export/restore/release)."""

from __future__ import annotations

import asyncio
import logging
import hashlib
import math

import jax
import numpy as np
import time
from collections import deque
from pathlib import Path
from typing import AsyncIterator, Callable

from pantheon.engine.events import GenerationRequest
from pantheon.engine.graphs import GraphRegistry
from pantheon.engine.memory import MemoryLadder
from pantheon.engine.runner import ModelRunner
from pantheon.engine.scheduler import BusyError, Scheduler
from pantheon.engine import blob as session_blob
from pantheon.engine import sessions
from pantheon.config import ModelConfig, Settings, session_host_bytes, session_key
from pantheon.engine.host_budget import HostBudget, process_host_budget
from pantheon.engine.sessions import CapacityError, Parked, SessionError, SlotTable
from pantheon.gguf.reader import GGUFError, GGUFFile, open_gguf
from pantheon.model.dtypes import backend_of, compute_dtype, kv_cache_dtype, kv_dtype_name
from pantheon.model.family import family_of
from pantheon.model.spec import ModelSpec, spec_from_gguf
from pantheon.model.state import rewind
from pantheon.model.weights import params_nbytes
from pantheon.native import build as native_build
from pantheon.text.chat_template import ChatTemplate, ChatTemplateError
from pantheon.text.reasoning import think_mode
from pantheon.text.tokenizer import Tokenizer

__all__ = ["Engine", "BusyError"]
DEFAULT_PREFILL_TOK_S = 500.0  # before a prefill has been measured (SmolLM2, 2 CPU cores)


log = logging.getLogger(__name__)


class Throughput:
    """Tokens and device-step seconds per kind ("prefill": steps that only prefilled; "decode":
    steps with decode rows, mixed ones included): totals since start, and rates over the last
    `window_s` seconds. Written by the device thread, read by /metrics (plain ints and floats:
    a reader sees a consistent-enough snapshot)."""

    def __init__(self, window_s: float = 60.0):
        self.window_s = window_s
        self.tokens = {"prefill": 0, "decode": 0}
        self.seconds = {"prefill": 0.0, "decode": 0.0}
        self._recent: dict[str, deque] = {"prefill": deque(), "decode": deque()}

    def record(self, kind: str, tokens: int, seconds: float) -> None:
        self.tokens[kind] += tokens
        self.seconds[kind] += seconds
        recent = self._recent[kind]
        recent.append((time.monotonic(), tokens, seconds))
        while recent and recent[0][0] < time.monotonic() - self.window_s:
            recent.popleft()

    def rate(self, kind: str) -> float:
        """Tokens per second of device time over the window (0 when nothing ran in it)."""
        cutoff = time.monotonic() - self.window_s
        recent = [r for r in list(self._recent[kind]) if r[0] >= cutoff]
        seconds = sum(r[2] for r in recent)
        return sum(r[1] for r in recent) / seconds if seconds > 0 else 0.0


def text_of(gguf: GGUFFile, path: Path, chat_template: str | None = None) -> tuple[Tokenizer, ChatTemplate | None]:
    """The file's tokenizer and chat template, or `chat_template` in its place (--chat-template: a
    builtin's name or Jinja source). Their problems refuse the file (a GGUFError), before anything
    touches the device. A base model's file may hold no chat template: it serves raw completions
    only (/v1/completions, `generate --raw`) unless given one; chat turns get a 400 that says so."""
    try:
        tokenizer = Tokenizer.from_gguf(gguf)
        template = None
        if chat_template:
            template = ChatTemplate.given(chat_template, tokenizer)
        elif gguf.metadata.get("tokenizer.chat_template"):
            template = ChatTemplate.from_gguf(gguf, tokenizer)
        if template is not None:
            template.probe()
        return tokenizer, template
    except GGUFError:
        raise
    except ValueError as e:  # incl. ChatTemplateError
        raise GGUFError(f"{path}: {' '.join(str(e).split())}") from None


def _finite(a: np.ndarray) -> bool:
    """Whether a state array holds only finite values: floats as they are; a q8_0 KV cache's bytes
    (uint8, ggml's 34-byte blocks: model/dtypes.Q8_0_KV) through their fp16 scales."""
    if a.dtype == np.uint8:
        return bool(np.isfinite(np.ascontiguousarray(a).reshape(-1, 34)[:, :2].copy().view(np.float16)).all())
    return a.dtype.kind in "ib" or bool(np.isfinite(a.astype(np.float32, copy=False)).all())


def _owned(arrays: dict) -> dict:
    """Exported slot arrays that stay as they are: a host-resident layer (the KV allocation fallback)
    exports a view of the live cache, copied; a device array's export is already its own."""
    return {k: a.copy() if a.flags.writeable else a for k, a in arrays.items()}


def exact_kernels_note(backend: str, numerics: str, quantized: bool) -> str:
    """A line for the log where `exact` numerics take the f32 kernels: a CPU without AVX-512 VNNI
    (the AVX2 kinds) multiplies a quantized model's weights in f32 there, slower than llama.cpp's
    8-bit products on the same CPU; "" elsewhere."""
    if backend != "cpu" or numerics != "exact" or not quantized or not native_build.available() or native_build.fixed_point():
        return ""
    return ("this CPU has no AVX-512 VNNI, so `exact` numerics multiply the quantized weights in f32 "
            "(measured with both servers built for AVX2: 0.56-0.58 of llama-server's one-client decode); "
            "`--numerics llamacpp` runs llama.cpp's 8-bit products (measured level with it) at the cost "
            "of batch invariance")


class Engine:
    def __init__(self, config: ModelConfig, settings: Settings | None = None, *, device=None,
                 host_budget: HostBudget | None = None, blob_key: bytes | None = None):
        """Load `config`'s model (on `device`: a die, a mesh, or the default device) under the
        serve's `settings` (default: Settings(), no environment read). host_budget: the host tier
        for idle sessions (default: the process's); blob_key: seals exported session blobs."""
        t0 = time.perf_counter()
        settings = settings or Settings()
        self.path = Path(config.path)
        self.gguf: GGUFFile = open_gguf(self.path)
        self.spec: ModelSpec = spec_from_gguf(self.gguf)
        self.name = config.name or self.path.name.removesuffix(".gguf")
        self.tokenizer, self.template = text_of(self.gguf, self.path, config.chat_template)
        self.think = think_mode(self.template.source if self.template else None)
        self.ctx_configured = config.ctx_cap if config.ctx_cap > 0 else self.spec.ctx_train
        self.ctx = min(self.ctx_configured, self.spec.ctx_train)
        if isinstance(self.spec, ModelSpec):  # LongRoPE takes its factors by the context served
            self.spec = self.spec.for_context(self.ctx)
        self.reasoning_budget = config.reasoning_budget
        self.max_concurrent_configured = config.max_concurrent_configured
        # Without the batch scheduler: one generation at a time and no queue (the single-user path).
        self.max_concurrent_served = self.max_concurrent_configured if settings.batching else 1
        self.max_sessions = config.max_sessions
        n_slots = max(self.max_sessions, self.max_concurrent_served)
        family = family_of(self.spec)
        if hasattr(device, "devices") and device.size > 1 and not family.can_truncate:
            raise ValueError("the hybrid model runs on one die (its sharding is not built yet)")
        self.numerics = family.numerics_for(self.gguf, self.spec, config.numerics)
        self.registry = GraphRegistry()
        self.device = device
        self.dtype = compute_dtype(backend_of(device))  # bf16 on a GPU, f32 on the CPU (model/dtypes.py)
        params = family.load_params(self.gguf, self.spec, dtype=self.dtype, device=device, numerics=self.numerics)
        note = exact_kernels_note(backend_of(device), config.numerics,
                                  any(t.block_size > 1 for t in self.gguf.tensors.values()))
        if note:
            log.info("%s: %s", self.name, note)
        # CPU: f16 (f32 llamacpp); GPU: bf16
        self.kv_dtype = kv_cache_dtype(backend_of(device), config.kv_dtype, config.numerics)
        self.runner = ModelRunner(self.spec, self.numerics, params, n_slots, self.ctx, self.registry, device=device,
                                  dtype=self.kv_dtype)
        # Idle sessions move to host memory (the process-wide PN_SESSION_HOST_BYTES budget) rather
        # than lock the model out or lose their KV; see pantheon/engine/sessions.py.
        self.table = SlotTable(n_slots, self.max_sessions, can_truncate=family.can_truncate,
                               rewind=rewind(self.spec, self.ctx) if family.can_truncate else None,
                               idle_ttl_s=settings.idle_ttl_s, watch_grace_s=settings.watch_grace_s,
                               spill=self._spill_slot, fill=self._fill_slot, spill_bytes=self._spill_nbytes,
                               host=host_budget or process_host_budget(session_host_bytes()))
        devices = list(device.devices.flat) if hasattr(device, "devices") else [device] if device is not None else []
        self.ladder = MemoryLadder(devices=devices)
        self.scheduler = Scheduler(self, self.runner, self.table, settings.queue_depth if settings.batching else 0)
        # slots are marked (SlotTable.mark) where some buffers are whole rows (rings, recurrent state),
        # within one process
        self.marks = bool(set(self.runner.slot_layout(1)) - self.runner.positional()) and jax.process_count() == 1
        self.load_s = time.perf_counter() - t0
        self.weight_bytes = params_nbytes(params)
        self.kv_bytes = self.runner.cache.nbytes
        self._prefill = (0, 0.0)  # tokens, seconds of measured prefills
        self.throughput = Throughput()  # prefill and decode tokens and step seconds (/metrics)
        self._weights_version: int | None = None
        self._grammar_factory = None
        self.compiling = False  # the warm-up compile is running (warm_up)
        self.blob_key = blob_key or session_key()  # seals exported session blobs (engine/blob.py)

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
    def free_slots(self) -> int:
        """Requests this model takes now without queueing: the served concurrency less the
        requests admitted or queued (the router's `free_slots`, /metrics' pantheon_slots_free)."""
        return max(self.max_concurrent - self.scheduler.load, 0)

    @property
    def status(self) -> str:
        """The model row's `status`: "compiling" while the warm-up compile runs, then "ready"."""
        return "compiling" if self.compiling else "ready"

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

        return dialect_for(self.name, self.spec.arch, "bos_token" in (self.template.source if self.template else ""))

    @property
    def kv_dtype_name(self) -> str:
        """The KV cache's type as --kv-dtype names it (f32, f16, bf16)."""
        return kv_dtype_name(self.kv_dtype)

    @property
    def device_bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes

    def bytes_per_device(self) -> dict[int, int]:
        """Device buffer bytes of this model per device id (weights, KV/state, sampler state).

        From each array's shape and sharding only: any thread may ask while the device thread
        donates buffers to a step (a donated array's data is gone, its metadata is not)."""
        out: dict[int, int] = {}
        leaves = jax.tree_util.tree_leaves((self.runner.params, self.runner.cache, self.runner.sampler_state))
        for a in leaves:
            if not isinstance(a, jax.Array):  # host-resident KV (the allocation fallback)
                continue
            shard = math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize
            for device in a.sharding.device_set:
                out[device.id] = out.get(device.id, 0) + shard
        return out

    # ---- text helpers -----------------------------------------------------------------------------
    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        if self.template is None:
            raise ChatTemplateError(f"model {self.name!r} has no chat template (a base model): send raw text to "
                                    "/v1/completions instead")
        return self.template.render(messages, add_generation_prompt=add_generation_prompt, **kwargs)

    def encode_prompt(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, parse_special=True, add_bos=False)

    # ---- measurements -----------------------------------------------------------------------------
    def record_prefill(self, tokens: int, seconds: float) -> None:
        n, s = self._prefill
        self._prefill = (n + tokens, s + seconds)
        self.throughput.record("prefill", tokens, seconds)

    def record_decode(self, tokens: int, seconds: float) -> None:
        self.throughput.record("decode", tokens, seconds)

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

    def warm_up(self) -> None:
        """Compile every prefill bucket and decode step (runner.warm_up) on the device thread, first
        in its queue: requests that arrive meanwhile wait behind it instead of each waiting for its
        own compile mid-traffic, and the model is listed (ready) at once."""
        def done(seconds, error):
            self.compiling = False
            if error is not None:
                log.warning("%s: the compile warm-up failed (programs compile on first use): %s", self.name, error)
            else:
                log.info("%s: compiled its prefill buckets and decode steps in %.1f s", self.name, seconds)

        def warm() -> float:
            log.info("%s: compiling its programs (requests wait until this ends)", self.name)
            return self.runner.warm_up(lambda phase: log.info("%s: compiling %s", self.name, phase))

        self.compiling = True  # /v1/models shows "status": "compiling" meanwhile
        self.start()
        self.scheduler.put(("call", (warm, done)))

    def stop(self) -> None:
        self.scheduler.stop()
        self.table.drop_marks()  # their bytes back to the process's host budget
        if self.runner.mirror is not None:  # the followers of a multi-process model leave too
            self.runner.mirror.send(None)
            self.runner.mirror = None

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

        def emit(ev) -> None:
            try:
                loop.call_soon_threadsafe(events.put_nowait, ev)
            except RuntimeError:  # the consumer's loop is gone: nobody is listening any more
                request.cancelled.set()

        self.scheduler.put(("generate", (request, emit)))
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

    async def hidden_states(self, ids: list[int]) -> np.ndarray:
        """The final-normed hidden states [n, E] of `ids` run from position 0 (embeddings), on the
        device thread between decode steps: one sequence's prefill at a time."""
        if not 0 < len(ids) <= self.effective_ctx:
            raise ValueError(f"input of {len(ids)} tokens: embeddings take 1 to {self.effective_ctx} tokens")
        return await self.call(lambda: self.runner.hidden_states(ids))

    @property
    def pooling(self) -> str:
        from pantheon.engine.embedding import pooling_of

        return pooling_of(self.gguf.metadata, self.gguf.metadata.get("general.architecture", ""))

    def run_sync(self, request: GenerationRequest, emit: Callable) -> None:
        """Run one request to completion on this thread (the CLI; no server)."""
        self.scheduler.reserve()
        self.scheduler.put(("generate", (request, lambda ev: ev is not None and emit(ev))))
        self.scheduler.loop(until_idle=True)

    # ---- the session host tier's callbacks (device thread) ------------------------------------------
    def _tier_len(self, n_tok: int) -> int:
        """Positions a spill moves: n_tok rounded up to 64 x {1, 1.5, 2, 3, 4, 6, ...} (capped at the
        cache), so conversations of every length share a handful of copy shapes (no compile per length).
        The extra positions are stale, and a slot's positions past its history are never attended."""
        b = 64
        while b < n_tok:
            b = b * 3 // 2 if b & (b - 1) == 0 else b * 4 // 3
        return max(n_tok, min(b, self.runner.ctx))

    def mark_rows(self, slot: int, n_tok: int) -> dict:
        """A slot's sliding-ring and recurrent rows once its prompt of n_tok tokens is in (SlotTable.mark),
        for the prompts that are worth it; {} for the others, and where every buffer is positional
        (attention alone rewinds to any prefix) or the slot spans processes."""
        if n_tok < sessions.MARK_MIN_TOKENS or not self.marks:
            return {}
        return _owned(self.runner.export_rows(slot))

    def _spill_slot(self, slot: int, n_tok: int) -> dict:
        return _owned(self.runner.export_slot(slot, self._tier_len(n_tok)))

    def _fill_slot(self, slot: int, arrays: dict) -> None:
        out = {}
        for k, a in arrays.items():  # a restored blob holds exactly n_tok positions: pad to the tier length
            if k in self.runner.positional() and (m := self._tier_len(a.shape[0])) != a.shape[0]:
                padded = np.zeros((m, *a.shape[1:]), a.dtype)
                padded[:a.shape[0]] = a
                a = padded
            out[k] = a
        self.runner.import_slot(slot, out)

    def _slot_bytes(self, n_tok: int) -> int:
        """Bytes of one slot's state over its first n_tok positions (runner.slot_layout)."""
        layout = self.runner.slot_layout(n_tok)
        return sum(int(np.prod(shape)) * np.dtype(dtype).itemsize for shape, dtype in layout.values())

    @property
    def max_blob_bytes(self) -> int:
        """The size of the largest session blob this model can export (a whole window), header included."""
        return self._slot_bytes(self.ctx) + session_blob.MAX_HEADER_BYTES

    def _spill_nbytes(self, n_tok: int) -> int:
        return self._slot_bytes(self._tier_len(n_tok))

    def _exact(self, arrays: dict, n_tok: int) -> dict:
        by_position = self.runner.positional()
        return {k: a[:n_tok] if k in by_position else a for k, a in arrays.items()}

    # ---- session export / restore (device thread: run through `call`) -------------------------------
    def _single_process(self) -> None:
        if jax.process_count() > 1:  # a slot's KV is spread over the processes' dies
            raise SessionError(400, "invalid_request_error", "session export/restore is not available for a "
                                                             "model spanning several processes")

    def export_session(self, session_id: str) -> dict:
        """The id's most recently used conversation, from its slot or from the host tier."""
        self._single_process()
        if session_id not in self.table.sessions:
            raise SessionError(404, "session_not_found", f"no live session {session_id!r}")
        if self.table.session_busy(session_id):
            raise SessionError(429, "session_busy", f"a turn is in flight on session {session_id!r}; retry after it")
        conv = self.table.latest(session_id)
        if conv is None:
            raise SessionError(404, "session_not_found", f"session {session_id!r} holds no cached conversation")
        n_tok = len(conv.tokens)
        arrays = conv.arrays if isinstance(conv, Parked) else self.runner.export_slot(conv.index, self._tier_len(n_tok))
        header = {"arch": self.spec.arch, "weights_version": self.weights_version, "n_tok": n_tok,
                  "tokens_sha256": session_blob.tokens_digest(conv.tokens)}
        data = session_blob.pack(header, self._exact(arrays, n_tok), self.blob_key)
        return {"session_id": session_id, "weights_version": self.weights_version, "n_tok": n_tok,
                "blob_bytes": len(data), "blob": data, "tokens": list(conv.tokens)}

    def restore_session(self, session_id: str, data: bytes, tokens: list[int]) -> dict:
        """Install a blob this server (or one sharing its session key) exported. Its KV stays private
        to `session_id` (sessions.Slot.private): it never seeds another id or an anonymous request."""
        self._single_process()
        try:
            header, arrays = session_blob.unpack(data, self.blob_key)
        except session_blob.BlobError as e:
            raise SessionError(400, "bad_session_blob", str(e)) from None
        bad = lambda msg: SessionError(400, "bad_session_blob", msg)
        if header.get("arch") != self.spec.arch:
            raise bad(f"blob is for architecture {header.get('arch')!r}, this model is {self.spec.arch!r}")
        if header.get("weights_version") != self.weights_version:
            raise SessionError(409, "weights_version_mismatch", "blob was captured under different weights; "
                                                                "replay the conversation instead")
        # bool is an int subclass in Python: `true` is not token 1
        if not isinstance(tokens, list) or any(type(t) is not int or not 0 <= t < self.spec.n_vocab for t in tokens):
            raise bad("tokens must be integer token ids of this model")
        n_tok = header.get("n_tok")
        if type(n_tok) is not int or n_tok != len(tokens):
            raise bad(f"blob covers {n_tok} tokens but {len(tokens)} tokens were sent")
        if not 0 < n_tok < self.ctx:
            raise bad(f"blob of {n_tok} tokens does not fit this model's window ({self.ctx})")
        if header.get("tokens_sha256") != session_blob.tokens_digest(tokens):
            raise bad("tokens are not the ones this blob was exported with")
        layout = self.runner.slot_layout(n_tok)
        got = {k: (tuple(a.shape), str(a.dtype)) for k, a in arrays.items()}
        if got != layout:
            raise bad("blob arrays do not fit this model's state layout")
        for k, a in arrays.items():  # a NaN in one position would poison every later token of the session
            if not _finite(a):
                raise bad(f"blob array {k!r} holds non-finite values")
        try:
            self.table.restore(session_id, list(tokens), arrays)
        except CapacityError:
            raise SessionError(429, "model_at_session_capacity", "no free session slot for the restore") from None
        return {"restored": True, "session_id": session_id, "n_tok": n_tok}
