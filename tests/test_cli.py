"""The command line, run as a user would run it."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from pantheon import cli


def pantheon(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pantheon", *args], capture_output=True, text=True, timeout=timeout)


def test_backend_prints_one_lowercase_token():
    out = pantheon("--backend")
    assert out.returncode == 0 and out.stdout.strip() in ("cpu", "cuda")


def test_tokenize_with_and_without_special(smollm2_path):
    out = pantheon("tokenize", "--model", str(smollm2_path), "<|im_start|>Hello world")
    assert json.loads(out.stdout) == [1, 19556, 905]
    out = pantheon("tokenize", "--no-special", "<|im_start|>")
    assert json.loads(out.stdout) == [44, 108, 306, 79, 3738, 108, 46]


def test_generate_json_greedy_first_token_equals_llamacpp(smollm2_path):
    out = pantheon("generate", "--model", str(smollm2_path), "--numerics", "llamacpp", "--json", "--temperature", "0",
                   "--max-tokens", "4", "What is the capital of France?")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["prompt_tokens"] == 37 and result["tokens"][0] == 60  # llama.cpp's first greedy token
    assert len(result["tokens"]) == 4 and result["text"].startswith("L'")


def test_generate_on_a_bad_file_is_a_clear_error(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"nope")
    out = pantheon("generate", "--model", str(bad), "hi")
    assert out.returncode == 1 and "not a GGUF file" in out.stderr and "Traceback" not in out.stderr


def test_generate_tokens_reproduces_llamacpp_greedy_on_the_qwen35moe_references(reference_dir, qwen35moe_f32_gguf):
    """The F32 and Q3_K-experts reference files, through the CLI: llama.cpp's greedy continuation
    (the Q3_K file with exact dequantization is compared in tests/model; here its greedy run must
    equal the F32 file's where llama.cpp's own Q3_K run does)."""
    ref = json.loads((reference_dir / "qwen35moe" / "ref" / "greedy.json").read_text())
    path = qwen35moe_f32_gguf
    for seq in ("s5", "s33"):
        prompt = ref["f32"]["prompt"][seq]
        out = pantheon("generate", "--model", str(path), "--numerics", "exact", "--json", "--temperature", "0",
                       "--max-tokens", "24", "--tokens", json.dumps(prompt))
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["tokens"] == ref["f32"]["generated"][seq]


def test_generate_on_q3k_experts_follows_llamacpp_loosely(reference_dir, qwen35moe_q3k_experts_gguf):
    """llama.cpp's own Q3_K run rounds activations to 8 bits, so its greedy tokens are only loosely
    comparable (the exact comparison, to its dequantized-f32 logits, is in tests/model). Measured
    leading agreement of 24 tokens: exact numerics 20 (s5) and 24 (s33), llamacpp numerics 24 and 13."""
    ref = json.loads((reference_dir / "qwen35moe" / "ref" / "greedy.json").read_text())["q3k_experts"]
    path = qwen35moe_q3k_experts_gguf
    for numerics in ("exact", "llamacpp"):
        for seq in ("s5", "s33"):
            out = pantheon("generate", "--model", str(path), "--numerics", numerics, "--json", "--temperature", "0",
                           "--max-tokens", "24", "--tokens", json.dumps(ref["prompt"][seq]))
            got, expected = json.loads(out.stdout)["tokens"], ref["generated"][seq]
            agree = next((i for i in range(24) if got[i] != expected[i]), 24)
            assert agree >= 12, (numerics, seq, agree)


def test_version_prints_the_package_version():
    from importlib.metadata import version

    out = pantheon("--version", timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == f"pantheon {version('pantheon')}"


@pytest.mark.parametrize("argv, expected", [
    (["generate"], "give a PROMPT or --tokens"),
    (["generate", "--model", "/nonexistent/m.gguf", "hi"], "no such file: /nonexistent/m.gguf"),
    (["generate", "--max-tokens", "0", "hi"], "--max-tokens: must be a positive integer"),
    (["generate", "--max-tokens", "many", "hi"], "--max-tokens: invalid int value"),
    (["generate", "--temperature", "-1", "hi"], "--temperature: must be a finite number >= 0"),
    (["generate", "--top-p", "1.5", "hi"], "--top-p: must be in (0, 1]"),
    (["generate", "--tokens", "[1, -2]"], "--tokens takes a non-empty JSON list"),
    (["tokenize", "--model", "/nonexistent/m.gguf", "hi"], "no such file"),
    (["bench", "--decode-tokens", "-5"], "--decode-tokens: must be a positive integer"),
    (["bench", "--concurrency", "1,x"], "--concurrency: takes comma-separated positive integers"),
    (["bench", "--against", "http://127.0.0.1:9"], "give --concurrency too"),
    (["bench", "--concurrency", "1", "--runs", "0"], "--runs: must be a positive integer"),
    (["profile", "--requests", "0"], "--requests: must be a positive integer"),
    (["serve", "--port", "70000"], "--port: must be a port number"),
    (["serve", "--max-sessions", "0"], "--max-sessions: must be a positive integer"),
    (["serve", "--chat-template-file", "/nonexistent/t.jinja"], "--chat-template-file /nonexistent/t.jinja: No such file"),
    (["generate", "--chat-template", "chatml", "--chat-template-file", __file__, "hi"],
     "give --chat-template or --chat-template-file, not both"),
])
def test_bad_arguments_fail_at_once_in_one_line(argv, expected):
    """Before any model loads or jax imports: one line on stderr, exit code 2 (measured ~0.1 s each,
    where a load would take 25-38 s)."""
    out = pantheon(*argv, timeout=60)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0] and lines[0].startswith("pantheon"), out.stderr
    assert out.stdout == ""


def test_every_flag_of_every_subcommand_shows_its_default():
    parser = cli.build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, sp in subparsers.choices.items():
        formatter = sp._get_formatter()
        for action in sp._actions:
            if not action.option_strings or isinstance(action, argparse._HelpAction):
                continue
            text = formatter._expand_help(action) if action.help else ""
            assert "default" in text, (name, action.option_strings, text)
    assert "(default: exact)" in subparsers.choices["generate"].format_help()
    assert "(default: 256)" in subparsers.choices["generate"].format_help()


@pytest.mark.parametrize("command", ["generate", "bench", "profile", "serve"])
def test_numerics_default_is_exact_everywhere(command):
    argv = [command, "hi"] if command == "generate" else [command]
    args = cli.build_parser().parse_args(argv)
    assert args.numerics == "exact"
    assert cli.build_parser().parse_args([*argv, "--numerics", "llamacpp"]).numerics == "llamacpp"


def test_serve_with_a_missing_model_file_exits_2_with_the_path(tmp_path):
    missing = tmp_path / "missing.gguf"
    r = subprocess.run([sys.executable, "-m", "pantheon", "serve", "--port", "1", "--model", str(missing)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and f"model file not found: {missing}" in r.stderr, r.stderr


def test_serve_whose_every_model_fails_to_load_exits_1_with_the_reason(tmp_path):
    from tests.web.server import free_port

    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + bytes(64))
    r = subprocess.run([sys.executable, "-m", "pantheon", "serve", "--port", str(free_port()), "--model", str(bad)],
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 1, r.stderr[-2000:]
    assert "could not load bad" in r.stderr and "bad magic" in r.stderr and "no model could be loaded" in r.stderr


def test_generate_refuses_a_model_past_the_host_budget_in_one_line(tmp_path):
    """The CLI admits a model as serve does: past the budget it says so in one line and exits 1,
    before loading (no traceback, no OOM kill)."""
    import os

    from tests.fixtures.tiny_models import write_tiny_llama

    path = write_tiny_llama(tmp_path / "m.gguf")
    r = subprocess.run([sys.executable, "-m", "pantheon", "generate", "--model", str(path), "--max-tokens", "2", "hi"],
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PANTHEON_HOST_MEMORY_BYTES": "100000"})
    assert r.returncode == 1, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.startswith("pantheon:")]
    assert len(lines) == 1 and "admission refused" in lines[0] and "MiB" in lines[0], r.stderr
    assert "Traceback" not in r.stderr and "loading model" not in r.stderr


def test_bench_against_a_server_that_refuses_is_one_line_and_exit_1(smollm2_path):
    """A measured server that is not there (or answers errors) ends the bench with one line naming
    it and the first failure, not client threads' tracebacks."""
    r = pantheon("bench", "--model", str(smollm2_path), "--url", "http://127.0.0.1:9", "--concurrency", "1", timeout=120)
    assert r.returncode == 1, r.stderr[-2000:]
    lines = [line for line in r.stderr.strip().splitlines() if "Traceback" in line or line.startswith("pantheon")]
    assert lines == ["pantheon: http://127.0.0.1:9: 1 request(s) failed (first: ConnectError: [Errno 111] Connection refused)"]


def test_llama_servers_command_line_serves_here(capsys):
    """`pantheon serve` takes llama-server's common flags as it reads them: -m, -a, -c over -np
    slots, -np, -ctk/-ctv; the ones without effect here are named on stderr, once."""
    from pantheon.web.serve import config_from_args

    parser = cli.build_parser()
    argv = ["serve", "-m", "a.gguf", "-a", "a", "-c", "8192", "-np", "2", "-ctk", "f16", "-ctv", "f16",
            "-t", "2", "-ngl", "99", "-fa", "on", "--jinja", "-cb", "--port", "8099"]
    args = parser.parse_args(argv)
    cli._check_args(parser, args)
    config = config_from_args(args)
    assert config.models == (("a.gguf", "a"),)
    assert (config.ctx_cap, config.max_sessions, config.max_concurrent) == (4096, 2, 2)  # 8192 over 2 slots
    assert config.kv_dtype == "f16" and config.port == 8099
    assert capsys.readouterr().err.strip() == "pantheon serve: ignoring llama-server's -t -ngl -fa -cb --jinja " \
                                              "(see pantheon serve --help)"
    args = parser.parse_args(["serve", "-c", "8192"])  # llama-server's default slots: 4
    cli._check_args(parser, args)
    assert config_from_args(args).ctx_cap == 2048 and capsys.readouterr().err == ""
    assert config_from_args(args).sampling.given() == {}
    # a model card's recommended sampling, as llama-server takes it: every request's defaults
    args = parser.parse_args(["serve", "--temp", "0.6", "--top-k", "20", "--top-p", "0.95", "--min-p", "0",
                              "--repeat-penalty", "1.1", "--seed", "-1", "-n", "256"])
    assert config_from_args(args).sampling.given() == {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "min_p": 0.0,
                                                       "repetition_penalty": 1.1, "max_tokens": 256}
    assert config_from_args(parser.parse_args(["serve", "--seed", "7", "-n", "-1"])).sampling.given() == \
        {"seed": 7, "max_tokens": -1}
    assert config_from_args(parser.parse_args(["serve", "--reasoning-budget", "-1"])).reasoning_budget == 0  # unbounded


def test_llama_servers_other_serve_flags(capsys, monkeypatch):
    """--chat-template-kwargs and --reasoning become every request's template arguments; --cache-ram
    sizes the session host tier (MiB; 0 off, -1 all memory); --no-warmup, --no-slots, -v; the rest of
    llama-server's common flags are accepted and named."""
    from pantheon import config as config_module
    from pantheon.web.serve import config_from_args

    for name in ("PN_SESSION_HOST_BYTES", "PANTHEON_WARMUP"):
        monkeypatch.delenv(name, raising=False)
    parser = cli.build_parser()

    def read(*argv):
        args = parser.parse_args(["serve", *argv])
        cli._check_args(parser, args)
        return args, config_from_args(args)

    _, config = read("--chat-template-kwargs", '{"enable_thinking": true, "reasoning_effort": "low"}', "-rea", "off")
    assert config.sampling.template_kwargs == {"enable_thinking": False, "reasoning_effort": "low"}
    assert config.sampling.given() == {}  # merged under a request's kwargs, not filled in as a field
    assert read("--reasoning", "auto")[1].sampling.template_kwargs is None
    read("--cache-ram", "512")
    assert config_module.session_host_bytes() == 512 << 20
    read("-cram", "0")
    assert config_module.session_host_bytes() == 0
    read("--cache-ram", "-1")
    assert config_module.session_host_bytes() == config_module.physical_memory()
    assert config_module.Settings.from_env().warm_up
    args, config = read("--no-warmup", "--no-slots", "-v")
    assert not config_module.Settings.from_env().warm_up and not config.slots_endpoint and args.trace_requests
    assert read()[1].slots_endpoint and read()[1].tags == ()
    assert read("--tags", "small, chat,small")[1].tags == ("chat", "small")
    capsys.readouterr()
    _, config = read("--offline", "--embeddings", "--no-context-shift", "-kvu", "--cache-reuse", "256", "-ctxcp", "8",
                     "--reasoning-format", "none", "--no-ui")
    assert capsys.readouterr().err.strip() == "pantheon serve: ignoring llama-server's --no-webui --offline " \
        "--embedding --no-context-shift -kvu --cache-reuse -ctxcp (see pantheon serve --help)"
    assert config.sampling.given() == {"reasoning_format": "none"}  # a request's field where it gives none


@pytest.mark.parametrize("argv, expected", [
    (["serve", "-hf", "ggml-org/models"], "--hf-repo: there is no model hub here"),
    (["serve", "--model-url", "https://x/y.gguf"], "--model-url: there is no model hub here"),
    (["serve", "--chat-template-kwargs", "[1]"], "must be a JSON object"),
    (["serve", "--cache-ram", "-2"], "must be MiB, -1 (no limit) or 0 (off)"),
    (["serve", "--reasoning", "maybe"], "invalid choice: 'maybe'"),
    (["serve", "-c", "8192", "--ctx-cap", "2048"], "give --ctx-size"),
    (["serve", "-np", "2", "--max-sessions", "4"], "--parallel 2 sets --max-sessions too"),
    (["serve", "-ctk", "f16", "-ctv", "q8_0"], "held in one type here"),
    (["serve", "-ctk", "q4_0"], "invalid choice: 'q4_0'"),
    (["serve", "-c", "3", "-np", "4"], "leaves no context"),
    (["serve", "--min-p", "2"], "--min-p: must be in [0, 1]"),
    (["serve", "-n", "0"], "must be a positive integer or -1"),
    (["serve", "--presence-penalty", "nan"], "must be a finite number"),
])
def test_llama_servers_flags_that_cannot_be_served_fail_in_one_line(argv, expected):
    out = pantheon(*argv, timeout=60)
    assert out.returncode == 2 and expected in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_several_hosts_as_llama_server_takes_them():
    from pantheon.web.serve import binds, exposure_warning
    from pantheon.config import ServeConfig

    assert binds("127.0.0.1,::1", 8080) == ["127.0.0.1:8080", "[::1]:8080"]
    assert binds("localhost", 9) == ["localhost:9"] and binds("[::1]", 9) == ["[::1]:9"]
    assert exposure_warning(ServeConfig(host="127.0.0.1,::1")) is None
    assert "0.0.0.0" in exposure_warning(ServeConfig(host="127.0.0.1,0.0.0.0"))
