"""SmolLM2 (byte-level BPE, pre 'smollm') against llama.cpp's reference tokenization and prompts."""

from __future__ import annotations


import pytest

from tests.text.conftest import load_cases, reference_case_ids

TOKENIZATION = "smollm2/tokenization.json"
GREEDY = "smollm2/greedy.json"


@pytest.fixture(scope="module")
def tok_cases(reference_dir):
    return load_cases(reference_dir, TOKENIZATION)


@pytest.fixture(scope="module")
def greedy_cases(reference_dir):
    return load_cases(reference_dir, GREEDY)


def test_reference_files_have_cases():
    assert len(reference_case_ids(TOKENIZATION)) == 44
    assert len(reference_case_ids(GREEDY)) == 8


@pytest.mark.parametrize("case_id", reference_case_ids(TOKENIZATION))
def test_ids_match_llamacpp_with_and_without_parse_special(smollm2_tokenizer, tok_cases, case_id):
    c = tok_cases[case_id]
    assert smollm2_tokenizer.encode(c["text"], parse_special=True) == c["ids_parse_special"]
    assert smollm2_tokenizer.encode(c["text"], parse_special=False) == c["ids_no_parse_special"]
    # add_special=True adds nothing for this model (add_bos_token=false, no add_eos)
    assert smollm2_tokenizer.encode(c["text"], add_bos=None) == c["ids_parse_special"]


@pytest.mark.parametrize("case_id", reference_case_ids(TOKENIZATION))
def test_detokenize_matches_llamacpp_all_three_variants(smollm2_tokenizer, tok_cases, case_id):
    c = tok_cases[case_id]
    tk = smollm2_tokenizer
    assert tk.decode(c["ids_parse_special"]) == c["detok_parse_special"]
    assert tk.decode(c["ids_no_parse_special"]) == c["detok_no_parse_special"]
    assert tk.decode(c["ids_parse_special"], unparse_special=False) == \
        c["detok_parse_special_without_unparse_special"]


@pytest.mark.parametrize("case_id", reference_case_ids(GREEDY))
def test_prompt_ids_of_reference_rendered_prompt(smollm2_tokenizer, greedy_cases, case_id):
    c = greedy_cases[case_id]
    assert smollm2_tokenizer.encode(c["rendered_prompt"]) == c["prompt_ids"]


def test_eog_set_is_exactly_llamacpps_0_2_4(smollm2_tokenizer):
    tk = smollm2_tokenizer
    assert tk.eog_ids == frozenset({0, 2, 4})
    assert (tk.bos_id, tk.eos_id, tk.unk_id, tk.pad_id) == (1, 2, 0, 2)
    assert tk.special_id("fim_rep") == 4  # <reponame>, detected by text
    assert tk.vocab_size == 49152
    assert tk.add_bos is False


def test_control_tokens_are_ids_0_to_16_and_render_as_text(smollm2_tokenizer):
    tk = smollm2_tokenizer
    assert [i for i in range(200) if tk.is_control(i)] == list(range(17))
    assert tk.token_text(1) == "<|im_start|>"
    assert tk.token_bytes(1) == b"<|im_start|>"
    assert tk.token_text(38699) == "ĠHello" and tk.token_bytes(38699) == b" Hello"


def test_add_bos_true_prepends_bos_even_though_model_default_is_false(smollm2_tokenizer):
    assert smollm2_tokenizer.encode("Hello", add_bos=True) == [1, 19556]
    assert smollm2_tokenizer.encode("", add_bos=True) == [1]
    assert smollm2_tokenizer.encode("") == []


def test_token_id_out_of_range_is_a_clear_error(smollm2_tokenizer):
    with pytest.raises(ValueError, match="out of range"):
        smollm2_tokenizer.decode([49152])
    with pytest.raises(ValueError, match="out of range"):
        smollm2_tokenizer.token_bytes(-1)


def test_20000_letter_word_round_trips(smollm2_tokenizer):
    word = "abcdefghijklmnopqrstuvwxyz" * 769 + "abcdef"
    assert len(word) == 20000
    for text in (word, "a" * 20000):  # (a quadratic BPE would show as a slow suite, not as a failed assertion)
        assert smollm2_tokenizer.decode(smollm2_tokenizer.encode(text)) == text


def test_text_longer_than_any_fragment_with_many_special_tokens(smollm2_tokenizer):
    tk = smollm2_tokenizer
    turn = "<|im_start|>user\nHi there, 3 cats<|im_end|>\n"
    ids = tk.encode(turn * 200)
    assert ids == tk.encode(turn) * 200
    assert tk.decode(ids) == turn * 200
