"""`pantheon serve`: the same app, run by hypercorn in this process."""

from __future__ import annotations

import asyncio
import logging
import signal

from pantheon.config import ServeConfig

DRAIN_S = 30.0


def config_from_args(args) -> ServeConfig:
    env = ServeConfig.from_env()
    models = tuple((m, args.name[i] if i < len(args.name) else None) for i, m in enumerate(args.model))
    dies = tuple(int(d) for d in args.dies.split(",") if d.strip()) if args.dies else None
    pick = lambda flag, default: default if flag is None else flag
    return ServeConfig(models=models or env.models, host=args.host, port=args.port,
                       ctx_cap=pick(args.ctx_cap, env.ctx_cap), max_sessions=pick(args.max_sessions, env.max_sessions),
                       max_concurrent=pick(args.max_concurrent, env.max_concurrent),
                       reasoning_budget=pick(args.reasoning_budget, env.reasoning_budget), dies=dies,
                       numerics=args.numerics)


def serve(args) -> int:
    from hypercorn.asyncio import serve as hypercorn_serve
    from hypercorn.config import Config

    from pantheon.web import create_app

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = config_from_args(args)
    app = create_app(config)
    hc = Config()
    hc.bind = [f"{config.host}:{config.port}"]
    hc.keep_alive_timeout = 5
    hc.graceful_timeout = 5

    async def drain_then_stop(stop: asyncio.Event):
        """On SIGTERM/SIGINT: refuse new work (503 server_shutting_down, Retry-After: 1) while the
        generations in flight finish, for up to DRAIN_S, then let hypercorn close."""
        await stop.wait()
        app.pantheon.shutting_down = True
        deadline = asyncio.get_running_loop().time() + DRAIN_S
        while app.pantheon.pool.any_busy() and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)

    async def main():
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await hypercorn_serve(app, hc, shutdown_trigger=lambda: drain_then_stop(stop))

    asyncio.run(main())
    return 0
