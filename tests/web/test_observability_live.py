"""The access log and /metrics of a live `pantheon serve` (the shared SmolLM2 server): hypercorn
serving, the line written to the process's stderr in the default text format, one per request
including a refused one, and /metrics parsed by prometheus_client after real client traffic."""

from __future__ import annotations

import re
import time
import uuid

import httpx
from prometheus_client.parser import text_string_to_metric_families


def test_live_server_logs_each_request_and_counts_it(smol_server):
    session = f"live-{uuid.uuid4().hex[:8]}"
    ok = httpx.post(smol_server.url + "/v1/chat/completions", timeout=120, headers={"X-Session-Id": session},
                    json={"model": "smol", "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 3})
    assert ok.status_code == 200
    bad = httpx.post(smol_server.url + "/v1/chat/completions", timeout=30, json={"model": "smol", "messages": 7})
    assert bad.status_code == 400
    usage = ok.json()["usage"]
    deadline = time.time() + 10
    while time.time() < deadline and session not in smol_server.log():
        time.sleep(0.1)
    lines = [x for x in smol_server.log().splitlines() if '"POST /v1/chat/completions"' in x]
    mine = [x for x in lines if f"session={session}" in x]
    assert len(mine) == 1
    assert re.search(rf'"POST /v1/chat/completions" 200 [\d.]+s model=smol session={session} '
                     rf'prompt_tokens={usage["prompt_tokens"]} cached_tokens=\d+ completion_tokens='
                     rf'{usage["completion_tokens"]} finish_reason=\w+ ttft_s=[\d.]+', mine[0]), mine[0]
    assert any('" 400 ' in x and "error=invalid_request_error" in x for x in lines)

    families = {f.name: f for f in text_string_to_metric_families(httpx.get(smol_server.url + "/metrics").text)}
    requests = {tuple(sorted(s.labels.items())): s.value for s in families["pantheon_requests"].samples
                if s.name == "pantheon_requests_total"}
    assert requests[(("method", "POST"), ("route", "/v1/chat/completions"), ("status", "400"))] >= 1
    assert requests[(("method", "POST"), ("route", "/v1/chat/completions"), ("status", "200"))] >= 1
    ttft = [s for s in families["pantheon_time_to_first_token_seconds"].samples
            if s.name.endswith("_count") and s.labels["model"] == "smol"]
    assert ttft and ttft[0].value >= 1
