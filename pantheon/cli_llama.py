"""llama-server's `serve` flags, read as llama-server b11434 reads them, so its command lines serve
here too: the sampling defaults (--temp, --top-k, ..., -n), -c over -np slots, -np, -ctk/-ctv, and
the flags accepted without effect (named on stderr)."""

from __future__ import annotations

import sys

from pantheon import cli_types, config
from pantheon.config import KV_DTYPE_CHOICES


# llama-server flags `serve` accepts without effect, and why (flags taking a value are listed in
# LLAMA_SERVER_VALUED); a notice on stderr names the ones given.
LLAMA_SERVER_IGNORED = (
    (("-t", "--threads"), "the kernels use every core the process may run on"),
    (("-tb", "--threads-batch"), "as --threads"),
    (("-ngl", "--gpu-layers", "--n-gpu-layers"), "a model is placed on its dies whole (--dies)"),
    (("-fa", "--flash-attn"), "attention is always the blocked (flash) kernel"),
    (("-b", "--batch-size"), "prefill chunks are sized by the scheduler (up to 512 tokens)"),
    (("-ub", "--ubatch-size"), "as --batch-size"),
    (("-cb", "--cont-batching"), "batching is always continuous"),
    (("--jinja",), "chat templates are always Jinja (--chat-template NAME for llama.cpp's builtins)"),
    (("--metrics",), "/metrics is always served"),
    (("--slots",), "/slots is served unless --no-slots"),
    (("--no-webui", "--no-ui"), "there is no web UI; /admin/ui is the operator's dashboard"),
    (("--mlock",), "weights are held as the loader places them"),
    (("--no-mmap",), "as --mlock"),
    (("--offline",), "nothing is downloaded here: models are files (-m)"),
    (("--embedding", "--embeddings"), "a model serves embeddings and generation both"),
    (("--context-shift",), "a turn that reaches the context window ends there (finish_reason length)"),
    (("--no-context-shift",), "as --context-shift: no context shift is the only way here"),
    (("-kvu", "--kv-unified"), "each slot holds its own KV rows"),
    (("--swa-full",), "sliding-window layers keep rings of the window (and 512 positions to rewind)"),
    (("--cache-reuse",), "a prompt reuses its session's KV by prefix (and the slot's marks), not by KV shifting"),
    (("-ctxcp", "--ctx-checkpoints"), "a slot keeps up to 3 marks (its context checkpoints)"),
    (("--pooling",), "embeddings are pooled as the model file says"),
    (("-to", "--timeout"), "the HTTP server keeps hypercorn's timeouts"),
    (("--threads-http",), "requests are served by one asyncio loop"),
)
LLAMA_SERVER_VALUED = ("-t", "-tb", "-ngl", "-fa", "-b", "-ub", "--cache-reuse", "-ctxcp", "--pooling", "-to",
                       "--threads-http")
# llama-server's downloads: refused with one line (there is no model hub here)
LLAMA_SERVER_DOWNLOADS = (("-hf", "--hf-repo"), ("-hff", "--hf-file"), ("-mu", "--model-url"))


def _download(flags) -> str:
    return "download_" + flags[-1].lstrip("-").replace("-", "_")


def _ignored(flags) -> str:
    return "ignored_" + flags[-1].lstrip("-").replace("-", "_")


def add_sampling_defaults(s) -> None:
    """serve's sampling defaults: what a request that leaves the field out gets (config.SamplingDefaults)."""
    sampling = s.add_argument_group(
        "sampling defaults", "what a request that leaves the field out gets, on every route (llama-server's flags; "
                             "default: each API's own, the contract's temperature 0.7, top_p 0.95, top_k 40 on chat)")
    sampling.add_argument("--temp", "--temperature", dest="temp", type=cli_types.non_negative_float, default=None,
                          help="temperature (default: none)")
    sampling.add_argument("--top-k", type=cli_types.non_negative_int, default=None, help="top-k, 0: all (default: none)")
    sampling.add_argument("--top-p", type=cli_types.unit_float, default=None, help="top-p (default: none)")
    sampling.add_argument("--min-p", type=cli_types.fraction, default=None, help="min-p, 0: off (default: none)")
    sampling.add_argument("--repeat-penalty", type=cli_types.positive_float, default=None,
                          help="repetition penalty, 1: off (default: none)")
    sampling.add_argument("--presence-penalty", type=cli_types.finite_float, default=None,
                          help="presence penalty (default: none)")
    sampling.add_argument("--frequency-penalty", type=cli_types.finite_float, default=None,
                          help="frequency penalty (default: none)")
    sampling.add_argument("--seed", type=int, default=None,
                          help="sampling seed of every request that gives none; -1: a fresh one each (default: none)")
    sampling.add_argument("-n", "--n-predict", type=cli_types.n_predict, default=None,
                          help="tokens generated at most where a request says not; -1: to the window (default: none)")
    sampling.add_argument("--chat-template-kwargs", type=cli_types.json_object, default=None, metavar="JSON",
                          help="the chat template's arguments, under a request's chat_template_kwargs, e.g. "
                               "'{\"enable_thinking\": false}' (default: none)")
    sampling.add_argument("--reasoning-format", choices=("auto", "deepseek", "none"), default=None,
                          help="a think model's thoughts: auto or deepseek split them into reasoning_content, none "
                               "leaves them in the content (default: auto)")
    sampling.add_argument("-rea", "--reasoning", choices=("on", "off", "auto"), default=None,
                          help="thinking where a request does not say: on, off, or auto, the template's own "
                               "(default: auto, else $PANTHEON_NO_THINK)")


def add_llama_server_flags(s) -> None:
    """-c, -np, -ctk/-ctv, and the flags accepted without effect (LLAMA_SERVER_IGNORED)."""
    llama = s.add_argument_group(
        "llama-server's flags", "read as llama-server b11434 reads them, so its command lines serve here too")
    llama.add_argument("-c", "--ctx-size", type=cli_types.positive_int, default=None,
                       help="context tokens over all --parallel slots, as llama-server divides -c: each session "
                            "gets CTX_SIZE / parallel (instead of --ctx-cap; default: none)")
    llama.add_argument("-np", "--parallel", type=cli_types.positive_int, default=None,
                       help="slots: --max-sessions and --max-concurrent both (default: none)")
    for flag, what in (("-ctk", "--cache-type-k"), ("-ctv", "--cache-type-v")):
        llama.add_argument(flag, what, choices=KV_DTYPE_CHOICES[1:], default=None,
                           help=f"the {what[-1].upper()} cache's type: --kv-dtype (K and V are held in one type "
                                "here: give both the same; default: none)")
    llama.add_argument("-cram", "--cache-ram", type=cli_types.cache_mib, default=None, metavar="MIB",
                       help="host memory for idle sessions' KV (the session host tier), MiB: -1 no limit (all "
                            "physical memory), 0 off (default: $PN_SESSION_HOST_BYTES, else a quarter of memory)")
    llama.add_argument("--cors-origins", default=None, metavar="ORIGINS",
                       help="browser origins allowed by CORS: *, localhost (loopback origins only, llama-server's "
                            "special value) or a comma-separated list (default: $PANTHEON_CORS_ORIGINS, else *)")
    llama.add_argument("--tags", default=None, metavar="A,B",
                       help="comma-separated tags listed in each model's /v1/models row (default: none)")
    llama.add_argument("--no-warmup", action="store_true",
                       help="compile each program on first use instead of at load (default: compiled at load)")
    llama.add_argument("--no-slots", dest="slots_endpoint", action="store_false",
                       help="GET /slots answers 501, as llama-server's (default: served)")
    llama.add_argument("-v", "--verbose", "--log-verbose", action="store_true",
                       help="log at DEBUG, each request's timing breakdown included (default: INFO)")
    for flags in LLAMA_SERVER_DOWNLOADS:
        llama.add_argument(*flags, dest=_download(flags), metavar="X",
                           help="refused: there is no model hub here; give the GGUF file with -m (default: none)")
    for flags, why in LLAMA_SERVER_IGNORED:
        valued = flags[0] in LLAMA_SERVER_VALUED
        llama.add_argument(*flags, dest=_ignored(flags), help=f"accepted and ignored: {why}"
                           + (" (default: none)" if valued else ""), **({"metavar": "X"} if valued else
                                                                       {"action": "store_true"}))


def apply_llama_server_flags(sp, args) -> None:
    """llama-server's `serve` flags as Pantheon's: -c over -np slots, -np, -ctk/-ctv, --cache-ram,
    --no-warmup; a download refused; a notice for the ones without effect."""
    for flags in LLAMA_SERVER_DOWNLOADS:
        if getattr(args, _download(flags)) is not None:
            sp.error(f"{flags[-1]}: there is no model hub here: download the GGUF file yourself and give it with -m")
    if args.cache_ram is not None:
        config.set_session_host_bytes(config.physical_memory() if args.cache_ram < 0 else args.cache_ram << 20)
    if args.no_warmup:
        config.disable_warm_up()
    if args.verbose:
        args.trace_requests = True  # and serve logs pantheon's loggers at DEBUG
    if args.ctx_size is not None and args.ctx_cap is not None:
        sp.error("give --ctx-size (llama-server's, over all slots) or --ctx-cap (per session), not both")
    if args.parallel is not None:
        for flag, value in (("--max-sessions", args.max_sessions), ("--max-concurrent", args.max_concurrent)):
            if value is not None and value != args.parallel:
                sp.error(f"--parallel {args.parallel} sets {flag} too: give one of them")
        args.max_sessions = args.max_concurrent = args.parallel
    if args.ctx_size is not None:
        slots = args.max_sessions or 4
        if args.ctx_size < slots:
            sp.error(f"--ctx-size {args.ctx_size} leaves no context for each of {slots} slots")
        args.ctx_cap = args.ctx_size // slots
    types = {t for t in (args.cache_type_k, args.cache_type_v, args.kv_dtype) if t not in (None, "auto")}
    if len(types) > 1:
        sp.error(f"the K and V caches are held in one type here: --cache-type-k, --cache-type-v and --kv-dtype "
                 f"name {', '.join(sorted(types))}")
    if types:
        args.kv_dtype = types.pop()
    given = [flags[0] for flags, _ in LLAMA_SERVER_IGNORED if getattr(args, _ignored(flags)) not in (None, False)]
    if given:
        print(f"pantheon serve: ignoring llama-server's {' '.join(given)} (see pantheon serve --help)", file=sys.stderr)
