"""SentencePiece tokenization as llama.cpp does it (`llm_tokenizer_spm_session`).

A fragment (spaces already escaped to U+2581) starts as one symbol per character; the adjacent
pair whose concatenation is the best-scoring token is merged, again and again (ties: the leftmost
pair), until no adjacent pair forms a token. Each final symbol is its token, or its UTF-8 bytes
as `<0xXX>` byte tokens. Only the vocabulary and its scores are held: no merge table (for Gemma's
262k tokens, the merge table an HF BPE needs to emulate this has 515k entries and ~66 MiB).
"""

from __future__ import annotations

import heapq
from array import array
from collections.abc import Mapping, Sequence


class SentencePiece:
    """The vocabulary's text -> id map, scores and byte fallback; `tokenize` appends ids."""

    def __init__(self, token_to_id: Mapping[str, int], scores: Sequence[float] | None,
                 unk_id: int | None):
        n = len(token_to_id)
        self._ids = token_to_id
        # negated, so heapq's smallest is the best score
        self._neg = array("d", [0.0] * n if scores is None else (-float(scores[i]) for i in range(n)))
        # llama.cpp's byte_to_token: the <0xXX> token, else the byte as a one-character token
        self._bytes: list[int | None] = []
        for b in range(256):
            tid = token_to_id.get(f"<0x{b:02X}>")
            if tid is None and b < 0x80:
                tid = token_to_id.get(chr(b))
            self._bytes.append(tid if tid is not None else unk_id)

    def tokenize(self, text: str, out: list[int]) -> None:
        n = len(text)
        if not n:
            return
        ids, neg = self._ids, self._neg
        size = [1] * n          # a merged-away symbol has size 0
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        prv = list(range(-1, n - 1))
        # (negated score, left symbol, merged length): stale entries are skipped when popped
        heap = []
        for i in range(n - 1):
            tid = ids.get(text[i:i + 2])
            if tid is not None:
                heap.append((neg[tid], i, 2))
        heapq.heapify(heap)
        pop, push = heapq.heappop, heapq.heappush
        while heap:
            _, left, length = pop(heap)
            right = nxt[left]
            if right < 0 or size[left] == 0 or size[right] == 0 or size[left] + size[right] != length:
                continue
            size[left], size[right] = length, 0
            after = nxt[right]
            nxt[left] = after
            if after >= 0:
                prv[after] = left
            before = prv[left]
            if before >= 0:
                tid = ids.get(text[before:left + length])
                if tid is not None:
                    push(heap, (neg[tid], before, left + length - before))
            if after >= 0:
                tid = ids.get(text[left:after + size[after]])
                if tid is not None:
                    push(heap, (neg[tid], left, after + size[after] - left))
        i = 0
        while i >= 0:
            piece = text[i:i + size[i]]
            tid = ids.get(piece)
            if tid is not None:
                out.append(tid)
            else:  # only a lone character can fail to be a token: merges make tokens
                for b in piece.encode("utf-8", "surrogatepass"):
                    tid = self._bytes[b]
                    if tid is None:
                        raise ValueError(f"the vocabulary has no token for byte 0x{b:02X} and no unknown "
                                         f"token to stand for it")
                    out.append(tid)
            i = nxt[i]
