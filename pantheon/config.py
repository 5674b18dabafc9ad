"""Configuration as frozen dataclasses and accessors. Environment variable names live here and
nowhere else, and this is the only module that reads (or, for a multi-process serve, writes) the
environment: the serve's and engine's settings are read once into frozen dataclasses (ServeConfig,
ModelConfig, Settings); the process-wide switches below are read by an accessor when the component
that uses them is built (a runner, a ladder, a kernel plan), so a test can change them per case."""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from pathlib import Path

ENV_HOME = "PANTHEON_HOME"
ENV_MODEL = "PANTHEON_MODEL"
ENV_CTX_CAP = "PANTHEON_CTX_CAP"
ENV_MAX_SESSIONS = "PANTHEON_MAX_SESSIONS"
ENV_MAX_CONCURRENT = "PANTHEON_MAX_CONCURRENT"
ENV_REASONING_BUDGET = "PANTHEON_REASONING_BUDGET"
ENV_NO_THINK = "PANTHEON_NO_THINK"
ENV_TOOL_GRAMMAR = "PANTHEON_TOOL_GRAMMAR"
ENV_COMPILE_CACHE = "PANTHEON_COMPILE_CACHE"
ENV_MAX_BODY_BYTES = "PANTHEON_MAX_BODY_BYTES"
ENV_ADMIN_TOKEN = "PANTHEON_ADMIN_TOKEN"  # set: /admin/* needs Authorization: Bearer <token>
ENV_API_KEY = "PANTHEON_API_KEY"  # set: the inference routes need Authorization: Bearer <key> or x-api-key
ENV_MODELS_DIR = "PANTHEON_MODELS_DIR"  # set: /admin/models/load opens only files under it
ENV_ROUTER = "PANTHEON_ROUTER"  # a router to register with (serve --router)
ENV_ADVERTISE = "PANTHEON_ADVERTISE"  # the URL the router reaches this instance at (serve --advertise)
ENV_WARMUP = "PANTHEON_WARMUP"  # "0": compile on first use instead of at load (tests)
ENV_ACCESS_LOG = "PANTHEON_ACCESS_LOG"  # text (default), json or off: one line per request (web/observe.py)
ENV_HOST_MEMORY = "PANTHEON_HOST_MEMORY_BYTES"  # caps the host memory CPU admission plans with
ENV_KV_DTYPE = "PANTHEON_KV_DTYPE"  # the KV cache's type: auto (default), f32, f16, bf16, q8_0
ENV_SESSION_KEY = "PANTHEON_SESSION_KEY"  # seals session blobs (HMAC); unset: a random key per process
ENV_CORS_ORIGINS = "PANTHEON_CORS_ORIGINS"  # serve --cors-origins: "*" (default), "localhost", or a list

KV_DTYPE_CHOICES = ("auto", "f32", "f16", "bf16", "q8_0")  # model/dtypes.kv_cache_dtype
DEFAULT_CTX_CAP = 4096
DEFAULT_MAX_BODY_BYTES = 8 << 20  # a request body past this gets 413 request_too_large (not session restore)


def pantheon_home() -> Path:
    """Where Pantheon caches the default model and compiled executables."""
    return Path(os.environ.get(ENV_HOME) or Path.home() / ".cache" / "pantheon")


@dataclass(frozen=True)
class SamplingDefaults:
    """What a request that leaves a sampling field out gets, where the operator says (serve --temp,
    --top-k, --top-p, --min-p, --repeat-penalty, --presence-penalty, --frequency-penalty, --seed,
    -n: llama-server's flags); None: each API's own default."""

    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    max_tokens: int | None = None  # -1: to the window
    reasoning_format: str | None = None  # --reasoning-format: "none" leaves thoughts in the content
    # the chat template's arguments (--chat-template-kwargs, --reasoning), under a request's own
    template_kwargs: dict | None = None

    def given(self) -> dict:
        """The sampling fields set (template_kwargs merge instead)."""
        return {k: v for k, v in self.__dict__.items() if v is not None and k != "template_kwargs"}


@dataclass(frozen=True)
class ModelConfig:
    """How one model is served: where it comes from and the per-model caps."""

    path: str
    name: str = ""  # "" = the file's name without .gguf
    ctx_cap: int = DEFAULT_CTX_CAP
    max_sessions: int = 4
    max_concurrent: int = 0  # 0 = the resolved max_sessions
    reasoning_budget: int = 0  # 0 = unbounded
    dies: tuple[int, ...] | None = None  # device ordinals; None = the die manager's choice
    quantize: bool = False
    numerics: str = "exact"  # batch-invariant f32; "llamacpp" rounds activations like llama.cpp's CPU path
    kv_dtype: str = "auto"  # model/dtypes.kv_cache_dtype: f16 on the CPU, bf16 on a GPU
    chat_template: str | None = None  # --chat-template: a builtin's name or Jinja source; None: the file's
    aliases: tuple[str, ...] = ()  # more names the model answers to (llama-server's -a a,b,c)
    tags: tuple[str, ...] = ()  # llama-server's --tags: listed in the model's row, nothing else

    @property
    def max_concurrent_configured(self) -> int:
        return self.max_concurrent or self.max_sessions

ENV_DIE_RESERVE = "PN_DIE_RESERVE_BYTES"
ENV_BATCH_SLOTS = "QWEN35_BATCH_SLOTS"  # "0" turns the batch scheduler off (single-user path)
ENV_QUEUE_DEPTH = "BS_QUEUE_DEPTH"
DEFAULT_QUEUE_DEPTH = 32
ENV_SESSION_IDLE_TTL = "PN_SESSION_IDLE_TTL_MS"
ENV_WATCH_GRACE = "PN_SESSION_WATCH_GRACE_MS"
ENV_SESSION_HOST_BYTES = "PN_SESSION_HOST_BYTES"  # host tier for idle sessions; default a quarter of RAM
MAX_MODEL_DIES = 8  # PN_MODEL_MAX_DIES


def _env_int(name: str) -> int | None:
    value = os.environ.get(name, "").strip()
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not an integer") from None


def _env_choice(name: str, choices: tuple[str, ...]) -> str:
    """The variable's value, one of `choices` (unset: the first)."""
    value = (os.environ.get(name) or choices[0]).strip().lower()
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not one of {', '.join(choices)}")
    return value


@dataclass(frozen=True)
class ServeConfig:
    """What `pantheon serve` / `hypercorn pantheon.web:app` serves. Built once from CLI flags or the
    environment; per-model caps left None take the engine defaults."""

    models: tuple[tuple[str, str | None], ...] = ()  # (path, served name); empty -> the default model
    host: str = "127.0.0.1"
    port: int = 8080
    ctx_cap: int | None = None
    max_sessions: int | None = None
    max_concurrent: int | None = None
    reasoning_budget: int | None = None
    dies: tuple[int, ...] | None = None
    numerics: str = "exact"
    kv_dtype: str = "auto"
    chat_template: str | None = None  # every model's template in place of its file's (--chat-template)
    sampling: SamplingDefaults = SamplingDefaults()
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    admin_token: str | None = None  # None: /admin/* open (the contract's default)
    api_key: str | None = None  # None: the inference routes open (the contract's default)
    models_dir: str | None = None  # None: /admin/models/load opens any path
    access_log: str = "text"  # "text", "json" or "off" (web/observe.py)
    router: str | None = None  # a router's URL to register with (web/registration.py)
    advertise: str | None = None  # this instance's URL as the router should reach it (default http://host:port)
    slots_endpoint: bool = True  # GET /slots served (llama-server's --no-slots: 501)
    cors_origins: str = "*"  # "*": any (the contract's); "localhost": local origins; else a comma-separated list
    tags: tuple[str, ...] = ()  # every served model's tags (llama-server's --tags)

    @classmethod
    def from_env(cls) -> ServeConfig:
        models = []
        for item in filter(None, (os.environ.get(ENV_MODEL) or "").split(";")):
            path, _, name = item.partition(",")
            models.append((path.strip(), name.strip() or None))
        return cls(models=tuple(models), ctx_cap=_env_int(ENV_CTX_CAP), max_sessions=_env_int(ENV_MAX_SESSIONS),
                   max_concurrent=_env_int(ENV_MAX_CONCURRENT), reasoning_budget=_env_int(ENV_REASONING_BUDGET),
                   max_body_bytes=_env_int(ENV_MAX_BODY_BYTES) or DEFAULT_MAX_BODY_BYTES,
                   admin_token=os.environ.get(ENV_ADMIN_TOKEN) or None,
                   api_key=os.environ.get(ENV_API_KEY) or None,
                   models_dir=os.environ.get(ENV_MODELS_DIR) or None,
                   access_log=(os.environ.get(ENV_ACCESS_LOG) or "text").strip().lower(),
                   router=os.environ.get(ENV_ROUTER) or None, advertise=os.environ.get(ENV_ADVERTISE) or None,
                   kv_dtype=_env_choice(ENV_KV_DTYPE, KV_DTYPE_CHOICES),
                   cors_origins=(os.environ.get(ENV_CORS_ORIGINS) or "*").strip() or "*")

    def model_config(self, path: str, name: str | None) -> ModelConfig:
        # comma-separated names are llama-server's aliases: the first in sorted order is the id (its
        # std::set's), the others answer too
        names = comma_set(name)
        served = names[0] if names else Path(path).name.removesuffix(".gguf")
        return ModelConfig(path=path, name=served, aliases=tuple(names[1:]), tags=self.tags,
                           ctx_cap=self.ctx_cap or DEFAULT_CTX_CAP,
                           max_sessions=self.max_sessions or 4, max_concurrent=self.max_concurrent or 0,
                           reasoning_budget=self.reasoning_budget or 0, dies=self.dies, numerics=self.numerics,
                           kv_dtype=self.kv_dtype, chat_template=self.chat_template)


def comma_set(text: str | None) -> tuple[str, ...]:
    """llama-server's comma-separated names (-a, --tags) as its std::set holds them: distinct, sorted."""
    return tuple(sorted({n.strip() for n in (text or "").split(",") if n.strip()}))


_session_key: bytes | None = None


def session_key() -> bytes:
    """The key session blobs are sealed with (engine/blob.py): PANTHEON_SESSION_KEY's UTF-8 bytes,
    else 32 random bytes drawn once per process — then only this process accepts its own blobs.
    Instances that move sessions between them (a router's drain) must share one key."""
    global _session_key
    if _session_key is None:
        value = os.environ.get(ENV_SESSION_KEY, "")
        if value and len(value.encode()) < 16:
            raise ValueError(f"{ENV_SESSION_KEY} must be at least 16 bytes (e.g. 64 hex digits)")
        _session_key = value.encode() if value else secrets.token_bytes(32)
    return _session_key


def host_memory_cap() -> int | None:
    """PANTHEON_HOST_MEMORY_BYTES: the most host memory admission may plan with on the CPU (below
    MemAvailable: a container's share, or a test's small budget); unset: no cap."""
    return _env_int(ENV_HOST_MEMORY)


def session_key_configured() -> bool:
    return bool(os.environ.get(ENV_SESSION_KEY))


def session_host_bytes() -> int:
    """The process-wide budget for sessions moved to host memory (PN_SESSION_HOST_BYTES; 0 disables
    the tier). Default: a quarter of physical memory."""
    value = _env_int(ENV_SESSION_HOST_BYTES)
    return max(value, 0) if value is not None else physical_memory() // 4


def physical_memory() -> int:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


def no_think_default() -> bool:
    """PANTHEON_NO_THINK decides enable_thinking when a request does not say."""
    return os.environ.get(ENV_NO_THINK, "").strip().lower() in ("1", "true", "yes", "on")


@dataclass(frozen=True)
class Settings:
    """Engine-wide settings, read from the environment (the contract's names) once, when a serve or
    command starts (`from_env`), and passed to every Engine it builds."""

    batching: bool = True
    queue_depth: int = DEFAULT_QUEUE_DEPTH
    idle_ttl_s: float = 12 * 3600
    watch_grace_s: float = 45.0
    warm_up: bool = True  # compile every prefill bucket and decode step at load (runner.warm_up)

    @classmethod
    def from_env(cls) -> Settings:
        ttl, grace, depth = _env_int(ENV_SESSION_IDLE_TTL), _env_int(ENV_WATCH_GRACE), _env_int(ENV_QUEUE_DEPTH)
        return cls(batching=os.environ.get(ENV_BATCH_SLOTS, "1").strip() != "0",
                   queue_depth=DEFAULT_QUEUE_DEPTH if depth is None else max(depth, 0),
                   idle_ttl_s=12 * 3600 if ttl is None else ttl / 1000,
                   watch_grace_s=45.0 if grace is None else grace / 1000,
                   warm_up=os.environ.get(ENV_WARMUP, "1").strip() != "0")


# ---- process-wide switches: diagnostics, tuning, kernels ------------------------------------------
ENV_DTYPE = "PANTHEON_DTYPE"  # auto (default), float32 or bfloat16: model/dtypes.compute_dtype
ENV_KERNELS = "PANTHEON_KERNELS"  # kernel modes, e.g. "reference" or "attention_decode=interpret" (pallas/dispatch.py)
ENV_FULL_STEP = "PANTHEON_FULL_STEP"  # "0": decode through the per-layer programs only (engine/runner.py)
ENV_NATIVE = "PANTHEON_NATIVE"  # "0": no native CPU kernels (native/build.py)
ENV_NATIVE_ISA = "PANTHEON_NATIVE_ISA"  # "native" (default) or "avx2": the instruction set they are built for
ENV_CXX = "CXX"  # the C++ compiler the native kernels are built with
ENV_NO_TCMALLOC = "PANTHEON_NO_TCMALLOC"  # set: do not re-exec with tcmalloc preloaded (engine/backend.py)
ENV_FAULTS = "PANTHEON_FAULTS"  # fault injection at start-up (faults.py)
ENV_TEST_HOOKS = "PANTHEON_TEST_HOOKS"  # "1": POST /admin/test/faults is served
ENV_PRESSURE_PCT = "PN_MEM_PRESSURE_PCT"  # the memory ladder's thresholds (engine/memory.py)
ENV_CRITICAL_PCT = "PN_MEM_CRITICAL_PCT"
ENV_KV_RETRY_BUDGET = "PN_KV_RETRY_BUDGET"  # tries to bring a host-KV layer back on-die (engine/residency.py)
ENV_ROUTER_TTL = "PANTHEON_ROUTER_TTL"  # seconds an instance stays listed without a heartbeat (router/)


def compute_dtype_name() -> str:
    return os.environ.get(ENV_DTYPE, "auto").strip().lower() or "auto"


def kernel_overrides() -> str:
    return os.environ.get(ENV_KERNELS, "")


def tool_grammar(value: str | None = None) -> str:
    """PANTHEON_TOOL_GRAMMAR (or `value` as it would be set), the one parse both its readers share:
    "required" (unset: only tool_choice "required" is constrained), "all" ("1": every request with
    tools) or "off" ("0")."""
    value = os.environ.get(ENV_TOOL_GRAMMAR, "") if value is None else value
    return {"0": "off", "1": "all"}.get(value.strip(), "required")


def full_step_enabled() -> bool:
    return os.environ.get(ENV_FULL_STEP, "1").strip() != "0"


def native_enabled() -> bool:
    return os.environ.get(ENV_NATIVE, "1").strip() != "0"


def native_isa() -> str:
    """PANTHEON_NATIVE_ISA: "native" (this CPU's instructions, AVX-512 where it has them) or "avx2"
    (the 8-wide AVX2 paths on any x86 CPU: how CI tests them on an AVX-512 machine)."""
    value = os.environ.get(ENV_NATIVE_ISA, "native").strip().lower() or "native"
    if value not in ("native", "avx2"):
        raise ValueError(f"{ENV_NATIVE_ISA}={value!r}: expected 'native' or 'avx2'")
    return value


def cxx() -> str | None:
    return os.environ.get(ENV_CXX) or None


def admin_token() -> str | None:
    return os.environ.get(ENV_ADMIN_TOKEN) or None


def router_ttl_s() -> float:
    return float(os.environ.get(ENV_ROUTER_TTL) or 10.0)


def fault_spec() -> str:
    return os.environ.get(ENV_FAULTS, "")


def test_hooks_enabled() -> bool:
    return os.environ.get(ENV_TEST_HOOKS, "") == "1"


def ladder_thresholds_pct() -> tuple[float, float]:
    """(pressure, critical): the ladder's MemAvailable thresholds in % of MemTotal (10 and 4)."""
    return float(os.environ.get(ENV_PRESSURE_PCT, 10.0)), float(os.environ.get(ENV_CRITICAL_PCT, 4.0))


def die_reserve_bytes() -> int:
    return int(os.environ.get(ENV_DIE_RESERVE, "0") or 0)


def kv_retry_budget() -> int:
    return int(os.environ.get(ENV_KV_RETRY_BUDGET, "5"))


def compile_cache_dir() -> str:
    """Where XLA's persistent compilation cache lives ("off": none)."""
    return os.environ.get(ENV_COMPILE_CACHE) or str(pantheon_home() / "xla-cache")


def environment_with_tcmalloc(library: str) -> dict[str, str] | None:
    """This process's environment with tcmalloc (`library`) added to LD_PRELOAD, for a re-exec; None
    when a tcmalloc is already preloaded or PANTHEON_NO_TCMALLOC says not to."""
    preload = os.environ.get("LD_PRELOAD", "")
    if os.environ.get(ENV_NO_TCMALLOC) or "tcmalloc" in preload:
        return None
    return dict(os.environ, LD_PRELOAD=(library + " " + preload).strip())


def thread_caches_configured() -> bool:
    """Whether the operator sized tcmalloc's thread caches (its own variable): left as they say."""
    return bool(os.environ.get("TCMALLOC_MAX_TOTAL_THREAD_CACHE_BYTES"))


def set_session_host_bytes(n: int) -> None:
    """The host tier's budget from here on (serve --cache-ram), in this process and what it starts."""
    os.environ[ENV_SESSION_HOST_BYTES] = str(max(int(n), 0))


def disable_warm_up() -> None:
    """Settings.from_env's warm_up false from here on (serve --no-warmup): programs compile on first use."""
    os.environ[ENV_WARMUP] = "0"


def disable_session_host_tier() -> None:
    """A model spread over several processes keeps no host tier (a slot's KV is spread over them):
    session_host_bytes() answers 0 from here on, in this process and what it starts."""
    os.environ[ENV_SESSION_HOST_BYTES] = "0"
