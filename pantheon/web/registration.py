"""`pantheon serve --router URL`: register with a router at start-up, heartbeat every few seconds,
deregister on shutdown (pantheon/router). Each report says what the contract lists: the served
ids with `max_concurrent`, free slots and `context_window` (the ladder moves it at runtime), and
the instance's live sessions (the router sends their turns here)."""

from __future__ import annotations

import asyncio
import logging

import httpx

from pantheon.config import ENV_SESSION_KEY, session_key_configured

log = logging.getLogger("pantheon.web")


def report(state, advertise: str, instance_id: str | None) -> dict:
    models = []
    for entry in state.pool.ready():
        e = entry.engine
        models.append({"id": entry.config.name, "max_concurrent": e.max_concurrent, "free_slots": e.free_slots,
                       "context_window": e.effective_ctx})
    sessions = sorted({sid for entry in state.pool.ready() for sid in list(entry.engine.table.sessions)})
    body = {"url": advertise, "models": models, "sessions": sessions}
    if instance_id:
        body["instance_id"] = instance_id
    return body


class Registration:
    """The serve's side of the registry protocol, as one background task on the serving loop."""

    def __init__(self, state, router: str, advertise: str, interval_s: float = 2.0):
        self.state, self.router, self.advertise = state, router.rstrip("/"), advertise.rstrip("/")
        self.interval_s = interval_s
        self.instance_id: str | None = None
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        # httpx logs every request at INFO: a heartbeat every 2 s would bury the access log
        logging.getLogger("httpx").setLevel(logging.WARNING)
        if not session_key_configured():
            log.warning("%s is not set: this instance seals session blobs with its own random key, so its "
                        "sessions cannot move to another instance when it drains (give every instance "
                        "behind the router the same key)", ENV_SESSION_KEY)
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        async with httpx.AsyncClient(timeout=5.0) as client:
            while True:
                try:
                    await self._beat(client)
                except httpx.HTTPError as e:
                    log.warning("router %s unreachable: %s (retrying)", self.router, e)
                except asyncio.CancelledError:
                    raise
                except Exception:  # noqa: BLE001 - the serve keeps serving whatever the router says
                    log.exception("registration with %s failed", self.router)
                await asyncio.sleep(self.interval_s)

    async def _beat(self, client: httpx.AsyncClient) -> None:
        body = report(self.state, self.advertise, self.instance_id)
        if self.instance_id is not None:
            r = await client.post(self.router + "/registry/heartbeat", json=body)
            if r.status_code != 404:  # 404: the router forgot us (restarted, or we timed out)
                r.raise_for_status()
                return
            body.pop("instance_id", None)
        r = await client.post(self.router + "/registry/register", json=body)
        r.raise_for_status()
        self.instance_id = r.json()["instance_id"]
        self.interval_s = min(self.interval_s, float(r.json().get("heartbeat_s", self.interval_s)))
        log.info("registered with router %s as %s (%s)", self.router, self.instance_id, self.advertise)

    async def leave(self, wait_idle) -> dict:
        """Leave the router without losing a session: mark this instance draining (the router sends
        nothing new here), await `wait_idle()` (the turns in flight), have the router move the idle
        sessions to another replica (export here, restore there), then deregister. Returns the
        router's account ({"moved": [...], "failed": [...]}; empty when not registered)."""
        iid = self.instance_id
        if self._task is not None:
            self._task.cancel()
            self._task = None
        result: dict = {}
        if iid is not None:
            async with httpx.AsyncClient(timeout=120.0) as client:
                try:
                    await client.post(self.router + "/registry/drain", json={"instance_id": iid, "sessions": []})
                    await wait_idle()
                    sessions = [{"id": sid, "model": entry.config.name} for entry in self.state.pool.ready()
                                for sid in list(entry.engine.table.sessions)]
                    r = await client.post(self.router + "/registry/drain",
                                          json={"instance_id": iid, "sessions": sessions})
                    if r.status_code == 200:
                        result = r.json()
                        log.info("drained: %d sessions moved, %d not", len(result.get("moved", [])),
                                 len(result.get("failed", [])))
                except httpx.HTTPError as e:
                    log.warning("could not drain through router %s: %s", self.router, e)
        else:
            await wait_idle()
        await self.stop()
        return result

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001
                pass
        self._task = None
        iid, self.instance_id = self.instance_id, None
        if iid is not None:
            try:
                async with httpx.AsyncClient(timeout=3.0) as client:
                    await client.post(self.router + "/registry/deregister", json={"instance_id": iid})
                log.info("deregistered from router %s", self.router)
            except httpx.HTTPError as e:
                log.warning("could not deregister from %s: %s", self.router, e)
