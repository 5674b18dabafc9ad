"""`pantheon serve`: the same app, run by hypercorn in this process; and the shutdown drain that
both it and plain `hypercorn pantheon.web:app` use.

The drain: on SIGTERM/SIGINT new requests get 503 server_shutting_down (Retry-After: 1) while the
turns in flight finish, for up to DRAIN_S; then hypercorn stops accepting, closes the connections
and runs the lifespan shutdown (the pool closes). Hypercorn has no hook between "shutdown
requested" and "stop accepting": its asyncio worker awaits `raise_shutdown(shutdown_trigger)` and
closes the listening sockets right after it raises. Whoever owns the signal — hypercorn's own
handlers (in-process, `--workers 0`, `pantheon serve`) or its supervisor process, which sets a
multiprocessing event the worker polls (the default single worker) — the trigger is awaited
there, so the app wraps that one function at lifespan start-up (`install_drain`): the trigger
fires, the registered states drain, then ShutdownError. One code path for every way of running."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import signal
import sys

from pantheon.config import SamplingDefaults, ServeConfig, comma_set

log = logging.getLogger("pantheon.web")

DRAIN_S = 30.0
_draining: list = []  # the ServerStates served in this process (one, outside tests)


async def drain(state, limit_s: float = DRAIN_S) -> None:
    """Refuse new work and wait (at most limit_s) until no turn is in flight."""
    state.shutting_down = True
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit_s

    async def wait_idle():
        if not state.idle():
            log.info("shutting down: draining the turns in flight (at most %.0f s)", limit_s)
        while not state.idle() and loop.time() < deadline:
            await asyncio.sleep(0.05)

    if getattr(state, "registration", None) is not None:
        # with a router: it stops sending work here, the turns finish, the idle sessions move to
        # another replica, then this instance deregisters (registration.leave)
        state.drained = await state.registration.leave(wait_idle)
    else:
        await wait_idle()


def install_drain(state) -> None:
    """At lifespan start-up (before hypercorn creates its shutdown task): drain `state` when the
    server is told to stop, before it stops accepting."""
    if state not in _draining:
        _draining.append(state)
    try:
        import hypercorn.asyncio.run as hypercorn_run
    except ImportError:  # another ASGI server: the lifespan shutdown still drains (bounded)
        return

    def wrap(original):
        async def raise_shutdown(shutdown_event):
            async def trigger_then_drain():
                await shutdown_event()
                await asyncio.gather(*(drain(s) for s in list(_draining)))

            await original(trigger_then_drain)

        return raise_shutdown

    patch_once(hypercorn_run, "raise_shutdown", wrap, "on SIGTERM the turns in flight get only hypercorn's "
                                                      "graceful_timeout")


def patch_once(owner, name: str, wrap, without: str) -> None:
    """Replace `owner.name` (a hypercorn internal) with `wrap(original)`, once per process; where this
    hypercorn has no such attribute, warn what is lost (`without`) and leave it."""
    original = getattr(owner, name, None)
    if original is None:
        log.warning("this hypercorn has no %s.%s: %s", getattr(owner, "__name__", owner), name, without)
        return
    if getattr(original, "pantheon", False):
        return
    replacement = wrap(original)
    replacement.pantheon = True
    setattr(owner, name, replacement)


def uninstall_drain(state) -> None:
    if state in _draining:
        _draining.remove(state)


def _sampling(args) -> SamplingDefaults:
    """serve's sampling defaults (--temp, ..., -n), llama-server's flags; --seed -1: none."""
    seed = getattr(args, "seed", None)
    return SamplingDefaults(temperature=getattr(args, "temp", None), top_k=getattr(args, "top_k", None),
                            top_p=getattr(args, "top_p", None), min_p=getattr(args, "min_p", None),
                            repetition_penalty=getattr(args, "repeat_penalty", None),
                            presence_penalty=getattr(args, "presence_penalty", None),
                            frequency_penalty=getattr(args, "frequency_penalty", None),
                            seed=None if seed == -1 else seed, max_tokens=getattr(args, "n_predict", None),
                            reasoning_format=getattr(args, "reasoning_format", None),
                            template_kwargs=_template_kwargs(args))


def _template_kwargs(args) -> dict | None:
    """--chat-template-kwargs, with --reasoning on/off as its enable_thinking (llama-server's reading)."""
    kwargs = dict(getattr(args, "chat_template_kwargs", None) or {})
    reasoning = getattr(args, "reasoning", None)
    if reasoning in ("on", "off"):
        kwargs["enable_thinking"] = reasoning == "on"
    return kwargs or None


def config_from_args(args) -> ServeConfig:
    env = ServeConfig.from_env()
    models = tuple((m, args.name[i] if i < len(args.name) else None) for i, m in enumerate(args.model))
    dies = tuple(int(d) for d in args.dies.split(",") if d.strip()) if args.dies else None
    pick = lambda flag, default: default if flag is None else flag
    return ServeConfig(models=models or env.models, host=args.host, port=args.port,
                       ctx_cap=pick(args.ctx_cap, env.ctx_cap), max_sessions=pick(args.max_sessions, env.max_sessions),
                       max_concurrent=pick(args.max_concurrent, env.max_concurrent),
                       reasoning_budget=pick(args.reasoning_budget, env.reasoning_budget), dies=dies,
                       numerics=args.numerics, kv_dtype=getattr(args, "kv_dtype", None) or env.kv_dtype,
                       chat_template=getattr(args, "chat_template", None), sampling=_sampling(args),
                       max_body_bytes=env.max_body_bytes,
                       admin_token=getattr(args, "admin_token", None) or env.admin_token,
                       api_key=getattr(args, "api_key", None) or env.api_key,
                       models_dir=getattr(args, "models_dir", None) or env.models_dir,
                       access_log="off" if getattr(args, "quiet", False) else getattr(args, "log_format", None) or env.access_log,
                       router=getattr(args, "router", None) or env.router,
                       advertise=getattr(args, "advertise", None) or env.advertise,
                       slots_endpoint=getattr(args, "slots_endpoint", True),
                       cors_origins=getattr(args, "cors_origins", None) or env.cors_origins,
                       tags=comma_set(getattr(args, "tags", None)))


def exposure_warning(config: ServeConfig) -> str | None:
    """A line for stderr when the server listens beyond loopback with /admin/* open to anyone."""
    if config.admin_token or all(_loopback(h) for h in hosts(config.host)):
        return None
    return (f"pantheon: warning: serving on {config.host} without an admin token: anyone who can reach this "
            "port can load and unload models (set PANTHEON_ADMIN_TOKEN or --admin-token)")


def hosts(host: str) -> list[str]:
    """--host's addresses: one, or several comma-separated as llama-server takes them."""
    return [h.strip() for h in host.split(",") if h.strip()] or ["127.0.0.1"]


def binds(host: str, port: int) -> list[str]:
    """hypercorn's binds for --host and --port (an IPv6 address in brackets)."""
    return [f"[{h.strip('[]')}]:{port}" if ":" in h.strip("[]") else f"{h}:{port}" for h in hosts(host)]


def _loopback(host: str) -> bool:
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip().strip("[]")).is_loopback
    except ValueError:
        return False  # a host name other than localhost: assume it is reachable


def join_processes(args, config: ServeConfig) -> ServeConfig:
    """`--coordinator`: join the multi-controller runtime (engine/distributed.py) and place the model
    on every process's dies."""
    import dataclasses

    import jax

    from pantheon.config import disable_session_host_tier
    from pantheon.engine.distributed import initialize

    if len(config.models) > 1:
        raise SystemExit("pantheon: a model spanning several processes is served alone (one --model)")
    initialize(args.coordinator, args.num_processes, args.process_id)
    disable_session_host_tier()
    return dataclasses.replace(config, dies=config.dies or tuple(range(jax.device_count())))


def follow_process_zero(config: ServeConfig) -> int:
    """A process other than 0: load the same model on the same global mesh, then replay process
    0's device calls until it stops. It serves no HTTP."""
    from pantheon.default_model import SERVED_NAME, default_model_path
    from pantheon.engine.distributed import StepChannel, follow
    from pantheon.engine.pool import ModelPool

    path, name = config.models[0] if config.models else (str(default_model_path()), SERVED_NAME)
    pool = ModelPool()
    engine = pool.load(config.model_config(path, name)).engine
    engine.scheduler.stop()  # this process never schedules: process 0 does
    follow(engine.runner, StepChannel())
    return 0


def serve(args) -> int:
    from hypercorn.asyncio import serve as hypercorn_serve
    from hypercorn.config import Config

    from pantheon.web import create_app

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if getattr(args, "verbose", False):  # llama-server's -v
        logging.getLogger("pantheon").setLevel(logging.DEBUG)
    if getattr(args, "trace_requests", False):
        logging.getLogger("pantheon.trace").setLevel(logging.DEBUG)
    config = config_from_args(args)
    if getattr(args, "coordinator", None):
        config = join_processes(args, config)
        if args.process_id != 0:
            return follow_process_zero(config)
    if warning := exposure_warning(config):
        print(warning, file=sys.stderr)
    missing = [path for path, _ in config.models if not os.path.isfile(path)]
    if missing:
        print(f"pantheon: model file not found: {', '.join(missing)}", file=sys.stderr)
        return 2
    app = create_app(config)
    hc = Config()
    hc.bind = binds(config.host, config.port)
    hc.keep_alive_timeout = 5
    hc.graceful_timeout = 5

    async def run() -> None:
        # SIGINT/SIGTERM, or every configured model failing to load, stop the server; install_drain
        # (lifespan start-up) makes the stop drain first, exactly as under plain hypercorn.
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        app.pantheon.on_all_failed = lambda: loop.call_soon_threadsafe(stop.set)
        await hypercorn_serve(app, hc, shutdown_trigger=stop.wait)

    asyncio.run(run())
    if app.pantheon.health_status() == "failed":
        for failed in app.pantheon.load_errors:
            print(f"pantheon: could not load {failed['model']}: {failed['error']}", file=sys.stderr)
        print("pantheon: no model could be loaded; stopping", file=sys.stderr)
        return 1
    return 0
