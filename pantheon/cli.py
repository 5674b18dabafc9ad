"""Command line: serve | generate | tokenize | bench | profile | --backend."""

from __future__ import annotations

import argparse
import json
import sys
import time

from pantheon.engine.backend import compiled_backend, configure_jax, reexec_with_tcmalloc


def _model_path(arg: str | None) -> str:
    if arg:
        return arg
    from pantheon.default_model import default_model_path

    return str(default_model_path())


def _load_engine(args, ctx_cap: int = 4096, max_sessions: int = 1):
    from pantheon.engine.engine import Engine

    configure_jax()
    return Engine(_model_path(args.model), ctx_cap=ctx_cap, max_sessions=max_sessions, numerics=args.numerics)


def cmd_generate(args) -> int:
    from pantheon.engine.events import Delta, GenerationRequest, RequestError
    from pantheon.engine.sampler import SamplingParams

    engine = _load_engine(args)
    if args.tokens is not None:
        try:
            ids = [int(t) for t in json.loads(args.tokens)]
        except (ValueError, TypeError):
            print("pantheon: --tokens takes a JSON list of token ids", file=sys.stderr)
            return 2
        if not ids or not all(0 <= t < engine.spec.n_vocab for t in ids):
            print(f"pantheon: --tokens must be a non-empty list of ids in [0, {engine.spec.n_vocab})", file=sys.stderr)
            return 2
    elif args.prompt is None:
        print("pantheon: give a PROMPT or --tokens", file=sys.stderr)
        return 2
    else:
        prompt = args.prompt if args.raw else engine.render_chat([{"role": "user", "content": args.prompt}])
        ids = engine.encode_prompt(prompt)
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
        result = run_interleave(engine, args.interleave)
        print(result.table())
        print(json.dumps(result.as_dict()))
        return 0
    from pantheon.engine.bench import run_bench

    engine = _load_engine(args, ctx_cap=max(1024, args.prompt_tokens + args.decode_tokens + 8))
    result = run_bench(engine, prompt_tokens=args.prompt_tokens, decode_tokens=args.decode_tokens)
    print(result.table())
    print(json.dumps(result.as_dict()))
    return 0


def _bench_http(args) -> int:
    """Against --url, or a server started here for the run (max_concurrent = the largest level)."""
    from pantheon.engine import httpbench
    from pantheon.gguf import open_gguf
    from pantheon.text.tokenizer import Tokenizer

    levels = [int(x) for x in args.concurrency.split(",") if x.strip()]
    path = _model_path(args.model)
    bias = {str(t): -100 for t in Tokenizer.from_gguf(open_gguf(path)).eog_ids}  # full-length decodes
    server = None
    url = args.url
    try:
        if not url:
            server, url = _start_bench_server(path, max(levels), args)
        results = []
        httpbench.run_level(url, 1, 8, bias)  # warm-up: compiles the executables the levels need
        for level in levels:
            httpbench.run_level(url, level, 8, bias)
            results.append(httpbench.run_level(url, level, args.decode_tokens, bias))
        print(httpbench.table(results))
        print(httpbench.as_json(results))
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=60)
    return 0


def _start_bench_server(path: str, concurrency: int, args):
    import socket
    import subprocess

    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "pantheon", "serve", "--model", path, "--port", str(port),
           "--max-concurrent", str(concurrency), "--max-sessions", str(concurrency), "--ctx-cap", "1024",
           "--numerics", args.numerics]
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


def cmd_profile(args) -> int:
    from pathlib import Path

    from pantheon.engine.profile import capture, trace_files

    engine = _load_engine(args)
    out = capture(engine, Path(args.out), requests=args.requests, max_tokens=args.max_tokens)
    print(f"trace written to {out}")
    for f in trace_files(out):
        print(f"  {f}  (open in https://ui.perfetto.dev or chrome://tracing)")
    return 0


def cmd_serve(args) -> int:
    from pantheon.web.serve import serve

    return serve(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pantheon", description=__doc__)
    p.add_argument("--backend", action="store_true", help="print the backend this install runs on and exit")
    sub = p.add_subparsers(dest="command")

    def model_args(sp, numerics="exact"):
        sp.add_argument("--model", help="GGUF file (default: the embedded SmolLM2-135M-Instruct Q4_1)")
        sp.add_argument("--numerics", choices=("llamacpp", "exact"), default=numerics,
                        help="llamacpp: round activations as llama.cpp's quantized matmuls do (reproduces its "
                             "tokens; not batch-invariant); exact: f32 activations (batch-invariant)")

    g = sub.add_parser("generate", help="generate a completion for one prompt")
    model_args(g, numerics="llamacpp")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.7)
    g.add_argument("--top-p", type=float, default=0.95)
    g.add_argument("--top-k", type=int, default=40)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--raw", action="store_true", help="feed PROMPT as-is instead of one chat user message")
    g.add_argument("--json", action="store_true", help='print {"text", "tokens", "prompt_tokens"}')
    g.add_argument("--tokens", help="a JSON list of prompt token ids, fed as-is (instead of PROMPT)")
    g.add_argument("prompt", nargs="?")
    g.set_defaults(func=cmd_generate)

    t = sub.add_parser("tokenize", help="print the token ids of TEXT as a JSON list")
    t.add_argument("--model")
    t.add_argument("--no-special", action="store_true", help="do not parse special-token text")
    t.add_argument("text")
    t.set_defaults(func=cmd_tokenize)

    b = sub.add_parser("bench", help="prefill and decode throughput, time to first token")
    model_args(b)
    b.add_argument("--prompt-tokens", type=int, default=512)
    b.add_argument("--decode-tokens", type=int, default=128)
    b.add_argument("--concurrency", help="comma-separated levels, e.g. 1,4,8: aggregate decode tok/s and TTFT "
                                         "p50/p95 against a live server (started here unless --url)")
    b.add_argument("--url", help="a running server to measure with --concurrency")
    b.add_argument("--interleave", type=int, metavar="N",
                   help="short-request TTFT and a running stream's decode tok/s, alone and beside an "
                        "N-token prefill (through the scheduler)")
    b.set_defaults(func=cmd_bench)

    pr = sub.add_parser("profile", help="capture a jax.profiler trace of a few requests into profiles/")
    model_args(pr)
    pr.add_argument("--requests", type=int, default=4)
    pr.add_argument("--max-tokens", type=int, default=32)
    pr.add_argument("--out", default="profiles", help="folder for <timestamp>-<model>/ (default profiles/)")
    pr.set_defaults(func=cmd_profile)

    s = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    s.add_argument("--model", action="append", default=[], help="GGUF file (repeatable)")
    s.add_argument("--numerics", choices=("llamacpp", "exact"), default="exact",
                   help="exact (default): f32 activations, batching never changes results; llamacpp: "
                        "llama.cpp's 8-bit activation rounding")
    s.add_argument("--name", action="append", default=[], help="served name for the matching --model")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8080)
    s.add_argument("--ctx-cap", type=int, default=None)
    s.add_argument("--max-sessions", type=int, default=None)
    s.add_argument("--max-concurrent", type=int, default=None)
    s.add_argument("--reasoning-budget", type=int, default=None)
    s.add_argument("--dies", default=None, help="comma-separated device ordinals, e.g. 0,1")
    s.add_argument("--admin-token", default=None,
                   help="require Authorization: Bearer TOKEN on /admin/* (default $PANTHEON_ADMIN_TOKEN; "
                        "the variable keeps it out of the process list)")
    s.add_argument("--models-dir", default=None,
                   help="POST /admin/models/load opens only files under this folder (default $PANTHEON_MODELS_DIR)")
    s.set_defaults(func=cmd_serve)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.backend:
        print(compiled_backend())
        return 0
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    if argv is None and args.command in ("generate", "bench", "serve", "profile"):
        reexec_with_tcmalloc(sys.argv)
    from pantheon.default_model import DefaultModelError
    from pantheon.gguf.reader import GGUFError

    try:
        return args.func(args)
    except (GGUFError, DefaultModelError) as e:
        print(f"pantheon: {' '.join(str(e).splitlines())}", file=sys.stderr)  # one line
        return 1
