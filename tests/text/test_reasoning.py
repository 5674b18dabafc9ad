"""ReasoningSplitter: <think>…</think> vs content under any chunking; budget; think_mode."""

from __future__ import annotations

import random

from pantheon.text.reasoning import ReasoningBudget, ReasoningSplitter, think_mode


def split(pieces, **kw):
    """Feed pieces; return (reasoning, content, all (kind, text) items in order)."""
    sp = ReasoningSplitter(**kw)
    items = []
    for p in pieces:
        got = sp.push(p)
        # within one push adjacent same-kind items are merged and none is empty
        assert all(t for _, t in got)
        assert all(a[0] != b[0] for a, b in zip(got, got[1:]))
        items += got
    items += sp.flush()
    reasoning = "".join(t for k, t in items if k == "reasoning")
    content = "".join(t for k, t in items if k == "content")
    return reasoning, content, items


def random_chunks(text, rng, max_len=6):
    out, i = [], 0
    while i < len(text):
        n = rng.randint(0, max_len)
        out.append(text[i:i + n])
        i += n
    return out


def kinds_in_order(items):
    """Reasoning must all come before content (the streaming delta order)."""
    seen_content = False
    for k, _ in items:
        if k == "content":
            seen_content = True
        elif seen_content:
            return False
    return True


FULL = "<think>abc</think>\n\nanswer"


def test_full_block_one_char_at_a_time():
    assert split(list(FULL))[:2] == ("abc", "answer")


def test_full_block_whole_and_random_chunkings():
    assert split([FULL])[:2] == ("abc", "answer")
    rng = random.Random()  # fresh each run
    texts = {
        FULL: ("abc", "answer"),
        "\n<think>\nstep 1\n\nstep 2\n</think>\n\nThe answer is <b>42</b>.\n":
            ("step 1\n\nstep 2", "The answer is <b>42</b>.\n"),
        "<think></think>\n\nhi": ("", "hi"),
        "<think>a < b and </thin> is not a tag</think>ok": ("a < b and </thin> is not a tag", "ok"),
    }
    for _ in range(200):
        for text, expect in texts.items():
            reasoning, content, items = split(random_chunks(text, rng))
            assert (reasoning, content) == expect, text
            assert kinds_in_order(items)


def test_start_in_reasoning_without_open_tag():
    pieces = ["Let me ", "think.", "</th", "ink>", "\n\nDone."]
    assert split(pieces, start_in_reasoning=True)[:2] == ("Let me think.", "Done.")


def test_start_in_reasoning_drops_redundant_open_tag():
    assert split(["<th", "ink>\nx</think>y"], start_in_reasoning=True)[:2] == ("x", "y")


def test_start_in_reasoning_unclosed_is_all_reasoning():
    got = split(["just thinking </thi"], start_in_reasoning=True)
    assert got[:2] == ("just thinking </thi", "")


def test_close_tag_split_across_pieces():
    for pieces in (["<think>abc</", "think>x"], ["<think>abc<", "/", "thi", "nk", ">x"]):
        assert split(pieces)[:2] == ("abc", "x")


def test_partial_close_tag_that_is_not_a_tag_stays_reasoning():
    assert split(["<think>a</th", "ere</think>b"])[:2] == ("a</there", "b")


def test_no_think_tag_is_all_content():
    text = "  Hello there.\n\nSecond paragraph."
    assert split(list(text))[:2] == ("", text)  # verbatim, leading whitespace included


def test_think_in_the_middle_is_content():
    text = "Use <think> tags like <think>this</think> to reason."
    reasoning, content, _ = split(list(text))
    assert (reasoning, content) == ("", text)


def test_second_think_block_after_close_is_content():
    assert split(["<think>r</think>a <think>b</think>"])[:2] == ("r", "a <think>b</think>")


def test_partial_open_tag_at_end_is_content():
    assert split(["<thi"])[:2] == ("", "<thi")
    assert split(["<thinking about it"])[:2] == ("", "<thinking about it")


def test_in_reasoning_and_reasoning_closed_track_state():
    sp = ReasoningSplitter()
    assert not sp.in_reasoning
    sp.push("<think>")
    assert sp.in_reasoning and not sp.reasoning_closed
    sp.push("hmm</think>")
    assert not sp.in_reasoning and sp.reasoning_closed
    plain = ReasoningSplitter()
    plain.push("Hi")
    assert not plain.in_reasoning and not plain.reasoning_closed
    assert ReasoningSplitter(start_in_reasoning=True).in_reasoning


def test_reasoning_streams_before_close_arrives():
    sp = ReasoningSplitter()
    assert sp.push("<think>first ") == [("reasoning", "first")]  # trailing space held
    assert sp.push("second") == [("reasoning", " second")]
    assert sp.push("</think>\n\nok") == [("content", "ok")]


def test_one_push_may_yield_reasoning_then_content():
    assert ReasoningSplitter().push(FULL) == [("reasoning", "abc"), ("content", "answer")]


def test_budget_fires_exactly_once_at_n():
    b = ReasoningBudget(5)
    fired = [b.tick(True) for _ in range(12)]
    assert fired == [False] * 4 + [True] + [False] * 7


def test_budget_counts_only_reasoning_tokens():
    b = ReasoningBudget(3)
    pattern = [True, False, True, False, True, True]
    assert [b.tick(r) for r in pattern] == [False, False, False, False, True, False]


def test_budget_disabled_when_not_positive():
    for n in (0, -1, None):
        b = ReasoningBudget(n)
        assert not any(b.tick(True) for _ in range(100))


def test_budget_with_splitter_forces_close():
    sp, b = ReasoningSplitter(start_in_reasoning=True), ReasoningBudget(3)
    items = []
    for piece in ["a", " b", " c", " d", " e"]:
        items += sp.push(piece)
        if b.tick(sp.in_reasoning):
            items += sp.push("</think>\n\n")  # what the engine injects when the budget is spent
    items += sp.flush()
    assert sp.reasoning_closed and not b.tick(sp.in_reasoning)
    assert "".join(t for k, t in items if k == "reasoning") == "a b c"
    assert "".join(t for k, t in items if k == "content") == "d e"


def test_think_mode():
    assert think_mode("{% if enable_thinking %}<think>\n{% endif %}")
    assert not think_mode("{{ '<|im_start|>' + message['role'] }}")
    assert not think_mode("")


def test_kept_thoughts_stay_in_the_content_while_the_block_is_followed(smollm2_tokenizer):
    """ChoiceText for reasoning_format "none": every piece is content (the prompt's opening first),
    while the splitter still knows whether the think block is open (the budget reads it)."""
    from pantheon.text.pipeline import ChoiceText

    text = ChoiceText(smollm2_tokenizer, think=True, start_in_reasoning=True, keep_thoughts=True, lead="<think>\n")
    out = [text.push_text(p) for p in ("let me ", "see</th", "ink>\n\nIt is ", "4.")]
    assert [d.reasoning for d in out] == ["", "", "", ""]
    assert "".join(d.content for d in out) + text.finish().content == "<think>\nlet me see</think>\n\nIt is 4."
    assert not text.in_reasoning
    fresh = ChoiceText(smollm2_tokenizer, think=True, start_in_reasoning=True, keep_thoughts=True)
    fresh.push_text("still thinking")
    assert fresh.in_reasoning
