"""The scheduler's core promises, on a tiny model through the Engine (no HTTP): long prompts are
interleaved with running streams and with short prompts; a failed device step fails only its own
requests and the model keeps serving, with the other sessions' caches intact."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

from pantheon.config import ModelConfig
from pantheon.engine.engine import Engine
from pantheon.engine.events import Admitted, ChoiceEnd, Delta, RequestEnd, RequestError
from pantheon.engine.events import GenerationRequest
from pantheon.faults import FAULTS
from pantheon.engine.sampler import SamplingParams
from pantheon.engine.chunks import SHARED_CHUNKS
from pantheon.engine.scheduler import Scheduler
from tests.fixtures.tiny_models import write_tiny_llama

NO_END = ((0, -100.0), (2, -100.0))  # the tiny vocabulary's end-of-generation ids


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = write_tiny_llama(tmp_path_factory.mktemp("sched") / "tiny.gguf",
                            extra_metadata={"llama.context_length": 4096})
    eng = Engine(ModelConfig(str(path), "tiny", ctx_cap=4096, max_sessions=4))
    eng.start()
    yield eng
    eng.stop()


def request(prompt, max_tokens=8, session_id=None, **sampling):
    params = SamplingParams(**{"temperature": 0.0, "logprobs": True, "logit_bias": NO_END, **sampling})
    return GenerationRequest(list(prompt), [params], max_tokens, session_id=session_id)


def prompt_of(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 200, n)]


class Recorder:
    """Every event of several concurrent requests, in the order the device thread emitted them."""

    def __init__(self):
        self.log: list[tuple[str, object]] = []
        self.lock = threading.Lock()

    async def consume(self, engine, name: str, req: GenerationRequest, started: asyncio.Event | None = None):
        async for ev in engine.submit(req):
            with self.lock:
                self.log.append((name, ev))
            if started is not None and isinstance(ev, Delta):
                started.set()

    def first(self, name: str, kind) -> int:
        return next(i for i, (n, ev) in enumerate(self.log) if n == name and isinstance(ev, kind))

    def count(self, name: str, kind, start: int, end: int) -> int:
        return sum(1 for n, ev in self.log[start:end] if n == name and isinstance(ev, kind))


def test_a_running_stream_gets_a_token_every_step_while_a_long_prompt_prefills(engine):
    long_prompt = prompt_of(1500, 1)
    rec = Recorder()

    async def main():
        started = asyncio.Event()
        stream = asyncio.create_task(rec.consume(engine, "stream", request(prompt_of(8, 2), max_tokens=400), started))
        await started.wait()
        await rec.consume(engine, "long", request(long_prompt, max_tokens=1))
        await stream

    asyncio.run(main())
    admitted, first = rec.first("long", Admitted), rec.first("long", Delta)
    chunks = -(-len(long_prompt) // SHARED_CHUNKS[0])
    # one decode step of the stream rides along with every prefill chunk of the long prompt
    assert rec.count("stream", Delta, admitted, first) >= chunks - 1


def test_a_short_prompt_is_answered_before_a_long_prompt_ahead_of_it_finishes_prefilling(engine):
    rec = Recorder()

    async def main():
        long = asyncio.create_task(rec.consume(engine, "long", request(prompt_of(3000, 3), max_tokens=1)))
        await asyncio.sleep(0)  # queued first
        await rec.consume(engine, "short", request(prompt_of(5, 4), max_tokens=2))
        await long

    asyncio.run(main())
    assert rec.first("short", RequestEnd) < rec.first("long", Delta)


def test_the_short_requests_output_does_not_depend_on_the_long_prompt_beside_it(engine):
    short = request(prompt_of(6, 5), max_tokens=6)
    alone = engine_tokens(engine, short)

    async def main():
        rec = Recorder()
        long = asyncio.create_task(rec.consume(engine, "long", request(prompt_of(900, 6), max_tokens=2)))
        await asyncio.sleep(0)
        await rec.consume(engine, "short", request(prompt_of(6, 5), max_tokens=6))
        await long
        return [t.token for n, ev in rec.log if n == "short" and isinstance(ev, Delta) for t in ev.tokens]

    assert asyncio.run(main()) == alone


def engine_tokens(engine, req) -> list[int]:
    async def main():
        return [t.token async for ev in engine.submit(req) if isinstance(ev, Delta) for t in ev.tokens]

    return asyncio.run(main())


def run_events(engine, req) -> list:
    async def main():
        return [ev async for ev in engine.submit(req)]

    return asyncio.run(main())


def test_a_repeated_prompt_sends_its_last_token_through_a_decode_step(engine):
    """All but the last token of a repeated prompt is in a slot: that token joins a decode step as
    a row (no prefill chunk, which would pad it to a 16-token chunk), and the tokens are the cold
    run's."""
    cold = run_events(engine, request(prompt_of(40, 9), max_tokens=6))
    warm = run_events(engine, request(prompt_of(40, 9), max_tokens=6))
    tokens = [[t.token for ev in evs if isinstance(ev, Delta) for t in ev.tokens] for evs in (cold, warm)]
    end_cold, end_warm = cold[-1], warm[-1]
    assert isinstance(end_warm, RequestEnd) and end_warm.cached_tokens == 39
    assert end_cold.timing["prefill_chunks"] >= 1 and end_warm.timing["prefill_chunks"] == 0
    # the decode step that took the prompt's last token counts as prompt time (llama-server's
    # timings: the first token never costs a decode step)
    assert end_warm.timing["decode_steps"] == 5 and end_warm.timing["prefill_ms"] > 0
    assert tokens[1] == tokens[0] and len(tokens[0]) == 6
    assert end_warm.prompt_tokens == 40 and end_warm.kv_used == end_cold.kv_used


def test_a_failed_step_fails_its_request_and_the_next_request_and_sessions_are_served(engine):
    first = run_events(engine, request(prompt_of(20, 7), max_tokens=5, session_id="kept"))
    end = next(ev for ev in first if isinstance(ev, RequestEnd))
    history = prompt_of(20, 7) + [t.token for ev in first if isinstance(ev, Delta) for t in ev.tokens]

    FAULTS.set("step", 1)
    failed = run_events(engine, request(prompt_of(30, 8), max_tokens=5))
    errors = [ev for ev in failed if isinstance(ev, RequestError)]
    assert errors and errors[0].type == "server_error"
    # words and a request id for the client; the exception itself only in the server's log
    assert errors[0].message.startswith("generation failed on the device (request id ")
    assert "injected" not in errors[0].message and "Fault" not in errors[0].message
    assert not any(isinstance(ev, RequestEnd) for ev in failed)
    assert engine.scheduler.failed_steps >= 1

    after = run_events(engine, request(prompt_of(30, 8), max_tokens=5))
    assert any(isinstance(ev, RequestEnd) for ev in after)
    resumed = run_events(engine, request(history + prompt_of(4, 9), max_tokens=3, session_id="kept"))
    resumed_end = next(ev for ev in resumed if isinstance(ev, RequestEnd))
    assert resumed_end.cached_tokens >= end.prompt_tokens + end.completion_tokens - 1


def test_a_failed_decode_step_leaves_batch_mates_outside_the_step_untouched_and_recovers(engine):
    """The fault hits a decode step (a stream is running); afterwards the same prompt decodes to the
    same tokens as before the fault: the KV cache was not corrupted by the half-run step."""
    prompt = prompt_of(12, 10)
    before = engine_tokens(engine, request(prompt, max_tokens=6))

    async def main():
        started = asyncio.Event()
        rec = Recorder()
        task = asyncio.create_task(rec.consume(engine, "s", request(prompt_of(12, 11), max_tokens=1000), started))
        await started.wait()
        FAULTS.set("step", 1)
        await task
        return rec.log

    log = asyncio.run(main())
    assert any(isinstance(ev, RequestError) for _, ev in log)
    assert engine_tokens(engine, request(prompt, max_tokens=6)) == before


def test_repair_replaces_a_deleted_state_buffer(engine):
    def go():
        engine.runner.cache.k[0].delete()
        return engine.runner.repair()

    lost = asyncio.run(engine.call(go))
    assert lost is True and not engine.runner.cache.k[0].is_deleted()
    assert any(isinstance(ev, RequestEnd) for ev in run_events(engine, request(prompt_of(10, 12), max_tokens=3)))


def test_hostile_sampling_values_are_clamped_into_device_range():
    p = SamplingParams(temperature=float("inf"), top_p=7.0, top_k=2**31, presence_penalty=1e9,
                       frequency_penalty=float("nan"), top_logprobs=10**6,
                       logit_bias=((5, 1e9), (10**12, 1.0), (-3, 1.0)))
    s = p.sanitized(1000)
    assert s.top_k == 1000 and s.top_p == 1.0 and 0 < s.temperature <= 1e4
    assert s.presence_penalty == 2.0 and s.frequency_penalty == 0.0 and s.top_logprobs == 20
    assert s.logit_bias == ((5, 100.0),)


@pytest.mark.parametrize("pressure", [False, True], ids=["ok", "pressure"])
def test_the_ladders_window_bounds_a_running_sequence(engine, pressure, monkeypatch):
    """Memory pressure halves the window (4096 -> 2048) for running sequences as for new prompts: a
    2100-token prompt admitted before the pressure ends with "length" at its next token instead of
    running to max_tokens. Without pressure the same request runs its 24 tokens."""
    start = Scheduler._start

    def start_then_pressure(self, *args):
        # admitted under OK; the pressure arrives in the device thread before the prefill's first chunk
        # (set from the asyncio side on seeing Admitted, it raced the prefill on a fast machine)
        start(self, *args)
        FAULTS.memory = "pressure"

    if pressure:
        monkeypatch.setattr(Scheduler, "_start", start_then_pressure)

    async def main():
        events = []
        try:
            async for ev in engine.submit(request(prompt_of(2100, 21), max_tokens=24)):
                events.append(ev)
        finally:
            FAULTS.memory = None
        return events

    assert engine.effective_ctx == 4096
    events = asyncio.run(main())
    end = next(ev for ev in events if isinstance(ev, ChoiceEnd))
    assert end.finish_reason == "length"
    assert end.completion_tokens == (1 if pressure else 24)


def test_a_prompt_goes_in_chunks_that_waste_few_padded_rows():
    """A chunk is padded to its bucket (chunks.CHUNK_BUCKETS) and a padded row costs a real row's
    work: a prompt's chunks cover it exactly, none past the limit, and their rows (each extra chunk
    counted as CHUNK_SPLIT_ROWS) never exceed those of chunks of the limit with the remainder in
    one; a remainder far from its bucket goes in more chunks."""
    from pantheon.engine.chunks import CHUNK_BUCKETS, CHUNK_SPLIT_ROWS, bucket_for, chunk_length

    def chunks(n, limit=CHUNK_BUCKETS[-1]):
        out = []
        while n - sum(out):
            out.append(chunk_length(n - sum(out), limit))
        return out

    assert chunks(138) == [128, 10] and chunks(650) == [512, 128, 10] and chunks(400) == [256, 128, 16]
    assert chunks(35) == [35] and chunks(50) == [50] and chunks(512) == [512]  # close to their buckets
    rng = np.random.default_rng()
    for n in list(rng.integers(1, 3000, 200)) + list(range(1, 600)):
        for limit in (CHUNK_BUCKETS[-1], *SHARED_CHUNKS):
            got = chunks(int(n), limit)
            assert sum(got) == n and all(0 < c <= limit for c in got)
            whole = [limit] * (int(n) // limit) + ([int(n) % limit] if n % limit else [])
            cost = [sum(bucket_for(c, CHUNK_BUCKETS) for c in cs) + CHUNK_SPLIT_ROWS * len(cs) for cs in (got, whole)]
            assert cost[0] <= cost[1], (n, limit, got)


def test_where_padding_is_free_a_remainder_goes_in_one_chunk():
    """Where the native kernels leave padded rows out of every product (chunks.padding_is_free), a
    prompt goes in chunks of the limit and its remainder in one; no split to spare padding."""
    from pantheon.engine.chunks import CHUNK_BUCKETS, chunk_length

    def chunks(n, limit=CHUNK_BUCKETS[-1]):
        out = []
        while n - sum(out):
            out.append(chunk_length(n - sum(out), limit, padding_free=True))
        return out

    assert chunks(138) == [138] and chunks(650) == [512, 138] and chunks(400) == [400]
    assert chunks(1500) == [512, 512, 476] and chunks(300, 128) == [128, 128, 44]


def test_padding_is_free_only_where_every_layer_matrix_skips_zero_rows(engine, monkeypatch):
    """A dense model whose layer matrices all take the native kernels at every row count (the GEMM
    of AVX-512 builds) pays nothing for padded rows; not on builds whose long chunks multiply f32
    weights, nor with f32 matrices or routed experts."""
    import dataclasses

    from pantheon.engine.chunks import padding_is_free
    from pantheon.native import build

    spec, params = engine.runner.spec, engine.runner.params
    assert engine.runner.padding_free == build.gemm() == padding_is_free(spec, params)
    monkeypatch.setattr(build, "gemm", lambda: True)
    assert padding_is_free(spec, params)
    assert not padding_is_free(dataclasses.replace(spec, n_expert=4, n_expert_used=2), params)
    assert padding_is_free(dataclasses.replace(spec, swa_layers=(True,) * spec.n_layer, swa_window=8), params)
    layers = [dict(layer) for layer in params["layers"]]
    layers[1]["wo"] = np.zeros((layers[1]["wo"].n_out, layers[1]["wo"].n_in), np.float32)  # an f32 matrix
    assert not padding_is_free(spec, {**params, "layers": layers})
    monkeypatch.setattr(build, "gemm", lambda: False)
    assert not padding_is_free(spec, params)


def test_an_idle_device_thread_hands_freed_pages_back_once(engine, monkeypatch):
    """When the last request is done, the device thread hands the allocator's free pages back to
    the OS (a long chunk's dequantized matrices are freed but kept by tcmalloc otherwise), once
    per stretch of work: not on every idle poll, and not while sequences still run."""
    import pantheon.engine.scheduler as sched

    calls = []
    monkeypatch.setattr(sched, "release_free_memory", lambda: calls.append(len(engine.scheduler.running)) or "")
    end = run_events(engine, request(prompt_of(20, 3), max_tokens=4))[-1]
    assert isinstance(end, RequestEnd)
    deadline = time.monotonic() + 10
    while not calls and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(1.2)  # an idle poll or more: no second release without new work
    assert calls == [0]
