"""StopMatcher never leaks a stop string, whatever the chunking; RepetitionDetector: loops only."""

from __future__ import annotations

import random
import time

import pytest

from pantheon.text.stops import RepetitionDetector, StopMatcher


def run_stops(stops, pieces):
    """Feed pieces; return (emitted text, stopped, list of emitted chunks)."""
    m = StopMatcher(stops)
    chunks, stopped = [], False
    for p in pieces:
        out, stopped = m.push(p)
        chunks.append(out)
    if not stopped:
        chunks.append(m.flush())
    return "".join(chunks), stopped, chunks


def random_chunks(text, rng, max_len=5):
    out, i = [], 0
    while i < len(text):
        n = rng.randint(0, max_len)  # 0: empty pieces happen (a token completing no character)
        out.append(text[i:i + n])
        i += n
    return out


def reference_cut(stops, text):
    """Expected output by brute force: the first prefix of text that ends with some stop."""
    for end in range(1, len(text) + 1):
        hits = [s for s in stops if s and text[:end].endswith(s)]
        if hits:
            return text[: end - max(map(len, hits))], True
    return text, False


def test_stop_split_across_two_pushes():
    assert run_stops(["<|im_end|>"], ["Hello<|im", "_end|> trailing"])[:2] == ("Hello", True)


def test_stop_split_across_three_pushes():
    text, stopped, chunks = run_stops(["STOP"], ["abc S", "T", "OP def"])
    assert (text, stopped) == ("abc ", True)
    assert chunks == ["abc ", "", ""]  # "S" and "T" were held, never emitted


def test_stop_one_char_per_push_never_leaks_any_part():
    stop = "</answer>"
    text = "the result is 42</answer> and more"
    m = StopMatcher([stop])
    emitted = ""
    for ch in text:
        out, stopped = m.push(ch)
        emitted += out
        assert "<" not in emitted  # not even the first character of the stop leaks
        if stopped:
            break
    assert stopped and emitted == "the result is 42"


def test_false_start_is_released_when_it_stops_matching():
    text, stopped, chunks = run_stops(["<|im_end|>"], ["a <|im", "_start|> b"])
    assert (text, stopped) == ("a <|im_start|> b", False)
    assert chunks[0] == "a "


def test_overlapping_candidates_ab_and_abc_stop_at_ab():
    for pieces in (["xabc"], ["xa", "bc"], list("xabc")):
        assert run_stops(["ab", "abc"], pieces)[:2] == ("x", True)


def test_stop_aab_in_aaab_found_after_partial_restart():
    # the held "aa" fails on the third 'a' but its suffix "aa" must still be kept as a prefix
    for pieces in (["aaab"], list("aaab"), ["a", "aa", "b"], ["aaa", "b"]):
        assert run_stops(["aab"], pieces)[:2] == ("a", True)


def test_stop_at_very_start():
    assert run_stops(["###"], ["###rest"])[:2] == ("", True)
    assert run_stops(["###"], ["#", "#", "#", "rest"])[:2] == ("", True)


def test_no_stop_flush_returns_held_text():
    m = StopMatcher(["<|im_end|>"])
    assert m.push("done <|im_e") == ("done ", False)
    assert m.flush() == "<|im_e"


def test_multiple_stops_earliest_occurrence_wins():
    got = run_stops(["world", "hello", "say"], ["please hello there world"])
    assert got[:2] == ("please ", True)
    m = StopMatcher(["world", "hello"])
    m.push("please hello there world")
    assert m.matched == "hello"


def test_pushes_after_stop_return_nothing():
    m = StopMatcher(["x"])
    assert m.push("abxcd") == ("ab", True)
    assert m.push("more") == ("", True)
    assert m.flush() == ""


def test_empty_stops_are_ignored():
    assert run_stops(["", ""], ["abc", "def"])[:2] == ("abcdef", False)
    assert run_stops(None, ["abc"])[:2] == ("abc", False)
    assert run_stops(["", "c"], ["abcd"])[:2] == ("ab", True)


def test_nested_stops_result_does_not_depend_on_chunking():
    # "bc" completes before "abcd" does, so it wins however the text is cut
    for pieces in (["abcd"], list("abcd"), ["ab", "cd"]):
        assert run_stops(["abcd", "bc"], pieces)[:2] == ("a", True)


def test_random_chunkings_match_brute_force_reference():
    rng = random.Random()  # fresh each run: any chunking must give the same answer
    alphabet = "ab<|>"
    for _ in range(300):
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 5)))
                 for _ in range(rng.randint(1, 4))]
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        expect = reference_cut(stops, text)
        got_text, got_stopped, _ = run_stops(stops, random_chunks(text, rng))
        assert (got_text, got_stopped) == expect, (stops, text)


def test_many_long_stops_stay_cheap_on_long_output():
    rng = random.Random(1)
    stops = ["".join(rng.choice("abcdefgh") for _ in range(120)) for _ in range(16)]
    m = StopMatcher(stops)
    piece = "abcdefgh" * 2
    t0 = time.perf_counter()
    for _ in range(20000):  # 320k characters of output
        out, stopped = m.push(piece)
        assert not stopped
    # a whole-output rescan would take minutes here; window rescans take well under a second
    assert time.perf_counter() - t0 < 3.0


# ---- RepetitionDetector ----

LOOP_PREFIX = [60, 23, 39614, 1141, 552, 28, 2618, 12693, 2756]
LOOP_BLOCK = [28, 2618, 4649]


def first_trip(ids, det=None):
    det = det or RepetitionDetector()
    for i, t in enumerate(ids):
        if det.push(t):
            return i
    return None


def test_real_loop_28_2618_4649_trips_within_100_tokens():
    ids = LOOP_PREFIX + LOOP_BLOCK * 200
    det = RepetitionDetector()
    at = first_trip(ids, det)
    assert at is not None and at < 100
    assert det.period == 3
    assert det.push(1) is True  # latched


def test_single_token_repeated_32_times_trips_exactly_at_32():
    ids = [5, 6, 7] + [42] * 40
    assert first_trip(ids) == 3 + 31  # the 32nd copy
    assert first_trip([5, 6, 7] + [42] * 31 + [8]) is None


def test_long_period_needs_six_repeats():
    rng = random.Random()
    block = rng.sample(range(1000, 50000), 40)  # distinct ids: period exactly 40
    assert first_trip(block * 5 + [1]) is None  # 5 repeats of a paragraph: not yet a loop
    at = first_trip(block * 7)
    assert at == 6 * 40 - 1


def test_random_ids_never_trip():
    rng = random.Random()
    assert first_trip([rng.randrange(50000) for _ in range(5000)]) is None


WORDS = ("when the quiet harbor town woke before dawn fishermen carried nets down narrow stone "
         "lanes while gulls circled above bright painted boats children raced toward school "
         "bakers opened wooden shutters letting warm bread scent drift across market squares "
         "where merchants arranged lemons olives cheeses under striped awnings").split()


def test_english_paragraph_ids_never_trip():
    assert len(set(WORDS)) == len(WORDS)  # a repeated-word-free list
    ids = {w: 1000 + 37 * i for i, w in enumerate(WORDS)}
    rng = random.Random()
    # sentences drawn from the vocabulary, joined by common function words ("the", ",", ".")
    seq = []
    for _ in range(200):
        sent = rng.sample(WORDS, rng.randint(5, 15))
        seq += [ids[w] for w in sent] + [13, 220, 279]  # ". the"
    seq += [ids[w] for w in WORDS]
    assert first_trip(seq) is None


def test_short_legit_repetition_does_not_trip():
    laugh = [4762, 13] * 10  # "ha. ha. ..." 10 times
    table = [91, 12, 91, 12, 91, 12, 198] * 4  # small markdown separator rows
    assert first_trip([1, 2, 3] + laugh + [7, 8] + table + [9]) is None


def test_reset_clears_state():
    det = RepetitionDetector()
    first_trip([3] * 32, det)
    assert det.looping
    det.reset()
    assert not det.looping and first_trip([3] * 31, det) is None


@pytest.mark.parametrize("bad", [0, -1])
def test_invalid_max_period_rejected(bad):
    with pytest.raises(ValueError):
        RepetitionDetector(max_period=bad)
