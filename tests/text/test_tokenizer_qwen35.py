"""The qwen35 pre-tokenizer (tiny 384-token vocab) against llama.cpp's tokenization."""

from __future__ import annotations

import json

import pytest

REF = "qwen35moe/ref/tokenizer_ref.json"


@pytest.fixture(scope="module")
def qwen35_cases(reference_dir):
    return json.loads((reference_dir / REF).read_text(encoding="utf-8"))


def test_qwen35_ids_match_llamacpp_with_and_without_parse_special(qwen35_tokenizer, qwen35_cases):
    assert len(qwen35_cases) == 7
    for c in qwen35_cases:
        assert qwen35_tokenizer.encode(c["text"], parse_special=True) == c["ids_parse_special"], c["text"]
        assert qwen35_tokenizer.encode(c["text"], parse_special=False) == c["ids_no_special"], c["text"]


def test_qwen35_single_token_pieces_match_llamacpp(qwen35_tokenizer, qwen35_cases):
    # llama.cpp's per-token pieces; a lone partial UTF-8 byte shows as U+FFFD
    for c in qwen35_cases:
        assert [qwen35_tokenizer.decode([i]) for i in c["ids_parse_special"]] == c["pieces"], c["text"]
        assert qwen35_tokenizer.decode(c["ids_parse_special"]) == c["text"]


def test_qwen35_user_defined_think_and_tool_call_match_without_parse_special(qwen35_tokenizer):
    tk = qwen35_tokenizer
    assert tk.encode("<think>x</tool_call>", parse_special=False)[0] == 380
    assert tk.encode("<think>x</tool_call>", parse_special=False)[-1] == 383
    assert tk.encode("<|im_start|>", parse_special=False) != [378]
    assert tk.encode("<|im_start|>", parse_special=True) == [378]
    # user-defined tokens are not control: kept when control tokens are dropped
    assert tk.decode([378, 380, 379], unparse_special=False) == "<think>"


def test_qwen35_eog_and_specials(qwen35_tokenizer):
    tk = qwen35_tokenizer
    assert tk.eog_ids == frozenset({377, 379})
    assert (tk.bos_id, tk.eos_id) == (377, 379)
    assert tk.pre == "qwen35" and tk.clean_spaces is False
