"""What an operator sees (pantheon/web/observe.py, metrics.py, dashboard.py), in process on a tiny model:

* the access log: exactly one parseable line per request — streamed, refused (400/404 with the
  error type), admin and metrics scrapes included — with model, session, token counts, finish
  reason; text and JSON formats; `--quiet` / `--log-format` reach the config;
* `GET /metrics` scraped with prometheus_client's own parser: request counters by route and
  status, token counters and TTFT/inter-token histograms moved by exactly what the requests did,
  and the state gauges (slots, sessions, graphs/attention residency, per-die memory, ladder);
* the per-request timing breakdown on the `pantheon.trace` debug logger;
* `/admin/ui`: the static page, served without the admin token (its script sends it), while the
  data routes still need it.
A live server's log (tests/web/test_observability_live.py) checks the same line end to end."""

from __future__ import annotations

import json
import logging
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pantheon.cli import build_parser
from pantheon.web.serve import config_from_args
from tests.fixtures.tiny_models import write_tiny_llama
from tests.web.inprocess import InProcessApp

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4,
        "temperature": 0}


class Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    path = write_tiny_llama(tmp_path_factory.mktemp("obs") / "tiny.gguf")
    server = InProcessApp([(str(path), "tiny")], access_log="json")
    yield server
    server.close()


@pytest.fixture
def access(app):
    handler = Lines()
    logger = logging.getLogger("pantheon.access")
    logger.addHandler(handler)
    yield handler.lines
    logger.removeHandler(handler)


def get(app, path, headers=None):
    async def go():
        r = await app.client.get(path, headers=headers or {})
        return r.status_code, (await r.get_data()).decode(), dict(r.headers)

    return app.run(go())


def scrape(app) -> dict:
    """{(name, frozenset(labels)): value} from /metrics, parsed by prometheus_client."""
    status, text, headers = get(app, "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    # llama-server's header: when the process started, unix seconds
    assert 0 < time.time() - int(headers["process-start-time-unix"]) < 3600
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(samples, name, **labels) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def test_access_log_has_one_json_line_per_request(app, access):
    status, body, _ = app.post("/v1/chat/completions", CHAT, {"X-Session-Id": "obs-1"})
    assert status == 200
    status, events = app.stream("/v1/chat/completions", CHAT)
    assert status == 200 and events[-1] == "[DONE]"
    assert app.post("/v1/chat/completions", {"model": "tiny", "messages": "nope"})[0] == 400
    assert get(app, "/v1/models")[0] == 200
    assert get(app, "/no/such/route")[0] == 404
    lines = [json.loads(line) for line in access]
    assert [(r["method"], r["path"], r["status"]) for r in lines] == [
        ("POST", "/v1/chat/completions", 200), ("POST", "/v1/chat/completions", 200),
        ("POST", "/v1/chat/completions", 400), ("GET", "/v1/models", 200), ("GET", "/no/such/route", 404)]
    first, streamed = lines[0], lines[1]
    usage = body["usage"]
    assert first["model"] == "tiny" and first["session"] == "obs-1"
    assert (first["prompt_tokens"], first["completion_tokens"], first["cached_tokens"]) == (
        usage["prompt_tokens"], usage["completion_tokens"], usage["prompt_tokens_details"]["cached_tokens"])
    assert first["finish_reason"] == body["choices"][0]["finish_reason"]
    assert first["duration_s"] >= first["ttft_s"] > 0
    assert streamed["completion_tokens"] >= 1 and streamed["finish_reason"] in ("stop", "length")
    assert lines[2]["error"] == "invalid_request_error" and "model" not in lines[2]
    assert lines[4]["error"] == "not_found"
    assert all("time" in r and "duration_s" in r for r in lines)


def test_metrics_count_what_the_requests_did(app):
    before = scrape(app)
    # a prompt no earlier test sent: a repeated one would find all but its last token cached, and
    # that token goes through a decode step (no prefill phase at all)
    fresh = dict(CHAT, messages=[{"role": "user", "content": "count these metrics, please"}])
    status, body, _ = app.post("/v1/chat/completions", fresh)
    assert status == 200
    assert app.post("/v1/chat/completions", {"model": "tiny"})[0] == 400
    after = scrape(app)
    route = "/v1/chat/completions"
    delta = lambda name, **labels: value(after, name, **labels) - value(before, name, **labels)  # noqa: E731
    assert delta("pantheon_requests_total", route=route, method="POST", status="200") == 1
    assert delta("pantheon_requests_total", route=route, method="POST", status="400") == 1
    assert delta("pantheon_requests_total", route="/metrics", method="GET", status="200") == 1  # the first scrape
    usage = body["usage"]
    assert delta("pantheon_tokens_total", model="tiny", kind="prompt") == usage["prompt_tokens"]
    assert delta("pantheon_tokens_total", model="tiny", kind="generated") == usage["completion_tokens"]
    assert delta("pantheon_time_to_first_token_seconds_count", model="tiny") == 1
    assert delta("pantheon_inter_token_latency_seconds_count", model="tiny") == usage["completion_tokens"] - 1
    assert delta("pantheon_request_duration_seconds_count", route=route) == 2
    assert delta("pantheon_engine_tokens_total", model="tiny", phase="decode") >= usage["completion_tokens"] - 1
    assert delta("pantheon_engine_tokens_total", model="tiny", phase="prefill") >= 1
    engine = app.engine("tiny")
    assert value(after, "pantheon_slots_free", model="tiny") == engine.max_concurrent
    assert value(after, "pantheon_slots_active", model="tiny") == 0
    assert value(after, "pantheon_max_concurrent", model="tiny", kind="configured") == engine.max_concurrent_configured
    assert value(after, "pantheon_context_window_tokens", model="tiny", kind="effective") == engine.effective_ctx
    graphs = engine.registry.counters()
    assert value(after, "pantheon_graphs", model="tiny", state="live") == graphs["live"] > 0
    assert value(after, "pantheon_graphs", model="tiny", state="failed") == 0
    att = engine.runner.attention.counters(True)
    assert value(after, "pantheon_attention_layers", model="tiny", state="total") == att["total"]
    assert value(after, "pantheon_memory_ladder_level", model="tiny", level="ok") == 1
    assert value(after, "pantheon_device_memory_budget_bytes", die="0") > 0
    assert value(after, "pantheon_device_memory_used_bytes", die="0") == sum(engine.bytes_per_device().values())
    assert value(after, "pantheon_tokens_per_second", model="tiny", phase="decode") > 0


def test_llama_servers_series_read_the_same_counts(app):
    """llama-server's names (`llamacpp:*`) beside ours: prompt tokens computed and reused, tokens
    generated, their device seconds and rates, requests running and waiting."""
    req = {"prompt": "the llama-server metrics, twice", "n_predict": 3, "temperature": 0, "model": "tiny"}
    before = scrape(app)
    first, second = app.post("/completion", req)[1], app.post("/completion", req)[1]
    after = scrape(app)
    delta = lambda name, **labels: value(after, name, **labels) - value(before, name, **labels)  # noqa: E731
    assert second["timings"]["cache_n"] > 0
    cached = first["timings"]["cache_n"] + second["timings"]["cache_n"]
    computed = first["timings"]["prompt_n"] + second["timings"]["prompt_n"]
    assert delta("llamacpp:prompt_tokens_cache_total") == cached == delta("pantheon_tokens_total", model="tiny",
                                                                            kind="cached")
    assert delta("llamacpp:prompt_tokens_total") == computed
    assert delta("llamacpp:tokens_predicted_total") == 6
    prompt = value(after, "pantheon_tokens_total", model="tiny", kind="prompt")
    assert value(after, "llamacpp:prompt_cache_hit_ratio") == pytest.approx(
        value(after, "pantheon_tokens_total", model="tiny", kind="cached") / prompt)
    engine = app.engine("tiny")
    assert value(after, "llamacpp:tokens_predicted_seconds_total") == pytest.approx(engine.throughput.seconds["decode"])
    assert value(after, "llamacpp:predicted_tokens_seconds") > 0 and value(after, "llamacpp:prompt_tokens_seconds") > 0
    assert value(after, "llamacpp:requests_processing") == 0 == value(after, "llamacpp:requests_deferred")


def test_sessions_show_by_tier(app):
    assert app.post("/v1/chat/completions", CHAT, {"X-Session-Id": "obs-tier"})[0] == 200
    assert value(scrape(app), "pantheon_sessions", model="tiny", tier="device") >= 1


def test_trace_breakdown_explains_a_request(app):
    handler = Lines()
    logger = logging.getLogger("pantheon.trace")
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    # a prompt no other test sent: a wholly cached prompt would prefill no chunk at all
    body = {**CHAT, "messages": [{"role": "user", "content": "a prompt only the trace test sends"}]}
    try:
        assert app.post("/v1/chat/completions", body)[0] == 200
    finally:
        logger.removeHandler(handler)
        logger.setLevel(logging.NOTSET)
    line = next(x for x in handler.lines if x.startswith("POST /v1/chat/completions"))
    parts = json.loads(line.split(" ", 2)[2])
    for key in ("render_tokenize_ms", "queue_wait_ms", "prefill_to_first_token_ms", "decode_ms", "prefill_chunks",
                "prefill_ms", "decode_steps", "decode_step_ms", "detok_ms", "total_ms"):
        assert key in parts, key
    assert parts["prefill_chunks"] >= 1 and parts["decode_steps"] >= 1


def test_text_format_and_flags(tmp_path):
    from pantheon.web.observe import _line

    rec = {"_wall": 0.0, "method": "POST", "path": "/v1/chat/completions", "status": 429, "duration_s": 0.0123,
           "model": "m", "error": "server_busy", "client": "127.0.0.1:5"}
    text = _line(rec, "text")
    assert text.startswith('1970-01-01T00:00:00.000+00:00 127.0.0.1:5 "POST /v1/chat/completions" 429 0.012s')
    assert "model=m" in text and "error=server_busy" in text
    parser = build_parser()
    assert config_from_args(parser.parse_args(["serve", "--quiet"])).access_log == "off"
    assert config_from_args(parser.parse_args(["serve", "--log-format", "json"])).access_log == "json"
    assert config_from_args(parser.parse_args(["serve"])).access_log == "text"


def test_quiet_writes_no_lines(tmp_path, access):
    server = InProcessApp([], access_log="off")
    try:
        assert get(server, "/")[0] == 200
    finally:
        server.close()
    assert access == []


def test_dashboard_page_is_served_without_the_token(tmp_path):
    server = InProcessApp([], admin_token="tok")
    try:
        status, html, headers = get(server, "/admin/ui")
        assert status == 200 and headers["content-type"].startswith("text/html")
        assert "/admin/models" in html and "/metrics" in html and "Authorization" in html
        assert "http://" not in html and "https://" not in html  # nothing from a CDN
        assert get(server, "/admin/models")[0] == 401
        assert get(server, "/admin/models", {"Authorization": "Bearer tok"})[0] == 200
    finally:
        server.close()
