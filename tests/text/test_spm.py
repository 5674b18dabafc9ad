"""llama.cpp's SentencePiece merging (`text/spm.py`) against a plain quadratic reading of the same
rule (every round: the adjacent pair whose concatenation is the best-scoring token, the leftmost
on a tie; merged until no pair is a token; leftovers as byte tokens), on random vocabularies with
many equal scores and random texts; and the rule's corners by hand."""

from __future__ import annotations

import random

import pytest

from pantheon.text.spm import SentencePiece


def reference(text: str, ids: dict[str, int], scores: list[float], unk: int | None) -> list[int]:
    syms = list(text)
    while True:
        best = None
        for i in range(len(syms) - 1):
            tid = ids.get(syms[i] + syms[i + 1])
            if tid is not None and (best is None or scores[tid] > best[0]):
                best = (scores[tid], i)
        if best is None:
            break
        i = best[1]
        syms[i:i + 2] = [syms[i] + syms[i + 1]]
    out = []
    for s in syms:
        if s in ids:
            out.append(ids[s])
        else:
            out.extend(ids.get(f"<0x{b:02X}>", unk) for b in s.encode())
    return out


def vocabulary(rng: random.Random, alphabet: str, n: int):
    pieces = list(dict.fromkeys(alphabet[: len(alphabet) - 2]))  # two characters only as bytes
    while len(pieces) < n:
        a, b = rng.choice(pieces), rng.choice(pieces)
        if a + b not in pieces and len(a + b) <= 6:
            pieces.append(a + b)
    texts = ["<unk>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    ids = {t: i for i, t in enumerate(texts)}
    scores = [0.0] * 257 + [float(rng.randint(-8, 0)) for _ in pieces]  # many ties
    return ids, scores


@pytest.mark.parametrize("seed", range(6))
def test_random_vocabularies_and_texts_match_the_quadratic_rule(seed):
    rng = random.Random(seed)
    alphabet = "▁abcdeé中"
    ids, scores = vocabulary(rng, alphabet, 60)
    spm = SentencePiece(ids, scores, unk_id=0)
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40)))
        out: list[int] = []
        spm.tokenize(text, out)
        assert out == reference(text, ids, scores, 0), text


def test_equal_scores_merge_the_leftmost_pair_first():
    ids = {"<unk>": 0, "a": 1, "b": 2, "ab": 3, "ba": 4}
    spm = SentencePiece(ids, [0.0, 0.0, 0.0, -1.0, -1.0], unk_id=0)
    out: list[int] = []
    spm.tokenize("aba", out)
    assert out == [3, 1]  # "ab" + "a", not "a" + "ba"
    spm = SentencePiece(ids, [0.0, 0.0, 0.0, -1.0, -0.5], unk_id=0)
    out = []
    spm.tokenize("aba", out)
    assert out == [1, 4]  # the better score wins over position


def test_a_merged_symbol_goes_on_merging_with_its_new_neighbours():
    ids = {"<unk>": 0, "a": 1, "b": 2, "c": 3, "bc": 4, "abc": 5, "ab": 6}
    spm = SentencePiece(ids, [0, 0, 0, 0, -1.0, -2.0, -3.0], unk_id=0)
    out: list[int] = []
    spm.tokenize("abc", out)
    assert out == [5]  # bc first (-1), then a+bc (-2); ab (-3) went stale


def test_characters_outside_the_vocabulary_become_bytes_or_unk():
    ids = {"<unk>": 0, "<0xC3>": 1, "<0xA9>": 2, "h": 3}
    spm = SentencePiece(ids, [0.0] * 4, unk_id=0)
    out: list[int] = []
    spm.tokenize("hé€", out)
    assert out == [3, 1, 2, 0, 0, 0]  # é's two bytes; € has no byte tokens: unk for each
    with pytest.raises(ValueError, match="no token for byte"):
        SentencePiece({"h": 0}, [0.0], unk_id=None).tokenize("hé", [])
