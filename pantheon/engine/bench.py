"""`pantheon bench`: prefill throughput (512-token prompt), batch-1 decode throughput (128 tokens)
and time to first token, after a warm-up that compiles every executable the run needs."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import numpy as np

from pantheon.engine.engine import Engine
from pantheon.engine.sampler import SamplingParams


@dataclass
class BenchResult:
    model: str
    backend: str
    prompt_tokens: int
    decode_tokens: int
    prefill_tok_s: float
    decode_tok_s: float
    ttft_ms: float
    compile_s: float
    weight_bytes: int
    kv_bytes: int

    def as_dict(self) -> dict:
        return asdict(self)

    def table(self) -> str:
        rows = [("model", self.model), ("backend", self.backend),
                (f"prefill tok/s ({self.prompt_tokens}-token prompt)", f"{self.prefill_tok_s:.1f}"),
                (f"decode tok/s (batch 1, {self.decode_tokens} tokens)", f"{self.decode_tok_s:.1f}"),
                ("time to first token (ms)", f"{self.ttft_ms:.1f}"),
                ("compile, warm-up (s)", f"{self.compile_s:.2f}"),
                ("weights on device (MiB)", f"{self.weight_bytes / 2**20:.1f}"),
                ("KV cache on device (MiB)", f"{self.kv_bytes / 2**20:.1f}")]
        w = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{w}}  {v}" for k, v in rows)


def run_bench(engine: Engine, prompt_tokens: int = 512, decode_tokens: int = 128, rounds: int = 3) -> BenchResult:
    import jax

    rng = np.random.default_rng(0)
    # Ordinary text ids (skip the control tokens at the start of the vocab).
    prompt = rng.integers(100, engine.spec.n_vocab, size=prompt_tokens).tolist()
    greedy = SamplingParams(temperature=0.0)
    runner = engine.runner

    t0 = time.perf_counter()
    run_decode(engine, prompt, decode_tokens)  # compiles every prefill, sample and decode executable
    compile_s = time.perf_counter() - t0

    prefill_s, ttft_s, decode_s = [], [], []
    for _ in range(rounds):
        t = time.perf_counter()
        runner.prefill(0, prompt, 0).block_until_ready()
        prefill_s.append(time.perf_counter() - t)
        t = time.perf_counter()  # request in -> first token id out
        state = runner.start_sampling(0, greedy)
        runner.sample(runner.prefill(0, prompt, 0)[None], [0], [state])
        ttft_s.append(time.perf_counter() - t)
        decode_s.append(run_decode(engine, prompt, decode_tokens))
    return BenchResult(engine.name, jax.default_backend(), prompt_tokens, decode_tokens,
                       prompt_tokens / min(prefill_s), decode_tokens / min(decode_s), 1000 * min(ttft_s),
                       compile_s, engine.weight_bytes, engine.kv_bytes)


def run_decode(engine: Engine, prompt: list[int], n: int) -> float:
    """Seconds for n greedy decode steps (prefill excluded), end tokens ignored."""
    runner = engine.runner
    state = runner.start_sampling(0, SamplingParams(temperature=0.0))
    logits = runner.prefill(0, prompt, 0)[None]
    tok = int(runner.sample(logits, [0], [state]).tokens[0])
    pos = len(prompt)
    t = time.perf_counter()
    for _ in range(n):
        logits = runner.decode([0], [tok], [pos])
        tok = int(runner.sample(logits, [0], [state]).tokens[0])
        pos += 1
    return time.perf_counter() - t


@dataclass
class InterleaveResult:
    """A short request and a running stream, alone and beside another request's long prefill."""

    model: str
    long_prompt_tokens: int
    short_ttft_alone_ms: float
    short_ttft_beside_prefill_ms: float
    stream_tok_s_alone: float
    stream_tok_s_during_prefill: float
    long_prefill_s: float  # the long prompt's own time to first token, with the stream beside it

    def as_dict(self) -> dict:
        return asdict(self)

    def table(self) -> str:
        n = self.long_prompt_tokens
        rows = [("model", self.model),
                ("short request TTFT alone (ms)", f"{self.short_ttft_alone_ms:.0f}"),
                (f"short request TTFT beside a {n}-token prefill (ms)", f"{self.short_ttft_beside_prefill_ms:.0f}"),
                ("running stream decode tok/s alone", f"{self.stream_tok_s_alone:.1f}"),
                (f"running stream decode tok/s during the {n}-token prefill", f"{self.stream_tok_s_during_prefill:.1f}"),
                (f"{n}-token prompt's TTFT with the stream beside it (s)", f"{self.long_prefill_s:.1f}")]
        w = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{w}}  {v}" for k, v in rows)


def run_interleave(engine: Engine, long_tokens: int = 8000) -> InterleaveResult:
    """Measured through the scheduler (engine.submit), as the server runs it. The whole scenario
    runs twice; the first pass compiles every executable it needs and is not reported."""
    import asyncio

    from pantheon.engine.events import Admitted, Delta, GenerationRequest

    rng = np.random.default_rng(0)
    no_end = tuple((t, -100.0) for t in engine.tokenizer.eog_ids)
    greedy = SamplingParams(temperature=0.0, logprobs=True, logit_bias=no_end)
    # The running stream samples (seeded): a greedy one on a random prompt soon trips the
    # repetition-loop detector and ends.
    sampled = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, seed=1, logprobs=True, logit_bias=no_end)

    def request(n_prompt: int, max_tokens: int, params=greedy) -> GenerationRequest:
        return GenerationRequest(rng.integers(100, engine.spec.n_vocab, n_prompt).tolist(), [params], max_tokens)

    async def first_token_s(req) -> float:
        t = time.perf_counter()
        async for ev in engine.submit(req):
            if isinstance(ev, Delta):
                return time.perf_counter() - t
        raise RuntimeError("no token")

    async def stream(req, stamps: list[float], stop: asyncio.Event):
        async for ev in engine.submit(req):
            if isinstance(ev, Delta):
                stamps.extend(time.perf_counter() for _ in ev.tokens)
            if stop.is_set():
                break

    async def scenario():
        alone = min([await first_token_s(request(16, 1)) for _ in range(3)])
        stamps: list[float] = []
        stop = asyncio.Event()
        task = asyncio.create_task(stream(request(16, long_tokens, sampled), stamps, stop))
        while len(stamps) < 20:
            await asyncio.sleep(0.01)
        t = time.perf_counter()
        while len(stamps) < 40:
            await asyncio.sleep(0.01)
        stream_alone = (len([s for s in stamps if s > t])) / (time.perf_counter() - t)
        admitted = asyncio.Event()
        long_first: list[float] = []

        async def long_request():
            t0 = time.perf_counter()
            async for ev in engine.submit(request(long_tokens, 1)):
                if isinstance(ev, Admitted):
                    admitted.set()
                if isinstance(ev, Delta):
                    long_first.append(time.perf_counter() - t0)
                    return

        long = asyncio.create_task(long_request())
        await admitted.wait()
        t_long = time.perf_counter()
        await asyncio.sleep(0.5)  # well inside the long prefill
        beside = await first_token_s(request(16, 1))
        await long
        during = len([s for s in stamps if t_long < s]) / (time.perf_counter() - t_long)
        stop.set()
        if task.done():
            raise RuntimeError("the running stream ended before the long prefill did")
        await task
        return alone, beside, stream_alone, during, long_first[0]

    asyncio.run(scenario())  # compiles
    alone, beside, stream_alone, during, long_s = asyncio.run(scenario())
    return InterleaveResult(engine.name, long_tokens, 1000 * alone, 1000 * beside, stream_alone, during, long_s)
