"""A real `pantheon serve` (hypercorn) subprocess on 127.0.0.1 for HTTP tests; `HypercornProcess`
runs the same app as `hypercorn pantheon.web:app`, configured from the environment."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, args: list[str], env: dict | None = None, wait_models: int = 1, timeout: float = 180):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = f"/tmp/pantheon-test-server-{self.port}.log"
        self._log = open(self.log_path, "wb")
        full_env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
        self.proc = subprocess.Popen(self.command(args), stdout=self._log, stderr=subprocess.STDOUT, env=full_env)
        self._wait(wait_models, timeout)

    def command(self, args: list[str]) -> list[str]:
        return [sys.executable, "-m", "pantheon", "serve", "--port", str(self.port), *args]

    def _wait(self, n_models: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                r = httpx.get(self.url + "/v1/models", timeout=2)
                if r.status_code == 200 and len(r.json()["data"]) >= n_models:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"server not ready after {timeout}s:\n{self.log()}")

    def log(self) -> str:
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")[-4000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self._log.close()


class HypercornProcess(ServerProcess):
    """`.venv/bin/hypercorn pantheon.web:app --bind 127.0.0.1:PORT [args]`: models from `env`
    (PANTHEON_MODEL=...), as an operator would run it."""

    def command(self, args: list[str]) -> list[str]:
        hypercorn = os.path.join(os.path.dirname(sys.executable), "hypercorn")
        return [hypercorn, "pantheon.web:app", "--bind", f"127.0.0.1:{self.port}", *args]


class BackgroundStream:
    """A streaming chat completion on its own thread, for tests that act while a turn is in flight:
    `started` is set at its first data event, `lines` holds every line received."""

    def __init__(self, url: str, body: dict, timeout: float = 120):
        import threading

        self.started = threading.Event()
        self.lines: list[str] = []
        self.status: int | None = None
        self.thread = threading.Thread(target=self._run, args=(url, {**body, "stream": True}, timeout))
        self.thread.start()

    def _run(self, url: str, body: dict, timeout: float) -> None:
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=timeout) as r:
            self.status = r.status_code
            for line in r.iter_lines():
                self.lines.append(line)
                if line.startswith("data: {"):
                    self.started.set()

    def join(self, timeout: float = 120) -> None:
        self.thread.join(timeout)


@contextlib.contextmanager
def watching(url: str, session_id: str, name: str | None = None, timeout: float = 30):
    """Hold `GET /session/watch` open for the block; the watch is established on entry. Yields the
    line iterator (dropping it would close the connection)."""
    params = {"session_id": session_id, **({"name": name} if name else {})}
    with httpx.stream("GET", url + "/session/watch", params=params, timeout=timeout) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = r.iter_lines()
        assert next(lines) == ": watch established"
        yield lines
