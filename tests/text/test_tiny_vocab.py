"""The tiny models' vocabulary and chat templates (tests/fixtures/tiny_models.py), read back from a
written GGUF: merges apply in rank order, specials/think tokens partition as llama.cpp does, and the
ChatML / Qwen3-style thinking templates render the expected prompts."""

from __future__ import annotations

import pytest

from pantheon.gguf import open_gguf
from pantheon.text.chat_template import ChatTemplate
from pantheon.text.tokenizer import ATTR_CONTROL, ATTR_USER_DEFINED, Tokenizer
from tests.fixtures.tiny_models import (BYTE_BASE, CHATML, ENDOFTEXT_ID, IM_END_ID, IM_START_ID, THINK_CHATML,
                                        tiny_vocab, write_tiny_llama)


@pytest.fixture(scope="module")
def think_gguf(tmp_path_factory):
    path = write_tiny_llama(tmp_path_factory.mktemp("vocab") / "think.gguf", n_layer=1, think_tokens=True,
                            chat_template=THINK_CHATML)
    return open_gguf(path)


@pytest.fixture(scope="module")
def tok(think_gguf):
    return Tokenizer.from_gguf(think_gguf)


def ids(tok, *texts):
    return [tok.token_to_id(t) for t in texts]


def test_vocab_layout(tok):
    tokens, types, merges = tiny_vocab(think_tokens=True)
    assert tok.vocab_size == len(tokens) == len(types)
    assert tok.token_text(BYTE_BASE + ord("a")) == "a" and tok.token_text(BYTE_BASE + ord(" ")) == "Ġ"
    assert tok.token_bytes(BYTE_BASE + 0xFF) == b"\xff"
    assert all(tok.token_to_id(m.replace(" ", "")) is not None for m in merges)
    assert (tok.bos_id, tok.eos_id, tok.unk_id, tok.pad_id) == (ENDOFTEXT_ID, IM_END_ID, ENDOFTEXT_ID, ENDOFTEXT_ID)
    assert tok.add_bos is False
    assert tok.eog_ids == frozenset({ENDOFTEXT_ID, IM_END_ID})
    for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        assert tok.token_attr(tok.token_to_id(t)) & ATTR_CONTROL
    for t in ("<think>", "</think>"):
        assert tok.token_attr(tok.token_to_id(t)) == ATTR_USER_DEFINED


def test_merges_apply_in_rank_order(tok):
    assert tok.encode(" the world") == ids(tok, "Ġthe", "Ġworld")
    assert tok.encode(" hello") == ids(tok, "Ġhello")
    assert tok.encode("hello") == ids(tok, "hell", "o")
    assert tok.encode("system") == ids(tok, "system")
    assert tok.encode("12") == [BYTE_BASE + ord("1"), BYTE_BASE + ord("2")]  # smollm: digits split


def test_specials_partition(tok):
    assert tok.encode("<|im_start|>user\n") == [IM_START_ID, tok.token_to_id("user"), BYTE_BASE + ord("\n")]
    plain = tok.encode("<|im_end|>", parse_special=False)
    assert IM_END_ID not in plain and tok.decode(plain) == "<|im_end|>"
    # USER_DEFINED think tokens are always one token, even without parse_special
    think = tok.token_to_id("<think>")
    assert tok.encode("<think>\nx", parse_special=False)[0] == think
    assert tok.decode([IM_START_ID, think, IM_END_ID], unparse_special=False) == "<think>"


@pytest.mark.parametrize("text", ["hello the world", " leading and  double  spaces ", "tabs\tand\nnewlines\n\n",
                                  "ünïcödé, 日本語, emoji 🙂", "it's   I'm  you're", ""])
def test_round_trip(tok, text):
    assert tok.decode(tok.encode(text)) == text


def test_think_template(think_gguf, tok):
    t = ChatTemplate.from_gguf(think_gguf, tok)
    assert t.source == THINK_CHATML and (t.bos_token, t.eos_token) == ("<|endoftext|>", "<|im_end|>")
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    head = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert t.render(msgs) == head + "<think>\n"
    assert t.render(msgs, enable_thinking=True) == head + "<think>\n"
    assert t.render(msgs, enable_thinking=False) == head + "<think>\n\n</think>\n\n"
    assert t.render(msgs, add_generation_prompt=False) == head[:-len("<|im_start|>assistant\n")]
    # an earlier assistant turn loses its reasoning
    turns = msgs + [{"role": "assistant", "content": "<think>\nhmm\n</think>\n\nHello!"},
                    {"role": "user", "content": "bye"}]
    out = t.render(turns, add_generation_prompt=False)
    assert "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nbye<|im_end|>\n" in out and "hmm" not in out
    prompt_ids = tok.encode(t.render(msgs, enable_thinking=False))
    assert prompt_ids.count(tok.token_to_id("<think>")) == 1 and prompt_ids.count(tok.token_to_id("</think>")) == 1


def test_chatml_template_and_no_template(tmp_path):
    g = open_gguf(write_tiny_llama(tmp_path / "c.gguf", n_layer=1))
    t = ChatTemplate.from_gguf(g, Tokenizer.from_gguf(g))
    assert t.source == CHATML
    assert t.render([{"role": "user", "content": "hi"}]) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    g2 = open_gguf(write_tiny_llama(tmp_path / "n.gguf", n_layer=1, chat_template=None))
    assert "tokenizer.chat_template" not in g2.metadata
