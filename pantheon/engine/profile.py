"""`pantheon profile`: a jax.profiler trace of N chat requests (raw prompts for a base model without a
chat template) through the real scheduler, written
to profiles/<timestamp>-<model>/ (Perfetto JSON + XPlane). The scheduler and runner annotate
prefill chunks, decode steps and sampling (TraceAnnotation costs ~0.2 us when no trace runs)."""

from __future__ import annotations

import gzip
import json
import time
from pathlib import Path

import jax

from pantheon.engine.events import GenerationRequest
from pantheon.engine.sampler import SamplingParams

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "Name three colors.",
           "Explain photosynthesis briefly."]


def capture(engine, out_root: Path, requests: int = 4, max_tokens: int = 32) -> Path:
    """Warm up (compiles are not what a profile is for), then trace `requests` requests."""
    def run(i: int):
        prompt = PROMPTS[i % len(PROMPTS)]
        if engine.template is None:  # a base model: the raw text, as /v1/completions sends it
            ids = engine.tokenizer.encode(prompt, parse_special=True, add_bos=None)
        else:
            ids = engine.encode_prompt(engine.render_chat([{"role": "user", "content": prompt}]))
        req = GenerationRequest(ids, [SamplingParams(temperature=0)], max_tokens)
        with jax.profiler.TraceAnnotation(f"request_{i}", request=i):
            engine.run_sync(req, lambda ev: None)

    run(0)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = out_root / f"{stamp}-{engine.name}"
    out.mkdir(parents=True, exist_ok=True)
    with jax.profiler.trace(str(out), create_perfetto_trace=True):
        for i in range(requests):
            run(i)
    return out


def trace_files(out: Path) -> list[Path]:
    return sorted(out.rglob("*.json.gz"))


def event_names(trace: Path) -> set[str]:
    with gzip.open(trace) as f:
        return {e.get("name", "") for e in json.load(f).get("traceEvents", [])}
