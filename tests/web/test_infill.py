"""llama-server's /infill in process (a tiny model with Qwen2.5-Coder's FIM tokens): its
repository-level prompt laid out token for token as llama-server lays it out, fitted to its batch,
the answer in /completion's shape (streamed too), and its refusals: bad input_extra (400) and a
vocabulary without FIM tokens (501)."""

from __future__ import annotations

import pytest

from pantheon.engine.chat import fim_prompt_ids, infill_ids
from tests.fixtures.tiny_models import write_tiny_llama
from tests.web.inprocess import InProcessApp, tiny_app

FIM = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|repo_name|>", "<|file_sep|>")
BODY = {"input_prefix": "int main() {\n", "input_suffix": "}\n", "prompt": "    int n = ",
        "n_predict": 3, "temperature": 0}


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    path = write_tiny_llama(tmp_path_factory.mktemp("infill") / "coder.gguf", extra_tokens=FIM)
    server = InProcessApp([(str(path), "coder")])
    yield server
    server.close()


def test_the_prompt_is_llama_servers_repository_layout(app):
    tok = app.engine().tokenizer
    pre, suf, mid, rep, sep = (tok.token_to_id(t) for t in FIM)
    assert (tok.special_id("fim_pre"), tok.special_id("fim_rep"), tok.special_id("fim_sep")) == (pre, rep, sep)

    def text(s):
        return tok.encode(s, parse_special=False, add_bos=False)

    bos = [tok.bos_id] if tok.add_bos else []
    middle = text("x = ")
    ids = infill_ids(tok, "a\nb\n", "c\n", [("lib.h", "int f();\n")], middle, batch=2048, room=10_000)
    assert ids == [rep, *text("myproject\n"), sep, *text("lib.h\n"), *text("int f();\n"), sep, *text("filename\n"),
                   *bos, pre, *text("a\nb\n"), *middle, suf, *text("c\n"), mid]
    # fitted as llama-server fits it: the prefix's last 3/4 batch, the suffix's first quarter less the
    # middle and two, the extra context's last `room` tokens
    long_prefix, long_suffix = "p" * 40, "s" * 40
    ids = infill_ids(tok, long_prefix, long_suffix, [("f", "e" * 30)], middle, batch=32, room=5)
    extra = [rep, *text("myproject\n"), sep, *text("f\n"), *text("e" * 30), sep, *text("filename\n")]
    n_suffix = 32 // 4 - 2 - len(middle)
    assert 0 < n_suffix < len(text(long_suffix)) and len(text(long_prefix)) > 24
    assert ids == fim_prompt_ids(tok, text(long_prefix)[-24:], text(long_suffix)[:n_suffix], middle, extra[-5:])
    ids = infill_ids(tok, "a", "b", [("f", "e")], [], batch=16, room=-3)  # no room: no extra files
    assert ids[:len(bos) + 1] == bos + [pre]


def test_infill_answers_as_completion_does(app):
    status, body, _ = app.post("/infill", {**BODY, "input_extra": [{"filename": "lib.h", "text": "int f();\n"}]})
    assert status == 200 and body["stop"] is True and body["tokens_predicted"] == 3 == body["timings"]["predicted_n"]
    assert isinstance(body["content"], str)
    tok = app.engine().tokenizer
    expected = infill_ids(tok, BODY["input_prefix"], BODY["input_suffix"], [("lib.h", "int f();\n")],
                          tok.encode(BODY["prompt"], parse_special=True, add_bos=False), batch=128,
                          room=128 - 128 - 2 * 3)  # tiny_app's window 128: no room for the extra files
    assert body["tokens_evaluated"] == len(expected)
    status, events = app.stream("/infill", BODY)
    assert status == 200 and events[-1]["stop"] is True and events[-1]["tokens_predicted"] == 3


@pytest.mark.parametrize("extra", [{}, {"filename": "ok"}, {"filename": 123}, {"filename": 123, "text": "abc"},
                                   {"filename": "a", "text": 456}, "text"])
def test_bad_input_extra_is_refused(app, extra):
    status, body, _ = app.post("/infill", {**BODY, "input_extra": [extra]})
    assert status == 400 and body["error"]["type"] == "invalid_request_error" and "input_extra[0]" in body["error"]["message"]


@pytest.mark.parametrize("body, says", [({**BODY, "input_prefix": 5}, "input_prefix"),
                                        ({**BODY, "input_extra": {}}, "input_extra"),
                                        ({**BODY, "prompt": {"a": 1}}, "prompt")])
def test_bad_fields_are_refused(app, body, says):
    status, out, _ = app.post("/infill", body)
    assert status == 400 and says in out["error"]["message"]


def test_a_model_without_fim_tokens_gets_501(tmp_path_factory):
    server = tiny_app(tmp_path_factory, "no-fim")
    try:
        status, body, _ = server.post("/infill", BODY)
        assert status == 501 and body["error"]["type"] == "not_supported_error"
        assert "prefix, suffix, middle" in body["error"]["message"]
    finally:
        server.close()


def test_completions_suffix_is_the_same_fim_prompt_without_extra(app):
    tok = app.engine().tokenizer
    status, body, _ = app.post("/v1/completions", {"model": "coder", "prompt": "int main() {\n", "suffix": "}\n",
                                                   "max_tokens": 2, "temperature": 0})
    ids = fim_prompt_ids(tok, tok.encode("int main() {\n", parse_special=False, add_bos=False),
                         tok.encode("}\n", parse_special=False, add_bos=False))
    assert status == 200 and body["usage"]["prompt_tokens"] == len(ids)
