"""Command line: serve | router | generate | tokenize | bench | profile | --backend."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pantheon import cli_llama, cli_types
from pantheon.config import KV_DTYPE_CHOICES, admin_token
from pantheon.engine.backend import compiled_backend, configure_jax, reexec_with_tcmalloc
from pantheon.engine.memory import limit_thread_caches
from pantheon.text.chat_template import BUILTIN_TEMPLATES


def _phase(message: str) -> None:
    """One line per long silent phase, on stderr, only when it is a terminal."""
    if sys.stderr.isatty():
        print(f"pantheon: {message}", file=sys.stderr, flush=True)


def _model_path(arg: str | None) -> str:
    if arg:
        return arg
    from pantheon.default_model import default_model_path

    return str(default_model_path())


def _load_engine(args, ctx_cap: int = 4096, max_sessions: int = 1):
    from pantheon.engine.engine import Engine

    from pantheon.config import ModelConfig, Settings
    from pantheon.engine.pool import ModelPool

    path = _model_path(args.model)
    configure_jax()
    limit_thread_caches()
    # refused before the load, as `serve` refuses one (a PoolError: one line, exit 1)
    ModelPool().admit(ModelConfig(path=path, name=path, ctx_cap=ctx_cap, max_sessions=max_sessions,
                                  numerics=args.numerics, kv_dtype=args.kv_dtype))
    _phase(f"loading model {path} ({args.numerics} numerics, {args.kv_dtype} KV)...")
    config = ModelConfig(path=path, ctx_cap=ctx_cap, max_sessions=max_sessions, numerics=args.numerics,
                         kv_dtype=args.kv_dtype, chat_template=getattr(args, "chat_template", None))
    return Engine(config, Settings.from_env())


def cmd_generate(args) -> int:
    from pantheon.engine.events import Delta, GenerationRequest, RequestError
    from pantheon.engine.sampler import SamplingParams

    engine = _load_engine(args)
    if args.tokens is not None:
        ids = args.token_ids  # parsed and checked before the load (_check_args)
        if not all(0 <= t < engine.spec.n_vocab for t in ids):
            print(f"pantheon: --tokens must be a non-empty list of ids in [0, {engine.spec.n_vocab})", file=sys.stderr)
            return 2
    else:
        raw = args.raw or engine.template is None  # a base model without a template: the text as it is
        if raw:  # BOS as the model says, as llama.cpp tokenizes a raw prompt
            ids = engine.tokenizer.encode(args.prompt, parse_special=True, add_bos=None)
        else:
            ids = engine.encode_prompt(engine.render_chat([{"role": "user", "content": args.prompt}]))
    sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                              logprobs=args.json)  # token ids ride the logprob records
    request = GenerationRequest(ids, [sampling], args.max_tokens)
    tokens, pieces, errors = [], [], []

    def emit(ev):
        if isinstance(ev, Delta):
            tokens.extend(t.token for t in ev.tokens)
            piece = ev.reasoning + ev.content
            pieces.append(piece)
            if not args.json:
                sys.stdout.write(piece)
                sys.stdout.flush()
        elif isinstance(ev, RequestError):
            errors.append(ev.message)

    _phase("compiling (the first run per shape; later runs read the XLA cache) and generating...")
    engine.run_sync(request, emit)
    if errors:
        print(f"pantheon: {errors[0]}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"text": "".join(pieces), "tokens": tokens, "prompt_tokens": len(ids)}, ensure_ascii=False))
    else:
        sys.stdout.write("\n")
    return 0


def cmd_tokenize(args) -> int:
    from pantheon.gguf import open_gguf
    from pantheon.text.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(open_gguf(_model_path(args.model)))
    print(json.dumps(tok.encode(args.text, parse_special=not args.no_special)))
    return 0


def cmd_bench(args) -> int:
    if args.concurrency:
        return _bench_http(args)
    if args.interleave:
        from pantheon.engine.bench import run_interleave

        engine = _load_engine(args, ctx_cap=args.interleave + 512, max_sessions=4)
        _phase("compiling and measuring...")
        result = run_interleave(engine, args.interleave)
        print(result.table())
        print(json.dumps(result.as_dict()))
        return 0
    from pantheon.engine.bench import run_bench

    engine = _load_engine(args, ctx_cap=max(1024, args.prompt_tokens + args.decode_tokens + 8))
    _phase("compiling (warm-up) and measuring...")
    result = run_bench(engine, prompt_tokens=args.prompt_tokens, decode_tokens=args.decode_tokens)
    print(result.table())
    print(json.dumps(result.as_dict()))
    return 0


def _bench_http(args) -> int:
    """Against --url, or a server started here for the run (max_concurrent = the largest level).
    Per server: the levels' decode throughput, one long prompt's TTFT, RSS after warm-up and at the end."""
    from pantheon.engine import httpbench
    from pantheon.gguf import open_gguf
    from pantheon.text.tokenizer import Tokenizer

    levels = [int(x) for x in args.concurrency.split(",") if x.strip()]
    path = _model_path(args.model)
    gguf = open_gguf(path)
    bias = {str(t): -100 for t in Tokenizer.from_gguf(gguf).eog_ids}  # full-length decodes
    httpbench.RAW_COMPLETIONS = not gguf.metadata.get("tokenizer.chat_template")  # a base model: raw text
    server = None
    url = args.url
    try:
        if not url:
            _phase("starting a server and loading the model...")
            server, url = httpbench.start_server(path, max(levels), ["--ctx-cap", str(args.ctx_cap), "--numerics",
                                                                     args.numerics, "--kv-dtype", args.kv_dtype])
        servers = {"pantheon": url} | ({"other": args.against} if args.against else {})
        pids = {name: httpbench.local_pid(u) for name, u in servers.items()}
        for u in servers.values():  # warm-up: compile, first touches
            httpbench.run_level(u, 1, 8, bias, first_prompt=999)
        warm = {name: httpbench.memory_of(pid) for name, pid in pids.items()}
        _phase(f"measuring {', '.join(servers)} ({args.runs} runs per level, alternating)...")
        bandwidth = {"before": httpbench.memory_read_gbs()}
        results = httpbench.compare(servers, levels, args.decode_tokens, bias, runs=args.runs)
        bandwidth["after"] = httpbench.memory_read_gbs()
        long = httpbench.long_prompts(servers, args.long_prompt_words, bias, runs=args.runs) if args.long_prompt_words \
            else {name: httpbench.LongPromptResult(0, float("nan")) for name in servers}
        end = {name: httpbench.memory_of(pid) for name, pid in pids.items()}
        if args.against:
            print(httpbench.comparison_table(results["pantheon"], results["other"]))
        else:
            print(httpbench.table(results["pantheon"]))
        print(httpbench.server_table(list(servers), long, warm, end))
        print(f"this machine's memory read bandwidth ({bandwidth['before']['threads']} threads): "
              f"{bandwidth['before']['gb_per_s']} GB/s before the levels, {bandwidth['after']['gb_per_s']} after")
        out = json.loads(httpbench.as_json(results["pantheon"], results.get("other")))
        out["memory_read_gbs"] = bandwidth
        out["servers"] = {name: {"long_prompt": {"prompt_tokens": long[name].prompt_tokens, "ttft_ms": long[name].ttft_ms},
                                 "memory_after_warmup": warm[name], "memory_at_end": end[name]} for name in servers}
        print(json.dumps(out))
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=60)
    return 0


def cmd_router(args) -> int:
    import asyncio
    import logging

    from hypercorn.asyncio import serve as hypercorn_serve
    from hypercorn.config import Config

    from pantheon.router import create_app

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    hc = Config()
    hc.bind = [f"{args.host}:{args.port}"]
    hc.graceful_timeout = 5
    asyncio.run(hypercorn_serve(create_app(args.instance_ttl, admin_token=admin_token()),
                                hc))
    return 0


def cmd_profile(args) -> int:
    from pantheon.engine.profile import capture, trace_files

    engine = _load_engine(args)
    _phase("compiling and tracing...")
    out = capture(engine, Path(args.out), requests=args.requests, max_tokens=args.max_tokens)
    print(f"trace written to {out}")
    for f in trace_files(out):
        print(f"  {f}  (open in https://ui.perfetto.dev or chrome://tracing)")
    return 0


def cmd_serve(args) -> int:
    from pantheon.web.serve import serve

    return serve(args)


class _Parser(argparse.ArgumentParser):
    """Usage errors are one line on stderr and exit code 2, before anything heavy is imported."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" unless the help already says what the default is."""

    def _get_help_string(self, action):
        help_ = action.help or ""
        if "default" in help_ or action.default in (None, argparse.SUPPRESS) or not action.option_strings:
            return help_
        if action.nargs == 0 and action.default is False:  # a switch
            return help_ + " (default: off)"
        return super()._get_help_string(action)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("pantheon")
    except PackageNotFoundError:
        return "unknown (not installed)"


NUMERICS_HELP = ("exact: f32 activations (K-quant products on AVX-512 VNNI: 23-bit fixed point per 32, exact integer "
                 "sums), the right answers and batch-invariant; llamacpp: round activations "
                 "to 8-bit blocks as llama.cpp's quantized matmuls do (reproduces llama.cpp's tokens; batch "
                 "composition can flip near-ties)")
KV_DTYPE_HELP = ("the KV cache's type: auto (on the CPU f16, as llama.cpp, or f32 with --numerics llamacpp; bf16 "
                 "on a GPU), f32, f16, bf16, or q8_0 (ggml's 8-bit blocks, 8.5 bits a value; the CPU only) "
                 "(default: auto)")
DEFAULT_MODEL_HELP = "GGUF file (default: the embedded SmolLM2-135M-Instruct Q4_1, fetched once)"


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="pantheon", description=__doc__, formatter_class=_HelpFormatter)
    p.add_argument("--backend", action="store_true", help="print the backend this install runs on and exit")
    p.add_argument("--version", action="version", version=f"%(prog)s {_version()}",
                   help="print the installed version and exit")
    sub = p.add_subparsers(dest="command", parser_class=_Parser)

    def add(name, **kw):
        return sub.add_parser(name, formatter_class=_HelpFormatter, **kw)

    def model_args(sp):
        sp.add_argument("-m", "--model", type=cli_types.gguf_file, help=DEFAULT_MODEL_HELP)
        sp.add_argument("--numerics", choices=("exact", "llamacpp"), default="exact", help=NUMERICS_HELP)
        sp.add_argument("--kv-dtype", choices=KV_DTYPE_CHOICES, default="auto", help=KV_DTYPE_HELP)

    def chat_template_args(sp):
        sp.add_argument("--chat-template", metavar="NAME|JINJA", default=None,
                        help=f"the chat template in place of the file's: one of {', '.join(BUILTIN_TEMPLATES)} "
                             "(llama.cpp's names) or a Jinja template's text (default: the file's "
                             "tokenizer.chat_template; a file without one serves raw completions only)")
        sp.add_argument("--chat-template-file", metavar="PATH", default=None,
                        help="read the chat template's Jinja text from this file (default: none)")

    g = add("generate", help="generate a completion for one prompt")
    model_args(g)
    g.add_argument("--max-tokens", type=cli_types.positive_int, default=256, help="tokens to generate at most")
    g.add_argument("--temperature", type=cli_types.non_negative_float, default=0.7, help="sampling temperature; 0 is greedy")
    g.add_argument("--top-p", type=cli_types.unit_float, default=0.95, help="nucleus sampling mass, in (0, 1]")
    g.add_argument("--top-k", type=cli_types.non_negative_int, default=40, help="sample among the k likeliest tokens; 0: all")
    g.add_argument("--seed", type=int, default=None, help="sampling seed (default: a fresh random seed)")
    chat_template_args(g)
    g.add_argument("--raw", action="store_true", help="feed PROMPT as-is instead of one chat user message")
    g.add_argument("--json", action="store_true", help='print {"text", "tokens", "prompt_tokens"}')
    g.add_argument("--tokens", help="a JSON list of prompt token ids, fed as-is instead of PROMPT (default: none)")
    g.add_argument("prompt", nargs="?", help="the user message (or, with --raw, the whole prompt text)")
    g.set_defaults(func=cmd_generate)

    t = add("tokenize", help="print the token ids of TEXT as a JSON list")
    t.add_argument("--model", type=cli_types.gguf_file, help=DEFAULT_MODEL_HELP)
    t.add_argument("--no-special", action="store_true", help="do not parse special-token text")
    t.add_argument("text", help="the text to tokenize")
    t.set_defaults(func=cmd_tokenize)

    b = add("bench", help="prefill and decode throughput, time to first token")
    model_args(b)
    b.add_argument("--prompt-tokens", type=cli_types.positive_int, default=512, help="prompt length of the one-stream run")
    b.add_argument("--decode-tokens", type=cli_types.positive_int, default=128, help="tokens decoded per stream")
    b.add_argument("--concurrency", type=cli_types.levels,
                   help="comma-separated levels, e.g. 1,4,8: aggregate decode tok/s and TTFT p50/p95 against a "
                        "live server, started here unless --url (default: off, the engine directly)")
    b.add_argument("--url", help="a running server to measure with --concurrency (default: start one here)")
    b.add_argument("--against", metavar="URL",
                   help="with --concurrency: also measure this OpenAI-compatible server (e.g. llama-server on the "
                        "same model), alternating run by run, and print both with the ratios (default: off)")
    b.add_argument("--long-prompt-words", type=cli_types.non_negative_int, default=1200,
                   help="with --concurrency: the TTFT of one prompt of this many words (~1500 tokens) per run, "
                        "alone on each server; 0: off (default: 1200)")
    b.add_argument("--ctx-cap", type=cli_types.positive_int, default=2048,
                   help="with --concurrency: context per session of the server started here; llama-server's "
                        "match is -c <ctx-cap x its -np> (default: 2048)")
    b.add_argument("--runs", type=cli_types.positive_int, default=3,
                   help="measured runs per level (and per server); the median run is reported (default: 3)")
    b.add_argument("--interleave", type=cli_types.positive_int, metavar="N",
                   help="short-request TTFT and a running stream's decode tok/s, alone and beside an "
                        "N-token prefill, through the scheduler (default: off)")
    b.set_defaults(func=cmd_bench)

    pr = add("profile", help="capture a jax.profiler trace of a few requests into profiles/")
    model_args(pr)
    pr.add_argument("--requests", type=cli_types.positive_int, default=4, help="requests to trace")
    pr.add_argument("--max-tokens", type=cli_types.positive_int, default=32, help="tokens generated per request")
    pr.add_argument("--out", default="profiles", help="folder for <timestamp>-<model>/")
    pr.set_defaults(func=cmd_profile)

    s = add("serve", help="serve the OpenAI-compatible HTTP API")
    s.add_argument("-m", "--model", action="append", default=[],
                   help="GGUF file, repeatable (default: $PANTHEON_MODEL, else the embedded SmolLM2 model); "
                        "a file that fails to load leaves the server up, answering 503 no_models_loaded")
    s.add_argument("--numerics", choices=("exact", "llamacpp"), default="exact", help=NUMERICS_HELP)
    s.add_argument("--kv-dtype", choices=KV_DTYPE_CHOICES, default=None,
                   help=KV_DTYPE_HELP.replace("(default: auto", "(default: $PANTHEON_KV_DTYPE, else auto"))
    chat_template_args(s)
    s.add_argument("-a", "--alias", "--name", dest="name", action="append", default=[],
                   help="served name for the matching --model; comma-separated names are llama-server's aliases "
                        "(the first in sorted order is the id, each answers) (default: the file name without .gguf)")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on")
    s.add_argument("--port", type=cli_types.port, default=8080, help="port to listen on")
    s.add_argument("--ctx-cap", type=cli_types.positive_int, default=None,
                   help="context tokens per slot (default: $PANTHEON_CTX_CAP, else 4096)")
    s.add_argument("--max-sessions", type=cli_types.positive_int, default=None,
                   help="sessions kept on the device (default: $PANTHEON_MAX_SESSIONS, else 4)")
    s.add_argument("--max-concurrent", type=cli_types.positive_int, default=None,
                   help="requests decoding together (default: $PANTHEON_MAX_CONCURRENT, else --max-sessions)")
    s.add_argument("--reasoning-budget", type=cli_types.reasoning_budget, default=None,
                   help="thinking tokens per turn before the think block is closed; 0 or llama-server's -1: no "
                        "budget (default: $PANTHEON_REASONING_BUDGET, else 0: no budget)")
    s.add_argument("--dies", type=cli_types.dies, default=None,
                   help="comma-separated device ordinals, e.g. 0,1 (default: the die manager's choice)")
    s.add_argument("--admin-token", default=None,
                   help="require Authorization: Bearer TOKEN on /admin/* (default $PANTHEON_ADMIN_TOKEN; "
                        "the variable keeps it out of the process list)")
    s.add_argument("--api-key", default=None,
                   help="require Authorization: Bearer KEY or x-api-key: KEY on the inference routes (default "
                        "$PANTHEON_API_KEY; unset: open, as the contract serves)")
    s.add_argument("--models-dir", default=None,
                   help="POST /admin/models/load opens only files under this folder (default $PANTHEON_MODELS_DIR)")
    s.add_argument("--log-format", choices=("text", "json"), default=None,
                   help="the access log: one line per request, text or JSON (default $PANTHEON_ACCESS_LOG, else text)")
    s.add_argument("--quiet", action="store_true", help="no access log (default: one line per request)")
    s.add_argument("--router", default=None, metavar="URL",
                   help="register with this router (pantheon router) and heartbeat to it (default $PANTHEON_ROUTER)")
    s.add_argument("--advertise", default=None, metavar="URL",
                   help="the URL the router reaches this instance at (default http://HOST:PORT)")
    s.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                   help="one model over several processes/hosts: the jax.distributed coordinator (process 0's "
                        "address); every process runs the same serve command with its --process-id "
                        "(default: none, one process)")
    s.add_argument("--num-processes", type=cli_types.positive_int, default=1, help="processes in all, with --coordinator (default: 1)")
    s.add_argument("--process-id", type=cli_types.non_negative_int, default=0,
                   help="this process: 0 serves HTTP, the others follow its steps (default: 0)")
    s.add_argument("--trace-requests", action="store_true",
                   help="log each request's timing breakdown (queue wait, prefill, decode, detok) at DEBUG "
                        "(default: off)")
    cli_llama.add_sampling_defaults(s)
    cli_llama.add_llama_server_flags(s)
    s.set_defaults(func=cmd_serve)

    r = add("router", help="run the router that serve instances register with (pantheon.router)")
    r.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    r.add_argument("--port", type=cli_types.port, default=8090, help="port to listen on (default: %(default)s)")
    r.add_argument("--instance-ttl", type=cli_types.positive_float, default=10.0,
                   help="seconds without a heartbeat after which an instance is no longer live (default: %(default)s)")
    r.set_defaults(func=cmd_router)
    return p


def _check_args(parser: argparse.ArgumentParser, args) -> None:
    """What argparse's types cannot check alone, before anything loads (one line, exit code 2)."""
    sp = parser._subparsers._group_actions[0].choices.get(args.command)  # its prog names the subcommand
    if args.command == "serve":
        cli_llama.apply_llama_server_flags(sp, args)
    if args.command == "bench" and (args.against or args.url) and not args.concurrency:
        sp.error("--against and --url measure over HTTP: give --concurrency too, e.g. 1,4,8")
    if args.command == "serve" and (args.coordinator or args.num_processes > 1 or args.process_id):
        if not args.coordinator or args.num_processes < 2 or args.process_id >= args.num_processes:
            sp.error("--coordinator HOST:PORT needs --num-processes N >= 2 and --process-id in [0, N)")
    if getattr(args, "chat_template_file", None):
        if args.chat_template:
            sp.error("give --chat-template or --chat-template-file, not both")
        try:
            args.chat_template = Path(args.chat_template_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            sp.error(f"--chat-template-file {args.chat_template_file}: {e.strerror if isinstance(e, OSError) else e}")
    if args.command != "generate":
        return
    if args.tokens is None:
        if args.prompt is None:
            sp.error("give a PROMPT or --tokens")
        return
    try:
        ids = json.loads(args.tokens)
        ok = isinstance(ids, list) and bool(ids) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                          for t in ids)
    except ValueError:
        ok = False
    if not ok:
        sp.error("--tokens takes a non-empty JSON list of token ids, e.g. [1, 2, 3]")
    args.token_ids = ids


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _check_args(parser, args)
    if args.backend:
        print(compiled_backend())
        return 0
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    if argv is None and args.command in ("generate", "bench", "serve", "profile"):
        reexec_with_tcmalloc(sys.argv)
    from pantheon.default_model import DefaultModelError
    from pantheon.engine.httpbench import BenchError
    from pantheon.engine.pool import PoolError
    from pantheon.gguf.reader import GGUFError

    try:
        return args.func(args)
    except (GGUFError, DefaultModelError, PoolError, BenchError) as e:
        print(f"pantheon: {' '.join(str(e).splitlines())}", file=sys.stderr)  # one line
        return 1
