"""Continuous batching on the device thread.

Requests expand into one `Sequence` per choice. Each loop iteration: take new work from the inbox,
drop cancelled or timed-out work, admit waiting sequences into free slots (up to `max_concurrent`
decoding at once), run one prefill chunk of one sequence (long prompts are interleaved with decode
steps, so running streams keep flowing), then one batched decode step over every decoding slot and
one batched sampling call. Token handling (text pipeline, stops, reasoning budget, finish) is
per sequence and pure Python.

With `max_concurrent=1` and no queue this is exactly the single-user path: one generation at a
time, a second request answered 429 at once."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
from jax.profiler import TraceAnnotation

from pantheon.engine.events import (Admitted, ChoiceEnd, Delta, GenerationRequest, RequestEnd, RequestError,
                                    TokenInfo)
from pantheon.engine.runner import CHUNK_BUCKETS, ModelRunner, SlotSampling
from pantheon.engine.sampler import MAX_TOP_LOGPROBS, SamplingParams
from pantheon.engine.sessions import CapacityError, Slot, SlotTable
from pantheon.text.pipeline import ChoiceText

log = logging.getLogger(__name__)
THINK_CLOSE = "</think>\n\n"
QUEUE_WAIT_S = 30.0
INTERLEAVED_CHUNK = 128  # prefill chunk while other streams are decoding: keeps their steps flowing


class BusyError(Exception):
    """Every slot is busy and the queue is full."""


class MemoryConstrained(Exception):
    """Critical memory pressure: new prompts are refused."""


@dataclass
class _RequestState:
    request: GenerationRequest
    emit: Callable
    enqueued: float
    remaining: int
    admitted: bool = False
    completion_tokens: int = 0
    kv_used: int = 0
    cached: int = 0
    failed: bool = False


@dataclass
class Sequence:
    """One choice of one request, from admission to finish."""

    state: _RequestState
    index: int
    params: SamplingParams
    slot: Slot | None = None
    sampling: SlotSampling | None = None
    text: ChoiceText | None = None
    history: list[int] = field(default_factory=list)  # tokens whose KV is in the slot
    prefill_at: int = 0
    last: int | None = None  # sampled, to be fed to the next decode step
    n: int = 0
    forced: list[int] = field(default_factory=list)
    reasoning_tokens: int = 0
    pending: list[TokenInfo] = field(default_factory=list)
    matcher: object = None  # the grammar state of a constrained choice

    @property
    def request(self) -> GenerationRequest:
        return self.state.request

    @property
    def prefilling(self) -> bool:
        return self.prefill_at < len(self.request.prompt_ids)


class Scheduler:
    def __init__(self, engine, runner: ModelRunner, table: SlotTable, queue_depth: int):
        self.engine, self.runner, self.table = engine, runner, table
        self.queue_depth = queue_depth
        self.inbox: queue.Queue = queue.Queue()
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._load = 0  # requests admitted or queued, for the 429 decision on the asyncio side
        self._load_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._last_reap = 0.0
        self.force_close = engine.tokenizer.encode(THINK_CLOSE, parse_special=True, add_bos=False)

    # ---- the asyncio side -------------------------------------------------------------------------------
    def reserve(self) -> None:
        """Count a new request in, or raise BusyError when slots and queue are full."""
        if not self.engine.ladder.admits():
            raise MemoryConstrained()
        with self._load_lock:
            if self._load >= self.max_concurrent + self.queue_depth:
                raise BusyError()
            self._load += 1

    def _unreserve(self) -> None:
        with self._load_lock:
            self._load -= 1

    @property
    def load(self) -> int:
        return self._load

    @property
    def max_concurrent(self) -> int:
        return self.engine.max_concurrent

    def put(self, item) -> None:
        self.inbox.put(item)

    # ---- the device thread ------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._stopping = False
            self._thread = threading.Thread(target=self.loop, name=f"device-{self.engine.name}", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self._stopping = True
            self.inbox.put(None)
            self._thread.join(timeout=60)
            self._thread = None

    def loop(self, until_idle: bool = False) -> None:
        worked = True
        while not self._stopping:
            idle = not (self.waiting or self.running)
            if idle and until_idle and self.inbox.empty():
                return
            try:  # block when idle; when only waiting work that cannot start yet, poll gently
                item = self.inbox.get(timeout=1.0 if idle else 0.02) if idle or not worked else self.inbox.get_nowait()
            except queue.Empty:
                item = False
            while item is not False:
                if item is None:
                    return
                self._take(item)
                try:
                    item = self.inbox.get_nowait()
                except queue.Empty:
                    item = False
            try:
                worked = self.step()
            except Exception as e:  # noqa: BLE001 - a failed step fails its requests, not the thread
                log.exception("device step failed")
                for seq in list(self.running):
                    self._fail(seq.state, RequestError("server_error", f"generation failed: {e}"))

    def _take(self, item) -> None:
        kind, payload = item
        if kind == "generate":
            request, emit = payload
            st = _RequestState(request, emit, time.monotonic(), remaining=len(request.choices))
            self.waiting.extend(Sequence(st, i, p) for i, p in enumerate(request.choices))
        else:  # "call": run fn on this thread, hand back the result
            fn, done = payload
            try:
                done(fn(), None)
            except Exception as e:  # noqa: BLE001 - reported to the caller
                done(None, e)

    def step(self) -> bool:
        """One scheduling round; False when there was nothing to compute."""
        now = time.monotonic()
        self._drop_cancelled(now)
        self._admit()
        if now - self._last_reap > 1.0:
            self._last_reap = now
            self.table.reap()
            self.runner.registry.retry_due()
            self.runner.attention.retry_due()
        prefilling = [s for s in self.running if s.prefilling]
        if prefilling:
            with TraceAnnotation("prefill_chunk", slot=prefilling[0].slot.index):
                self._prefill_chunk(prefilling[0], decoding=len(prefilling) < len(self.running))
        decoding = [s for s in self.running if not s.prefilling and s.last is not None]
        if decoding:
            with TraceAnnotation("decode_step", batch=len(decoding)):
                self._decode_step(decoding)
        return bool(prefilling or decoding)

    # ---- admission --------------------------------------------------------------------------------------
    def _drop_cancelled(self, now: float) -> None:
        for seq in list(self.waiting):
            st = seq.state
            if st.request.cancelled.is_set() or st.failed:
                self.waiting.remove(seq)
                self._sequence_gone(st)
            elif not st.admitted and now - st.enqueued > QUEUE_WAIT_S:
                self._fail(st, RequestError("server_busy", f"queued for more than {QUEUE_WAIT_S:.0f} s; retry",
                                            {"retry_after": 1}))
        for seq in list(self.running):
            if seq.request.cancelled.is_set():
                self._finish(seq, None)

    def _admit(self) -> None:
        for seq in list(self.waiting):
            if len(self.running) >= self.max_concurrent:
                return
            req = seq.request
            session = req.session_id if seq.index == 0 else None
            try:
                got = self.table.acquire(session, req.prompt_ids, use_cache=seq.index == 0)
            except CapacityError:
                rate = self.engine.prefill_rate()
                self._fail(seq.state, RequestError(
                    "model_at_session_capacity",
                    f"all {self.table.max_sessions} session slots hold live sessions; retry later "
                    f"(re-prefilling this {len(req.prompt_ids)}-token prompt takes ~{len(req.prompt_ids) / rate:.1f} s)",
                    {"retry_after": 30}))
                continue
            if got is None:
                continue  # no free slot for this one yet; later sequences may still fit
            self.waiting.remove(seq)
            self._start(seq, *got)

    def _start(self, seq: Sequence, slot: Slot, cached: int) -> None:
        req, st = seq.request, seq.state
        seq.slot, seq.prefill_at = slot, cached
        seq.history = req.prompt_ids[:cached]
        self.runner.begin(slot.index, cached)
        seq.sampling = self.runner.start_sampling(slot.index, seq.params)
        parser = None
        if req.dialect is not None:
            from pantheon.text.tools import ToolCallParser

            parser = ToolCallParser(req.dialect, req.tools)
        seq.text = ChoiceText(self.engine.tokenizer, req.stops, req.think, req.start_in_reasoning, parser)
        if req.grammar is not None:
            seq.matcher = self.engine.grammar_factory.matcher(req.grammar)
        self.running.append(seq)
        if seq.index == 0:
            st.cached = cached
        if not st.admitted:
            st.admitted = True
            st.emit(Admitted(cached))

    # ---- compute ----------------------------------------------------------------------------------------
    def _prefill_chunk(self, seq: Sequence, decoding: bool) -> None:
        prompt = seq.request.prompt_ids
        size = INTERLEAVED_CHUNK if decoding else CHUNK_BUCKETS[-1]
        chunk = prompt[seq.prefill_at:seq.prefill_at + size]
        t0 = time.perf_counter()
        logits = self.runner.prefill(seq.slot.index, chunk, seq.prefill_at)
        seq.prefill_at += len(chunk)
        seq.history.extend(chunk)
        if not seq.prefilling:
            out = self.runner.sample(logits[None], [seq.slot.index], [seq.sampling], self._forced([seq]),
                                     self._masks([seq]))
            self.engine.record_prefill(len(chunk), time.perf_counter() - t0)
            self._accept(seq, out, 0)

    def _decode_step(self, rows: list[Sequence]) -> None:
        slots = [s.slot.index for s in rows]
        logits = self.runner.decode(slots, [s.last for s in rows], [len(s.history) for s in rows])
        for s in rows:
            s.history.append(s.last)
            s.last = None
        out = self.runner.sample(logits, slots, [s.sampling for s in rows], self._forced(rows), self._masks(rows))
        for i, s in enumerate(rows):
            self._accept(s, out, i)

    def _masks(self, rows: list[Sequence]) -> np.ndarray | None:
        """Grammar bitmasks for the constrained rows (all ones elsewhere), or None."""
        if not any(s.matcher is not None for s in rows):
            return None
        words = self.engine.grammar_factory.mask_words
        mask = np.full((len(rows), words), -1, np.int32)
        for i, s in enumerate(rows):
            if s.matcher is not None and not s.forced:
                s.matcher.fill_bitmask(mask[i])
        return mask

    @staticmethod
    def _forced(rows: list[Sequence]) -> list[int] | None:
        if not any(s.forced for s in rows):
            return None
        return [s.forced.pop(0) if s.forced else -1 for s in rows]

    # ---- per-token handling -------------------------------------------------------------------------------
    def _accept(self, seq: Sequence, out, row: int) -> None:
        req, params = seq.request, seq.params
        token = int(out.tokens[row])
        if token in self.engine.tokenizer.eog_ids:
            return self._finish(seq, "stop", self._closing(seq))
        if seq.matcher is not None:
            seq.matcher.consume(token)
        seq.n += 1
        if params.logprobs:
            k = min(params.top_logprobs, MAX_TOP_LOGPROBS)
            top = [(int(a), float(b)) for a, b in zip(out.top_ids[row][:k], out.top_logprobs[row][:k])]
            seq.pending.append(TokenInfo(token, float(out.logprob[row]), top))
        was_reasoning = seq.text.in_reasoning
        delta = seq.text.push(token)
        if delta.stopped:
            return self._finish(seq, "stop", delta)
        if delta or seq.pending:
            self._emit(seq, delta)
        if delta.looping and not self._compelled(seq):
            return self._finish(seq, "repetition_loop", self._closing(seq))
        budget = req.reasoning_budget if req.think else 0
        if was_reasoning and seq.text.in_reasoning and not seq.forced:
            seq.reasoning_tokens += 1
            if budget > 0 and seq.reasoning_tokens == budget:
                seq.forced = list(self.force_close)
        if seq.n >= req.max_tokens or len(seq.history) + 1 >= self.engine.ctx:
            return self._finish(seq, "length", self._closing(seq))
        seq.last = token

    @staticmethod
    def _compelled(seq: Sequence) -> bool:
        """A choice the grammar compels to a call or a JSON value: a loop inside it runs into the
        grammar's bounds or max_tokens and is closed there, rather than cut off unfinished."""
        g = seq.matcher.grammar if seq.matcher is not None else None
        return g is not None and (g.kind == "json" or g.mode in ("required", "named"))

    def _closing(self, seq: Sequence):
        """End of a choice: a constrained call that can still close gets its closing text appended
        (the grammar allowed the end token only where that is possible), then the text is flushed."""
        closing = seq.matcher.closing_text() if seq.matcher is not None else None
        if closing:
            self._emit(seq, seq.text.push_text(closing))
        return seq.text.finish()

    def _emit(self, seq: Sequence, delta) -> None:
        if delta or seq.pending:
            seq.state.emit(Delta(seq.index, delta.reasoning, delta.content, seq.pending, delta.tool_calls))
            seq.pending = []

    def _finish(self, seq: Sequence, reason: str | None, delta=None) -> None:
        """reason None: cancelled (nothing more is sent)."""
        st = seq.state
        if delta is not None:
            self._emit(seq, delta)
        self.running.remove(seq)
        self.table.release_slot(seq.slot, seq.history)
        st.completion_tokens += seq.n
        if seq.index == 0:
            st.kv_used = len(seq.history)
        if reason is not None and not st.failed:
            if seq.text.n_tool_calls and reason != "repetition_loop":
                reason = "tool_calls"
            error = seq.text.tool_errors[0].to_dict() if seq.text.tool_errors else None
            closed = None if seq.matcher is None else seq.matcher.closing_text() == ""
            st.emit(ChoiceEnd(seq.index, reason, seq.n, error, closed))
        self._sequence_gone(st)

    def _sequence_gone(self, st: _RequestState) -> None:
        st.remaining -= 1
        if st.remaining == 0:
            if not st.failed and not st.request.cancelled.is_set():
                conflict = self.table.take_conflict(st.request.session_id)
                st.emit(RequestEnd(len(st.request.prompt_ids), st.completion_tokens, st.kv_used, st.cached, conflict))
            st.emit(None)  # end of stream
            self._unreserve()

    def _fail(self, st: _RequestState, error: RequestError) -> None:
        if st.failed:
            return
        st.failed = True
        st.emit(error)
        for seq in [s for s in self.waiting if s.state is st]:
            self.waiting.remove(seq)
            self._sequence_gone(st)
        for seq in [s for s in self.running if s.state is st]:
            self._finish(seq, None)
