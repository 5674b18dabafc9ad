"""The Quart app in this process, driven by Quart's test client: route logic without a live server.

`InProcessApp(models)` builds the app with its models loaded synchronously; `run(coro)` runs a
coroutine on the app's own event loop (one loop for the app's whole life, as under hypercorn)."""

from __future__ import annotations

import asyncio
import json
import threading

from pantheon.config import ServeConfig
from pantheon.web import create_app


class InProcessApp:
    def __init__(self, models: list[tuple[str, str]], **config):
        self.app = create_app(ServeConfig(models=tuple(models), **config), load_models=False)
        self.state = self.app.pantheon
        for path, name in models:
            self.state.pool.load(self.state.config.model_config(path, name))
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.client = self.app.test_client()

    def run(self, coro, timeout: float = 300):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def post(self, path: str, body: dict, headers: dict | None = None) -> tuple[int, dict, dict]:
        """(status, JSON body, headers)."""
        async def go():
            r = await self.client.post(path, json=body, headers=headers or {})
            return r.status_code, await r.get_json(), dict(r.headers)

        return self.run(go())

    def get(self, path: str, headers: dict | None = None) -> tuple[int, dict | list]:
        """(status, JSON body) of a GET."""
        async def go():
            r = await self.client.get(path, headers=headers or {})
            return r.status_code, await r.get_json()

        return self.run(go())

    def stream(self, path: str, body: dict) -> tuple[int, list[dict | str]]:
        """A streaming POST: (status, the decoded `data:` payloads, "[DONE]" as a string)."""
        async def go():
            r = await self.client.post(path, json={**body, "stream": True})
            return r.status_code, (await r.get_data()).decode()

        status, text = self.run(go())
        events = []
        for line in text.splitlines():
            if line.startswith("data: "):
                payload = line[len("data: "):]
                events.append(payload if payload == "[DONE]" else json.loads(payload))
        return status, events

    def engine(self, name: str | None = None):
        return self.state.pool.resolve(name)

    def close(self) -> None:
        self.state.pool.close()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


def tiny_app(tmp_path_factory, folder: str, **config):
    """An InProcessApp serving a tiny llama model as "tiny" (a module fixture's body)."""
    from tests.fixtures.tiny_models import write_tiny_llama

    path = write_tiny_llama(tmp_path_factory.mktemp(folder) / "tiny.gguf")
    return InProcessApp([(str(path), "tiny")], **config)
