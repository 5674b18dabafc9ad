"""Continuous batching on the device thread, in nano-vllm's shape.

Requests expand into one `Sequence` per choice (engine/sequence.py). Each iteration of the device
loop is

    plan = schedule()         admission, the decode rows, and at most one prefill chunk
    out = runner.run(plan.work)
    postprocess(plan, out)    each sampled token goes through its sequence's policy

A step spends a bounded token budget: every decoding sequence's one token plus, when a prompt is
waiting to be prefilled, one chunk of it (chunks.chunk_budget) — `STEP_TOKENS` while nothing else
is in flight; when other sequences decode or prefill beside it, at most 128 tokens and at most
`SHARED_STEP_KEYS` tokens x keys of attention work (so a step stays short deep into a long
prompt). Prompts being prefilled take turns chunk by chunk (round robin), so a short request's first token never waits for a long
prompt to finish, and running streams keep producing a token every step.

A failed device step fails only the requests in it: the runner's state stays consistent layer by
layer, slots whose contents are now unknown are invalidated, and the loop goes on. Maintenance
(session reaping, compile and KV-allocation retries) runs on a one-second timer between steps.

With `max_concurrent=1` and no queue this is exactly the single-user path: one generation at a
time, a second request answered 429 at once."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace

import numpy as np
from jax.profiler import TraceAnnotation

from pantheon.engine.events import (Admitted, ChoiceEnd, Delta, PromptLogprobs, PromptProgress, RequestEnd, RequestError,
                                    TokenInfo, failure_message)
from pantheon.engine.memory import release_free_memory
from pantheon.engine.chunks import chunk_budget, chunk_length
from pantheon.engine.runner import DecodeWork, ModelRunner, PrefillWork, StepOutput, StepWork
from pantheon.engine.sequence import Outcome, RequestState, Sequence, TokenPolicy
from pantheon.engine.sessions import CapacityError, Slot, SlotTable
from pantheon.text.pipeline import ChoiceText

log = logging.getLogger(__name__)

THINK_CLOSE = "</think>\n\n"
QUEUE_WAIT_S = 30.0
MAINTENANCE_S = 1.0


def server_error(what: str, error: BaseException, detail: str = "") -> RequestError:
    return RequestError("server_error", failure_message(log, what, error, detail))


class BusyError(Exception):
    """Every slot is busy and the queue is full."""


class MemoryConstrained(Exception):
    """Critical memory pressure: new prompts are refused."""


@dataclass
class Plan:
    """One step: the sequence whose prompt advances by `chunk`, and the decoding sequences."""

    prefill: Sequence | None = None
    chunk: list[int] = field(default_factory=list)
    decode: list[Sequence] = field(default_factory=list)
    work: StepWork = field(default_factory=StepWork)

    @property
    def sequences(self) -> list[Sequence]:
        return ([self.prefill] if self.prefill is not None else []) + self.decode

    def __bool__(self) -> bool:
        return self.prefill is not None or bool(self.decode)


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
        self._last_maintenance = 0.0
        self._steps = 0
        self.failed_steps = 0
        self.policy = TokenPolicy(frozenset(engine.tokenizer.eog_ids),
                                  tuple(engine.tokenizer.encode(THINK_CLOSE, parse_special=True, add_bos=False)),
                                  engine.ctx)

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
        busy_since_release = False
        while not self._stopping:
            idle = not (self.waiting or self.running)
            if idle and busy_since_release:
                # The steps' transient buffers (a long chunk's dequantized matrices, a compile's
                # working set) are freed, but the allocator keeps their pages: an idle server
                # hands them back (1 B Q8_0 after a 366-token prompt: ~290 MB).
                release_free_memory()
                busy_since_release = False
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
            except Exception as e:  # noqa: BLE001 - last resort: the device thread must never die
                error = server_error("generation failed", e)
                for st in {id(s.state): s.state for s in self.running}.values():
                    self._fail(st, RequestError(error.type, error.message))
                worked = True
            busy_since_release |= worked

    def step(self) -> bool:
        """One scheduling round; False when there was nothing to compute."""
        self._maintenance()
        plan = self.schedule()
        if not plan:
            return False
        self._steps += 1
        t0 = time.perf_counter()
        try:
            with TraceAnnotation("step", prefill=len(plan.chunk), decode=len(plan.decode)):
                out = self.runner.run(plan.work)
                if plan.prefill is not None and plan.prefill.request.progress and out.prefill is None:
                    self.runner.sync()  # a progress report says what is computed, not dispatched
        except Exception as e:  # noqa: BLE001 - a failed step fails its own requests, never the thread
            self._step_failed(plan, e)
            return True
        dt = time.perf_counter() - t0
        if plan.chunk and not plan.decode:
            self.engine.record_prefill(len(plan.chunk), dt)
        elif plan.decode:
            self.engine.record_decode(len(plan.decode), dt)
        if plan.prefill is not None:
            plan.prefill.state.prefill_chunks += 1
            plan.prefill.state.prefill_s += dt
        # A row with no token yet carries its prompt's last token (_start): prompt time, as
        # llama-server counts it (the first token never costs a decode step).
        prompt_rows = {id(s.state) for s in plan.decode if s.n == 0}
        for st in {id(s.state): s.state for s in plan.decode}.values():
            if id(st) in prompt_rows:
                st.prefill_s += dt
            else:
                st.decode_steps += 1
                st.decode_s += dt
        self.postprocess(plan, out)
        return True

    def _take(self, item) -> None:
        kind, payload = item
        if kind == "generate":
            request, emit = payload
            st = RequestState(request, emit, time.monotonic(), remaining=len(request.choices))
            self.waiting.extend(Sequence(st, i, p) for i, p in enumerate(request.choices))
        else:  # "call": run fn on this thread, hand back the result
            fn, done = payload
            try:
                done(fn(), None)
            except Exception as e:  # noqa: BLE001 - reported to the caller
                done(None, e)

    def _maintenance(self) -> None:
        now = time.monotonic()
        if now - self._last_maintenance < MAINTENANCE_S:
            return
        self._last_maintenance = now
        for name, job in (("reap", self.table.reap), ("graph retry", self.runner.registry.retry_due),
                          ("kv retry", self.runner.attention.retry_due), ("followers", self.runner.keepalive)):
            try:
                job()
            except Exception:  # noqa: BLE001 - maintenance never stops serving
                log.exception("maintenance (%s) failed", name)

    # ---- schedule ---------------------------------------------------------------------------------------
    def schedule(self) -> Plan:
        """Admit what fits, then plan this step: every decoding sequence, plus one prefill chunk of
        the prompt that has waited longest for its turn."""
        self._drop_cancelled(time.monotonic())
        self._admit()
        plan = Plan(decode=[s for s in self.running if s.decoding])
        prefilling = [s for s in self.running if s.prefilling]
        if prefilling:
            seq = min(prefilling, key=lambda s: s.prefill_turn)
            seq.prefill_turn = self._steps + 1
            plan.prefill = seq
            remaining = len(seq.request.prompt_ids) - seq.prefill_at
            if seq.index == 0 and (at := seq.request.mark_at) is not None and seq.prefill_at < at:
                remaining = at - seq.prefill_at  # a chunk ends where the last user turn starts: marked there
            plan.chunk = seq.request.prompt_ids[seq.prefill_at:seq.prefill_at + chunk_length(remaining, self._chunk_size(seq), self.runner.padding_free)]
        plan.work = self._work(plan)
        return plan

    def _chunk_size(self, seq: Sequence) -> int:
        return chunk_budget(seq.prefill_at, alone=len(self.running) == 1,
                            scored_vocab=self.engine.spec.n_vocab if self._scored(seq) else 0)

    @staticmethod
    def _scored(seq: Sequence) -> bool:
        """Whether this sequence scores its prompt: a request's first choice, where it asked."""
        return seq.index == 0 and seq.request.prompt_logprobs is not None

    def _work(self, plan: Plan) -> StepWork:
        work = StepWork()
        seq = plan.prefill
        if seq is not None:
            work.prefill = PrefillWork(seq.slot.index, plan.chunk, seq.prefill_at)
            if self._scored(seq):
                at = seq.prefill_at + 1
                work.prefill.targets = seq.request.prompt_ids[at:at + len(plan.chunk)]
                work.prefill.top = seq.request.prompt_logprobs
            if seq.prefill_at + len(plan.chunk) == len(seq.request.prompt_ids):  # the prompt's last chunk
                work.prefill.sampling = seq.sampling
                work.prefill.forced = seq.take_forced()
                masks = self._masks([seq])
                work.prefill.mask = None if masks is None else masks[0]
        rows = plan.decode
        if rows:
            forced = [s.take_forced() for s in rows]
            work.decode = DecodeWork([s.slot.index for s in rows], [s.last for s in rows],
                                     [len(s.history) for s in rows], [s.sampling for s in rows],
                                     forced if any(f >= 0 for f in forced) else None, self._masks(rows))
        return work

    def _masks(self, rows: list[Sequence]) -> np.ndarray | None:
        """Grammar bitmasks for the constrained rows (all ones elsewhere), or None."""
        if not any(s.matcher is not None for s in rows):
            return None
        mask = np.full((len(rows), self.engine.grammar_factory.mask_words), -1, np.int32)
        for i, s in enumerate(rows):
            s.fill_mask(mask[i])
        return mask

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
                # a scored prompt runs from its first token: a cached prefix has no logits to score
                got = self.table.acquire(session, req.prompt_ids, use_cache=seq.index == 0 and not self._scored(seq))
            except CapacityError:
                rate = self.engine.prefill_rate()
                self._fail(seq.state, RequestError(
                    "model_at_session_capacity",
                    f"all {self.table.max_sessions} session slots hold sessions that are busy or watched; retry later "
                    f"(re-prefilling this {len(req.prompt_ids)}-token prompt takes ~{len(req.prompt_ids) / rate:.1f} s)",
                    {"retry_after": 30}))
                continue
            except Exception as e:  # noqa: BLE001 - e.g. a session moving between tiers failed
                self._fail(seq.state, server_error("admission failed", e))
                continue
            if got is None:
                continue  # no free slot for this one yet; later sequences may still fit
            self.waiting.remove(seq)
            try:
                self._start(seq, *got)
            except Exception as e:  # noqa: BLE001 - e.g. an invalid grammar: this request only
                self.table.release_slot(got[0], seq.history)
                self._fail(seq.state, server_error("could not start generation", e))

    def _start(self, seq: Sequence, slot: Slot, cached: int) -> None:
        req, st = seq.request, seq.state
        seq.slot, seq.prefill_at = slot, cached
        seq.history = req.prompt_ids[:cached]
        if 0 < cached == len(req.prompt_ids) - 1:
            # All but the last prompt token is cached (a repeated prompt, a regenerated turn): that
            # token joins the next decode step as a row, at the decode step's memory speed, rather
            # than a prefill chunk padded to CHUNK_BUCKETS[0] tokens that reads the f32 weights.
            seq.prefill_at, seq.last = len(req.prompt_ids), req.prompt_ids[-1]
        seq.prefill_turn = self._steps  # arrivals queue behind prompts already waiting for a chunk
        self.runner.begin(slot.index, cached)
        seq.sampling = self.runner.start_sampling(slot.index, seq.params, req.prompt_ids)
        parser = None
        if req.dialect is not None:
            from pantheon.text.tools import ToolCallParser

            # under a tool grammar the call cannot fail, so it streams as it is generated (the
            # opening once the name is read, then each argument); otherwise it comes out whole
            # (thoughts left in the content pass through it as content, not read for calls)
            parser = ToolCallParser(req.dialect, req.tools, incremental=req.grammar is not None,
                                    start_in_reasoning=req.start_in_reasoning and req.thoughts_in_content is not None)
        seq.text = ChoiceText(self.engine.tokenizer, req.stops, req.think, req.start_in_reasoning, parser,
                              keep_thoughts=req.thoughts_in_content is not None, lead=req.thoughts_in_content or "")
        if req.grammar is not None:
            seq.matcher = self.engine.grammar_factory.matcher(req.grammar)
        self.running.append(seq)
        if seq.index == 0:
            st.cached = cached
        if not st.admitted:
            st.admitted, st.admitted_at = True, time.perf_counter()
            st.emit(Admitted(cached))
        self._progress(seq, cached)

    # ---- postprocess ------------------------------------------------------------------------------------
    def postprocess(self, plan: Plan, out: StepOutput) -> None:
        policy = self._token_policy()
        seq = plan.prefill
        if seq is not None:
            seq.prefill_at += len(plan.chunk)
            seq.history.extend(plan.chunk)
            if seq.prefill_at == seq.request.mark_at and out.prefill is None:  # the last user turn starts
                self._mark(seq)
            self._progress(seq, seq.prefill_at)
            if out.scores is not None:
                self._scores(seq, plan.work.prefill.targets, out.scores)
            if out.prefill is not None:  # the prompt is in
                self._mark(seq)
                self._accept(seq, out.prefill, 0, policy)
        for s in plan.decode:
            s.history.append(s.last)
            s.last = None
            if s.n == 0:  # its prompt's last token went in as a decode row (_start): the prompt is in
                self._progress(s, len(s.request.prompt_ids))
                self._mark(s)
        for i, s in enumerate(plan.decode):
            self._accept(s, out.decode, i, policy)

    def _mark(self, seq: Sequence) -> None:
        """Mark the slot's rows as they stand after the sequence's history so far (its prompt, or the
        part before its last user turn), which a later prompt could not rewind to (SlotTable.mark)."""
        if seq.index != 0:
            return
        try:
            self.table.mark(seq.slot, seq.history, self.engine.mark_rows(seq.slot.index, len(seq.history)))
        except Exception:  # noqa: BLE001 - without a mark a later prompt prefills from 0
            log.exception("marking a slot's prompt end failed")

    def _token_policy(self) -> TokenPolicy:
        """This step's per-token rules: the memory ladder's window bounds running sequences as it
        bounds new prompts (under pressure a sequence that reaches it ends with "length")."""
        window = self.engine.effective_ctx
        return self.policy if window == self.policy.ctx else replace(self.policy, ctx=window)

    def _accept(self, seq: Sequence, out, row: int, policy: TokenPolicy) -> None:
        if seq not in self.running:  # its request failed earlier in this step
            return
        t0 = time.perf_counter()
        try:
            top = post = []
            if seq.params.logprobs:
                top = [(int(a), float(b)) for a, b in zip(out.top_ids[row], out.top_logprobs[row])]
                post = [(int(a), float(b)) for a, b in zip(out.post_ids[row], out.post_probs[row])]
            outcome: Outcome = seq.accept(int(out.tokens[row]), float(out.logprob[row]), top, policy,
                                          post=(float(out.post_prob[row]), post))
        except Exception as e:  # noqa: BLE001 - a fault in one choice's text handling fails that request
            return self._fail(seq.state, server_error("generation failed while handling a token", e))
        finally:
            seq.state.text_s += time.perf_counter() - t0
        if outcome.finish is not None:
            return self._finish(seq, outcome.finish, outcome.delta)
        self._emit(seq, outcome.delta)

    def _step_failed(self, plan: Plan, error: Exception) -> None:
        """The device step raised. Its requests fail; slots whose contents are now unknown forget
        them (every slot, when a state buffer was lost); everything else keeps serving."""
        self.failed_steps += 1
        failure = server_error("generation failed on the device", error, f"{self.failed_steps} so far")
        try:
            lost_all = self.runner.repair()
        except Exception:  # noqa: BLE001
            log.exception("could not repair the device state")
            lost_all = True
        # A KV cache only ever wrote past each row's committed history, so the committed part is
        # intact; a recurrent state was updated in place by some layers, so it is not.
        keeps_history = self.table.can_truncate and not lost_all
        victims = self.running if lost_all else plan.sequences
        states = {id(s.state): s.state for s in victims}
        for s in list(victims):
            if not keeps_history:
                s.history = []
        if lost_all:
            for slot in self.table.slots:
                if not slot.busy:
                    self.table.invalidate(slot)  # its session's next turn re-prefills
        for st in states.values():
            self._fail(st, RequestError(failure.type, failure.message))

    # ---- events -----------------------------------------------------------------------------------------
    def _scores(self, seq: Sequence, targets: list[int], scores) -> None:
        """A scored chunk's entries (`targets`: the prompt tokens it scored, PrefillWork.targets);
        once the prompt is done, the PromptLogprobs event (before the first token's Delta)."""
        seq.prompt_scores.extend(
            TokenInfo(int(t), float(lp), [(int(i), float(v)) for i, v in zip(ids, lps)])
            for t, lp, ids, lps in zip(targets, scores.logprob, scores.top_ids, scores.top_logprobs))
        if not seq.prefilling:
            seq.state.emit(PromptLogprobs(seq.request.prompt_ids[0], seq.prompt_scores))
            seq.prompt_scores = []

    def _progress(self, seq: Sequence, processed: int) -> None:
        """A PromptProgress event for a request that asked for them (its first choice's prompt)."""
        st = seq.state
        if st.request.progress and seq.index == 0:
            st.emit(PromptProgress(len(st.request.prompt_ids), st.cached, processed,
                                   time.perf_counter() - st.admitted_at, st.timings(processed - st.cached, 0)))

    def _emit(self, seq: Sequence, delta) -> None:
        if (delta is not None and delta) or seq.pending:
            st = seq.state
            timings = st.timings(len(st.request.prompt_ids) - st.cached, seq.n) if st.request.timed else None
            st.emit(Delta(seq.index, delta.reasoning, delta.content, seq.pending, delta.tool_calls, timings))
            seq.pending = []

    def _finish(self, seq: Sequence, reason: str | None, delta=None) -> None:
        """reason None: cancelled or failed (nothing more is sent for this choice)."""
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
            st.emit(ChoiceEnd(seq.index, reason, seq.n, error, seq.grammar_closed, seq.text.stop.matched))
        self._sequence_gone(st)

    def _sequence_gone(self, st: RequestState) -> None:
        st.remaining -= 1
        if st.remaining == 0:
            if not st.failed and not st.request.cancelled.is_set():
                conflict = self.table.take_conflict(st.request.session_id)
                st.emit(RequestEnd(len(st.request.prompt_ids), st.completion_tokens, st.kv_used, st.cached, conflict,
                                   st.timing()))
            st.emit(None)  # end of stream
            self._unreserve()

    def _fail(self, st: RequestState, error: RequestError) -> None:
        if st.failed:
            return
        st.failed = True
        st.emit(error)
        for seq in [s for s in self.waiting if s.state is st]:
            self.waiting.remove(seq)
            self._sequence_gone(st)
        for seq in [s for s in self.running if s.state is st]:
            self._finish(seq, None)
