"""llama-server's introspection routes in process (tiny model, Quart's test client): GET /props,
GET /slots, POST /apply-template; shaped as llama-server b11434 shapes them and
refused in the contract's error shape."""

from __future__ import annotations

import pytest

from tests.web.inprocess import tiny_app

KEY = "sk-props-1"
HELLO = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    server = tiny_app(tmp_path_factory, "props", max_concurrent=3)
    yield server
    server.close()


def test_props_describe_the_model_and_its_defaults(app):
    status, body = app.get("/props")
    engine = app.engine()
    assert status == 200
    assert body["model_path"] == str(engine.path) and body["model_path"].endswith(".gguf")
    assert body["model_alias"] == "tiny" and body["model_ftype"] == "Q8_0"  # the fixture's file type
    assert body["total_slots"] == engine.max_concurrent == 3
    settings = body["default_generation_settings"]
    assert settings["n_ctx"] == engine.effective_ctx
    # /completion's own defaults (llama-server's temperature 0.8), read from a request that sets nothing
    assert settings["params"]["temperature"] == 0.8 and settings["params"]["top_k"] == 40
    assert settings["params"]["top_p"] == 0.95 and settings["params"]["n_predict"] == -1
    assert settings["params"]["seed"] == -1
    assert settings["params"]["min_p"] == 0.05 and settings["params"]["repeat_penalty"] == 1.0  # llama-server's
    assert body["chat_template"] == engine.template.source and "im_start" in body["chat_template"]
    assert body["bos_token"] == engine.tokenizer.token_text(engine.tokenizer.bos_id)
    assert body["eos_token"] == engine.tokenizer.token_text(engine.tokenizer.eos_id)
    assert body["modalities"] == {"vision": False, "video": False, "audio": False}
    assert body["build_info"].startswith("pantheon ")


def test_props_cannot_be_set(app):
    status, body, _ = app.post("/props", {"n_ctx": 5})
    assert status == 501 and body["error"]["type"] == "not_supported_error"


def test_slots_count_the_busy_ones_and_name_no_request(app):
    engine = app.engine()
    status, body = app.get("/slots")
    assert status == 200 and [s["id"] for s in body] == [0, 1, 2]
    assert all(s == {"id": s["id"], "n_ctx": engine.effective_ctx, "speculative": False, "is_processing": False}
               for s in body)
    assert app.get("/slots?fail_on_no_slot=1")[0] == 200
    scheduler = engine.scheduler
    taken = 0
    try:  # requests admitted: the scheduler's own count, as a running request holds it
        for _ in range(engine.max_concurrent):
            scheduler.reserve()
            taken += 1
            busy = [s["is_processing"] for s in app.get("/slots")[1]]
            assert busy == [i < taken for i in range(3)]
        status, body = app.get("/slots?fail_on_no_slot=1")
        assert status == 503 and body["error"]["type"] == "unavailable_error"
    finally:
        for _ in range(taken):
            scheduler._unreserve()
    assert app.get("/slots?fail_on_no_slot=1")[0] == 200


def test_apply_template_renders_what_a_chat_would_run(app):
    engine = app.engine()
    status, body, _ = app.post("/apply-template", {"messages": HELLO})
    assert status == 200 and body == {"prompt": engine.render_chat(HELLO)}
    assert body["prompt"].endswith("<|im_start|>assistant\n") and "hello" in body["prompt"]
    # the prompt the chat route tokenizes is this text
    from pantheon.engine.chat import plan_chat
    from pantheon.web.chat_request import parse_chat_request

    plan = plan_chat(engine, parse_chat_request({"messages": HELLO}))
    assert plan.request.prompt_ids == engine.encode_prompt(body["prompt"])
    # without the assistant's opening: the same conversation, ending at the user's turn
    status, closed, _ = app.post("/apply-template", {"messages": HELLO, "add_generation_prompt": False})
    assert status == 200 and closed["prompt"] == engine.render_chat(HELLO, add_generation_prompt=False)
    assert body["prompt"] == closed["prompt"] + "<|im_start|>assistant\n"


def test_a_developer_turn_is_a_system_turn(app):
    """OpenAI's newer clients send their system prompt as `developer`: rendered as `system`, as
    llama.cpp maps it, where the template has no developer role of its own."""
    engine = app.engine()
    status, body, _ = app.post("/apply-template", {"messages": [{"role": "developer", "content": "Be brief."}] + HELLO})
    assert status == 200 and body["prompt"] == engine.render_chat([{"role": "system", "content": "Be brief."}] + HELLO)
    assert "developer" not in body["prompt"]
    from types import SimpleNamespace

    from pantheon.engine.chat import developer_as_system

    harmony = SimpleNamespace(template=SimpleNamespace(source="<|start|>{{ m.role }}<|channel|>"))  # GPT-OSS's own role
    turns = [{"role": "developer", "content": "x"}]
    assert developer_as_system(harmony, turns) is turns


PREFILL = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "Well, the"}]


def test_a_final_assistant_message_is_continued(app):
    """Anthropic's prefill (llama-server's too): the conversation up to the assistant's opening, then
    the text the assistant has begun; the answer continues it and holds only the continuation."""
    engine = app.engine()
    status, body, _ = app.post("/apply-template", {"messages": PREFILL})
    assert status == 200 and body["prompt"] == engine.render_chat(PREFILL[:1]) + "Well, the"
    n_prompt = len(engine.encode_prompt(body["prompt"]))
    status, reply, _ = app.post("/v1/messages", {"model": "tiny", "max_tokens": 2, "temperature": 0,
                                                 "messages": PREFILL})
    assert status == 200 and reply["usage"]["input_tokens"] + reply["usage"]["cache_read_input_tokens"] == n_prompt
    status, reply, _ = app.post("/v1/chat/completions", {"model": "tiny", "max_tokens": 2, "temperature": 0,
                                                         "messages": PREFILL})
    assert status == 200 and reply["usage"]["prompt_tokens"] == n_prompt
    # not a prefill: an empty final assistant turn, a tool call, or asked for the conversation as it is
    for last in ({"role": "assistant", "content": ""},
                 {"role": "assistant", "content": "x", "tool_calls": [
                     {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}):
        text = app.post("/apply-template", {"messages": PREFILL[:1] + [last]})[1]["prompt"]
        assert text.endswith("<|im_start|>assistant\n") and text.count("<|im_start|>assistant") == 2
    closed = app.post("/apply-template", {"messages": PREFILL, "add_generation_prompt": False})[1]["prompt"]
    assert closed == engine.render_chat(PREFILL, add_generation_prompt=False)


def test_continue_final_message_as_vllm_and_llama_server_read_it(app):
    """continue_final_message (with add_generation_prompt false, both vLLM's): the final assistant
    turn continued, empty or not; a final turn of another role continued where its text ends; and
    add_generation_prompt false alone renders the conversation as it is, on the chat route too."""
    engine = app.engine()
    go_on = {"add_generation_prompt": False, "continue_final_message": True}
    assert app.post("/apply-template", {"messages": PREFILL, **go_on})[1]["prompt"] == \
        engine.render_chat(PREFILL[:1]) + "Well, the"
    assert app.post("/apply-template", {"messages": PREFILL, **go_on, "continue_final_message": "content"})[1] == \
        {"prompt": engine.render_chat(PREFILL[:1]) + "Well, the"}
    empty = PREFILL[:1] + [{"role": "assistant", "content": ""}]
    assert app.post("/apply-template", {"messages": empty, **go_on})[1]["prompt"] == engine.render_chat(PREFILL[:1])
    text = app.post("/apply-template", {"messages": HELLO, **go_on})[1]["prompt"]
    assert text.endswith("hello") and engine.render_chat(HELLO, add_generation_prompt=False).startswith(text)
    status, reply, _ = app.post("/v1/chat/completions", {"model": "tiny", "max_tokens": 2, "messages": HELLO,
                                                         "add_generation_prompt": False})
    assert status == 200
    assert reply["usage"]["prompt_tokens"] == len(engine.encode_prompt(engine.render_chat(HELLO, False)))
    status, reply, _ = app.post("/v1/chat/completions", {"model": "tiny", "max_tokens": 2, "messages": HELLO, **go_on})
    assert status == 200 and reply["usage"]["prompt_tokens"] == len(engine.encode_prompt(text))


CALL = {"role": "assistant", "content": "x", "tool_calls": [
    {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}


@pytest.mark.parametrize("extra, says", [
    ({"continue_final_message": True}, "Cannot set both add_generation_prompt and continue_final_message"),
    ({"continue_final_message": True, "add_generation_prompt": True}, "Cannot set both"),
    ({"continue_final_message": "reasoning_content", "add_generation_prompt": False}, "not supported"),
    ({"continue_final_message": 5, "add_generation_prompt": False}, "'continue_final_message' must be a boolean"),
    ({"continue_final_message": True, "add_generation_prompt": False, "messages": HELLO + [CALL]},
     "Cannot continue an assistant message that contains tool calls"),
    ({"continue_final_message": True, "add_generation_prompt": False, "messages": [{"role": "user", "content": ""}]},
     "the chat template does not show the final message's text"),
])
@pytest.mark.parametrize("route", ["/apply-template", "/v1/chat/completions"])
def test_continue_final_message_refusals(app, route, extra, says):
    status, out, _ = app.post(route, {"messages": PREFILL, "max_tokens": 1, **extra})
    assert status == 400 and out["error"]["type"] == "invalid_request_error" and says in out["error"]["message"]


@pytest.mark.parametrize("body, says", [
    ({"messages": 5}, "'messages' must be an array"),
    ({}, "'messages' must be an array"),
    ({"messages": []}, "messages"),
    ({"messages": HELLO, "tools": "x"}, "'tools' must be an array"),
    ({"messages": HELLO, "add_generation_prompt": "no"}, "'add_generation_prompt' must be a boolean"),
    ({"messages": HELLO, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]},
     "invalid tools"),
])
def test_apply_template_refusals(app, body, says):
    status, out, _ = app.post("/apply-template", body)
    assert status == 400 and out["error"]["type"] == "invalid_request_error" and says in out["error"]["message"]


def test_apply_template_without_a_template_and_the_file_type_from_the_file(tmp_path_factory):
    from tests.fixtures.tiny_models import write_tiny_llama
    from tests.web.inprocess import InProcessApp

    path = write_tiny_llama(tmp_path_factory.mktemp("props-base") / "base.gguf", chat_template=None,
                            extra_metadata={"general.file_type": 15})
    server = InProcessApp([(str(path), "base")])
    try:
        status, body, _ = server.post("/apply-template", {"messages": HELLO})
        assert status == 400 and "no chat template" in body["error"]["message"]
        props = server.get("/props")[1]
        assert props["chat_template"] == "" and props["model_ftype"] == "Q4_K_M"  # as the file says
    finally:
        server.close()


def test_chat_template_kwargs_reach_the_template(tmp_path_factory):
    """chat_template_kwargs (vLLM's and llama-server's) are the template's arguments, over the serve's
    --chat-template-kwargs / --reasoning; enable_thinking among them is the request's thinking
    switch; the template's own variables and a malformed object are refused."""
    from pantheon.config import SamplingDefaults
    from tests.fixtures.tiny_models import THINK_CHATML, write_tiny_llama
    from tests.web.inprocess import InProcessApp

    template = "{{ greeting | default('none') }}|" + THINK_CHATML
    path = write_tiny_llama(tmp_path_factory.mktemp("kwargs") / "think.gguf", chat_template=template)
    server = InProcessApp([(str(path), "think")], sampling=SamplingDefaults(
        template_kwargs={"greeting": "hi", "enable_thinking": False}))
    try:
        def prompt(**body):
            status, out, _ = server.post("/apply-template", {"messages": HELLO, **body})
            return out["prompt"] if status == 200 else (status, out["error"]["type"], out["error"]["message"])

        assert prompt().startswith("hi|") and not prompt().endswith("<think>\n")  # the serve's, thinking off
        assert prompt(chat_template_kwargs={"greeting": "hey there"}).startswith("hey there|")
        assert prompt(chat_template_kwargs={"enable_thinking": True}).endswith("<think>\n")
        assert prompt(chat_template_kwargs={"enable_thinking": True}, enable_thinking=False) == prompt()
        status, reply, _ = server.post("/v1/chat/completions", {
            "model": "think", "max_tokens": 1, "messages": HELLO, "chat_template_kwargs": {"greeting": "hey there"}})
        engine = server.engine()
        assert status == 200 and reply["usage"]["prompt_tokens"] == len(engine.encode_prompt(
            prompt(chat_template_kwargs={"greeting": "hey there"})))
        hey = len(engine.encode_prompt(prompt(chat_template_kwargs={"greeting": "hey there"})))
        assert hey != len(engine.encode_prompt(prompt()))
        for route, body in (("/v1/messages/count_tokens", {"messages": HELLO}),
                            ("/v1/responses/input_tokens", {"input": "hello"})):
            status, out, _ = server.post(route, {"model": "think", "chat_template_kwargs": {"greeting": "hey there"}, **body})
            assert status == 200 and out["input_tokens"] == hey, (route, out)
        for kwargs, says in (([1], "'chat_template_kwargs' must be an object"),
                             ({"messages": []}, "'chat_template_kwargs.messages' is set by the server"),
                             ({"enable_thinking": "yes"}, "'chat_template_kwargs.enable_thinking' must be a boolean")):
            status, kind, message = prompt(chat_template_kwargs=kwargs)
            assert (status, kind) == (400, "invalid_request_error") and says in message
    finally:
        server.close()


def test_no_slots_answers_as_llama_server(tmp_path_factory):
    server = tiny_app(tmp_path_factory, "no-slots", slots_endpoint=False)
    try:
        status, body = server.get("/slots")
        assert status == 501 and body["error"]["type"] == "not_supported_error" and "--slots" in body["error"]["message"]
        assert server.get("/props")[1]["endpoint_slots"] is False
    finally:
        server.close()


def test_props_need_the_key_the_model_list_does_not(tmp_path_factory):
    server = tiny_app(tmp_path_factory, "props-key", api_key=KEY)
    try:
        assert server.get("/v1/models")[0] == 200 and server.get("/health")[0] == 200
        assert server.get("/props")[0] == 401 and server.get("/slots")[0] == 401
        assert server.post("/apply-template", {"messages": HELLO})[0] == 401
        assert server.get("/props", {"Authorization": f"Bearer {KEY}"})[0] == 200
    finally:
        server.close()


def test_min_p_and_repetition_penalty_reach_the_sampler_under_either_name(app):
    from pantheon.engine.chat import _sampling
    from pantheon.web.chat_request import parse_chat_request

    chat = parse_chat_request({"messages": HELLO, "min_p": 0.1, "repetition_penalty": 1.3})
    params = _sampling(chat, 0)
    assert params.min_p == 0.1 and params.repetition_penalty == 1.3
    chat = parse_chat_request({"messages": HELLO, "repeat_penalty": 1.2, "min_p": 7})  # llama-server's name; clamped
    assert _sampling(chat, 0).repetition_penalty == 1.2 and chat.min_p == 1.0
    assert _sampling(parse_chat_request({"messages": HELLO}), 0).min_p == 0.0  # the OpenAI routes: off
    status, body, _ = app.post("/completion", {"prompt": "hi", "n_predict": 2, "repeat_penalty": 1.5})
    settings = body["generation_settings"]
    assert status == 200 and settings["min_p"] == 0.05 and settings["repeat_penalty"] == 1.5
    status, body, _ = app.post("/completion", {"prompt": "hi", "n_predict": 2, "min_p": 0.2, "repeat_penalty": 0})
    assert body["generation_settings"]["min_p"] == 0.2 and body["generation_settings"]["repeat_penalty"] == 0.01
    status, body, _ = app.post("/v1/chat/completions", {"messages": HELLO, "max_tokens": 2, "min_p": "x"})
    assert status == 400 and "min_p" in body["error"]["message"]


def test_a_chat_template_given_at_serve_replaces_the_files(tmp_path_factory):
    """serve --chat-template: a builtin by llama.cpp's name in place of the file's template, for
    every served model; POST /admin/models/load takes its own (`chat_template`)."""
    from pantheon.engine.chat import plan_chat
    from pantheon.text.chat_template import BUILTIN_TEMPLATES
    from pantheon.web.chat_request import parse_chat_request

    given = tiny_app(tmp_path_factory, "given-template", chat_template="gemma")
    try:
        engine = given.engine()
        bos = engine.tokenizer.token_text(engine.tokenizer.bos_id) if engine.tokenizer.add_bos else ""
        status, body, _ = given.post("/apply-template", {"messages": HELLO})
        assert status == 200 and body["prompt"] == bos + "<start_of_turn>user\nhello<end_of_turn>\n<start_of_turn>model\n"
        assert given.get("/props")[1]["chat_template"] == BUILTIN_TEMPLATES["gemma"]
        plan = plan_chat(engine, parse_chat_request({"messages": HELLO}))
        assert plan.request.prompt_ids == engine.encode_prompt(body["prompt"])
        status, row, _ = given.post("/admin/models/load", {"path": str(engine.path), "name": "tiny-llama3",
                                                           "chat_template": "llama3"})
        assert status == 200, row
        status, body, _ = given.post("/apply-template", {"model": "tiny-llama3", "messages": HELLO})
        assert body["prompt"] == bos + "<|start_header_id|>user<|end_header_id|>\n\nhello<|eot_id|>" \
                                       "<|start_header_id|>assistant<|end_header_id|>\n\n"
        for bad in (5, ""):  # not a template
            status, err, _ = given.post("/admin/models/load", {"path": str(engine.path), "name": "x", "chat_template": bad})
            assert status == 400 and err["error"]["type"] == "invalid_request_error", err
        # one that does not compile refuses the load, and says why
        status, err, _ = given.post("/admin/models/load", {"path": str(engine.path), "name": "x",
                                                           "chat_template": "{% for m in messages %}"})
        assert status == 500 and err["error"]["type"] == "load_failed" and "chat template" in err["error"]["message"]
    finally:
        given.close()


def test_a_template_that_takes_a_system_turn_only_first_gets_the_later_ones_folded(tmp_path_factory):
    """Claude Code sends a system turn after a user turn; a template that refuses that (Mistral's
    do) renders them folded into the user turn beside them instead of a 400."""
    strict = ("{% for m in messages %}{% if m['role'] == 'system' and not loop.first %}"
              "{{ raise_exception('system only first') }}{% endif %}{% if loop.first and m['role'] == 'assistant' %}"
              "{{ raise_exception('a user opens') }}{% endif %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
              "{% if add_generation_prompt %}[assistant]{% endif %}")
    app = tiny_app(tmp_path_factory, "strict-template", chat_template=strict)
    try:
        turns = [{"role": "user", "content": "hello"}, {"role": "system", "content": "agents"}]
        status, body, _ = app.post("/apply-template", {"messages": turns})
        assert status == 200 and body["prompt"] == "[user]hello\n\nagents[assistant]"
        status, reply, _ = app.post("/v1/messages", {"max_tokens": 2, "messages": turns})
        assert status == 200 and reply["type"] == "message"
        # ... and one with no system role at all (Gemma 2's) gets the system prompt in the first user turn
        gemma2 = tiny_app(tmp_path_factory, "no-system-role", chat_template=(
            "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
            "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"))
        try:
            status, body, _ = gemma2.post("/apply-template", {"messages": [{"role": "system", "content": "S"}] + turns})
            assert status == 200 and body["prompt"] == "[user]S\n\nhello\n\nagents"
        finally:
            gemma2.close()
        # what folding cannot mend is still a 400 with the template's reason
        status, err, _ = app.post("/v1/chat/completions", {"max_tokens": 2, "messages": [
            {"role": "assistant", "content": "hi"}, {"role": "system", "content": "s"}, {"role": "user", "content": "u"}]})
        assert status == 400 and "a user opens" in err["error"]["message"]
    finally:
        app.close()


def test_the_model_rows_carry_llama_servers_meta(app):
    """`meta` as llama-server's /v1/models has it (its web UI reads n_ctx_train from it)."""
    import math

    engine = app.engine()
    row = app.get("/v1/models")[1]["data"][0]
    tensors = engine.gguf.tensors.values()
    assert row["meta"] == {"vocab_type": 2 if engine.gguf.metadata["tokenizer.ggml.model"] == "gpt2" else 1,
                           "n_vocab": engine.spec.n_vocab, "n_ctx_train": engine.spec.ctx_train,
                           "n_embd": engine.spec.n_embd, "n_params": sum(math.prod(t.shape) for t in tensors),
                           "size": sum(t.nbytes for t in tensors)}
    assert row["meta"]["n_params"] > 0 and row["meta"]["size"] > 0
