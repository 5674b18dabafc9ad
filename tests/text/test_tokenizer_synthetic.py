"""Tiny in-memory vocabularies whose llama.cpp tokenization can be worked out by hand:
SentencePiece (leading-space rule, score-ordered merges, byte fallback) and byte-level BPE
(llama3 regex + ignore_merges + default BOS, gpt-2 regex, clean_spaces)."""

from __future__ import annotations

import pytest

from pantheon.text.detok import IncrementalDetokenizer
from pantheon.text.token_bytes import bytes_to_unicode
from pantheon.text.tokenizer import Tokenizer

# ---- SentencePiece ---------------------------------------------------------------------------------
# ids: 0 <unk>, 1 <s>, 2 </s>, 3..258 <0x00>..<0xFF>, then the normal pieces below
SPM_PIECES = [("▁", -5.0), ("h", -6.0), ("e", -6.0), ("l", -6.0), ("o", -6.0), ("▁h", -1.0),
              ("▁he", -1.1), ("ll", -1.2), ("▁hell", -1.3), ("▁hello", -1.4), ("el", -1.5)]
ID = {p: 259 + i for i, (p, _) in enumerate(SPM_PIECES)}


def byte_id(b: int) -> int:
    return 3 + b


def spm_meta(**over) -> dict:
    scores = dict(SPM_PIECES)
    scores.update(over.pop("scores", {}))
    meta = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
                                 + [p for p, _ in SPM_PIECES],
        "tokenizer.ggml.scores": [0.0] * 259 + [scores[p] for p, _ in SPM_PIECES],
        "tokenizer.ggml.token_type": [2, 3, 3] + [6] * 256 + [1] * len(SPM_PIECES),
        "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.unknown_token_id": 0,
    }
    meta.update(over)
    return meta


@pytest.fixture(scope="module")
def spm():
    return Tokenizer.from_metadata(spm_meta())


def test_spm_defaults_add_bos_and_prefix_a_space(spm):
    assert spm.add_bos is True and spm.add_space_prefix is True
    assert spm.encode("hello") == [1, ID["▁hello"]]
    assert spm.encode("hello", add_bos=False) == [ID["▁hello"]]
    assert spm.encode("hello hello", add_bos=False) == [ID["▁hello"], ID["▁hello"]]
    assert spm.eog_ids == frozenset({2})


def test_spm_text_starting_with_space_gets_a_second_space_like_llamacpp(spm):
    # llama.cpp prefixes ' ' even when the text already starts with one: "▁▁hello"
    # (HF Metaspace(prepend_scheme='first') would give just [▁hello])
    assert spm.encode(" hello", add_bos=False) == [ID["▁"], ID["▁hello"]]


def test_spm_every_fragment_after_a_special_token_gets_the_space(spm):
    assert spm.encode("<s>hello</s>", add_bos=False) == [1, ID["▁hello"], 2]
    assert spm.encode("hello</s>hello", add_bos=False) == [ID["▁hello"], 2, ID["▁hello"]]


def test_spm_control_text_without_parse_special_is_bytes(spm):
    b = byte_id
    ids = spm.encode("<s>hello</s>", parse_special=False, add_bos=False)
    assert ids == [ID["▁"], b(0x3C), b(0x73), b(0x3E), ID["h"], ID["e"], ID["ll"], ID["o"],
                   b(0x3C), b(0x2F), b(0x73), b(0x3E)]
    assert spm.decode(ids) == "<s>hello</s>"


def test_spm_unknown_character_falls_back_to_utf8_byte_tokens(spm):
    ids = spm.encode("hé", add_bos=False)
    assert ids == [ID["▁h"], byte_id(0xC3), byte_id(0xA9)]
    assert spm.decode(ids) == "hé"
    det = IncrementalDetokenizer(spm, strip_leading_space=True)
    assert [det.push(i) for i in ids] == ["h", "", "é"]


def test_spm_merges_follow_scores_not_position():
    no_prefix = Tokenizer.from_metadata(spm_meta(**{"tokenizer.ggml.add_space_prefix": False}))
    # "h e l l o": ll (-1.2) beats el (-1.5)
    assert no_prefix.encode("hello", add_bos=False) == [ID["h"], ID["e"], ID["ll"], ID["o"]]
    el_first = Tokenizer.from_metadata(spm_meta(scores={"el": -0.5}, **{"tokenizer.ggml.add_space_prefix": False}))
    assert el_first.encode("hello", add_bos=False) == [ID["h"], ID["el"], ID["l"], ID["o"]]
    el_first_prefixed = Tokenizer.from_metadata(spm_meta(scores={"el": -0.5}))
    assert el_first_prefixed.encode("hello", add_bos=False) == [ID["▁h"], ID["el"], ID["l"], ID["o"]]


def test_spm_decode_strips_one_leading_space_of_the_first_token_only(spm):
    assert spm.decode([ID["▁hello"]]) == "hello"
    assert spm.decode([ID["▁"], ID["▁hello"]]) == " hello"
    assert spm.decode([1, ID["▁hello"]]) == "<s> hello"
    # the dropped BOS still uses up the strip, as in llama_detokenize
    assert spm.decode([1, ID["▁hello"]], unparse_special=False) == " hello"
    # remove_special drops the BOS (and, with add_eos, the EOS) and then keeps the space: llama.cpp quirk
    assert spm.decode([1, ID["▁hello"], 2], remove_special=True) == " hello</s>"


# ---- byte-level BPE -----------------------------------------------------------------------------------
B2U = bytes_to_unicode()


def bpe_meta(pre: str, **over) -> dict:
    merged = ["ab", "abc", "'S", "12", "123", "ĠH", "ĠHI"]
    merges = ["a b", "' S", "1 2", "12 3", "Ġ H", "ĠH I"]  # note: no merge makes "abc"
    tokens = [B2U[b] for b in range(256)] + merged + ["<|begin_of_text|>", "<|eot_id|>", "<|fim_pad|>"]
    meta = {
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [1] * (256 + len(merged)) + [3, 3, 1],
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": 263, "tokenizer.ggml.eos_token_id": 264,
    }
    meta.update(over)
    return meta


def tid(tk: Tokenizer, text: str) -> int:
    i = tk.token_to_id(text)
    assert i is not None, text
    return i


def test_llama3_ignore_merges_takes_whole_word_and_adds_bos_by_default():
    tk = Tokenizer.from_metadata(bpe_meta("llama-bpe"))
    assert tk.add_bos is True
    assert tk.encode("abc") == [263, tid(tk, "abc")]          # whole word is a token: merges ignored
    gpt2 = Tokenizer.from_metadata(bpe_meta("gpt-2"))
    assert gpt2.add_bos is False
    assert gpt2.encode("abc") == [tid(gpt2, "ab"), ord("c")]  # byte tokens sit at their byte value


def test_llama3_regex_splits_uppercase_contraction_and_digit_triples():
    tk = Tokenizer.from_metadata(bpe_meta("llama3"))
    # (?:'[sS]...) keeps "'S" together; the gpt-2 regex only knows lowercase 's
    assert tk.encode("IT'S", add_bos=False) == [ord("I"), ord("T"), tid(tk, "'S")]
    gpt2 = Tokenizer.from_metadata(bpe_meta("gpt-2"))
    assert gpt2.encode("IT'S") == [ord("I"), ord("T"), ord("'"), ord("S")]
    # \p{N}{1,3}: "1231" -> "123" + "1"; smollm isolates every digit
    assert tk.encode("1231", add_bos=False) == [tid(tk, "123"), ord("1")]
    smol = Tokenizer.from_metadata(bpe_meta("smollm"))
    assert smol.encode("1231") == [ord("1"), ord("2"), ord("3"), ord("1")]


def test_forced_control_and_eog_by_text():
    tk = Tokenizer.from_metadata(bpe_meta("llama3"))
    eot, fim_pad = tid(tk, "<|eot_id|>"), tid(tk, "<|fim_pad|>")
    assert tk.eog_ids == frozenset({264, eot, fim_pad})
    # <|fim_pad|> is NORMAL in the file but llama.cpp forces it to CONTROL
    assert tk.is_control(fim_pad)
    assert tk.encode("x<|fim_pad|>", add_bos=False) == [ord("x"), fim_pad]
    assert tk.encode("x<|fim_pad|>", parse_special=False, add_bos=False)[0] == ord("x")
    assert len(tk.encode("x<|fim_pad|>", parse_special=False, add_bos=False)) > 2


def test_gpt2_decode_applies_llamacpp_clean_spaces_but_stream_does_not():
    tk = Tokenizer.from_metadata(bpe_meta("gpt-2"))
    text = "x , y ' z 's ok ."
    ids = tk.encode(text)
    assert tk.decode(ids) == "x, y'z's ok."
    assert tk.decode(ids, clean_spaces=False) == text
    det = IncrementalDetokenizer(tk)
    assert det.push_many(ids) + det.flush() == text
    smol = Tokenizer.from_metadata(bpe_meta("smollm"))  # clean_spaces is off for smollm
    assert smol.decode(smol.encode(text)) == text


def test_unknown_model_or_pre_is_a_clear_value_error():
    with pytest.raises(ValueError, match="unsupported tokenizer.ggml.model 'bert'"):
        Tokenizer.from_metadata(bpe_meta("gpt-2", **{"tokenizer.ggml.model": "bert"}))
    with pytest.raises(ValueError, match="unsupported tokenizer.ggml.pre 'no-such-pre'"):
        Tokenizer.from_metadata(bpe_meta("no-such-pre"))
    with pytest.raises(ValueError, match="no tokenizer.ggml.merges"):
        Tokenizer.from_metadata(bpe_meta("gpt-2", **{"tokenizer.ggml.merges": []}))


def test_missing_pre_falls_back_to_llamacpp_default_regexes(caplog):
    meta = bpe_meta("gpt-2")
    del meta["tokenizer.ggml.pre"]
    tk = Tokenizer.from_metadata(meta)
    assert tk.pre == "default"
    assert "no tokenizer.ggml.pre" in caplog.text
    assert tk.decode(tk.encode("Hi, 12345 there!")) == "Hi, 12345 there!"
