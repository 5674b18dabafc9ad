"""IncrementalDetokenizer: only whole characters, and the stream adds up to decode()."""

from __future__ import annotations

import pytest

from pantheon.text.detok import IncrementalDetokenizer

TEXTS = [
    "Hi 🦙 café 日本",
    "emoji 😀👍🏽🇺🇸 👨\u200d👩\u200d👧\u200d👦 done",
    "中文分词测试：你好，世界！",
    "<|im_start|>assistant\nΕλληνικά 한국어<|im_end|>",
]


def _is_complete_text(s: str) -> bool:
    # a str chunk can only be wrong by containing U+FFFD from a cut multi-byte sequence
    return "\ufffd" not in s


@pytest.mark.parametrize("text", TEXTS)
def test_stream_never_emits_partial_utf8_and_concatenates_to_decode(smollm2_tokenizer, text):
    tk = smollm2_tokenizer
    ids = tk.encode(text)
    # the test is only meaningful if some character really is split across tokens
    pieces = [tk.token_bytes(i) for i in ids]
    assert any(_is_split(p) for p in pieces) or "<|" in text
    det = IncrementalDetokenizer(tk)
    chunks = [det.push(i) for i in ids] + [det.flush()]
    assert all(_is_complete_text(c) for c in chunks), chunks
    assert "".join(chunks) == tk.decode(ids) == text


def _is_split(piece: bytes) -> bool:
    try:
        piece.decode("utf-8")
        return False
    except UnicodeDecodeError:
        return True


def test_llama_emoji_is_held_back_until_its_last_byte(smollm2_tokenizer):
    tk = smollm2_tokenizer
    det = IncrementalDetokenizer(tk)
    ids = tk.encode("🦙")
    assert len(ids) > 1
    outs = [det.push(i) for i in ids]
    assert outs[:-1] == [""] * (len(ids) - 1) and outs[-1] == "🦙"
    assert det.pending_bytes == b""


def test_space_before_split_cjk_char_is_emitted_immediately(smollm2_tokenizer):
    tk = smollm2_tokenizer
    ids = tk.encode(" 日")
    first = tk.token_bytes(ids[0])
    assert first.startswith(b" ") and _is_split(first)
    det = IncrementalDetokenizer(tk)
    assert det.push(ids[0]) == " "
    assert "".join(det.push(i) for i in ids[1:]) + det.flush() == "日"


def test_unparse_special_false_drops_control_tokens_in_stream(smollm2_tokenizer):
    tk = smollm2_tokenizer
    ids = tk.encode("<|im_start|>assistant\nhello<|im_end|>")
    det = IncrementalDetokenizer(tk, unparse_special=False)
    assert det.push_many(ids) + det.flush() == "assistant\nhello" == tk.decode(ids, unparse_special=False)


def test_truncated_stream_flushes_replacement_character(smollm2_tokenizer):
    tk = smollm2_tokenizer
    ids = tk.encode("🦙")
    det = IncrementalDetokenizer(tk)
    assert det.push_many(ids[:-1]) == ""
    assert det.flush() == "\ufffd"


def test_out_of_range_token_is_a_clear_error(smollm2_tokenizer):
    with pytest.raises(ValueError, match="out of range"):
        IncrementalDetokenizer(smollm2_tokenizer).push(10**6)
