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
