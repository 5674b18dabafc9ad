"""Reasoning split and budget on generated think-style models served for real.

The tiny models have random weights, so what they say is noise; what is tested is the plumbing:
the prompt opens <think>, the reasoning budget forces "</think>\\n\\n" after N tokens, and the output
is split into reasoning_content and content — also when "</think>" is several tokens
(think_tokens=False spells it in bytes) and when it is one special token (think_tokens=True)."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.fixtures.tiny_models import THINK_CHATML, write_tiny_llama
from tests.web.server import ServerProcess

MSG = [{"role": "user", "content": "hello world"}]
NO_END = {"0": -100, "2": -100}  # never sample <|endoftext|> or <|im_end|>


@pytest.fixture(scope="module")
def think_server(tmp_path_factory):
    d = tmp_path_factory.mktemp("think")
    split = write_tiny_llama(d / "think-split.gguf", chat_template=THINK_CHATML, think_tokens=False, seed=3)
    single = write_tiny_llama(d / "think-token.gguf", chat_template=THINK_CHATML, think_tokens=True, seed=4)
    server = ServerProcess(["--model", str(split), "--name", "split", "--model", str(single), "--name", "single",
                            "--ctx-cap", "256"], wait_models=2)
    yield server
    server.stop()


def chat(server, **body):
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": MSG, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def ban_think_tags(model: str) -> dict:
    # With think_tokens=True, ids 321/322 are <think>/</think>: keep the model from closing early.
    return {**NO_END, "321": -100, "322": -100} if model == "single" else NO_END


@pytest.mark.parametrize("model", ["split", "single"])
def test_budget_forces_close_after_n_reasoning_tokens_and_splits(think_server, model):
    budget = 6
    r = chat(think_server, model=model, enable_thinking=True, reasoning_budget=budget, max_tokens=20,
             temperature=0.9, seed=7, logprobs=True, logit_bias=ban_think_tags(model))
    msg, choice = r["choices"][0]["message"], r["choices"][0]
    tokens = [bytes(t["bytes"]) for t in choice["logprobs"]["content"]]
    assert len(tokens) == 20 and r["usage"]["completion_tokens"] == 20
    reasoning = b"".join(tokens[:budget]).decode("utf-8", "replace").strip()
    assert msg.get("reasoning_content", "") == reasoning
    closing = b"".join(tokens[budget:])
    assert closing.startswith(b"</think>\n\n")  # the forced close, one or several tokens
    assert "</think>" not in msg["content"] and "</think>" not in msg.get("reasoning_content", "")
    assert msg["content"] == closing[len(b"</think>\n\n"):].decode("utf-8", "replace").lstrip()


@pytest.mark.parametrize("model", ["split", "single"])
def test_streamed_reasoning_then_content_equals_non_streaming(think_server, model):
    body = dict(model=model, enable_thinking=True, max_reasoning_tokens=5, max_tokens=16, temperature=0.9,
                seed=11, logit_bias=ban_think_tags(model))
    full = chat(think_server, **body)["choices"][0]["message"]
    r = httpx.post(think_server.url + "/v1/chat/completions", json={"messages": MSG, "stream": True, **body},
                   timeout=120)
    deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in r.text.splitlines()
              if line.startswith("data: {")]
    kinds = [k for d in deltas for k in ("reasoning_content", "content") if d.get(k)]
    assert kinds == sorted(kinds, key=lambda k: k != "reasoning_content")  # all reasoning before content
    assert "".join(d.get("reasoning_content", "") for d in deltas) == full.get("reasoning_content", "")
    assert "".join(d.get("content") or "" for d in deltas) == full["content"]


def test_enable_thinking_false_prefills_a_closed_block_so_all_is_content(think_server):
    r = chat(think_server, model="split", enable_thinking=False, max_tokens=8, temperature=0.9, seed=1,
             logit_bias=NO_END)
    msg = r["choices"][0]["message"]
    assert "reasoning_content" not in msg and r["usage"]["completion_tokens"] == 8


def test_budget_zero_disables_forcing(think_server):
    r = chat(think_server, model="split", enable_thinking=True, reasoning_budget=0, max_tokens=12, temperature=0.9,
             seed=2, logit_bias=NO_END)
    msg = r["choices"][0]["message"]
    assert msg["content"] == "" and msg["reasoning_content"]  # never closed: all of it is reasoning


@pytest.mark.parametrize("model", ["split", "single"])
def test_reasoning_format_none_leaves_the_thoughts_in_the_content(think_server, model):
    """llama-server's reasoning_format "none": nothing is split out; the content is the think block
    the prompt opened, then every generated token's text (the budget's forced close included)."""
    r = chat(think_server, model=model, enable_thinking=True, reasoning_budget=6, max_tokens=20, temperature=0.9,
             seed=7, logprobs=True, logit_bias=ban_think_tags(model), reasoning_format="none")
    msg, choice = r["choices"][0]["message"], r["choices"][0]
    tokens = b"".join(bytes(t["bytes"]) for t in choice["logprobs"]["content"])
    assert "reasoning_content" not in msg and b"</think>\n\n" in tokens
    assert msg["content"] == "<think>\n" + tokens.decode("utf-8", "replace")
