"""The newer routes' own logic in process (tiny model, Quart's test client): the API key, each API's
refusals in its own error shape, the Responses store's bounds, embedding pooling and the hidden
states it pools."""

from __future__ import annotations

import numpy as np
import pytest

from pantheon.engine.embedding import normalize, pool, pooling_of
from pantheon.web.response_store import Kept, ResponseStore
from tests.web.inprocess import InProcessApp, tiny_app

KEY = "sk-test-7f3a"
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2, "temperature": 0}
MESSAGES = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hello"}]}


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    server = tiny_app(tmp_path_factory, "api-routes")
    yield server
    server.close()


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    server = tiny_app(tmp_path_factory, "api-key", api_key=KEY)
    yield server
    server.close()


# ---- the API key -------------------------------------------------------------------------------------
def test_api_key_guards_the_inference_routes(keyed):
    status, body, headers = keyed.post("/v1/chat/completions", CHAT)
    assert status == 401 and body["error"]["type"] == "authentication_error" and {k.lower(): v for k, v in headers.items()}["www-authenticate"] == "Bearer"
    assert keyed.post("/v1/chat/completions", CHAT, {"Authorization": f"Bearer {KEY}"})[0] == 200
    assert keyed.post("/v1/chat/completions", CHAT, {"x-api-key": KEY})[0] == 200
    assert keyed.post("/v1/chat/completions", CHAT, {"Authorization": "Bearer wrong"})[0] == 401
    assert keyed.post("/tokenize", {"content": "hi"})[0] == 401
    assert keyed.get("/v1/models")[0] == 200 and keyed.get("/models")[0] == 200  # public, as llama-server's
    # Anthropic's clients send x-api-key and read Anthropic's error shape
    status, body, _ = keyed.post("/v1/messages", MESSAGES)
    assert status == 401 and body == {"type": "error", "error": {"type": "authentication_error", "message": body[
        "error"]["message"]}}
    assert keyed.post("/v1/messages", MESSAGES, {"x-api-key": KEY})[0] == 200
    assert keyed.get("/health")[0] == 200 and keyed.get("/")[0] == 200  # probes stay open


def test_no_api_key_by_default(app):
    assert app.post("/v1/chat/completions", CHAT)[0] == 200


# ---- refusals in each API's shape ------------------------------------------------------------------------
@pytest.mark.parametrize("body, needle", [
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}]}, "'max_tokens' is required"),
    ({"model": "tiny", "max_tokens": 2, "messages": []}, "'messages' is required"),
    ({"model": "tiny", "max_tokens": 2, "messages": [{"role": "tool", "content": "x"}]}, "must be \"user\""),
    ({**MESSAGES, "tool_choice": {"type": "sometimes"}}, "'tool_choice'"),
    ({**MESSAGES, "messages": [{"role": "user", "content": [{"type": "tool_use", "name": "f", "input": {}}]}]},
     "is not a content block"),
])
def test_messages_refusals(app, body, needle):
    status, reply, _ = app.post("/v1/messages", body)
    assert status == 400 and reply["type"] == "error" and reply["error"]["type"] == "invalid_request_error"
    assert needle in reply["error"]["message"]


def test_messages_unknown_subroute_is_a_404_in_anthropics_shape(app):
    status, reply, _ = app.post("/v1/messages/batches", MESSAGES)
    assert status == 404 and reply["type"] == "error" and reply["error"]["type"] == "not_found_error"


def test_messages_take_claude_codes_system_turns_and_billing_header(app):
    """Claude Code (2.1) sends system turns among the messages and opens its system prompt with a
    billing header that changes per request: the turns are kept in their place (the prompt equals
    the OpenAI form's), the header left out."""
    from pantheon.web.anthropic_routes import _system_text

    turns = [{"role": "user", "content": "hello"}, {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
             {"role": "user", "content": "again"}]
    status, reply, _ = app.post("/v1/messages", {**MESSAGES, "messages": turns})
    assert status == 200 and reply["type"] == "message", reply
    counted = app.post("/v1/messages/count_tokens", {"model": "tiny", "messages": turns})[1]["input_tokens"]
    status, prompt, _ = app.post("/apply-template", {"messages": [turns[0], {"role": "system", "content": "Be brief."},
                                                                  turns[2]]})
    assert counted == len(app.engine().encode_prompt(prompt["prompt"])) and "Be brief." in prompt["prompt"]
    # the billing header changes per request (its version suffix, its cch= hash): left out, so the
    # system prompt is the same text for every request and session of a client
    for version in ("2.1.197.c23; cch=a1b2c", "2.1.197.03a"):
        header = [{"type": "text", "text": f"x-anthropic-billing-header: cc_version={version}; cc_entrypoint=cli;"},
                  {"type": "text", "text": "You are Claude Code."}]
        assert _system_text("system", header) == "You are Claude Code."
        assert _system_text("system", header[0]["text"] + "\nYou are Claude Code.") == "You are Claude Code."
    assert _system_text("system", "You are x-anthropic-billing-header: here.") == \
        "You are x-anthropic-billing-header: here."  # not a header
    from pantheon.web.anthropic_routes import parse_messages_request

    async def thinking(kind):
        async with app.app.test_request_context("/v1/messages", method="POST"):
            return parse_messages_request({**MESSAGES, "thinking": {"type": kind}}).enable_thinking

    # Claude Code's "adaptive" leaves it to the model (its template's default), as no field does
    assert [app.run(thinking(k)) for k in ("enabled", "disabled", "adaptive")] == [True, False, None]


def test_count_tokens_needs_no_max_tokens(app):
    status, reply, _ = app.post("/v1/messages/count_tokens", {"model": "tiny", "messages": MESSAGES["messages"]})
    assert status == 200 and reply["input_tokens"] > 0


@pytest.mark.parametrize("body, needle", [
    ({"prompt": "x", "n": 3, "best_of": 2}, "'best_of' (2) must be at least 'n' (3)"),
    ({"prompt": "x", "best_of": 3, "stream": True}, "cannot be streamed"),
    ({"prompt": ["x"] * 17}, "at most 16"),
    ({"prompt": []}, "'prompt' is required"),
    ({"prompt": [1, 2, 10**6]}, "outside the vocabulary"),
    ({"prompt": "x", "logprobs": -1}, "'logprobs' must be"),
])
def test_completions_refusals(app, body, needle):
    status, reply, _ = app.post("/v1/completions", {"model": "tiny", "max_tokens": 2, **body})
    assert status == 400 and reply["error"]["type"] == "invalid_request_error", reply
    assert needle in reply["error"]["message"]


def test_completions_best_of_returns_the_likeliest(app):
    status, reply, _ = app.post("/v1/completions", {"model": "tiny", "prompt": "hello", "max_tokens": 3, "n": 1,
                                                    "best_of": 3, "temperature": 1.5, "seed": 7})
    assert status == 200 and len(reply["choices"]) == 1 and reply["choices"][0]["index"] == 0
    assert reply["usage"]["completion_tokens"] == 9  # all three were generated


def test_responses_refusals_and_the_store(app):
    status, reply, _ = app.post("/v1/responses", {"model": "tiny", "input": "x", "previous_response_id": "resp_nope"})
    assert status == 404 and reply["error"]["type"] == "not_found"
    status, reply, _ = app.post("/v1/responses", {"model": "tiny", "input": [{"type": "computer_call"}]})
    assert status == 400 and "'input[0]'" in reply["error"]["message"]
    status, reply, _ = app.post("/v1/responses", {"model": "tiny", "input": "hello", "max_output_tokens": 2,
                                                  "store": False, "temperature": 0})
    assert status == 200 and reply["store"] is False
    assert app.get(f"/v1/responses/{reply['id']}")[0] == 404  # not kept
    status, kept, _ = app.post("/v1/responses", {"model": "tiny", "input": "hello", "max_output_tokens": 2,
                                                 "temperature": 0})
    assert app.get(f"/v1/responses/{kept['id']}") == (200, kept)


def test_response_store_is_bounded():
    store = ResponseStore(max_responses=3, max_bytes=100)
    for i in range(4):
        store.put(f"r{i}", Kept([], {"id": f"r{i}"}, None, 10))
    assert store.get("r0") is None and len(store) == 3  # the oldest went first
    store.get("r1")  # now the most recently used
    store.put("big", Kept([], {}, None, 85))
    assert store.get("r1") is not None and store.get("r2") is None and store.get("r3") is None
    assert store.delete("big") and not store.delete("big")


# ---- embeddings ----------------------------------------------------------------------------------------
def test_pooling_and_normalisation():
    h = np.array([[3.0, 0.0], [1.0, 2.0], [2.0, 4.0]], np.float32)
    assert np.allclose(pool(h, "mean"), [2.0, 2.0]) and np.allclose(pool(h, "cls"), h[0])
    assert np.allclose(pool(h, "last"), h[-1]) and pool(h, "none") is h
    assert np.allclose(normalize(np.array([3.0, 4.0])), [0.6, 0.8]) and not normalize(np.zeros(2)).any()
    assert pooling_of({}, "llama") == "mean" and pooling_of({"bert.pooling_type": 2}, "bert") == "cls"


def test_hidden_states_are_causal_and_repeatable(app):
    engine = app.engine("tiny")
    ids = [1, 5, 9, 13, 17, 21, 3]
    full = app.run(engine.hidden_states(ids))
    head = app.run(engine.hidden_states(ids[:4]))
    assert full.shape == (7, engine.spec.n_embd) and np.isfinite(full).all()
    assert np.allclose(full[:4], head, atol=1e-5)  # a position sees only what precedes it
    assert np.array_equal(app.run(engine.hidden_states(ids)), full)


def test_embeddings_route(app):
    status, reply, _ = app.post("/v1/embeddings", {"model": "tiny", "input": [[1, 5, 9], "hello"]})
    assert status == 200 and [d["index"] for d in reply["data"]] == [0, 1]
    v = np.array(reply["data"][0]["embedding"])
    assert abs(np.linalg.norm(v) - 1) < 1e-5 and reply["usage"]["prompt_tokens"] >= 4
    status, reply, _ = app.post("/v1/embeddings", {"model": "tiny", "input": "x", "encoding_format": "hex"})
    assert status == 400 and "encoding_format" in reply["error"]["message"]
    # llama-server's forms: text and ids mixed in one prompt, {"prompt_string"}, "content" for "input"
    tok = app.engine().tokenizer
    mixed = [5, 9, "hello", 7]
    ids = [5, 9] + tok.encode("hello", parse_special=True, add_bos=False) + [7]
    status, reply, _ = app.post("/v1/embeddings", {"model": "tiny", "input": mixed})
    assert status == 200 and len(reply["data"]) == 1 and reply["usage"]["prompt_tokens"] == len(ids)
    same = app.post("/v1/embeddings", {"model": "tiny", "input": [ids]})[1]["data"][0]["embedding"]
    assert reply["data"][0]["embedding"] == same
    status, reply, _ = app.post("/embeddings", {"model": "tiny", "content": [{"prompt_string": "hello"}, [1, "x"]]})
    assert status == 200 and [d["index"] for d in reply["data"]] == [0, 1]
    parts = {"content": [{"type": "text", "text": "hello "}, {"type": "text", "text": "world"}]}
    status, reply, _ = app.post("/v1/embeddings", {"model": "tiny", "input": ["hello world", parts]})
    assert status == 200 and reply["data"][0]["embedding"] == reply["data"][1]["embedding"]  # the parts' text joined
    for bad in ([5, None], [{"prompt_string": 3}], [[]], {}, {"content": "string"},
                {"content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]},
                {"prompt_string": "a <__media__>", "multimodal_data": ["AAAA"]}):  # llama-server's media: text only here
        assert app.post("/v1/embeddings", {"model": "tiny", "input": bad})[0] == 400
    status, err, _ = app.post("/completion", {"prompt": {"prompt_string": "a <__media__>", "multimodal_data": ["AAAA"]}})
    assert status == 400 and "multimodal_data" in err["error"]["message"]


def test_llama_servers_legacy_embedding_route(app):
    """/embedding: llama-server's shape, [{"index", "embedding": [[...]]}], normalised as embd_normalize
    says (llama.cpp's common_embd_normalize), the same vector as /v1/embeddings' by default."""
    oai = np.array(app.post("/v1/embeddings", {"model": "tiny", "input": "hello"})[1]["data"][0]["embedding"])
    status, reply, _ = app.post("/embedding", {"model": "tiny", "content": ["hello", [1, 5, 9]]})
    assert status == 200 and [r["index"] for r in reply] == [0, 1] and all(len(r["embedding"]) == 1 for r in reply)
    np.testing.assert_allclose(reply[0]["embedding"][0], oai, atol=1e-6)
    raw = np.array(app.post("/embedding", {"model": "tiny", "content": "hello", "embd_normalize": -1})[1][0]["embedding"][0])
    assert abs(np.linalg.norm(raw) - 1) > 1e-3  # not normalised
    np.testing.assert_allclose(raw / np.linalg.norm(raw), oai, atol=1e-5)
    for p, scale in ((0, np.abs(raw).max() / 32760), (1, np.abs(raw).sum()), (3, (np.abs(raw) ** 3).sum() ** (1 / 3))):
        got = app.post("/embedding", {"model": "tiny", "content": "hello", "embd_normalize": p})[1][0]["embedding"][0]
        np.testing.assert_allclose(got, raw / scale, rtol=1e-5, atol=1e-6)
    big = app.post("/embedding", {"model": "tiny", "content": "hello", "embd_normalize": 2**31 - 1})[1][0]["embedding"][0]
    assert not any(big)  # the p-norm overflows to infinity: a zero vector, as llama.cpp's pow gives
    for bad in ("2", -2, 1.5, True, 2**31, 10**40):
        status, reply, _ = app.post("/embedding", {"model": "tiny", "content": "hello", "embd_normalize": bad})
        assert status == 400 and "embd_normalize" in reply["error"]["message"]


def test_legacy_embedding_route_gives_every_token_where_the_pooling_is_none(tmp_path_factory):
    from tests.fixtures.tiny_models import write_tiny_llama
    from tests.web.inprocess import InProcessApp

    path = write_tiny_llama(tmp_path_factory.mktemp("pool-none") / "tiny.gguf", extra_metadata={"llama.pooling_type": 0})
    server = InProcessApp([(str(path), "tiny")])
    try:
        status, reply, _ = server.post("/embedding", {"model": "tiny", "content": [[1, 5, 9, 13]]})
        assert status == 200 and len(reply[0]["embedding"]) == 4  # a vector per token, unnormalised
        hidden = server.run(server.engine("tiny").hidden_states([1, 5, 9, 13]))
        np.testing.assert_allclose(reply[0]["embedding"], hidden, atol=1e-6)
        assert server.post("/v1/embeddings", {"model": "tiny", "input": "x"})[0] == 400  # OpenAI's shape cannot
    finally:
        server.close()


# ---- admin load inherits the serve's per-model options ------------------------------------------------
def test_admin_load_inherits_numerics_and_kv_type(tmp_path_factory):
    from tests.fixtures.tiny_models import write_tiny_llama

    path = write_tiny_llama(tmp_path_factory.mktemp("inherit") / "tiny.gguf")
    app = InProcessApp([], numerics="llamacpp", kv_dtype="f32", max_concurrent=2)
    try:
        status, row, _ = app.post("/admin/models/load", {"path": str(path), "name": "late"})
        assert status == 200, row
        assert (row["numerics"], row["kv_dtype"]) == ("llamacpp", "f32")
        assert app.engine("late").numerics.mode == "llamacpp" and app.engine("late").max_concurrent == 2
        status, row, _ = app.post("/admin/models/load", {"path": str(path), "name": "exact", "numerics": "exact"})
        assert status == 200 and row["numerics"] == "exact"
        status, row, _ = app.post("/admin/models/load", {"path": str(path), "name": "x", "numerics": "fast"})
        assert status == 400 and "'numerics'" in row["error"]["message"]
    finally:
        app.close()


# ---- llama-server's native /completion ----------------------------------------------------------------
def test_native_completion(app):
    status, body, _ = app.post("/completion", {"prompt": "hello", "n_predict": 4, "temperature": 0, "n_probs": 3,
                                               "return_tokens": True})
    assert status == 200 and body["stop"] is True and body["stop_type"] == "limit"
    assert body["tokens_predicted"] == 4 == len(body["tokens"]) == len(body["completion_probabilities"])
    assert body["timings"]["predicted_n"] == 4 and body["timings"]["prompt_n"] + body["timings"]["cache_n"] == \
        body["tokens_evaluated"]
    probs = body["completion_probabilities"][0]
    assert probs["id"] == body["tokens"][0] and len(probs["top_logprobs"]) == 3 and probs["logprob"] <= 0
    assert body["generation_settings"]["n_predict"] == 4 and body["has_new_line"] in (True, False)
    assert body["generation_settings"]["logit_bias"] == [] and body["generation_settings"]["ignore_eos"] is False
    # ignore_eos bans the end-of-generation tokens: llama-server lists them with a null (-inf) bias
    status, body, _ = app.post("/completion", {"prompt": "hello", "n_predict": 2, "ignore_eos": True,
                                               "logit_bias": [[5, 1.5]]})
    eog = sorted(app.state.pool.resolve(None).tokenizer.eog_ids)
    assert status == 200 and body["generation_settings"]["ignore_eos"] is True
    assert sorted(body["generation_settings"]["logit_bias"], key=lambda e: e["token"]) == \
        sorted([{"token": 5, "bias": 1.5}] + [{"token": t, "bias": None} for t in eog], key=lambda e: e["token"])
    # a top-level array with ids is one prompt; without, one result per prompt
    status, one, _ = app.post("/completion", {"prompt": [1, 5, "hello", 9], "n_predict": 2, "temperature": 0})
    assert status == 200 and isinstance(one, dict)
    status, many, _ = app.post("/completion", {"prompt": ["hello", [1, 5, 9], {"prompt_string": "hi"}],
                                               "n_predict": 2, "temperature": 0})
    assert status == 200 and [r["index"] for r in many] == [0, 1, 2]
    status, picked, _ = app.post("/completion", {"prompt": "hello", "n_predict": 2,
                                                 "response_fields": ["content", "generation_settings/n_predict"]})
    assert status == 200 and set(picked) == {"content", "generation_settings/n_predict"}
    # /completions is its twin, as llama-server routes it (OpenAI's legacy shape: /v1/completions)
    status, twin, _ = app.post("/completions", {"prompt": "hello", "n_predict": 4, "temperature": 0})
    assert status == 200 and twin["tokens_predicted"] == 4 and "content" in twin and "choices" not in twin


def test_native_completion_post_sampling_probs(app):
    """llama-server's post_sampling_probs: probabilities under the sampler's distribution."""
    req = {"prompt": "hello", "n_predict": 3, "n_probs": 5, "post_sampling_probs": True}
    status, body, _ = app.post("/completion", {**req, "temperature": 0})
    assert status == 200 and len(body["completion_probabilities"]) == 3
    for t in body["completion_probabilities"]:  # greedy: the argmax alone, no token it cannot draw
        assert t["prob"] == 1.0 and "logprob" not in t
        assert t["top_probs"] == [{"id": t["id"], "token": t["token"], "bytes": t["bytes"], "prob": 1.0}]
    status, body, _ = app.post("/completion", {**req, "temperature": 1.0, "top_k": 3, "top_p": 1.0, "seed": 4})
    for t in body["completion_probabilities"]:  # top-k 3: three candidates, as llama-server lists them
        probs = [p["prob"] for p in t["top_probs"]]
        assert len(probs) == 3 and sum(probs) == pytest.approx(1.0, abs=1e-5) and min(probs) > 0
        assert t["prob"] == next(p["prob"] for p in t["top_probs"] if p["id"] == t["id"]) > 0
    status, events = app.stream("/completion", {**req, "temperature": 0})
    assert all(e["completion_probabilities"][0]["prob"] == 1.0 for e in events[:-1])


def test_native_completion_stream_and_refusals(app):
    status, events = app.stream("/completion", {"prompt": "hello", "n_predict": 3, "temperature": 0})
    assert status == 200 and "[DONE]" not in events  # llama-server sends none
    assert [e["stop"] for e in events] == [False] * (len(events) - 1) + [True]
    assert all(len(e["tokens"]) >= 1 for e in events[:-1]) and events[-1]["stop_type"] == "limit"
    status, body, _ = app.post("/completion", {"prompt": "x " * 400, "n_predict": 2})  # tiny_app: 128 a slot
    assert status == 400 and body["error"]["type"] == "exceed_context_size_error" and body["error"]["n_ctx"] > 0
    assert "exceeds the available context size" in body["error"]["message"]  # llama-server's words
    assert app.post("/completion", {"prompt": [1, None]})[0] == 400
    assert app.post("/completion", {"n_predict": 2})[0] == 400


# ---- llama-server's additions to the OpenAI routes ------------------------------------------------------
def test_chat_carries_llama_servers_fingerprint_and_timings(app):
    status, body, _ = app.post("/v1/chat/completions", {**CHAT, "max_tokens": 3})
    assert status == 200 and body["system_fingerprint"] == f"b{app.state.build}"
    t = body["timings"]
    assert t["predicted_n"] == body["usage"]["completion_tokens"] == 3
    assert t["prompt_n"] + t["cache_n"] == body["usage"]["prompt_tokens"] and t["predicted_ms"] >= 0
    status, events = app.stream("/v1/chat/completions", {**CHAT, "max_tokens": 3, "stream_options": {"include_usage": True}})
    chunks = [e for e in events if isinstance(e, dict)]
    assert status == 200 and all(c["system_fingerprint"] == body["system_fingerprint"] for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"}  # the contract's first chunk, unchanged
    last = chunks[-1]
    assert last["choices"] == [] and last["timings"]["predicted_n"] == last["usage"]["completion_tokens"] == 3


def test_llama_servers_grammar_and_json_schema_constrain_the_answer(app):
    import json as _json
    import re

    grammar = 'root ::= ("yes" | "no") " " [0-9] [0-9]?'
    for seed in range(3):
        status, body, _ = app.post("/completion", {"prompt": "hello", "n_predict": 8, "seed": seed, "grammar": grammar})
        assert status == 200 and re.fullmatch(r"(yes|no) [0-9]{1,2}", body["content"]), body["content"]
    status, body, _ = app.post("/v1/chat/completions", {**CHAT, "max_tokens": 8, "temperature": 1, "grammar": grammar})
    assert status == 200 and re.fullmatch(r"(yes|no) [0-9]{1,2}", body["choices"][0]["message"]["content"])
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    status, body, _ = app.post("/completion", {"prompt": "hello", "n_predict": 64, "seed": 1, "json_schema": schema})
    assert status == 200 and set(_json.loads(body["content"])) == {"n"}
    # llama-server's json_object with a "schema" beside its type enforces that schema
    status, body, _ = app.post("/v1/chat/completions", {**CHAT, "max_tokens": 64, "temperature": 1, "seed": 1,
                                                        "response_format": {"type": "json_object", "schema": schema}})
    assert status == 200 and body["response_format_status"] == "applied"
    assert set(_json.loads(body["choices"][0]["message"]["content"])) == {"n"}
    for bad, says in (({"grammar": "root ::= ("}, "invalid 'grammar'"), ({"grammar": 5}, "'grammar' must be"),
                      ({"json_schema": "x"}, "'json_schema' must be"),
                      ({"grammar": grammar, "response_format": {"type": "json_object"}}, "cannot be combined")):
        status, out, _ = app.post("/completion", {"prompt": "hello", "n_predict": 2, **bad})
        assert status == 400 and says in out["error"]["message"], out
    from pantheon.engine.chat import PlanError, plan_chat
    from pantheon.web.chat_request import parse_chat_request

    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    with pytest.raises(PlanError, match="cannot be combined with tools"):  # (the tiny window takes no tools)
        plan_chat(app.engine(), parse_chat_request({**CHAT, "grammar": grammar, "tools": tools}))


@pytest.mark.parametrize("route, body, usage", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello"}]}, "completion_tokens"),
    ("/v1/completions", {"prompt": "hello"}, "completion_tokens"),
])
def test_n_predict_is_max_tokens_where_that_is_absent(app, route, body, usage):
    ban = {"logit_bias": {str(t): -100 for t in app.engine().tokenizer.eog_ids}, "temperature": 0, "model": "tiny"}
    assert app.post(route, {**body, **ban, "n_predict": 5})[1]["usage"][usage] == 5
    assert app.post(route, {**body, **ban, "n_predict": 5, "max_tokens": 2})[1]["usage"][usage] == 2  # max_tokens wins
    assert app.post(route, {**body, **ban, "n_predict": "x"})[0] == 400


# ---- a routed-experts model (qwen3moe) end to end ---------------------------------------------------------
def test_a_qwen3moe_model_serves_chat_batched(tmp_path_factory):
    from tests.fixtures.tiny_models import Q, write_tiny_llama

    path = write_tiny_llama(tmp_path_factory.mktemp("moe") / "moe.gguf", arch="qwen3moe", weight_type=Q.Q8_0,
                            seed=18, qk_norm=True, head_dim=32, n_expert=8, n_expert_used=3, n_ff_exp=32)
    app = InProcessApp([(str(path), "moe")])
    try:
        chat = {"model": "moe", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 6, "temperature": 0}
        status, alone, _ = app.post("/v1/chat/completions", chat)
        assert status == 200, alone
        status, batched, _ = app.post("/v1/chat/completions", {**chat, "n": 3})
        assert status == 200 and {c["message"]["content"] for c in batched["choices"]} == \
            {alone["choices"][0]["message"]["content"]}  # exact numerics: batching changes nothing
        assert app.engine("moe").spec.n_expert == 8
    finally:
        app.close()


def test_the_serves_sampling_defaults_fill_what_a_request_leaves_out(tmp_path_factory):
    """serve --temp/--top-k/.../-n (llama-server's flags): a field a request leaves out takes the
    operator's value on every route; a field it gives wins."""
    from pantheon.config import SamplingDefaults
    from pantheon.web.chat_request import parse_chat_request

    ops = tiny_app(tmp_path_factory, "sampling-defaults",
                   sampling=SamplingDefaults(temperature=0.0, top_k=7, min_p=0.25, repetition_penalty=1.3,
                                             seed=11, max_tokens=3))
    try:
        async def parsed(body):
            async with ops.app.app_context():
                return parse_chat_request(body)

        chat = ops.run(parsed({"messages": [{"role": "user", "content": "hi"}]}))
        assert (chat.temperature, chat.top_k, chat.min_p, chat.repetition_penalty, chat.seed, chat.max_tokens) == \
            (0.0, 7, 0.25, 1.3, 11, 3)
        assert chat.top_p == 0.95  # not set by the operator: the contract's
        mine = ops.run(parsed({"messages": [{"role": "user", "content": "hi"}], "temperature": 1.5, "repeat_penalty": 1.0,
                               "max_completion_tokens": 9}))
        assert (mine.temperature, mine.repetition_penalty, mine.max_tokens) == (1.5, 1.0, 9)
        status, body, _ = ops.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
        assert status == 200 and body["usage"]["completion_tokens"] == 3
        greedy = ops.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                   "temperature": 0, "top_k": 7, "min_p": 0.25,
                                                   "repeat_penalty": 1.3})[1]
        assert body["choices"][0]["message"] == greedy["choices"][0]["message"]
        for path, req in (("/completion", {"prompt": "hello"}), ("/v1/completions", {"prompt": "hello"})):
            status, out, _ = ops.post(path, req)
            assert status == 200 and (out.get("tokens_predicted") or out["usage"]["completion_tokens"]) == 3, out
        settings = ops.get("/props")[1]["default_generation_settings"]["params"]
        assert (settings["temperature"], settings["top_k"], settings["min_p"], settings["seed"], settings["n_predict"]) \
            == (0.0, 7, 0.25, 11, 3)
    finally:
        ops.close()
