"""`GET /metrics`: the Prometheus text format, through `prometheus_client`.

Two kinds of series, one registry per app (tests build many apps in one process):
* events, counted as they happen: requests by route, method and status with their duration
  (observe.AccessLog), prompt / cached / generated tokens, time to first token and inter-token
  latency (observe.observe_events);
* state, read from the pool and its engines at scrape time (`_StateCollector`): queue depth,
  active and free slots, sessions on the device and on the host tier, prefill and decode tokens
  and device seconds, recent tok/s, the `graphs` and `attention` residency of /admin/models,
  device memory used and budget per die (/admin/dies), and the memory ladder's level.
Names follow Prometheus conventions: `pantheon_` prefix, `_total` counters, `_seconds`, `_bytes`.
Beside them, llama-server's own series (`llamacpp:prompt_tokens_total`, ...; summed over the
served models, as llama-server serves one), so dashboards built for it read Pantheon too."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from quart import Blueprint, Response, current_app

bp = Blueprint("metrics", __name__)

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)
LADDER_LEVELS = ("ok", "pressure", "critical")


class Metrics:
    def __init__(self, state):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("pantheon_requests", "HTTP requests answered, by route, method and status",
                                ("route", "method", "status"), registry=r)
        self.duration = Histogram("pantheon_request_duration_seconds", "Request duration, to the end of the body",
                                  ("route",), buckets=LATENCY_BUCKETS, registry=r)
        self.tokens = Counter("pantheon_tokens", "Tokens of finished chat requests (kind: prompt, cached, generated)",
                              ("model", "kind"), registry=r)
        self.ttft = Histogram("pantheon_time_to_first_token_seconds", "Arrival to the first generated token",
                              ("model",), buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("pantheon_inter_token_latency_seconds", "Gap between successive generated tokens",
                             ("model",), buckets=TOKEN_BUCKETS, registry=r)
        self.token_totals: dict[str, int] = {"prompt": 0, "cached": 0, "generated": 0}  # all models
        r.register(_StateCollector(state))
        r.register(_LlamaServerCollector(state, self.token_totals))

    def count_tokens(self, model: str, prompt: int, cached: int, generated: int) -> None:
        """A finished request's tokens: its prompt (cached ones included), the cached, the generated."""
        for kind, n in (("prompt", prompt), ("cached", cached), ("generated", generated)):
            self.tokens.labels(model, kind).inc(n)
            self.token_totals[kind] += n

    def request_done(self, rec: dict) -> None:
        route = rec.get("route") or "unmatched"  # the matched rule, never the raw path (bounded labels)
        self.requests.labels(route, rec.get("method") or "", str(rec.get("status", 0))).inc()
        self.duration.labels(route).observe(rec.get("duration_s", 0.0))

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _queued(sched) -> int:
    """Requests admitted but not yet decoding (the scheduler's count, or its queue if larger)."""
    return max(sched.load - len(sched.running), len(sched.waiting), 0)


class _StateCollector:
    """The server's state as gauges (and the engines' own totals as counters), read per scrape."""

    def __init__(self, state):
        self.state = state

    def describe(self):
        return []  # dynamic: nothing to check at registration

    def collect(self):
        from pantheon.engine.dies import die_budget, visible_dies
        from pantheon.web.rows import attention_object, graphs_object

        g = lambda name, doc, labels: GaugeMetricFamily(name, doc, labels=labels)  # noqa: E731
        queue = g("pantheon_queue_depth", "Requests admitted but waiting for a slot", ["model"])
        active = g("pantheon_slots_active", "Requests decoding or prefilling now", ["model"])
        free = g("pantheon_slots_free", "Requests taken now without queueing (served max_concurrent - admitted)",
                 ["model"])
        concurrency = g("pantheon_max_concurrent", "Requests decoded at once: served and configured", ["model", "kind"])
        window = g("pantheon_context_window_tokens", "Per-session window: effective and configured", ["model", "kind"])
        sessions = g("pantheon_sessions", "Live sessions by where their KV is (tier: device, host)", ["model", "tier"])
        host_bytes = g("pantheon_session_host_bytes", "Bytes of idle sessions parked on the host tier", ["model"])
        rate = g("pantheon_tokens_per_second", "Device-time throughput over the last minute (phase: prefill, decode)",
                 ["model", "phase"])
        work_tokens = CounterMetricFamily("pantheon_engine_tokens", "Tokens the device processed (phase: prefill, "
                                          "decode)", labels=["model", "phase"])
        work_seconds = CounterMetricFamily("pantheon_engine_step_seconds", "Device-step seconds (phase: prefill, "
                                           "decode; decode includes mixed steps)", labels=["model", "phase"])
        graphs = g("pantheon_graphs", "Compiled step-graph residency (/admin/models graphs)", ["model", "state"])
        attention = g("pantheon_attention_layers", "Attention-path residency (/admin/models attention)",
                      ["model", "state"])
        ladder = g("pantheon_memory_ladder_level", "Memory ladder: 1 for the current level", ["model", "level"])
        failed_steps = CounterMetricFamily("pantheon_failed_steps", "Device steps that failed", labels=["model"])
        for entry in self.state.pool.ready():
            e, name = entry.engine, entry.config.name
            sched = e.scheduler
            running = len(sched.running)
            queue.add_metric([name], _queued(sched))
            active.add_metric([name], running)
            free.add_metric([name], e.free_slots)
            concurrency.add_metric([name, "served"], e.max_concurrent)
            concurrency.add_metric([name, "configured"], e.max_concurrent_configured)
            window.add_metric([name, "effective"], e.effective_ctx)
            window.add_metric([name, "configured"], e.ctx_configured)
            tiers = e.table.tiers()
            sessions.add_metric([name, "device"], tiers["on_device"])
            sessions.add_metric([name, "host"], tiers["on_host"])
            host_bytes.add_metric([name], tiers["host_bytes"])
            for phase in ("prefill", "decode"):
                rate.add_metric([name, phase], e.throughput.rate(phase))
                work_tokens.add_metric([name, phase], e.throughput.tokens[phase])
                work_seconds.add_metric([name, phase], e.throughput.seconds[phase])
            for key, value in (graphs_object(e, True) or {}).items():
                if isinstance(value, int) and key not in ("captures", "capture_failures"):
                    graphs.add_metric([name, key], value)
            for key, value in (attention_object(e, True) or {}).items():
                if isinstance(value, int):
                    attention.add_metric([name, key], value)
            level = e.ladder.level()
            for lv in LADDER_LEVELS:
                ladder.add_metric([name, lv], 1.0 if lv == level else 0.0)
            failed_steps.add_metric([name], sched.failed_steps)
        yield from (queue, active, free, concurrency, window, sessions, host_bytes, rate, work_tokens, work_seconds,
                    graphs, attention, ladder, failed_steps)

        used = g("pantheon_device_memory_used_bytes", "Bytes the loaded models hold per die", ["die"])
        budget = g("pantheon_device_memory_budget_bytes", "Each die's budget (vram_budget)", ["die"])
        per_die: dict = {}
        for entry in self.state.pool.ready():
            for dev, n in entry.engine.bytes_per_device().items():
                per_die[dev] = per_die.get(dev, 0) + n
        for d in visible_dies():
            used.add_metric([str(d.index)], per_die.get(d.device_id, 0))
            budget.add_metric([str(d.index)], die_budget(d))
        yield used
        yield budget


class _LlamaServerCollector:
    """llama-server's /metrics series (its names, their meaning as it counts them), read per scrape:
    prompt tokens computed (cached ones not) and their device seconds, tokens generated and theirs,
    the average rates, requests decoding and waiting, prompt tokens reused from the cache and
    their share of the prompt tokens."""

    def __init__(self, state, totals: dict[str, int]):
        self.state, self.totals = state, totals

    def describe(self):
        return []

    def collect(self):
        engines = [entry.engine for entry in self.state.pool.ready()]
        prefill_s = sum(e.throughput.seconds["prefill"] for e in engines)
        decode_s = sum(e.throughput.seconds["decode"] for e in engines)
        prompt, cached, generated = self.totals["prompt"], self.totals["cached"], self.totals["generated"]
        computed = prompt - cached
        running = sum(len(e.scheduler.running) for e in engines)
        waiting = sum(_queued(e.scheduler) for e in engines)
        for name, doc, value, kind in (
                ("prompt_tokens_total", "Number of prompt tokens processed.", computed, CounterMetricFamily),
                ("prompt_seconds_total", "Prompt process time", prefill_s, CounterMetricFamily),
                ("tokens_predicted_total", "Number of generation tokens processed.", generated, CounterMetricFamily),
                ("tokens_predicted_seconds_total", "Predict process time", decode_s, CounterMetricFamily),
                ("prompt_tokens_cache_total", "Number of prompt tokens reused from the cache.", cached,
                 CounterMetricFamily),
                ("prompt_tokens_seconds", "Average prompt throughput in tokens/s.",
                 sum(e.throughput.tokens["prefill"] for e in engines) / prefill_s if prefill_s else 0.0,
                 GaugeMetricFamily),
                ("predicted_tokens_seconds", "Average generation throughput in tokens/s.",
                 sum(e.throughput.tokens["decode"] for e in engines) / decode_s if decode_s else 0.0,
                 GaugeMetricFamily),
                ("prompt_cache_hit_ratio", "Prompt tokens reused from the cache over prompt tokens.",
                 cached / prompt if prompt else 0.0, GaugeMetricFamily),
                ("requests_processing", "Number of requests processing.", running, GaugeMetricFamily),
                ("requests_deferred", "Number of requests deferred.", waiting, GaugeMetricFamily)):
            family = kind(f"llamacpp:{name.removesuffix('_total') if kind is CounterMetricFamily else name}", doc)
            family.add_metric([], value)
            yield family


@bp.route("/metrics", methods=["GET"])
async def metrics():
    state = current_app.pantheon
    return Response(state.metrics.render(), content_type=CONTENT_TYPE_LATEST,
                    headers={"Process-Start-Time-Unix": str(state.started)})
