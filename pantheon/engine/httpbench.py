"""`pantheon bench --concurrency 1,4,8 [--against URL]`: aggregate decode throughput and time to
first token per concurrency level, measured over HTTP (streaming) as clients see it — against one
server, or against Pantheon and another OpenAI-compatible server (e.g. llama-server) in alternation,
with the ratios. Beside the levels: the time to first token of one long (~1500-token) prompt, and
each local server's resident memory after warm-up and at its peak (`/proc/PID/status`, the process
found by the port it listens on), and this machine's memory read bandwidth before and after the
levels (`memory_read_gbs`).

Every client streams a distinct prompt with the end-of-generation tokens banned by `logit_bias`, so
each request decodes exactly the asked number of tokens on either server; a level is run `runs`
times per server (alternating servers run by run) and the median run is reported."""

from __future__ import annotations

import json
import os
import secrets
import statistics
import threading
import time
from dataclasses import asdict, dataclass

import httpx
import numpy as np

TOPICS = ("a lighthouse keeper who finds a message in a bottle", "a cartographer mapping a city that moves",
          "two rival bakers in a mountain village", "a robot learning to garden", "a violinist who loses her hearing",
          "a ship's cat on a long voyage", "an astronomer who discovers a new comet",
          "a librarian guarding a forbidden book", "a child who can talk to rivers", "a retired detective's last case",
          "a beekeeper during a drought", "a train that never stops", "a painter who only paints doors",
          "twins separated by an ocean", "a chess player and a ghost", "the last clockmaker in Prague")


# Drawn once per process and put first in every prompt: a server's prompt cache (llama-server keeps
# finished prompts in host memory) cannot serve a prompt from an earlier bench run.
RUN_TAG = secrets.token_hex(4)


def prompt_for(i: int) -> str:
    return f"[{RUN_TAG}] Write a long story about {TOPICS[i % len(TOPICS)]}." + (f" Part {i // len(TOPICS) + 1}." if i >= len(TOPICS) else "")


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


# A base model without a chat template is measured through /v1/completions with the prompt as raw
# text (both servers serve it); everything else through chat completions (pantheon bench sets this).
RAW_COMPLETIONS = False


class BenchError(RuntimeError):
    """A measured request failed: the server and the first failure, in one line."""


REQUEST_ERRORS = (httpx.HTTPError, OSError, ValueError, KeyError)  # refused, HTTP status, bad stream


def _one(url: str, model: str | None, max_tokens: int, logit_bias: dict, prompt: str, out: list,
         usage_out: dict | None = None) -> None:
    body = {"max_tokens": max_tokens, "temperature": 0.7, "stream": True, "stream_options": {"include_usage": True},
            "logit_bias": logit_bias}
    body.update({"prompt": prompt} if RAW_COMPLETIONS else {"messages": [{"role": "user", "content": prompt}]})
    if model:
        body["model"] = model
    t0 = time.perf_counter()
    first, tokens, chunks = None, 0, 0
    route = "/v1/completions" if RAW_COMPLETIONS else "/v1/chat/completions"
    with httpx.stream("POST", url + route, json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            ev = json.loads(line[6:])
            choice = ev["choices"][0] if ev.get("choices") else {}
            if choice.get("text") or choice.get("delta", {}).get("content"):
                chunks += 1
                if first is None:
                    first = time.perf_counter()
            if ev.get("usage"):
                tokens = ev["usage"]["completion_tokens"]
                if usage_out is not None:
                    usage_out.update(ev["usage"])
    end = time.perf_counter()
    out.append((t0, (first or end) - t0, end, tokens or chunks))


def run_level(url: str, concurrency: int, max_tokens: int, logit_bias: dict, model: str | None = None,
              rounds: int = 1, first_prompt: int = 0) -> LevelResult:
    """`concurrency` streaming clients at once (each with its own prompt), `rounds` times."""
    results: list = []
    errors: list[str] = []

    def client(prompt: str) -> None:  # a failed request is counted and named, not a thread's traceback
        try:
            _one(url, model, max_tokens, logit_bias, prompt, results)
        except REQUEST_ERRORS as e:
            errors.append(f"{type(e).__name__}: {e}")

    start = time.perf_counter()
    for r in range(rounds):
        threads = [threading.Thread(target=client, args=(prompt_for(first_prompt + r * concurrency + i),))
                   for i in range(concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    if len(results) != concurrency * rounds:
        first = f" (first: {errors[0]})" if errors else ""
        raise BenchError(f"{url}: {concurrency * rounds - len(results)} request(s) failed{first}")
    wall = time.perf_counter() - start
    tokens = sum(r[3] for r in results)
    ttfts = sorted(r[1] for r in results)
    per_stream = statistics.mean(r[3] / max(r[2] - r[0] - r[1], 1e-9) for r in results)
    p95 = ttfts[min(len(ttfts) - 1, int(round(0.95 * (len(ttfts) - 1))))]
    return LevelResult(concurrency, len(results), tokens, wall, tokens / wall, per_stream,
                       1000 * statistics.median(ttfts), 1000 * p95)


# Words of the long prompt: varied enough that neither server's tokenizer collapses them.
_WORDS = ("river", "lantern", "copper", "orchard", "violet", "harbor", "meadow", "thunder", "quiet", "marble",
          "falcon", "ember", "willow", "compass", "velvet", "glacier", "saffron", "timber", "echo", "prairie")


def long_prompt_for(i: int, n_words: int) -> str:
    """A distinct long prompt: its first words name i, so no server's prefix cache serves it, and the
    rest is the same list for every i, so each server prefills as many tokens (the list once moved
    with i: 1371 tokens against 1251 for the 1 B's two servers, a TTFT ratio 9 % off)."""
    words = [_WORDS[(j * (j % 5 + 1)) % len(_WORDS)] for j in range(n_words)]
    return f"[{RUN_TAG}] Request {i:05d}: summarize this list. " + " ".join(words)


@dataclass
class LongPromptResult:
    prompt_tokens: int
    ttft_ms: float


def long_prompt_ttft(url: str, n_words: int, logit_bias: dict, model: str | None = None, index: int = 0) -> LongPromptResult:
    """One streaming request with a long prompt alone on the server: time to its first token."""
    out: list = []
    try:
        _one(url, model, 2, logit_bias, long_prompt_for(index, n_words), out, usage_out := {})
    except REQUEST_ERRORS as e:
        raise BenchError(f"{url}: the long prompt failed ({type(e).__name__}: {e})") from None
    return LongPromptResult(usage_out.get("prompt_tokens", 0), 1000 * out[0][1])


def start_server(path: str, concurrency: int, serve_args: list[str]):
    """`pantheon serve` of `path` on a free local port, for `concurrency` clients at once (as many
    sessions), with `serve_args` beside; returns (process, url) once it lists the model."""
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "pantheon", "serve", "--model", path, "--port", str(port),
           "--max-concurrent", str(concurrency), "--max-sessions", str(concurrency), *serve_args]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/v1/models", timeout=2).json()["data"]:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError("the bench server exited during start-up")
        time.sleep(0.5)
    proc.terminate()
    raise RuntimeError("the bench server did not come up in 300 s")


def local_pid(url: str) -> int | None:
    """The pid of the local process listening on url's port (Linux /proc), or None."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    if parts.hostname not in ("127.0.0.1", "localhost", "::1") or not parts.port:
        return None
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                for line in list(f)[1:]:
                    cols = line.split()
                    if cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == parts.port:  # LISTEN
                        inodes.add(cols[9])
        except OSError:
            continue
    if not inodes:
        return None
    targets = {f"socket:[{i}]" for i in inodes}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                if os.readlink(f"/proc/{pid}/fd/{fd}") in targets:
                    return int(pid)
        except OSError:
            continue
    return None


def memory_of(pid: int | None) -> dict[str, float]:
    """{"rss_mib", "peak_rss_mib"} of a local process (VmRSS, VmHWM), or {} when it cannot be read."""
    if pid is None:
        return {}
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        return {"rss_mib": int(fields["VmRSS"].split()[0]) / 1024, "peak_rss_mib": int(fields["VmHWM"].split()[0]) / 1024}
    except (OSError, KeyError, ValueError):
        return {}


def memory_read_gbs(mib: int = 512, passes: int = 3) -> dict[str, float]:
    """This machine's memory read bandwidth now: one thread per usable core reading its share of a
    fresh `mib` MiB array (numpy's reductions release the GIL), the best of `passes`. Decode streams
    every weight once a token, and a VM's bandwidth can move by 2x between minutes, so the bench
    reads it before and after the levels: a ratio from runs minutes apart is read beside it."""
    threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    data = np.ones((mib << 20) // 8, np.int64)  # written once: every page is resident before timing
    parts = np.array_split(data, threads)
    best = 0.0
    for _ in range(passes):
        workers = [threading.Thread(target=np.bitwise_xor.reduce, args=(part,)) for part in parts]
        t0 = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        best = max(best, data.nbytes / (time.perf_counter() - t0) / 1e9)
    return {"gb_per_s": round(best, 1), "threads": threads}


def median_run(runs: list[LevelResult]) -> LevelResult:
    """The run with the median aggregate throughput (its TTFTs come with it)."""
    return sorted(runs, key=lambda r: r.aggregate_tok_s)[len(runs) // 2]


def run_order(servers: dict[str, str], run: int) -> list[tuple[str, str]]:
    """The servers in the order run `run` measures them: as given on even runs, reversed on odd ones."""
    order = list(servers.items())
    return order if run % 2 == 0 else order[::-1]


def compare(servers: dict[str, str], levels: list[int], max_tokens: int, logit_bias: dict, runs: int = 3,
            models: dict[str, str | None] | None = None) -> dict[str, list[LevelResult]]:
    """{server name: url} -> {server name: [median LevelResult per level]}. Each level: one short
    warm-up per server, then `runs` measured runs, the servers alternating run by run and which goes
    first alternating too (A B, B A, ...: a machine whose memory bandwidth drifts within a level hits
    both alike, not the second server always later); distinct prompts in every run."""
    models = models or {}
    out: dict[str, list[LevelResult]] = {name: [] for name in servers}
    prompt = 0
    for level in levels:
        for name, url in servers.items():
            run_level(url, level, 8, logit_bias, models.get(name), first_prompt=prompt)
        prompt += level
        measured: dict[str, list[LevelResult]] = {name: [] for name in servers}
        for run in range(runs):
            for name, url in run_order(servers, run):
                measured[name].append(run_level(url, level, max_tokens, logit_bias, models.get(name),
                                                first_prompt=prompt))
            prompt += level
        for name in servers:
            out[name].append(median_run(measured[name]))
    return out


def long_prompts(servers: dict[str, str], n_words: int, logit_bias: dict, runs: int = 3,
                 models: dict[str, str | None] | None = None, first: int = 1000) -> dict[str, LongPromptResult]:
    """{server name: the median of `runs` long-prompt TTFTs}, servers alternating as in `compare`, a
    distinct prompt each."""
    models = models or {}
    got: dict[str, list[LongPromptResult]] = {name: [] for name in servers}
    for r in range(runs):
        for i, (name, url) in enumerate(run_order(servers, r)):
            got[name].append(long_prompt_ttft(url, n_words, logit_bias, models.get(name), first + r * len(servers) + i))
    return {name: sorted(rs, key=lambda x: x.ttft_ms)[len(rs) // 2] for name, rs in got.items()}


def server_table(names: list[str], long: dict[str, LongPromptResult], warm: dict[str, dict], end: dict[str, dict]) -> str:
    """Per server: the long prompt's TTFT, RSS after warm-up, RSS and peak RSS at the end (MiB);
    with two servers, the first's ratio to the second's."""
    def cell(v):
        return f"{v:>12.0f}" if isinstance(v, (int, float)) else f"{'-':>12}"

    rows = [f"{'server':>10}  {'prompt tok':>10}  {'TTFT ms':>12}  {'RSS warm MiB':>12}  {'RSS end MiB':>12}  {'peak MiB':>12}"]
    for n in names:
        rows.append(f"{n:>10}  {long[n].prompt_tokens:>10}  {cell(long[n].ttft_ms)}  {cell(warm[n].get('rss_mib'))}  "
                    f"{cell(end[n].get('rss_mib'))}  {cell(end[n].get('peak_rss_mib'))}")
    if len(names) == 2:
        a, b = names
        ratio = lambda x, y: f"{x / y:>12.2f}" if x and y else f"{'-':>12}"  # noqa: E731
        rows.append(f"{'ratio':>10}  {'':>10}  {ratio(long[a].ttft_ms, long[b].ttft_ms)}  "
                    f"{ratio(warm[a].get('rss_mib'), warm[b].get('rss_mib'))}  "
                    f"{ratio(end[a].get('rss_mib'), end[b].get('rss_mib'))}  "
                    f"{ratio(end[a].get('peak_rss_mib'), end[b].get('peak_rss_mib'))}")
    return "\n".join(rows)


def table(results: list[LevelResult]) -> str:
    head = f"{'concurrency':>11}  {'agg tok/s':>9}  {'per-stream tok/s':>16}  {'TTFT p50 ms':>11}  {'TTFT p95 ms':>11}"
    rows = [f"{r.concurrency:>11}  {r.aggregate_tok_s:>9.1f}  {r.per_stream_tok_s:>16.1f}  "
            f"{r.ttft_p50_ms:>11.0f}  {r.ttft_p95_ms:>11.0f}" for r in results]
    return "\n".join([head, *rows])


def comparison_table(ours: list[LevelResult], theirs: list[LevelResult], name: str = "other") -> str:
    """Side by side: aggregate tok/s and TTFT p50 of both, and the ratios (ours / theirs). The
    stream ratio is of the per-stream rates after each first token (decode alone: at one client
    the aggregate also carries the prompt's time)."""
    head = (f"{'clients':>7}  {'pantheon tok/s':>14}  {name + ' tok/s':>16}  {'ratio':>5}  {'stream ratio':>12}  "
            f"{'TTFT pantheon':>13}  {'TTFT ' + name:>13}  {'TTFT ratio':>10}")
    rows = [f"{a.concurrency:>7}  {a.aggregate_tok_s:>14.1f}  {b.aggregate_tok_s:>16.1f}  "
            f"{a.aggregate_tok_s / max(b.aggregate_tok_s, 1e-9):>5.2f}  "
            f"{a.per_stream_tok_s / max(b.per_stream_tok_s, 1e-9):>12.2f}  {a.ttft_p50_ms / 1000:>12.2f}s  "
            f"{b.ttft_p50_ms / 1000:>12.2f}s  {a.ttft_p50_ms / max(b.ttft_p50_ms, 1e-9):>10.2f}"
            for a, b in zip(ours, theirs)]
    return "\n".join([head, *rows])


def as_json(results: list[LevelResult], against: list[LevelResult] | None = None) -> str:
    out: dict = {"levels": [asdict(r) for r in results]}
    if against is not None:
        out["against"] = [asdict(r) for r in against]
        out["ratios"] = [{"concurrency": a.concurrency, "aggregate": a.aggregate_tok_s / max(b.aggregate_tok_s, 1e-9),
                          "per_stream": a.per_stream_tok_s / max(b.per_stream_tok_s, 1e-9),
                          "ttft_p50": a.ttft_p50_ms / max(b.ttft_p50_ms, 1e-9)} for a, b in zip(results, against)]
    return json.dumps(out)
