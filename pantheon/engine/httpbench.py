"""`pantheon bench --concurrency 1,4,8`: aggregate decode throughput and time to first token per
concurrency level, measured against a live server over HTTP (streaming), as clients see it."""

from __future__ import annotations

import json
import statistics
import threading
import time
from dataclasses import asdict, dataclass

import httpx

PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle."


@dataclass
class LevelResult:
    concurrency: int
    requests: int
    completion_tokens: int
    wall_s: float
    aggregate_tok_s: float
    per_stream_tok_s: float
    ttft_p50_ms: float
    ttft_p95_ms: float


def _one(url: str, model: str | None, max_tokens: int, logit_bias: dict, out: list) -> None:
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": max_tokens, "temperature": 0.7,
            "stream": True, "stream_options": {"include_usage": True}, "logit_bias": logit_bias}
    if model:
        body["model"] = model
    t0 = time.perf_counter()
    first, tokens = None, 0
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            ev = json.loads(line[6:])
            if first is None and ev.get("choices") and ev["choices"][0]["delta"].get("content"):
                first = time.perf_counter()
            if ev.get("usage"):
                tokens = ev["usage"]["completion_tokens"]
    end = time.perf_counter()
    out.append((t0, (first or end) - t0, end, tokens))


def run_level(url: str, concurrency: int, max_tokens: int, logit_bias: dict, model: str | None = None,
              rounds: int = 1) -> LevelResult:
    results: list = []
    start = time.perf_counter()
    for _ in range(rounds):
        threads = [threading.Thread(target=_one, args=(url, model, max_tokens, logit_bias, results))
                   for _ in range(concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    wall = time.perf_counter() - start
    tokens = sum(r[3] for r in results)
    ttfts = sorted(r[1] for r in results)
    per_stream = statistics.mean(r[3] / max(r[2] - r[0] - r[1], 1e-9) for r in results)
    p95 = ttfts[min(len(ttfts) - 1, int(round(0.95 * (len(ttfts) - 1))))]
    return LevelResult(concurrency, len(results), tokens, wall, tokens / wall, per_stream,
                       1000 * statistics.median(ttfts), 1000 * p95)


def table(results: list[LevelResult]) -> str:
    head = f"{'concurrency':>11}  {'agg tok/s':>9}  {'per-stream tok/s':>16}  {'TTFT p50 ms':>11}  {'TTFT p95 ms':>11}"
    rows = [f"{r.concurrency:>11}  {r.aggregate_tok_s:>9.1f}  {r.per_stream_tok_s:>16.1f}  "
            f"{r.ttft_p50_ms:>11.0f}  {r.ttft_p95_ms:>11.0f}" for r in results]
    return "\n".join([head, *rows])


def as_json(results: list[LevelResult]) -> str:
    return json.dumps({"levels": [asdict(r) for r in results]})
