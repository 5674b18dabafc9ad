"""What the server tells its operator about each request: the access log, the per-request record
behind it, and the request metrics (pantheon/web/metrics.py).

`AccessLog` wraps the Quart app as ASGI middleware, so it sees every request the way the client
does: the status line actually sent, and the end of the body — for a stream, when its last chunk
went out or the client went away. It gives each request a record (`scope["pantheon.record"]`) that
the routes fill as they learn things (`note`: model, session; `observe_events`: tokens, finish
reason, time to first token; `errors.error_response`: the error type), then writes one line per
request to the `pantheon.access` logger — text or JSON (`--log-format`), none with `--quiet` — and
counts it in the metrics. The per-request timing breakdown (queue wait, render+tokenize, prefill,
decode, detok) goes to the `pantheon.trace` logger at DEBUG."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from datetime import datetime, timezone

from pantheon.engine.memory import release_free_memory

access_log = logging.getLogger("pantheon.access")
trace_log = logging.getLogger("pantheon.trace")
RECORD = "pantheon.record"
FORMATS = ("text", "json", "off")


def current_record() -> dict | None:
    """The record of the request being handled (None outside a request)."""
    from quart import has_request_context, request

    return request.scope.get(RECORD) if has_request_context() else None


def note(**fields) -> None:
    """Add fields to the current request's record (no-op outside a request)."""
    rec = current_record()
    if rec is not None:
        rec.update({k: v for k, v in fields.items() if v is not None})


def mark(name: str) -> None:
    """Time a phase of the current request (seconds since it arrived), for the trace line."""
    rec = current_record()
    if rec is not None:
        rec.setdefault("marks", {})[name] = time.perf_counter() - rec["_t0"]


async def observe_events(events, rec: dict | None, metrics=None):
    """Pass the engine's events through, noting on `rec` what the access log and metrics report:
    time to first token, inter-token gaps, finish reasons, token counts, an error type. Closing
    this generator closes `events` (the engine then cancels the request)."""
    from pantheon.engine.events import Admitted, ChoiceEnd, Delta, RequestEnd, RequestError

    rec = rec if rec is not None else {"_t0": time.perf_counter()}
    model = rec.get("model", "")
    last = None
    try:
        async for ev in events:
            now = time.perf_counter()
            if isinstance(ev, Admitted):
                rec.setdefault("marks", {})["admitted"] = now - rec["_t0"]
            elif isinstance(ev, Delta) and (ev.tokens or ev.content or ev.reasoning or ev.tool_calls):
                if last is None:
                    rec["ttft_s"] = now - rec["_t0"]
                    rec.setdefault("marks", {})["first_token"] = rec["ttft_s"]
                    if metrics:
                        metrics.ttft.labels(model).observe(rec["ttft_s"])
                elif metrics:
                    n = max(len(ev.tokens), 1)
                    for _ in range(n):
                        metrics.itl.labels(model).observe((now - last) / n)
                last = now
            elif isinstance(ev, ChoiceEnd):
                rec.setdefault("finish", []).append(ev.finish_reason)
            elif isinstance(ev, RequestEnd):
                rec.update(prompt_tokens=ev.prompt_tokens, cached_tokens=ev.cached_tokens,
                           completion_tokens=ev.completion_tokens)
                rec.setdefault("marks", {})["end"] = now - rec["_t0"]
                rec["timing"] = ev.timing
                if metrics:
                    metrics.count_tokens(model, ev.prompt_tokens, ev.cached_tokens, ev.completion_tokens)
            elif isinstance(ev, RequestError):
                rec["error"] = ev.type
            yield ev
    finally:
        await events.aclose()


def _line(rec: dict, fmt: str) -> str:
    finish = rec.get("finish")
    fields = {"time": datetime.fromtimestamp(rec["_wall"], timezone.utc).isoformat(timespec="milliseconds"),
              "method": rec.get("method"), "path": rec.get("path"), "status": rec.get("status"),
              "duration_s": round(rec.get("duration_s", 0.0), 4), "model": rec.get("model"),
              "session": rec.get("session"), "prompt_tokens": rec.get("prompt_tokens"),
              "cached_tokens": rec.get("cached_tokens"), "completion_tokens": rec.get("completion_tokens"),
              "finish_reason": ",".join(dict.fromkeys(finish)) if finish else None,
              "ttft_s": round(rec["ttft_s"], 4) if "ttft_s" in rec else None, "error": rec.get("error"),
              "client": rec.get("client")}
    if fmt == "json":
        return json.dumps({k: v for k, v in fields.items() if v is not None}, separators=(",", ":"))
    head = f'{fields["time"]} {fields["client"] or "-"} "{fields["method"]} {fields["path"]}" {fields["status"]} ' \
           f'{fields["duration_s"]:.3f}s'
    rest = " ".join(f"{k}={v}" for k, v in fields.items()
                    if v is not None and k not in ("time", "method", "path", "status", "duration_s", "client"))
    return f"{head} {rest}".rstrip()


def configure_access_log(fmt: str) -> None:
    """Make the access lines visible however the server runs (`pantheon serve` or plain
    `hypercorn pantheon.web:app`, where nobody configures logging): a stderr handler of its own,
    unless the application already gave the logger one."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown access log format {fmt!r} ({', '.join(FORMATS)})")
    access_log.disabled = fmt == "off"
    if fmt != "off" and not access_log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        access_log.addHandler(handler)
        access_log.setLevel(logging.INFO)
        access_log.propagate = False


LARGE_BODY_BYTES = 16 << 20  # a request body past this (a session blob) returns its memory when it ends


class AccessLog:
    """ASGI middleware: one record per HTTP request, logged and counted when the response ends."""

    def __init__(self, app, fmt: str = "text", metrics=None):
        self.app, self.fmt, self.metrics = app, fmt, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        client = scope.get("client")
        rec = scope[RECORD] = {"_t0": time.perf_counter(), "_wall": time.time(), "method": scope.get("method"),
                               "path": scope.get("path"), "client": f"{client[0]}:{client[1]}" if client else None}

        async def sending(message):
            if message["type"] == "http.response.start":
                rec["status"] = message["status"]
            await send(message)

        received = 0

        async def receiving():
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            return message

        try:
            await self.app(scope, receive if scope.get("method") in ("GET", "HEAD") else receiving, sending)
        except BaseException:
            rec.setdefault("status", 500)
            rec.setdefault("error", "disconnected" if rec.get("status") != 500 else "server_error")
            raise
        finally:
            rec["duration_s"] = time.perf_counter() - rec["_t0"]
            self.finish(rec)
            if received > LARGE_BODY_BYTES:  # its buffers are freed now: give the pages back to the OS
                asyncio.get_running_loop().run_in_executor(None, release_free_memory)

    def finish(self, rec: dict) -> None:
        if self.metrics:
            self.metrics.request_done(rec)
        if self.fmt != "off":
            access_log.info(_line(rec, self.fmt))
        if trace_log.isEnabledFor(logging.DEBUG) and rec.get("marks"):
            trace_log.debug("%s %s %s", rec.get("method"), rec.get("path"), json.dumps(breakdown(rec)))


# (field, from mark, to mark) of the trace line; "arrived" is 0, the others are set as they happen
SPANS = (("render_tokenize_ms", "arrived", "planned"), ("queue_wait_ms", "planned", "admitted"),
         ("prefill_to_first_token_ms", "admitted", "first_token"), ("decode_ms", "first_token", "end"))


def breakdown(rec: dict) -> dict:
    """The request's timing, in milliseconds: arrival -> planned (render + tokenize), -> admitted
    (queue wait for a slot), -> first token (prefill), -> last event (decode + detok), and the
    engine's own split where it reported one (`timing`)."""
    marks = {"arrived": 0.0, **rec.get("marks", {})}
    out = {name: round((marks[b] - marks[a]) * 1e3, 2) for name, a, b in SPANS if a in marks and b in marks}
    out.update(rec.get("timing") or {})
    out["total_ms"] = round(rec.get("duration_s", 0.0) * 1e3, 2)
    return out
