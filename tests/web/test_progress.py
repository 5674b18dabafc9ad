"""llama-server's streaming telemetry, in process (tiny model): `return_progress` reports the
prompt's prefill chunk by chunk (`prompt_progress`: total, cache, processed, time_ms) on /completion,
chat completions, legacy completions and Responses; `timings_per_token` puts the timings so far on
every streamed delta; the generation rate is over decode steps (the first token costs none)."""

from __future__ import annotations

import pytest

from pantheon.engine.chunks import STEP_TOKENS
from tests.fixtures.tiny_models import write_tiny_llama
from tests.web.inprocess import InProcessApp


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    # a window of 2048: prompts of several prefill chunks
    path = write_tiny_llama(tmp_path_factory.mktemp("progress") / "tiny.gguf",
                            extra_metadata={"llama.context_length": 2048})
    server = InProcessApp([(str(path), "tiny")], max_concurrent=1)
    yield server
    server.close()


def long_ids(n: int, salt: int = 0) -> list[int]:
    return [100 + (7 * i + salt) % 200 for i in range(n)]


def check_progress(reports: list[dict], total: int, cache: int, chunks: int) -> None:
    assert len(reports) == chunks + 1  # one before any chunk, then one after each
    first = reports[0]
    assert first["total"] == total and first["cache"] == first["processed"] == cache
    for before, after in zip(reports, reports[1:]):
        assert after["total"] == total and after["cache"] == cache
        assert after["processed"] > before["processed"] and after["time_ms"] >= before["time_ms"]
    assert reports[-1]["processed"] == total


def test_completion_reports_each_prefill_chunk_with_timings(app):
    n = 2 * STEP_TOKENS + 40  # three chunks when alone on the device
    status, events = app.stream("/completion", {"prompt": long_ids(n), "n_predict": 4, "return_progress": True,
                                                "timings_per_token": True, "cache_prompt": False})
    assert status == 200
    progress = [e for e in events if isinstance(e, dict) and "prompt_progress" in e]
    check_progress([e["prompt_progress"] for e in progress], n, 0, 3)
    # llama.cpp's test: the first report comes before any prompt token is computed
    first = progress[0]["timings"]
    assert first["prompt_n"] == 0 and first["prompt_ms"] == 0.0
    assert first["predicted_n"] == 0 and first["predicted_ms"] == 0.0
    prompt_ms = [e["timings"]["prompt_ms"] for e in progress]
    assert prompt_ms == sorted(prompt_ms) and prompt_ms[-1] > 0
    assert [e["timings"]["prompt_n"] for e in progress] == [e["prompt_progress"]["processed"] for e in progress]
    assert all(e["content"] == "" and e["tokens"] == [] for e in progress)
    deltas = [e for e in events if isinstance(e, dict) and e.get("tokens") and not e.get("stop")]
    assert deltas and all("timings" in e for e in deltas)
    assert [e["timings"]["predicted_n"] for e in deltas] == sorted(e["timings"]["predicted_n"] for e in deltas)
    final = events[-1]
    assert final["stop"] is True and final["timings"]["predicted_n"] == 4


def test_a_cached_prefix_is_reported_as_cache(app):
    ids = long_ids(STEP_TOKENS + 100, salt=1)
    app.post("/completion", {"prompt": ids, "n_predict": 1, "cache_prompt": True})
    longer = ids + long_ids(60, salt=2)
    status, events = app.stream("/completion", {"prompt": longer, "n_predict": 2, "return_progress": True,
                                                "cache_prompt": True})
    reports = [e["prompt_progress"] for e in events if isinstance(e, dict) and "prompt_progress" in e]
    assert reports[0]["cache"] > 0
    check_progress(reports, len(longer), reports[0]["cache"], 1)
    assert all("timings" not in e for e in events[:-1] if isinstance(e, dict))  # not asked for


def test_without_return_progress_nothing_changes(app):
    status, events = app.stream("/completion", {"prompt": long_ids(STEP_TOKENS + 10, salt=3), "n_predict": 2})
    assert status == 200 and not any("prompt_progress" in e for e in events if isinstance(e, dict))


def test_chat_and_completions_and_responses_stream_progress(app):
    text = " ".join(f"word{i % 50}" for i in range(150))
    status, events = app.stream("/v1/chat/completions", {
        "messages": [{"role": "user", "content": text}], "max_tokens": 3, "return_progress": True})
    chunks = [e for e in events if isinstance(e, dict)]
    progress = [c for c in chunks if "prompt_progress" in c]
    assert status == 200 and len(progress) >= 2
    assert progress[-1]["prompt_progress"]["processed"] == progress[-1]["prompt_progress"]["total"]
    assert all(c["choices"][0]["delta"] == {"role": "assistant", "content": None} for c in progress)
    assert chunks.index(progress[-1]) < min(i for i, c in enumerate(chunks) if c["choices"] and
                                            c["choices"][0]["delta"].get("content"))

    status, events = app.stream("/v1/completions", {"prompt": text + " again", "max_tokens": 3, "return_progress": True,
                                                    "timings_per_token": True})
    progress = [e for e in events if isinstance(e, dict) and "prompt_progress" in e]
    assert status == 200 and len(progress) >= 2 and progress[0]["choices"][0]["text"] == ""
    assert progress[-1]["prompt_progress"]["processed"] == progress[-1]["prompt_progress"]["total"]
    texts = [e for e in events if isinstance(e, dict) and "prompt_progress" not in e and e.get("choices")
             and e["choices"][0]["text"]]
    assert texts and all("timings" in e for e in texts)

    status, events = app.stream("/v1/responses", {"input": text + " once more", "max_output_tokens": 3,
                                                  "return_progress": True, "timings_per_token": True})
    progress = [e for e in events if isinstance(e, dict) and "prompt_progress" in e]
    assert status == 200 and len(progress) >= 2
    assert all(e["type"] == "response.in_progress" and e["response"]["status"] == "in_progress" for e in progress)
    assert all(e["prompt_progress"]["processed"] >= e["prompt_progress"]["cache"] for e in progress)
    assert any(e["type"] == "response.output_text.delta" and "prompt_per_second" in e["timings"] for e in events
               if isinstance(e, dict) and "timings" in e)
    done = [e for e in events if isinstance(e, dict) and e.get("type") in ("response.completed", "response.incomplete")]
    assert done and "timings" in done[0] and "usage" in done[0]["response"]
    numbers = [e["sequence_number"] for e in events if isinstance(e, dict)]
    assert numbers == list(range(len(numbers)))


def test_generation_rate_is_over_decode_steps(app):
    status, body, _ = app.post("/completion", {"prompt": "I believe", "n_predict": 1})
    t = body["timings"]
    assert t["predicted_n"] == 1 and t["predicted_per_second"] == 0.0 and t["predicted_per_token_ms"] == 0.0
    status, body, _ = app.post("/completion", {"prompt": "I believe", "n_predict": 16, "ignore_eos": True})
    t = body["timings"]
    assert t["predicted_n"] == 16
    assert abs(t["predicted_per_second"] - 1e3 / t["predicted_ms"] * 15) < 1e-6
    assert all(v is not None and v >= 0 for v in t.values()) and t["prompt_ms"] > 0 and t["prompt_per_token_ms"] > 0
