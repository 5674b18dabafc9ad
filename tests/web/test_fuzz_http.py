"""Property-based HTTP fuzzing (in process, tiny model): mutated bodies of the right general shape
for every POST route and query strings for the GET routes. Invariants: client-caused input never
gets a 500; every status >= 400 carries the contract's error JSON; no body names a Python exception
class; and afterwards the server still answers GET / and a normal chat.

Routes (pantheon/web/*_routes.py): POST /v1/chat/completions (and its /input_tokens), /v1/completions,
/v1/messages, /v1/messages/count_tokens (Anthropic's error shape), /v1/responses (and /input_tokens), /v1/embeddings, /embedding, /tokenize,
/detokenize, /completion and /infill (llama-server's own), /apply-template, /admin/models/load, /admin/models/unload, /admin/session/export, /session/restore,
/session/release, /admin/test/faults (404 without PANTHEON_TEST_HOOKS); GET /, /v1/models,
/v1/responses/{id}, /admin/models, /admin/dies, /session/estimate, /session/watch, /props, /slots.

PANTHEON_FUZZ_EXAMPLES (default 60) sets the examples per test; CI keeps the default."""

from __future__ import annotations

import asyncio
import base64
import copy
import json
import os
import re

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests.fixtures.tiny_models import write_tiny_llama
from tests.web.inprocess import InProcessApp

EXAMPLES = int(os.environ.get("PANTHEON_FUZZ_EXAMPLES", "60"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                       HealthCheck.data_too_large, HealthCheck.filter_too_much])
EXC = re.compile(r"\b[A-Z][a-zA-Z]+(Error|Exception)\b")
CHAT = "/v1/chat/completions"
SESSIONS = ["fz-a", "fz-b", "fz-c"]
NORMAL_CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2,
               "temperature": 0}


# ---- value strategies ---------------------------------------------------------------------------
def no_exc_name(s: str) -> bool:
    return not EXC.search(s)


SURROGATES = st.sampled_from(["\ud800", "\udfff", "a\udc80b", "\ud83d", "x\ud800\udc00y"])
SPECIAL_TEXT = st.sampled_from(["", " ", "\x00", "tiny", "<|im_start|>", "<|im_end|>", "<think>", "</think>",
                                "{{ 7 * 7 }}", "{% for x in y %}", "\\u0000", "💥" * 50, "x" * 5000,
                                "../../etc/passwd", "/etc/passwd", "tiny.gguf", "."] + SESSIONS)
plain_text = st.text(max_size=30).filter(no_exc_name)
texts = st.one_of(plain_text, plain_text, plain_text, SURROGATES, SPECIAL_TEXT)
INTS = st.one_of(st.integers(-3, 3), st.integers(),
                 st.sampled_from([2**31 - 1, 2**31, -2**31 - 1, 2**53 + 1, 2**63, -2**63, 2**64, 10**30,
                                  -10**30, 10**300, -10**300]))
FLOATS = st.one_of(st.floats(), st.sampled_from([float("nan"), float("inf"), -float("inf"), 1e308, -1e308,
                                                 5e-324, -0.0, 1e300, 1e20]))
numbers = st.one_of(INTS, FLOATS)
scalars = st.one_of(st.none(), st.booleans(), numbers, texts)
values = st.recursive(scalars, lambda c: st.one_of(st.lists(c, max_size=4), st.dictionaries(texts, c, max_size=4)),
                      max_leaves=10)


def nest(depth: int, kind: str, leaf):
    for i in range(depth):
        leaf = [leaf] if kind == "list" or (kind == "mixed" and i % 2) else {"a": leaf}
    return leaf


deep = st.builds(nest, st.integers(1, 200), st.sampled_from(["list", "dict", "mixed"]), scalars)
anything = st.one_of(values, values, values, deep)


def either(plausible):
    """Mostly a plausible value for the field, sometimes anything at all."""
    return st.one_of(plausible, plausible, anything)


SCHEMA_TYPES = st.sampled_from(["object", "string", "integer", "number", "boolean", "array", "null", "nope"])
schemas = st.recursive(
    st.one_of(st.fixed_dictionaries({"type": SCHEMA_TYPES}),
              st.fixed_dictionaries({"type": st.just("string")},
                                    optional={"pattern": st.sampled_from(["(", "[a-z]+", "^x*$", "\\", "a{99999}"]),
                                              "minLength": INTS, "maxLength": INTS, "format": texts}),
              st.fixed_dictionaries({"enum": st.lists(scalars, max_size=4)}),
              st.fixed_dictionaries({"const": scalars}),
              st.fixed_dictionaries({"$ref": st.sampled_from(["#", "#/nope", "#/$defs/x", "http://x"])}),
              anything),
    lambda c: st.one_of(
        st.fixed_dictionaries({"type": st.just("object")},
                              optional={"properties": st.dictionaries(texts, c, max_size=3),
                                        "required": st.lists(texts, max_size=3),
                                        "additionalProperties": st.one_of(st.booleans(), c)}),
        st.fixed_dictionaries({"type": st.just("array")},
                              optional={"items": c, "minItems": INTS, "maxItems": INTS}),
        st.fixed_dictionaries({"anyOf": st.lists(c, max_size=3)}),
        st.fixed_dictionaries({"allOf": st.lists(c, max_size=3)})),
    max_leaves=6)

ROLES = st.sampled_from(["system", "user", "assistant", "tool", "developer", "", "robot"])
tool_calls = st.lists(st.fixed_dictionaries({}, optional={
    "id": texts, "type": either(st.just("function")),
    "function": either(st.fixed_dictionaries({}, optional={"name": either(texts),
                                                           "arguments": either(st.one_of(texts, values))}))}),
    max_size=3)
message = st.fixed_dictionaries({}, optional={"role": either(ROLES), "content": either(texts),
                                               "tool_calls": either(tool_calls), "reasoning_content": either(texts),
                                               "name": texts, "tool_call_id": texts})
tools = st.lists(either(st.fixed_dictionaries({"type": either(st.just("function")), "function": either(
    st.fixed_dictionaries({"name": either(texts)}, optional={"parameters": either(schemas),
                                                             "description": texts}))})), max_size=3)
response_format = st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(["json_object", "text", "json_schema", "nope"])}),
    st.fixed_dictionaries({"type": st.just("json_schema"), "json_schema": either(
        st.fixed_dictionaries({"name": texts}, optional={"schema": either(schemas), "strict": scalars}))}))
small_tokens = st.one_of(st.integers(1, 2), st.integers(1, 2), INTS, FLOATS)

CHAT_FIELDS = {
    "model": either(st.sampled_from(["tiny", "nope", ""])),
    "messages": either(st.lists(either(message), max_size=4)),
    "max_tokens": either(small_tokens), "max_completion_tokens": either(small_tokens),
    "temperature": numbers, "top_p": numbers, "top_k": INTS, "n": either(st.integers(-2, 10)),
    "stop": either(st.one_of(texts, st.lists(texts, max_size=5))), "stream": scalars,
    "stream_options": either(st.fixed_dictionaries({"include_usage": scalars})),
    "seed": numbers, "presence_penalty": numbers, "frequency_penalty": numbers,
    "logit_bias": either(st.dictionaries(st.one_of(texts, st.integers().map(str)), numbers, max_size=4)),
    "logprobs": scalars, "top_logprobs": INTS, "response_format": either(response_format),
    "tools": either(tools), "tool_choice": either(st.one_of(st.sampled_from(["auto", "none", "required"]),
                                                            st.fixed_dictionaries({"type": st.just("function"),
                                                                                   "function": values}))),
    "session_id": either(st.sampled_from(SESSIONS)), "prompt_cache_key": either(st.sampled_from(SESSIONS)),
    "enable_thinking": scalars, "reasoning_budget": INTS, "max_reasoning_tokens": INTS,
    "min_p": numbers, "repetition_penalty": numbers, "return_progress": scalars, "timings_per_token": scalars,
    "add_generation_prompt": scalars, "continue_final_message": either(st.sampled_from(["content", True, False])),
    "chat_template_kwargs": either(st.dictionaries(st.one_of(texts, st.sampled_from(["enable_thinking", "messages",
                                                                                       "documents"])), values,
                                                   max_size=3)),
    "reasoning_format": either(st.sampled_from(["none", "auto", "deepseek", "deepseek-legacy"])),
}
LOAD_PATHS = st.sampled_from(["tiny.gguf", "missing.gguf", "/nonexistent/x.gguf", "../outside.gguf", "/etc/passwd",
                              "/", "", ".", "link-out.gguf", "loop.gguf", "a\x00b", "x/" * 3000])
LOAD_FIELDS = {
    "path": either(LOAD_PATHS),
    "name": either(st.sampled_from(["tiny", "other"])), "dies": either(st.lists(INTS, max_size=10)),
    "ctx_cap": INTS, "max_sessions": INTS, "max_concurrent": INTS, "reasoning_budget": INTS, "quantize": scalars,
    "chat_template": either(st.one_of(st.sampled_from(["chatml", "gemma", "{% for m in messages %}", "{{ x.y.z }}"]),
                                      texts)),
}
UNLOAD_FIELDS = {"name": either(st.sampled_from(["nope", "", "other"])).filter(lambda v: v != "tiny")}
SESSION_FIELDS = {"session_id": either(st.sampled_from(SESSIONS)), "name": either(st.sampled_from(["tiny", "x"])),
                  "blob": either(st.one_of(st.binary(max_size=64).map(lambda b: base64.b64encode(b).decode()),
                                           st.just("%%%"), st.just("QQ"))),
                  "tokens": either(st.lists(INTS, max_size=8))}

token_ids = st.lists(st.one_of(st.integers(0, 40), INTS), min_size=0, max_size=6)
PROMPTS = st.one_of(texts, token_ids, st.lists(st.one_of(texts, token_ids), max_size=3))
COMPLETION_FIELDS = {
    "model": CHAT_FIELDS["model"], "prompt": either(PROMPTS), "max_tokens": either(small_tokens),
    "echo": scalars, "logprobs": either(st.integers(-1, 30)), "suffix": either(texts), "best_of": either(INTS),
    "n": either(st.integers(-2, 10)), "stream": scalars, "temperature": numbers, "stop": CHAT_FIELDS["stop"],
    "stream_options": CHAT_FIELDS["stream_options"], "seed": numbers, "logit_bias": CHAT_FIELDS["logit_bias"]}
BLOCK_TYPES = st.sampled_from(["text", "tool_use", "tool_result", "thinking", "redacted_thinking", "image",
                               "document", "nope"])
block = st.fixed_dictionaries({"type": either(BLOCK_TYPES)}, optional={
    "text": either(texts), "id": texts, "name": either(texts), "input": either(values), "tool_use_id": texts,
    "content": either(st.one_of(texts, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": texts}),
                                                max_size=2))),
    "is_error": scalars, "thinking": either(texts)})
anthropic_message = st.fixed_dictionaries({"role": either(st.sampled_from(["user", "assistant", "system"]))},
                                          optional={"content": either(st.one_of(texts, st.lists(block, max_size=3)))})
anthropic_tools = st.lists(either(st.fixed_dictionaries({"name": either(texts)}, optional={
    "input_schema": either(schemas), "description": texts, "type": either(st.sampled_from(["custom", "web_search"]))})),
    max_size=3)
MESSAGES_FIELDS = {
    "model": CHAT_FIELDS["model"], "max_tokens": either(small_tokens),
    "messages": either(st.lists(either(anthropic_message), max_size=4)),
    "system": either(st.one_of(texts, st.lists(block, max_size=2))), "tools": either(anthropic_tools),
    "tool_choice": either(st.fixed_dictionaries({"type": st.sampled_from(["auto", "any", "tool", "none", "x"])},
                                                optional={"name": texts})),
    "stop_sequences": either(st.lists(texts, max_size=3)), "stream": scalars, "temperature": numbers,
    "top_k": INTS, "top_p": numbers, "metadata": values,
    "thinking": either(st.fixed_dictionaries({"type": st.sampled_from(["enabled", "disabled", "adaptive"])},
                                             optional={"budget_tokens": INTS}))}
ITEM_TYPES = st.sampled_from(["message", "function_call", "function_call_output", "reasoning", "item_reference",
                              "web_search_call"])
item = st.fixed_dictionaries({}, optional={
    "type": either(ITEM_TYPES), "role": either(st.sampled_from(["user", "assistant", "system", "developer", "tool"])),
    "content": either(st.one_of(texts, st.lists(st.fixed_dictionaries({"type": st.sampled_from(
        ["input_text", "output_text", "input_image", "refusal"])}, optional={"text": texts}), max_size=2))),
    "call_id": either(texts), "name": either(texts), "arguments": either(texts), "output": either(texts)})
RESPONSES_FIELDS = {
    "model": CHAT_FIELDS["model"], "input": either(st.one_of(texts, st.lists(either(item), max_size=4))),
    "instructions": either(texts), "max_output_tokens": either(small_tokens), "stream": scalars,
    "temperature": numbers, "top_p": numbers, "store": scalars, "previous_response_id": either(texts),
    "tools": either(st.lists(st.fixed_dictionaries({"type": either(st.sampled_from(["function", "web_search"]))},
                                                   optional={"name": either(texts), "parameters": either(schemas)}),
                             max_size=3)),
    "tool_choice": either(st.one_of(st.sampled_from(["auto", "none", "required"]),
                                    st.fixed_dictionaries({"type": st.just("function"), "name": texts}))),
    "text": either(st.fixed_dictionaries({"format": either(st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "json_object", "json_schema", "x"])}, optional={"schema": schemas}))})),
    "reasoning": either(st.fixed_dictionaries({"effort": either(st.sampled_from(["none", "low", "high"]))})),
    "prompt_cache_key": either(st.sampled_from(SESSIONS))}
EMBEDDING_FIELDS = {"model": CHAT_FIELDS["model"], "input": either(PROMPTS),
                    "encoding_format": either(st.sampled_from(["float", "base64", "x"])), "dimensions": either(INTS)}
LEGACY_EMBEDDING_FIELDS = {"model": CHAT_FIELDS["model"], "content": either(PROMPTS), "input": either(PROMPTS),
                           "embd_normalize": either(st.one_of(st.integers(-3, 5), INTS))}
TOKENIZE_FIELDS = {"content": either(st.one_of(texts, st.lists(st.one_of(texts, INTS), max_size=4))),
                   "add_special": scalars, "parse_special": scalars, "with_pieces": scalars,
                   "model": CHAT_FIELDS["model"]}
DETOKENIZE_FIELDS = {"tokens": either(token_ids), "model": CHAT_FIELDS["model"]}
NATIVE_FIELDS = {"prompt": either(st.one_of(PROMPTS, st.fixed_dictionaries({"prompt_string": texts}))),
                 "n_predict": either(st.integers(-2, 3)), "n_probs": either(st.integers(-1, 25)), "stream": scalars,
                 "temperature": numbers, "top_k": INTS, "top_p": numbers, "seed": numbers, "ignore_eos": scalars,
                 "logit_bias": either(st.lists(st.tuples(st.one_of(INTS, texts), st.one_of(numbers, st.booleans())),
                                               max_size=3)),
                 "return_tokens": scalars, "response_fields": either(st.lists(texts, max_size=3)),
                 "stop": CHAT_FIELDS["stop"],
                 "grammar": either(st.one_of(st.sampled_from(['root ::= "a" | "b"', "root ::= (", 'root ::= x\nx ::= [a-z]+',
                                                              'root ::= "start" root?', ""]), texts)),
                 "json_schema": either(values), "min_p": numbers, "repeat_penalty": numbers,
                 "return_progress": scalars, "timings_per_token": scalars}
MESSAGES_BODY = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hello"}]}
INFILL_FIELDS = {**NATIVE_FIELDS, "input_prefix": either(texts), "input_suffix": either(texts),
                 "input_extra": either(st.lists(either(st.fixed_dictionaries(
                     {}, optional={"filename": either(texts), "text": either(texts)})), max_size=3))}
TEMPLATE_FIELDS = {"messages": CHAT_FIELDS["messages"], "tools": CHAT_FIELDS["tools"],
                   "add_generation_prompt": scalars, "model": CHAT_FIELDS["model"]}


@st.composite
def mutated(draw, base: dict, fields: dict):
    """`base` with 0..5 mutations: a known field set (plausible or anything), a field dropped, an
    extra field; sometimes not an object at all."""
    body = draw(base) if isinstance(base, st.SearchStrategy) else copy.deepcopy(base)
    for _ in range(draw(st.integers(0, 5))):
        op = draw(st.sampled_from(["set", "set", "set", "drop", "extra"]))
        if op == "set":
            key = draw(st.sampled_from(sorted(fields)))
            body[key] = draw(fields[key])
        elif op == "drop" and body:
            del body[draw(st.sampled_from(sorted(body)))]
        elif op == "extra":
            body[draw(texts)] = draw(anything)
    shape = draw(st.sampled_from(["object"] * 12 + ["array", "scalar", "deep"]))
    if shape == "array":
        return [body]
    if shape == "scalar":
        return draw(scalars)
    if shape == "deep":
        return nest(draw(st.integers(60, 300)), "mixed", body)
    return body


raw_bodies = st.one_of(
    st.binary(max_size=64), st.sampled_from([b"", b"   ", b"{", b"nul", b"[1,]", b'{"a":NaN}', b"\xff\xfe{}",
                                             b'{"a": 1' + b"0" * 5000 + b"}", b"[" * 100000 + b"]" * 100000,
                                             b'{"messages": "\\ud800"}', b'"\\udfff"', b"1e99999", b"-Infinity"]))

POST_ROUTES = {CHAT: (NORMAL_CHAT, CHAT_FIELDS),
               CHAT + "/input_tokens": (NORMAL_CHAT, CHAT_FIELDS),
               "/admin/models/load": (st.fixed_dictionaries({"path": LOAD_PATHS, "name": st.just("other")}),
                                      LOAD_FIELDS),
               "/admin/models/unload": ({"name": "nope"}, UNLOAD_FIELDS),
               "/admin/session/export": ({"session_id": "fz-a"}, SESSION_FIELDS),
               "/session/restore": ({"session_id": "fz-b", "blob": "AAAA", "tokens": [1, 2]}, SESSION_FIELDS),
               "/session/release": ({"session_id": "fz-c"}, SESSION_FIELDS),
               "/admin/test/faults": ({"step": 0}, {"step": INTS}),
               "/v1/completions": ({"model": "tiny", "prompt": "hi", "max_tokens": 2}, COMPLETION_FIELDS),
               "/v1/messages": (MESSAGES_BODY, MESSAGES_FIELDS),
               "/v1/messages/count_tokens": (MESSAGES_BODY, MESSAGES_FIELDS),
               "/v1/responses": ({"model": "tiny", "input": "hello", "max_output_tokens": 2}, RESPONSES_FIELDS),
               "/v1/responses/input_tokens": ({"model": "tiny", "input": "hello"}, RESPONSES_FIELDS),
               "/v1/embeddings": ({"model": "tiny", "input": "hello"}, EMBEDDING_FIELDS),
               "/embedding": ({"model": "tiny", "content": "hello"}, LEGACY_EMBEDDING_FIELDS),
               "/tokenize": ({"content": "hello"}, TOKENIZE_FIELDS),
               "/detokenize": ({"tokens": [1, 2]}, DETOKENIZE_FIELDS),
               "/completion": ({"prompt": "hello", "n_predict": 2}, NATIVE_FIELDS),
               "/infill": ({"input_prefix": "a", "input_suffix": "b", "prompt": "c", "n_predict": 2}, INFILL_FIELDS),
               "/apply-template": ({"messages": [{"role": "user", "content": "hello"}]}, TEMPLATE_FIELDS)}

EDGE_QUERY_VALUES = st.sampled_from(["1", "0", "-1", "nan", "inf", "-inf", "1e308", "1e400", "1e305", "1e300",
                                     "4.9e-324", "0x10", "1_000", " 5 ", "", "tiny", "fz-a", "%ff%fe", "%00",
                                     "9" * 5000, "%F0%9F%92%A5", "0.5", "1e-300", "1e20"])
QUERY_VALUES = st.one_of(EDGE_QUERY_VALUES, EDGE_QUERY_VALUES, numbers.map(str),
                         st.text(alphabet="0123456789.eE+-naif", max_size=12),
                         texts.map(lambda t: "".join(f"%{b:02X}" for b in t.encode("utf-8", "surrogatepass"))))
QUERY_KEYS = {"/session/estimate": ["tokens", "blob_bytes", "upload_bps", "name", "x"],
              "/session/watch": ["session_id", "name", "x"],
              "/props": ["model", "x"], "/slots": ["model", "fail_on_no_slot", "x"]}


@st.composite
def query_strings(draw, route: str):
    """Each of the route's parameters maybe once, then maybe repeats and strays."""
    names = QUERY_KEYS.get(route, ["x", "name", "limit", ""])
    once = draw(st.fixed_dictionaries({}, optional={k: QUERY_VALUES for k in names}))
    pairs = list(once.items()) + draw(st.lists(st.tuples(st.sampled_from(names), QUERY_VALUES), max_size=3))
    return "&".join(f"{k}={v.replace('&', '%26').replace('#', '%23')}" for k, v in pairs)


GET_ROUTES = ["/", "/v1/models", "/admin/models", "/admin/dies", "/session/estimate", "/session/watch",
              "/v1/responses/resp_nope", "/props", "/slots"]


# ---- the app and the invariants -----------------------------------------------------------------
@pytest.fixture(scope="module")
def app(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    models = root / "models"
    models.mkdir()
    tiny = write_tiny_llama(models / "tiny.gguf", extra_tokens=("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>",
                                                                 "<|repo_name|>", "<|file_sep|>"))  # /infill runs
    (root / "outside.gguf").write_bytes(tiny.read_bytes())
    (models / "link-out.gguf").symlink_to(root / "outside.gguf")
    (models / "loop.gguf").symlink_to(models / "loop.gguf")
    (models / "passwd").write_text("root:x:0:0:root:/root:/bin/bash\n")
    server = InProcessApp([(str(tiny), "tiny")], ctx_cap=128, max_sessions=4, max_concurrent=4,
                          models_dir=str(models))
    assert server.post(CHAT, {**NORMAL_CHAT, "session_id": "fz-a"})[0] == 200  # a live session to export
    yield server
    server.close()


def send(app, method: str, path: str, raw: bytes | None = None, timeout: float = 120):
    async def go():
        headers = {"Content-Type": "application/json"} if raw is not None else {}
        r = await app.client.open(path, method=method, data=raw, headers=headers)
        return r.status_code, r.headers.get("Content-Type", ""), (await r.get_data()).decode("utf-8", "replace")

    async def watch():
        """An established /session/watch never ends: read its first chunk, then hang up."""
        async with app.client.request(path, method=method) as conn:
            await conn.send_complete()
            first = await conn.receive()
            if conn.status_code == 200:
                await conn.disconnect()
        data = first + bytes(conn.response_data)
        return conn.status_code, conn.headers.get("Content-Type", ""), data.decode("utf-8", "replace")

    return app.run(asyncio.wait_for(watch() if path.startswith("/session/watch") else go(), timeout), timeout + 30)


def strict_json(text: str):
    """json.loads refusing NaN/Infinity (not JSON: clients' parsers reject them) and lone surrogates."""
    def refuse(constant):
        raise AssertionError(f"non-JSON constant {constant} in {text[:300]}")

    value = json.loads(text, parse_constant=refuse)
    stack = [value]
    while stack:  # no string in a reply may hold a lone surrogate (\ud800): not encodable as UTF-8
        v = stack.pop()
        if isinstance(v, str):
            v.encode("utf-8")
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return value


def check(result, what) -> None:
    status, ctype, text = result
    assert status != 500, (what, text[:500])
    assert not EXC.search(text), (what, status, text[:500])
    if status >= 400:
        body = strict_json(text)
        anthropic = isinstance(body, dict) and body.get("type") == "error"  # Anthropic's routes' own shape
        assert isinstance(body, dict) and set(body) == ({"type", "error"} if anthropic else {"error"}), \
            (what, text[:500])
        err = body["error"]
        assert isinstance(err.get("message"), str) and isinstance(err.get("type"), str), (what, text[:500])
        assert err["type"] not in ("server_error", "api_error"), (what, text[:500])
    elif "text/event-stream" in ctype:
        for line in text.splitlines():
            if line.startswith("data: {"):
                event = strict_json(line[len("data: "):])
                error = event.get("error") or (event.get("response") or {}).get("error")
                if isinstance(error, dict):
                    assert error.get("type", error.get("code")) not in ("server_error", "api_error"), (what, line[:500])
    else:
        strict_json(text)


def dumps(body) -> bytes:
    return json.dumps(body).encode()  # ensure_ascii: lone surrogates travel as \ud800 escapes; NaN as NaN


def still_serving(app) -> None:
    assert send(app, "GET", "/")[0] == 200
    status, _, text = send(app, "POST", CHAT, dumps(NORMAL_CHAT))
    assert status == 200, text[:500]
    assert json.loads(text)["choices"][0]["message"]["role"] == "assistant"


# ---- the properties -----------------------------------------------------------------------------
@pytest.mark.parametrize("route", sorted(POST_ROUTES))
def test_mutated_post_bodies(app, route):
    base, fields = POST_ROUTES[route]

    @FUZZ
    @given(body=mutated(base, fields))
    def prop(body):
        check(send(app, "POST", route, dumps(body)), (route, body))

    prop()
    still_serving(app)


def test_mutated_session_blobs(app):
    assert send(app, "POST", CHAT, dumps({**NORMAL_CHAT, "session_id": "fz-blob"}))[0] == 200
    status, _, text = send(app, "POST", "/admin/session/export", dumps({"session_id": "fz-blob"}))
    assert status == 200, text[:300]
    exported = json.loads(text)
    blob = base64.b64decode(exported["blob_b64"])

    @FUZZ
    @given(edits=st.lists(st.tuples(st.integers(0, len(blob) - 1), st.integers(0, 255)), max_size=6),
           cut=st.one_of(st.none(), st.integers(0, len(blob))), tokens=either(st.lists(INTS, max_size=8)),
           sid=st.sampled_from(SESSIONS))
    def prop(edits, cut, tokens, sid):
        data = bytearray(blob[:cut] if cut is not None else blob)
        for pos, byte in edits:
            if pos < len(data):
                data[pos] = byte
        body = {"session_id": sid, "blob": base64.b64encode(bytes(data)).decode(),
                "tokens": tokens if edits or cut is not None else exported.get("tokens", tokens)}
        check(send(app, "POST", "/session/restore", dumps(body)), ("restore", edits, cut, tokens))

    prop()
    still_serving(app)


def test_raw_bodies(app):
    @FUZZ
    @given(route=st.sampled_from(sorted(POST_ROUTES)), raw=raw_bodies)
    def prop(route, raw):
        check(send(app, "POST", route, raw), (route, raw[:200]))

    prop()
    still_serving(app)


# Inputs that once answered 500 (or a non-JSON body): always run, whatever the draw.
GET_REGRESSIONS = {"/session/estimate": ["tokens=1e308", "tokens=1e305", "tokens=1e300&upload_bps=1e-300",
                                         "tokens=1e20&blob_bytes=1e308&upload_bps=4.9e-324"]}


@pytest.mark.parametrize("route", GET_ROUTES)
def test_get_query_strings(app, route):
    def prop(query):
        check(send(app, "GET", f"{route}?{query}"), (route, query))

    for query in GET_REGRESSIONS.get(route, []):
        prop = example(query=query)(prop)
    FUZZ(given(query=query_strings(route))(prop))()
    still_serving(app)
